//! Amazon SQS (standard and FIFO queues, or an SQS-compatible server such as ElasticMQ):
//! `ReceiveMessage` → (store) → `DeleteMessageBatch`.
//!
//! - **Client**: the default AWS credential chain (the `AWS_*` variables the operator sets from
//!   the Secret refs, else IRSA web identity, ECS/EC2 roles); region from `spec.region`, else
//!   `AWS_REGION`, else the queue URL's host, else the shared config file; `spec.endpoint`
//!   overrides the endpoint. Every call has connect, attempt and operation timeouts (a long
//!   poll gets its `waitTimeSeconds` plus a margin), so a hung server is a transient failure.
//! - **`prepare`** resolves a `queueName` (GetQueueUrl), reads the queue's visibility timeout,
//!   `RedrivePolicy` and `FifoQueue`, checks that the dead-letter queue exists (default: the
//!   queue's name with `-dlq`, before `.fifo`) and that credentials resolve. What cannot work
//!   (no queue, no credentials, refused credentials, no region) is fatal and names the setting;
//!   see `classify.rs` for the one mapping of error codes used by every call. A source queue
//!   that goes missing later (deleted, maybe created again: AWS asks for 60 s between the two)
//!   is waited for, readiness false, and fatal only once it has been missing for 120 s.
//! - **Receive**: long polls of at most ten messages; a larger batch is gathered from
//!   concurrent receives. All system and message attributes are read; the key is
//!   `sqs:{adapter}:{MessageId}`.
//! - **Acknowledge**: `DeleteMessageBatch` in calls of ten, reading each entry's result (a 200
//!   response can still fail entries): an invalid receipt handle is stale, anything else is
//!   retried. **Lease**: `ChangeMessageVisibilityBatch` to the visibility timeout.
//! - **Dead letters**: `SendMessageBatch` to the dead-letter queue, the body unchanged, the
//!   context as `x-dlq-*` message attributes. A queue with its own `RedrivePolicy` counts
//!   deliveries itself; poison still goes to the dead-letter queue at once.
//! - **Queue health**: `GetQueueAttributes` depth figures, and the age of the oldest message
//!   this worker holds (see [`SqsProbe`]).
//!
//! **FIFO queues** keep each `MessageGroupId`'s order:
//! - SQS hands out a group's messages only once its earlier ones are deleted or visible
//!   again, so two receives (concurrent ones included) never hold messages of the same group,
//!   and receives retried by the SDK carry a `ReceiveRequestAttemptId` (they return the same
//!   messages instead of locking the group until its visibility expires).
//! - Acknowledgement never deletes a group's later message before an earlier one: at most one
//!   message per group per call, calls in order; when an entry fails, the group's later
//!   messages of that acknowledgement are not sent and are reported with the same outcome
//!   (retried or stale) — see `delete_plan.rs`.
//! - At receive time, the only failure that concerns a single message is one that cannot be
//!   delivered to the pipeline at all: SQS sent it without a receipt handle, so it can be
//!   neither deleted nor dead-lettered and comes back only when its visibility expires. The
//!   group's later messages of that receive are then made visible again
//!   (`ChangeMessageVisibility` 0, best effort: if that fails they come back when their
//!   visibility expires) and dropped from the batch, so nothing of the group is stored before
//!   it. An undecodable message *with* a receipt, and any poison the pipeline finds, stays in
//!   its place in the batch: it is dead-lettered and acknowledged in receive order, which keeps
//!   the group's order without holding the group back. A whole receive that fails returns
//!   nothing; whatever SQS had handed out is redelivered in order.

pub(crate) mod classify;
mod client;
pub(crate) mod dead_letter;
pub(crate) mod delete_plan;
pub(crate) mod gather;
pub(crate) mod in_flight;
pub mod reader;
mod receive;
mod send;

use std::time::{Duration, Instant};

use aws_config::timeout::TimeoutConfig;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::ProvideCredentials;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
    MessageSystemAttributeName, QueueAttributeName,
};
use futures::future::join_all;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use switchboard_api::QueueAdapter;
use switchboard_store::Dedup;

use self::classify::{Addressed, CREDENTIALS_SETTING, ServiceFault};
use self::dead_letter::{DEFAULT_MAX_MESSAGE_BYTES, WriteContext};
use self::delete_plan::{BATCH_LIMIT, DeletePlan, Outcome};
use self::in_flight::InFlight;
pub use self::receive::Receipt;
use self::receive::{Received, SqsDelivery, convert, sort_received};
use crate::health::now_ms;
use crate::metrics::adapter_counter;
use crate::transport::{Acked, DeadLetter, QueueHealth, QueueProbe, Transport, TransportError};

/// The visibility timeout SQS gives a queue that does not say.
const DEFAULT_VISIBILITY_SECONDS: u32 = 30;
/// How long credentials may fail to load at start-up before that is fatal.
const CREDENTIALS_DEADLINE: Duration = Duration::from_secs(20);
/// How often `maintain` (a no-op) and the queue-health probe run.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);

