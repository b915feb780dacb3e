//! What `prepare` learns about the queues: that credentials resolve, the source queue's URL
//! (GetQueueUrl for a `queueName`), its visibility timeout, `RedrivePolicy` and `FifoQueue`,
//! and that the dead-letter queue exists (its `FifoQueue`, `MaximumMessageSize` and
//! `MessageRetentionPeriod`, raised to `deadLetter.retentionDays` when it is shorter).

use std::time::{Duration, Instant};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::ProvideCredentials;
use aws_sdk_sqs::types::QueueAttributeName;

use super::classify::{self, Addressed, CREDENTIALS_SETTING, Verdict};
use super::dead_letter::DEFAULT_MAX_MESSAGE_BYTES;
use super::{DEFAULT_VISIBILITY_SECONDS, Sqs, client};
use crate::transport::TransportError;

/// How long credentials may fail to load at start-up before that is fatal.
const CREDENTIALS_DEADLINE: Duration = Duration::from_secs(20);

/// What `prepare` learnt about the queues.
#[derive(Debug, Clone)]
pub struct Queues {
    pub url: String,
    pub fifo: bool,
    pub visibility_seconds: u32,
    pub redrive: bool,
    pub dead_letter_url: String,
    pub dead_letter_fifo: bool,
    pub dead_letter_max_bytes: usize,
    /// The source queue's `MessageRetentionPeriod`.
    pub kept: Option<Duration>,
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

/// A queue's `MessageRetentionPeriod`.
fn retention(attributes: &Attributes) -> Option<Duration> {
    number::<u64>(attributes, QueueAttributeName::MessageRetentionPeriod).map(Duration::from_secs)
}

/// The URL of the source queue named `name` (GetQueueUrl).
pub async fn queue_url_of(
    client: &Client,
    errors: &classify::Settings,
    name: &str,
) -> Result<String, TransportError> {
    let output = client
        .get_queue_url()
        .queue_name(name)
        .send()
        .await
        .map_err(|err| errors.error("GetQueueUrl", Addressed::Source, err))?;
    output
        .queue_url()
        .map(str::to_owned)
        .ok_or_else(|| TransportError::protocol("SQS GetQueueUrl returned no URL"))
}

/// What the source queue's attributes say.
struct SourceQueue {
    fifo: bool,
    visibility_seconds: u32,
    redrive_policy: Option<String>,
    kept: Option<Duration>,
}

/// What the dead-letter queue's attributes say.
struct DeadLetterQueue {
    url: String,
    fifo: bool,
    max_bytes: usize,
    /// Its `MessageRetentionPeriod`.
    kept: Option<Duration>,
}

impl Sqs {
    /// Checks the credentials and reads both queues' attributes (see the module doc).
    pub(super) async fn discover_queues(&mut self) -> Result<(), TransportError> {
        self.check_credentials().await?;
        let url = self.resolve_queue_url().await?;
        self.errors.source_queue = url.clone();
        let source = self.read_source_queue(&url).await?;
        let dead_letter = self.read_dead_letter_queue(&url).await?;
        self.hold_retention(&dead_letter).await?;
        if self.queues.is_none() {
            self.log_queues(&url, &source, &dead_letter);
        }
        self.queues = Some(Queues {
            url,
            fifo: source.fifo,
            visibility_seconds: source.visibility_seconds,
            redrive: source.redrive_policy.is_some(),
            dead_letter_url: dead_letter.url,
            dead_letter_fifo: dead_letter.fifo,
            dead_letter_max_bytes: dead_letter.max_bytes,
            kept: source.kept,
        });
        self.errors.source_absence.found();
        Ok(())
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
        queue_url_of(&self.client, &self.errors, name).await
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

    async fn read_source_queue(&self, url: &str) -> Result<SourceQueue, TransportError> {
        let attributes = self
            .queue_attributes(
                url,
                Addressed::Source,
                &[
                    QueueAttributeName::VisibilityTimeout,
                    QueueAttributeName::RedrivePolicy,
                    QueueAttributeName::FifoQueue,
                    QueueAttributeName::MessageRetentionPeriod,
                ],
            )
            .await?;
        Ok(SourceQueue {
            fifo: is_fifo(&attributes, url),
            visibility_seconds: number(&attributes, QueueAttributeName::VisibilityTimeout)
                .unwrap_or(DEFAULT_VISIBILITY_SECONDS),
            redrive_policy: attributes
                .get(&QueueAttributeName::RedrivePolicy)
                .filter(|policy| !policy.trim().is_empty())
                .cloned(),
            kept: retention(&attributes),
        })
    }

    /// The dead-letter queue of the source queue `url` (`deadLetter.queueUrl`, else the
    /// default) and its attributes.
    async fn read_dead_letter_queue(
        &mut self,
        url: &str,
    ) -> Result<DeadLetterQueue, TransportError> {
        let dead_letter_url = self
            .settings
            .dead_letter_queue_url
            .clone()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| client::default_dead_letter_url(url));
        self.errors.dead_letter_queue = dead_letter_url.clone();
        let attributes = self
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
        Ok(DeadLetterQueue {
            fifo: is_fifo(&attributes, &dead_letter_url),
            max_bytes: number(&attributes, QueueAttributeName::MaximumMessageSize)
                .unwrap_or(DEFAULT_MAX_MESSAGE_BYTES),
            kept: retention(&attributes),
            url: dead_letter_url,
        })
    }