/// Everything the SQS transport needs to know.
#[derive(Debug, Clone)]
pub struct SqsSettings {
    /// `namespace/name` of the adapter.
    pub adapter: String,
    /// The pod name, recorded in dead letters.
    pub consumer: String,
    pub spec: switchboard_api::SqsSource,
    /// `spec.delivery.deadLetter.queueUrl`; default: the queue's URL with `-dlq`.
    pub dead_letter_queue_url: Option<String>,
    pub batch_size: usize,
    /// `spec.delivery.deadLetter.retentionDays`: the worker warns when the dead-letter queue
    /// keeps messages for less (SQS's own `MessageRetentionPeriod` decides).
    pub dead_letter_retention: Duration,
}

/// The SQS transport's own counters.
#[derive(Debug, Clone)]
struct SqsMetrics {
    released: Counter,
    without_receipt: Counter,
}

impl SqsMetrics {
    fn register(registry: &mut Registry, adapter: &str) -> Self {
        Self {
            released: adapter_counter(
                registry,
                "sqs_fifo_messages_released",
                "FIFO messages made visible again because an earlier message of their group in the same receive could not be delivered",
                adapter,
            ),
            without_receipt: adapter_counter(
                registry,
                "sqs_messages_without_receipt",
                "Messages SQS delivered without a receipt handle (skipped; redelivered when their visibility expires)",
                adapter,
            ),
        }
    }
}

/// What `prepare` learnt about the queues.
#[derive(Debug, Clone)]
struct Queues {
    url: String,
    fifo: bool,
    visibility_seconds: u32,
    redrive: bool,
    dead_letter_url: String,
    dead_letter_fifo: bool,
    dead_letter_max_bytes: usize,
}

/// What one dead-letter call did.
#[derive(Debug)]
enum Sent {
    /// Written, but for the letters SQS refused for good (indexes into the letters built).
    Written { refused: Vec<(usize, ServiceFault)> },
    /// SQS refused the whole call for what one of its letters carries.
    AllRefused(ServiceFault),
}

/// The SQS transport.
#[derive(Debug)]
pub struct Sqs {
    settings: SqsSettings,
    source: String,
    client: Client,
    config: aws_config::SdkConfig,
    errors: classify::Settings,
    receive_timeouts: TimeoutConfig,
    metrics: SqsMetrics,
    /// `None` until `prepare` succeeded.
    queues: Option<Queues>,
    /// Since when loading credentials has failed, while `prepare` keeps failing.
    credentials_failing_since: Option<Instant>,
    /// What this worker holds, for the probe's oldest-pending age.
    held: InFlight,
}

impl Sqs {
    /// Builds the client (no network yet). Fails fatally when the region cannot be found or
    /// the endpoint is not a URL.
    pub async fn new(
        settings: SqsSettings,
        registry: &mut Registry,
    ) -> Result<Self, TransportError> {
        let spec = &settings.spec;
        let (region, origin) = client::resolve_region(spec).await?;
        let endpoint = spec.endpoint.as_deref().filter(|e| !e.is_empty());
        if let (Some(url), None) = (spec.queue_url.as_deref(), endpoint)
            && let Some(in_url) = client::region_from_queue_url(url)
            && in_url != region.as_ref()
        {
            return Err(TransportError::fatal(
                "spec.source.sqs.region",
                format!(
                    "the queue URL is in region {in_url} but the worker would call SQS in {region} (from {}); set spec.source.sqs.region to {in_url}",
                    origin.setting()
                ),
                None,
            ));
        }
        let config = client::load_config(spec, region.clone()).await?;
        let client = Client::new(&config);
        let (source_setting, source_queue) = match (&spec.queue_url, &spec.queue_name) {
            (Some(url), _) if !url.is_empty() => ("spec.source.sqs.queueUrl", url.clone()),
            (_, Some(name)) if !name.is_empty() => ("spec.source.sqs.queueName", name.clone()),
            _ => {
                return Err(TransportError::fatal(
                    "spec.source.sqs",
                    "exactly one of queueUrl and queueName must be set",
                    None,
                ));
            }
        };
        let dead_letter_queue = settings
            .dead_letter_queue_url
            .clone()
            .or_else(|| {
                spec.queue_url
                    .as_deref()
                    .map(client::default_dead_letter_url)
            })
            .unwrap_or_else(|| format!("{source_queue}-dlq"));
        let errors = classify::Settings {
            source_setting,
            source_queue,
            region: region.to_string(),
            dead_letter_queue,
            source_absence: classify::QueueAbsence::default(),
        };
        Ok(Self {
            source: format!("sqs:{}", settings.adapter),
            metrics: SqsMetrics::register(registry, &settings.adapter),
            receive_timeouts: client::receive_timeouts(spec.wait_time_seconds),
            settings,
            client,
            config,
            errors,
            queues: None,
            credentials_failing_since: None,
            held: InFlight::default(),
        })
    }

    /// The transport of `adapter` for a command (`dlq`, `send`) run as `consumer`: connected,
    /// its queues checked as the worker does.
    pub async fn for_command(
        adapter: &QueueAdapter,
        consumer: &str,
    ) -> Result<Self, TransportError> {
        let Some(spec) = adapter.spec.source.sqs.clone() else {
            return Err(TransportError::fatal(
                "spec.source.sqs",
                "not an SQS adapter",
                None,
            ));
        };
        let settings = SqsSettings {
            adapter: adapter.adapter_name(),
            consumer: consumer.to_owned(),
            spec,
            dead_letter_queue_url: adapter.spec.delivery.dead_letter.queue_url.clone(),
            batch_size: 10,
            dead_letter_retention: adapter.spec.delivery.dead_letter.retention(),
        };
        let mut sqs = Self::new(settings, &mut Registry::default()).await?;
        sqs.prepare().await?;
        Ok(sqs)
    }

    fn queues(&self) -> Result<&Queues, TransportError> {
        self.queues
            .as_ref()
            .ok_or_else(|| TransportError::protocol("SQS transport used before prepare"))
    }

    /// Fails fatally when the credential chain has nothing, is misconfigured, or has failed
    /// for [`CREDENTIALS_DEADLINE`] since the first attempt (an unreachable or refusing
    /// metadata service, a web identity token STS will not take): at start-up that is a
    /// configuration to fix, better shown as a crash loop naming the setting than as a pod
    /// that never becomes ready.
    async fn check_credentials(&mut self) -> Result<(), TransportError> {
        let Some(provider) = self.config.credentials_provider() else {
            return Err(TransportError::fatal(
                CREDENTIALS_SETTING,
                "no AWS credentials provider",
                None,
            ));
        };
        let err = match provider.provide_credentials().await {
            Ok(_) => {
                self.credentials_failing_since = None;
                return Ok(());
            }
            Err(err) => err,
        };
        let since = *self
            .credentials_failing_since
            .get_or_insert_with(Instant::now);
        // The error type is not re-exported by the SDK crates this worker depends on; its
        // variants are told apart by their (stable) descriptions.
        let text = err.to_string();
        let missing = text.contains("not enabled") || text.contains("not properly configured");
        if missing || since.elapsed() >= CREDENTIALS_DEADLINE {
            let context = if missing {
                "no AWS credentials found: set the Secret refs (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), or give the pod a role (IRSA, instance profile)".to_owned()
            } else {
                format!(
                    "could not load AWS credentials for {} s: set the Secret refs (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), or check the pod's role (IRSA, instance profile)",
                    since.elapsed().as_secs()
                )
            };
            return Err(TransportError::fatal(
                CREDENTIALS_SETTING,
                context,
                Some(Box::new(err)),
            ));
        }
        Err(TransportError::transient(
            "could not load AWS credentials",
            err,
        ))
    }

    async fn resolve_queue_url(&self) -> Result<String, TransportError> {
        let spec = &self.settings.spec;
        if let Some(url) = spec.queue_url.as_deref().filter(|u| !u.is_empty()) {
            return Ok(url.to_owned());
        }
        let name = spec.queue_name.as_deref().unwrap_or_default();
        let output = self
            .client
            .get_queue_url()
            .queue_name(name)
            .send()
            .await
            .map_err(|err| self.errors.error("GetQueueUrl", Addressed::Source, err))?;
        output
            .queue_url()
            .map(str::to_owned)
            .ok_or_else(|| TransportError::protocol("SQS GetQueueUrl returned no URL"))
    }

    async fn queue_attributes(
        &self,
        url: &str,
        addressed: Addressed,
        names: &[QueueAttributeName],
    ) -> Result<Attributes, TransportError> {
        let mut call = self.client.get_queue_attributes().queue_url(url);
        for name in names {
            call = call.attribute_names(name.clone());
        }
        let output = call
            .send()
            .await
            .map_err(|err| self.errors.error("GetQueueAttributes", addressed, err))?;
        Ok(output.attributes().cloned().unwrap_or_default())
    }

    /// The visibility timeout receives ask for (`spec.visibilityTimeoutSeconds`, else the
    /// queue's).
    fn visibility_seconds(&self) -> u32 {
        self.settings
            .spec
            .visibility_timeout_seconds
            .or(self.queues.as_ref().map(|q| q.visibility_seconds))
            .unwrap_or(DEFAULT_VISIBILITY_SECONDS)
    }