    /// Raises the dead-letter queue's `MessageRetentionPeriod` to `deadLetter.retentionDays`
    /// when it is shorter (SetQueueAttributes). A refusal that waiting cannot fix (AccessDenied,
    /// an invalid value) is fatal naming the setting, unless `acceptShorterRetention`.
    async fn hold_retention(&self, dead_letter: &DeadLetterQueue) -> Result<(), TransportError> {
        let retention = self.settings.dead_letter_retention;
        let Some(kept) = dead_letter
            .kept
            .filter(|kept| retention.too_short(Some(*kept)))
        else {
            return Ok(());
        };
        if retention.accept_shorter {
            return retention.refused(&dead_letter.url, kept, "not raised: accepted as it is");
        }
        let result = self
            .client
            .set_queue_attributes()
            .queue_url(&dead_letter.url)
            .attributes(
                QueueAttributeName::MessageRetentionPeriod,
                retention.wanted.as_secs().to_string(),
            )
            .send()
            .await;
        match result {
            Ok(_) => {
                tracing::info!(
                    dead_letter_queue = %dead_letter.url,
                    from_seconds = kept.as_secs(),
                    to_seconds = retention.wanted.as_secs(),
                    "raised the dead-letter queue's MessageRetentionPeriod to deadLetter.retentionDays"
                );
                Ok(())
            }
            // Refused for good: the value (InvalidAttributeValue), or the permission.
            Err(err)
                if classify::refused_message(&err).is_some()
                    || classify::verdict(&err) == Verdict::Credentials =>
            {
                retention.refused(
                    &dead_letter.url,
                    kept,
                    format!(
                        "SetQueueAttributes MessageRetentionPeriod: {}",
                        classify::fault(&err)
                    ),
                )
            }
            Err(err) => Err(self
                .errors
                .error("SetQueueAttributes", Addressed::DeadLetter, err)),
        }
    }

    /// Logs, on the first `prepare`, what the queues are and what of them needs attention.
    fn log_queues(&self, url: &str, source: &SourceQueue, dead_letter: &DeadLetterQueue) {
        if let Some(policy) = &source.redrive_policy {
            tracing::info!(
                queue = %url,
                redrive_policy = %policy,
                dead_letter_queue = %dead_letter.url,
                "the queue has a RedrivePolicy: SQS moves messages received too often (delivery.maxDeliveries is not counted); poison still goes to the dead-letter queue at once"
            );
        }
        tracing::info!(
            queue = %url,
            fifo = source.fifo,
            visibility_seconds = self.settings.spec.visibility_timeout_seconds.unwrap_or(source.visibility_seconds),
            dead_letter_queue = %dead_letter.url,
            "SQS queue ready"
        );
    }
}