    /// One `ReceiveMessage` of up to `count` messages.
    async fn receive_once(
        &self,
        queues: &Queues,
        count: usize,
        wait_seconds: u32,
    ) -> Result<Vec<aws_sdk_sqs::types::Message>, TransportError> {
        let mut call = self
            .client
            .receive_message()
            .queue_url(&queues.url)
            .max_number_of_messages(i32::try_from(count.clamp(1, BATCH_LIMIT)).unwrap_or(10))
            .wait_time_seconds(i32::try_from(wait_seconds).unwrap_or(20))
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All");
        if let Some(seconds) = self.settings.spec.visibility_timeout_seconds {
            call = call.visibility_timeout(i32::try_from(seconds).unwrap_or(i32::MAX));
        }
        if queues.fifo {
            call = call.receive_request_attempt_id(format!("{:016x}", fastrand::u64(..)));
        }
        let output = call
            .customize()
            .config_override(
                aws_sdk_sqs::config::Builder::default()
                    .timeout_config(self.receive_timeouts.clone()),
            )
            .send()
            .await
            .map_err(|err| self.errors.error("ReceiveMessage", Addressed::Source, err))?;
        self.errors.source_absence.reached();
        Ok(output.messages.unwrap_or_default())
    }

    /// Converts received messages, applies the FIFO rule (see the module doc) and records
    /// what this worker now holds.
    async fn deliver(
        &self,
        queues: &Queues,
        raw: Vec<aws_sdk_sqs::types::Message>,
    ) -> Vec<SqsDelivery> {
        let received: Vec<Received> = raw
            .into_iter()
            .map(|message| convert(&self.source, queues.fifo, message))
            .collect();
        let sorted = sort_received(received);
        if !sorted.skipped.is_empty() {
            self.metrics
                .without_receipt
                .inc_by(sorted.skipped.len() as u64);
            tracing::warn!(
                count = sorted.skipped.len(),
                ids = ?sorted.skipped,
                "SQS delivered messages without a receipt handle; skipped (they return when their visibility expires)"
            );
        }
        if !sorted.released.is_empty() {
            self.metrics.released.inc_by(sorted.released.len() as u64);
            tracing::info!(
                count = sorted.released.len(),
                "made later messages of their FIFO groups visible again, behind a message that could not be delivered"
            );
            self.release(queues, &sorted.released).await;
        }
        if let Some(lease) = self.lease() {
            self.held.received(&sorted.messages, lease);
        }
        sorted.messages
    }

    /// Makes FIFO messages visible again at once (best effort: on failure they come back when
    /// their visibility expires, which keeps the order just the same).
    async fn release(&self, queues: &Queues, receipts: &[Receipt]) {
        for chunk in receipts.chunks(BATCH_LIMIT) {
            let entries = chunk.iter().enumerate().filter_map(|(id, receipt)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(id.to_string())
                    .receipt_handle(&receipt.handle)
                    .visibility_timeout(0)
                    .build()
                    .ok()
            });
            let result = self
                .client
                .change_message_visibility_batch()
                .queue_url(&queues.url)
                .set_entries(Some(entries.collect()))
                .send()
                .await;
            match result {
                Ok(output) if output.failed().is_empty() => {}
                Ok(output) => tracing::warn!(
                    failed = output.failed().len(),
                    "could not make held-back FIFO messages visible again; they return when their visibility expires"
                ),
                Err(err) => {
                    let err =
                        self.errors
                            .error("ChangeMessageVisibilityBatch", Addressed::Source, err);
                    tracing::warn!(error = %switchboard_telemetry::ErrorChain(&err), "could not make held-back FIFO messages visible again; they return when their visibility expires");
                }
            }
        }
    }

    /// One `DeleteMessageBatch` of `entries` (indices into `messages`), recorded in `plan`.
    /// A whole-call failure is returned (the entries are left unrecorded).
    async fn delete_batch(
        &self,
        queues: &Queues,
        messages: &[&SqsDelivery],
        entries: &[usize],
    ) -> Result<Vec<(usize, Outcome)>, TransportError> {
        let request: Vec<DeleteMessageBatchRequestEntry> = entries
            .iter()
            .enumerate()
            .map(|(id, &index)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(id.to_string())
                    .receipt_handle(&messages[index].receipt.handle)
                    .build()
                    .map_err(|err| {
                        TransportError::protocol(format!(
                            "cannot build a DeleteMessageBatch entry: {err}"
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        let output = self
            .client
            .delete_message_batch()
            .queue_url(&queues.url)
            .set_entries(Some(request))
            .send()
            .await
            .map_err(|err| {
                self.errors
                    .error("DeleteMessageBatch", Addressed::Source, err)
            })?;
        let mut outcomes: Vec<(usize, Outcome)> = entries
            .iter()
            .map(|&index| (index, Outcome::Deleted))
            .collect();
        let mut codes: Vec<&str> = Vec::new();
        for failed in output.failed() {
            let Some(slot) = failed
                .id()
                .parse::<usize>()
                .ok()
                .and_then(|id| outcomes.get_mut(id))
            else {
                continue;
            };
            slot.1 = if classify::is_stale_code(failed.code(), failed.message()) {
                Outcome::Stale
            } else {
                codes.push(failed.code());
                Outcome::Retry
            };
        }
        if !codes.is_empty() {
            codes.sort_unstable();
            codes.dedup();
            tracing::debug!(count = codes.len(), codes = ?codes, "SQS did not delete some messages; retrying them");
        }
        Ok(outcomes)
    }

    /// One `SendMessageBatch` of the dead letters `indexes` (into `built`). Entries SQS fails
    /// as the sender's fault (the letter itself: its size, characters, attributes) are
    /// returned as refused; a call SQS refuses as a whole for what it carries is
    /// [`Sent::AllRefused`]. Anything else is an error: the pipeline writes the batch again
    /// (a duplicate dead letter is acceptable, a lost one is not).
    async fn send_dead_letters(
        &self,
        queues: &Queues,
        built: &[dead_letter::Letter],
        indexes: &[usize],
    ) -> Result<Sent, TransportError> {
        let entries = indexes
            .iter()
            .enumerate()
            .map(|(id, &index)| built[index].entry(id))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| {
                TransportError::protocol(format!("cannot build a dead letter: {err}"))
            })?;
        let output = match self
            .client
            .send_message_batch()
            .queue_url(&queues.dead_letter_url)
            .set_entries(Some(entries))
            .send()
            .await
        {
            Ok(output) => output,
            Err(err) => {
                return match classify::refused_message(&err) {
                    Some(fault) => Ok(Sent::AllRefused(fault)),
                    None => Err(self
                        .errors
                        .error("SendMessageBatch", Addressed::DeadLetter, err)),
                };
            }
        };
        let mut refused = Vec::new();
        let mut failed_now = Vec::new();
        for failed in output.failed() {
            let fault = ServiceFault {
                code: failed.code().to_owned(),
                status: None,
                message: classify::redact(failed.message().unwrap_or("")),
            };
            let index = failed
                .id()
                .parse::<usize>()
                .ok()
                .and_then(|id| indexes.get(id));
            match index {
                Some(&index)
                    if failed.sender_fault()
                        || classify::is_refused_message_code(failed.code()) =>
                {
                    refused.push((index, fault));
                }
                _ => failed_now.push(fault),
            }
        }
        if let Some(fault) = failed_now.into_iter().next() {
            return Err(TransportError::transient(
                "SQS SendMessageBatch to the dead-letter queue failed for some of its entries",
                fault,
            ));
        }
        Ok(Sent::Written { refused })
    }

    /// One `ChangeMessageVisibilityBatch` setting `messages`' visibility to `seconds`.
    async fn change_visibility(
        &self,
        queues: &Queues,
        messages: &[&SqsDelivery],
        seconds: i32,
    ) -> Result<(), TransportError> {
        let entries = messages
            .iter()
            .enumerate()
            .filter_map(|(id, message)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(id.to_string())
                    .receipt_handle(&message.receipt.handle)
                    .visibility_timeout(seconds)
                    .build()
                    .ok()
            })
            .collect();
        let output = self
            .client
            .change_message_visibility_batch()
            .queue_url(&queues.url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|err| {
                self.errors
                    .error("ChangeMessageVisibilityBatch", Addressed::Source, err)
            })?;
        let refused: Vec<&str> = output
            .failed()
            .iter()
            .filter(|failed| !classify::is_stale_code(failed.code(), failed.message()))
            .map(|failed| failed.code())
            .collect();
        if !refused.is_empty() {
            // Not retried: a refusal such as the 12-hour visibility cap would repeat forever.
            // The message is redelivered when its visibility expires and deduplicated.
            tracing::warn!(count = refused.len(), codes = ?refused, "SQS refused to extend the visibility of some messages");
        }
        Ok(())
    }
}

/// Reads the queue's depth on its own clone of the client.
#[derive(Debug, Clone)]
pub struct SqsProbe {
    client: Client,
    /// The queue's URL (`None` until `prepare` resolved a `queueName`).
    queue_url: Option<String>,
    queue_name: Option<String>,
    /// The dead-letter queue's URL, once `prepare` resolved it.
    dead_letter_url: Option<String>,
    errors: classify::Settings,
    held: InFlight,
}

impl SqsProbe {
    /// The numeric attributes `names` of queue `url`.
    async fn attributes(
        &self,
        url: &str,
        names: &[QueueAttributeName],
        addressed: Addressed,
    ) -> Result<std::collections::HashMap<QueueAttributeName, u64>, TransportError> {
        let output = self
            .client
            .get_queue_attributes()
            .queue_url(url)
            .set_attribute_names(Some(names.to_vec()))
            .send()
            .await
            .map_err(|err| self.errors.error("GetQueueAttributes", addressed, err))?;
        Ok(output
            .attributes()
            .into_iter()
            .flatten()
            .filter_map(|(name, value)| Some((name.clone(), value.parse().ok()?)))
            .collect())
    }
}

impl QueueProbe for SqsProbe {
    /// Backlog = `ApproximateNumberOfMessages` + `…Delayed`, pending =
    /// `ApproximateNumberOfMessagesNotVisible` (both queue-wide). The oldest pending age is
    /// that of the oldest message *this worker* holds (received, visibility not expired, not
    /// yet deleted), from its `SentTimestamp`: SQS reports the queue-wide figure only as the
    /// CloudWatch metric `ApproximateAgeOfOldestMessage`, which the SQS API (and SQS-compatible
    /// servers) do not offer.
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let url = match (&self.queue_url, &self.queue_name) {
            (Some(url), _) => url.clone(),
            (None, Some(name)) => {
                let output = self
                    .client
                    .get_queue_url()
                    .queue_name(name)
                    .send()
                    .await
                    .map_err(|err| self.errors.error("GetQueueUrl", Addressed::Source, err))?;
                let url = output
                    .queue_url()
                    .map(str::to_owned)
                    .ok_or_else(|| TransportError::protocol("SQS GetQueueUrl returned no URL"))?;
                self.queue_url = Some(url.clone());
                url
            }
            (None, None) => return Ok(QueueHealth::default()),
        };
        use QueueAttributeName::{
            ApproximateNumberOfMessages as Visible, ApproximateNumberOfMessagesDelayed as Delayed,
            ApproximateNumberOfMessagesNotVisible as NotVisible,
        };
        let numbers = self
            .attributes(&url, &[Visible, NotVisible, Delayed], Addressed::Source)
            .await?;
        // The dead-letter queue's depth is for the gauge only: failing to read it is not an
        // outage of the source.
        let dead_letters = match &self.dead_letter_url {
            Some(dlq) => self
                .attributes(dlq, &[Visible, NotVisible], Addressed::DeadLetter)
                .await
                .ok()
                .map(|numbers| numbers.values().sum()),
            None => None,
        };
        Ok(QueueHealth {
            backlog: numbers
                .get(&Visible)
                .map(|v| v + numbers.get(&Delayed).unwrap_or(&0)),
            pending: numbers.get(&NotVisible).copied(),
            oldest_pending_age: Some(self.held.oldest_age(now_ms())),
            dead_letters,
            oldest_dead_letter_age: None,
        })
    }
}

/// Queue attributes as GetQueueAttributes returns them.
type Attributes = std::collections::HashMap<QueueAttributeName, String>;

/// Whether the queue is FIFO: its `FifoQueue` attribute, else its name.
fn is_fifo(attributes: &Attributes, url: &str) -> bool {
    attributes.get(&QueueAttributeName::FifoQueue).map_or_else(
        || url.ends_with(".fifo"),
        |v| v.eq_ignore_ascii_case("true"),
    )
}

/// A numeric queue attribute.
fn number<N: std::str::FromStr>(attributes: &Attributes, name: QueueAttributeName) -> Option<N> {
    attributes.get(&name).and_then(|v| v.parse().ok())
}

impl Transport for Sqs {
    type Receipt = Receipt;
    type Probe = SqsProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        self.check_credentials().await?;
        let url = self.resolve_queue_url().await?;
        self.errors.source_queue = url.clone();
        let attributes = self
            .queue_attributes(
                &url,
                Addressed::Source,
                &[
                    QueueAttributeName::VisibilityTimeout,
                    QueueAttributeName::RedrivePolicy,
                    QueueAttributeName::FifoQueue,
                ],
            )
            .await?;
        let fifo = is_fifo(&attributes, &url);
        let visibility_seconds = number(&attributes, QueueAttributeName::VisibilityTimeout)
            .unwrap_or(DEFAULT_VISIBILITY_SECONDS);
        let redrive_policy = attributes
            .get(&QueueAttributeName::RedrivePolicy)
            .filter(|policy| !policy.trim().is_empty());

        let dead_letter_url = self
            .settings
            .dead_letter_queue_url
            .clone()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| client::default_dead_letter_url(&url));
        self.errors.dead_letter_queue = dead_letter_url.clone();
        let dead_letter = self
            .queue_attributes(
                &dead_letter_url,
                Addressed::DeadLetter,
                &[
                    QueueAttributeName::FifoQueue,
                    QueueAttributeName::MaximumMessageSize,
                    QueueAttributeName::MessageRetentionPeriod,
                ],
            )
            .await?;
        let dead_letter_fifo = is_fifo(&dead_letter, &dead_letter_url);
        let dead_letter_max_bytes = number(&dead_letter, QueueAttributeName::MaximumMessageSize)
            .unwrap_or(DEFAULT_MAX_MESSAGE_BYTES);

        let first = self.queues.is_none();
        let kept = number::<u64>(&dead_letter, QueueAttributeName::MessageRetentionPeriod)
            .map(Duration::from_secs);
        if first && let Some(kept) = kept.filter(|kept| *kept < self.settings.dead_letter_retention)
        {
            tracing::warn!(
                dead_letter_queue = %dead_letter_url,
                retention_seconds = kept.as_secs(),
                wanted_seconds = self.settings.dead_letter_retention.as_secs(),
                "the dead-letter queue keeps messages for less than deadLetter.retentionDays: raise its MessageRetentionPeriod (SQS allows at most 14 days)"
            );
        }
        if first {
            if let Some(policy) = redrive_policy {
                tracing::info!(
                    queue = %url,
                    redrive_policy = %policy,
                    dead_letter_queue = %dead_letter_url,
                    "the queue has a RedrivePolicy: SQS moves messages received too often (delivery.maxDeliveries is not counted); poison still goes to the dead-letter queue at once"
                );
            }
            tracing::info!(
                queue = %url,
                fifo,
                visibility_seconds = self.settings.spec.visibility_timeout_seconds.unwrap_or(visibility_seconds),
                dead_letter_queue = %dead_letter_url,
                "SQS queue ready"
            );
        }
        self.queues = Some(Queues {
            url,
            fifo,
            visibility_seconds,
            redrive: redrive_policy.is_some(),
            dead_letter_url,
            dead_letter_fifo,
            dead_letter_max_bytes,
        });
        self.errors.source_absence.found();
        Ok(())
    }

    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<SqsDelivery>, TransportError> {
        let queues = self.queues()?;
        let wait = if block {
            self.settings.spec.wait_time_seconds
        } else {
            0
        };
        let raw = gather::gather(max, block, wait, |count, wait| {
            self.receive_once(queues, count, wait)
        })
        .await?;
        Ok(self.deliver(queues, raw).await)
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        let queues = self.queues()?;
        let last_seen = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        let context = WriteContext {
            origin: &queues.url,
            consumer: &self.settings.consumer,
            last_seen: &last_seen,
            fifo: queues.dead_letter_fifo,
            max_message_bytes: queues.dead_letter_max_bytes,
        };
        let built: Vec<dead_letter::Letter> = letters
            .iter()
            .map(|letter| {
                dead_letter::letter(
                    letter.message,
                    letter.reason,
                    &letter.error,
                    &letter.attempts,
                    context,
                )
            })
            .collect();
        let max = queues.dead_letter_max_bytes;
        // A letter over the queue's limit even without its context can never be written.
        let (fitting, too_large): (Vec<usize>, Vec<usize>) =
            (0..built.len()).partition(|&index| built[index].size() <= max);
        let mut refused: Vec<(usize, ServiceFault)> = too_large
            .into_iter()
            .map(|index| {
                let fault = ServiceFault {
                    code: "MessageTooLong".to_owned(),
                    status: None,
                    message: format!(
                        "{} bytes; the dead-letter queue takes at most {max} (MaximumMessageSize)",
                        built[index].size()
                    ),
                };
                (index, fault)
            })
            .collect();
        let sizes: Vec<usize> = fitting.iter().map(|&index| built[index].size()).collect();
        for range in dead_letter::batches(&sizes, max) {
            let indexes = &fitting[range];
            match self.send_dead_letters(queues, &built, indexes).await? {
                Sent::Written { refused: some } => refused.extend(some),
                Sent::AllRefused(fault) if indexes.len() == 1 => refused.push((indexes[0], fault)),
                // One letter SQS refuses fails the whole call: find it, letter by letter.
                Sent::AllRefused(_) => {
                    for &index in indexes {
                        match self.send_dead_letters(queues, &built, &[index]).await? {
                            Sent::Written { refused: some } => refused.extend(some),
                            Sent::AllRefused(fault) => refused.push((index, fault)),
                        }
                    }
                }
            }
        }
        let Some((_, first)) = refused.first() else {
            return Ok(());
        };
        let context = format!(
            "SQS refused {} dead letters for good (the dead-letter queue can never take them as they are; first: {} {})",
            refused.len(),
            first.code,
            first.message
        );
        let mut letters: Vec<usize> = refused.iter().map(|(index, _)| *index).collect();
        letters.sort_unstable();
        let (_, fault) = refused.swap_remove(0);
        Err(TransportError::dead_letters_refused(
            letters,
            context,
            Some(Box::new(fault)),
        ))
    }

    async fn ack(&mut self, messages: &[&SqsDelivery]) -> Result<Acked, TransportError> {
        if messages.is_empty() {
            return Ok(Acked::all());
        }
        let queues = self.queues()?;
        let mut plan = DeletePlan::new(messages.iter().map(|m| m.receipt.group.as_deref()));
        loop {
            let round = plan.next_round();
            if round.is_empty() {
                break;
            }
            let results = join_all(
                round
                    .iter()
                    .map(|entries| self.delete_batch(queues, messages, entries)),
            )
            .await;
            let mut failure = None;
            for (entries, result) in round.iter().zip(results) {
                match result {
                    Ok(outcomes) => {
                        for (index, outcome) in outcomes {
                            plan.record(index, outcome);
                        }
                    }
                    Err(err) if err.is_fatal() => return Err(err),
                    Err(err) => {
                        let outcome = match err.kind() {
                            crate::transport::ErrorKind::StaleReceipt => Outcome::Stale,
                            _ => Outcome::Retry,
                        };
                        for &index in entries {
                            plan.record(index, outcome);
                        }
                        failure.get_or_insert(err);
                    }
                }
            }
            // Nothing taken at all: an outage, reported as such (the pipeline backs off).
            if let Some(err) = failure
                && !plan.any_deleted()
                && err.kind() == &crate::transport::ErrorKind::Transient
            {
                return Err(err);
            }
        }
        let acked = plan.finish();
        let retried: std::collections::HashSet<usize> = acked.retry.iter().copied().collect();
        self.held.settled(
            messages
                .iter()
                .enumerate()
                .filter(|(index, _)| !retried.contains(index))
                .map(|(_, message)| message.external_id.as_str()),
        );
        Ok(acked)
    }

    fn lease(&self) -> Option<Duration> {
        match self.visibility_seconds() {
            0 => None,
            seconds => Some(Duration::from_secs(u64::from(seconds))),
        }
    }

    async fn extend_lease(&mut self, messages: &[&SqsDelivery]) -> Result<(), TransportError> {
        let queues = self.queues()?;
        let seconds = i32::try_from(self.visibility_seconds()).unwrap_or(i32::MAX);
        let results = join_all(
            messages
                .chunks(BATCH_LIMIT)
                .map(|chunk| self.change_visibility(queues, chunk, seconds)),
        )
        .await;
        results.into_iter().collect::<Result<(), _>>()?;
        if let Some(lease) = self.lease() {
            self.held.extended(messages, lease);
        }
        Ok(())
    }

    fn broker_dead_letters(&self) -> bool {
        self.queues.as_ref().is_some_and(|q| q.redrive)
    }

    async fn maintain(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    fn maintenance_interval(&self) -> Duration {
        MAINTENANCE_INTERVAL
    }

    fn probe(&self) -> SqsProbe {
        SqsProbe {
            client: self.client.clone(),
            queue_url: self
                .queues
                .as_ref()
                .map(|q| q.url.clone())
                .or_else(|| self.settings.spec.queue_url.clone()),
            queue_name: self.settings.spec.queue_name.clone(),
            dead_letter_url: self.queues.as_ref().map(|q| q.dead_letter_url.clone()),
            errors: self.errors.clone(),
            held: self.held.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(spec: serde_json::Value) -> SqsSettings {
        SqsSettings {
            adapter: "shop/orders".into(),
            consumer: "worker-0".into(),
            spec: serde_json::from_value(spec).expect("spec"),
            dead_letter_queue_url: None,
            batch_size: 10,
            dead_letter_retention: Duration::from_secs(14 * 86_400),
        }
    }

    fn fatal_setting(result: Result<Sqs, TransportError>) -> String {
        match result.map(drop).expect_err("fatal").kind() {
            crate::transport::ErrorKind::Fatal { setting } => setting.clone(),
            other => panic!("expected a fatal error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn queue_url_in_another_region_than_the_client_is_fatal() {
        let settings = settings(serde_json::json!({
            "queueUrl": "https://sqs.eu-west-1.amazonaws.com/123456789012/orders",
            "region": "us-east-1",
        }));
        let result = Sqs::new(settings, &mut Registry::default()).await;
        assert_eq!(fatal_setting(result), "spec.source.sqs.region");
    }

    #[tokio::test]
    async fn malformed_region_and_endpoint_are_fatal() {
        let bad_region = settings(serde_json::json!({"queueName": "orders", "region": "EU West"}));
        let result = Sqs::new(bad_region, &mut Registry::default()).await;
        assert_eq!(fatal_setting(result), "spec.source.sqs.region");
        let bad_endpoint = settings(serde_json::json!({
            "queueName": "orders", "region": "eu-west-1", "endpoint": "elasticmq:9324",
        }));
        let result = Sqs::new(bad_endpoint, &mut Registry::default()).await;
        assert_eq!(fatal_setting(result), "spec.source.sqs.endpoint");
    }

    #[tokio::test]
    async fn client_builds_without_network_and_names_its_source() {
        let settings = settings(serde_json::json!({
            "queueUrl": "https://sqs.ap-south-1.amazonaws.com/123456789012/orders.fifo",
            "region": "ap-south-1",
        }));
        let sqs = Sqs::new(settings, &mut Registry::default())
            .await
            .expect("builds");
        assert_eq!(sqs.source(), "sqs:shop/orders");
        assert_eq!(sqs.dedup(), Dedup::NativeId);
        assert_eq!(
            sqs.lease(),
            Some(Duration::from_secs(30)),
            "the SQS default until prepared"
        );
        assert!(!sqs.broker_dead_letters());
        assert!(sqs.queues().is_err(), "calls before prepare are refused");
    }
}
