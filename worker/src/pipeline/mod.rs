//! The store-then-ack loop: receive a batch → store it in one transaction → acknowledge it.
//!
//! Nothing is acknowledged before its todo is committed. Poison is dead-lettered without
//! holding up the rest of its batch. A failing dependency is retried with backoff, logged once
//! per outage, and reported through readiness; shutdown is checked between batches, and a
//! batch in hand is finished or left un-acknowledged.
//!
//! Up to [`IN_FLIGHT`](crate::transport::IN_FLIGHT) batches are stored at once (each in its own transaction, on its own
//! connection): while one commits, the next is received and starts committing. Batches are
//! still acknowledged one by one, in the order they were received, each only after its own
//! commit; a batch stored before an older one waits for it without counting as a store, so up
//! to [`HELD`](crate::transport::HELD) batches are held.
//!
//! The rooms: `intake` (classify a batch, start its store), `store` (the only one that writes
//! SQL), `lease` (extend the broker's lease while storing), `settle` (the settle order, a pure
//! plan: dead letters written and confirmed, then acknowledgements in receive order),
//! `monitor` (a dependency's outage state), `report` (queue health to the gauges and the
//! operator), `dead_letter_log` and `stale_log` (dead letters and stale acknowledgements
//! summed up in the log). This file is the loop.

mod dead_letter_log;
mod intake;
mod lease;
mod monitor;
mod report;
mod settle;
mod spans;
mod stale_log;
mod store;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchboard_api::source::Messaging;
use switchboard_api::{Envelope, PayloadFormat};
use switchboard_store::{Dedup, Store, StoreError};
use switchboard_telemetry::ErrorChain;
use tokio_util::sync::CancellationToken;

use self::dead_letter_log::DeadLetterLog;
use self::monitor::Monitor;
use self::settle::{InFlight, RecentLetters, settle_oldest};
use self::stale_log::StaleLog;
use self::store::StoreContext;
use crate::health::{Dependency, Health};
use crate::metrics::Metrics;
use crate::transport::{ErrorKind, Message, Transport, TransportError};

/// How long past its own next deadline the loop may be silent before `/healthz` fails.
const LIVENESS_SLACK: Duration = Duration::from_secs(60);

/// How often the worker reads its queue's health and reports it to the operator.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(5);

/// What the loop does with each batch.
#[derive(Debug, Clone)]
pub struct PipelineSettings {
    /// `namespace/name`, and this worker's consumer name: its report's key.
    pub adapter: String,
    pub worker: String,
    pub queue: String,
    pub batch_size: usize,
    pub max_deliveries: u64,
    pub format: PayloadFormat,
    pub max_bytes: usize,
    /// The producer's envelope: its event id, not the broker's message id, deduplicates.
    pub envelope: Envelope,
    /// Testing hook: abort the process after this many commits, before acknowledging.
    pub abort_after_commits: Option<u64>,
    /// How long dead letters are kept (`deadLetter.retentionDays`): attempts recorded for
    /// messages that never settled are pruned after it too.
    pub dead_letter_retention: Duration,
    /// What the source is in OpenTelemetry's messaging terms (the batch spans).
    pub messaging: Messaging,
}

/// How often the attempts of messages that never settled are pruned.
const PRUNE_INTERVAL: Duration = Duration::from_secs(3600);

/// Why the loop stopped for good: retrying cannot fix it, the worker exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Broker(TransportError),
    #[error("the worker cannot store messages")]
    Database(#[source] StoreError),
}

/// The loop for one adapter and one transport.
#[derive(Debug)]
pub struct Pipeline<T: Transport> {
    transport: T,
    settings: PipelineSettings,
    context: Arc<StoreContext>,
    broker: Monitor,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    cancel: CancellationToken,
    commits: u64,
    /// Whether the pipeline counts deliveries against `maxDeliveries` (not when the broker
    /// dead-letters by count itself).
    count_deliveries: bool,
    /// When the attempts of messages that never settled are next pruned.
    next_prune: Instant,
    dead_letter_log: DeadLetterLog,
    stale_log: StaleLog,
    /// Keys this worker dead-lettered lately: never dead-lettered twice.
    recent_letters: RecentLetters,
    /// Until when no batch is received ahead: the last extension of the leases held took over
    /// a quarter of a lease (see [`Pipeline::extend_leases`]).
    leases_strained_until: Option<Instant>,
}

/// What became of a broker operation that did not succeed.
enum Stopped {
    /// Shutdown interrupted a retry.
    Cancelled,
    /// The receipts can never be acknowledged.
    Stale(TransportError),
    /// Misconfiguration: the worker must exit.
    Fatal(TransportError),
}

impl<T: Transport> Pipeline<T> {
    pub fn new(
        transport: T,
        store: Store,
        settings: PipelineSettings,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        cancel: CancellationToken,
    ) -> Self {
        let database = store.endpoint();
        let context = Arc::new(StoreContext {
            store,
            source: transport.source().to_owned(),
            worker: settings.worker.clone(),
            queue: settings.queue.clone(),
            // An envelope's event id is a native id, whatever the broker has.
            dedup: match settings.envelope {
                Envelope::None => transport.dedup(),
                Envelope::CloudEvents | Envelope::Sns => Dedup::NativeId,
            },
            database: Monitor::new(
                Dependency::Database,
                database,
                health.clone(),
                metrics.clone(),
            ),
            metrics: metrics.clone(),
            cancel: cancel.clone(),
        });
        Self {
            broker: Monitor::new(
                Dependency::Broker,
                transport.endpoint(),
                health.clone(),
                metrics.clone(),
            ),
            transport,
            settings,
            context,
            metrics,
            health,
            cancel,
            commits: 0,
            count_deliveries: true,
            next_prune: Instant::now(),
            dead_letter_log: DeadLetterLog::default(),
            stale_log: StaleLog::default(),
            recent_letters: RecentLetters::default(),
            leases_strained_until: None,
        }
    }

    fn monitor(&self, dependency: Dependency) -> &Monitor {
        match dependency {
            Dependency::Broker => &self.broker,
            Dependency::Database => &self.context.database,
        }
    }

    /// Runs a broker operation until it succeeds, backing off on transient failures.
    async fn broker_op<R>(
        &mut self,
        mut op: impl AsyncFnMut(&mut T) -> Result<R, TransportError>,
    ) -> Result<R, Stopped> {
        let mut failed = Vec::new();
        loop {
            let attempted = Instant::now();
            match op(&mut self.transport).await {
                Ok(value) => {
                    self.broker.up();
                    for dependency in failed {
                        self.monitor(dependency).up();
                    }
                    return Ok(value);
                }
                Err(err) => match err.kind() {
                    // Refused dead letters are the caller's to keep elsewhere (only
                    // `write_dead_letters` refuses letters; anywhere else it is fatal).
                    ErrorKind::Fatal { .. } | ErrorKind::DeadLettersRefused { .. } => {
                        return Err(Stopped::Fatal(err));
                    }
                    ErrorKind::StaleReceipt => return Err(Stopped::Stale(err)),
                    ErrorKind::Transient => {
                        let dependency = err.dependency();
                        if !failed.contains(&dependency) {
                            failed.push(dependency);
                        }
                        if !self
                            .monitor(dependency)
                            .back_off(&err, attempted, &self.cancel)
                            .await
                        {
                            return Err(Stopped::Cancelled);
                        }
                    }
                },
            }
        }
    }

    /// Runs until cancelled; then finishes (or abandons, un-acknowledged) the batches in hand.
    /// Returns an error when the configuration cannot work (the worker exits non-zero).
    pub async fn run(mut self) -> Result<(), PipelineError> {
        match self
            .broker_op(async |transport| transport.prepare().await)
            .await
        {
            Ok(()) => {}
            Err(Stopped::Fatal(err) | Stopped::Stale(err)) => {
                return Err(PipelineError::Broker(err));
            }
            Err(Stopped::Cancelled) => return Ok(()),
        }
        self.count_deliveries = !self.transport.broker_dead_letters();
        self.check_source_retention().await;
        self.health.set_started();
        tracing::info!(source = %self.context.source, queue = %self.settings.queue, "worker started");
        let probe = self.spawn_probe();
        let result = self.receive_until_cancelled().await;
        probe.abort();
        result
    }

    /// Warns when the broker keeps the source's messages longer than the dedup window (best
    /// effort: the window is not read while the database is down).
    async fn check_source_retention(&self) {
        match self.context.store.dedup_window().await {
            Ok(window) => {
                self.transport.source_retention().warn_beyond(window);
            }
            Err(err) => tracing::debug!(
                error = %ErrorChain(&err),
                "the dedup window was not read: the broker's retention is not compared with it"
            ),
        }
    }

    async fn receive_until_cancelled(&mut self) -> Result<(), PipelineError> {
        let cancel = self.cancel.clone();
        let interval = self.transport.maintenance_interval();
        let mut next_maintenance = Instant::now();
        let mut in_flight: VecDeque<InFlight<T::Receipt>> = VecDeque::new();
        let mut result = Ok(());
        while !cancel.is_cancelled() {
            self.health.beat(Duration::from_secs(1) + LIVENESS_SLACK);
            if Instant::now() >= next_maintenance {
                match self.maintain().await {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(err) => {
                        result = Err(err);
                        break;
                    }
                }
                next_maintenance = Instant::now() + interval;
                self.flush_summaries(false);
            }
            let (batch_size, block) = (self.settings.batch_size, in_flight.is_empty());
            let attempted = Instant::now();
            let received = tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                received = self.transport.receive(batch_size, block) => received,
            };
            let oldest = match received {
                Ok(batch) if batch.is_empty() => {
                    self.broker.up();
                    if in_flight.is_empty() {
                        self.health.progressed();
                    }
                    in_flight.pop_front()
                }
                Ok(batch) => {
                    self.broker.up();
                    let started = self.start(batch);
                    in_flight.push_back(started);
                    let storing: Vec<bool> = in_flight.iter().map(InFlight::storing).collect();
                    if settle_oldest(&storing, self.receive_ahead()) {
                        in_flight.pop_front()
                    } else {
                        None
                    }
                }
                Err(err) if err.is_fatal() => {
                    result = Err(PipelineError::Broker(err));
                    break;
                }
                Err(err) => {
                    let monitor = self.monitor(err.dependency());
                    if !monitor.back_off(&err, attempted, &cancel).await {
                        break;
                    }
                    None
                }
            };
            if let Some(oldest) = oldest
                && let Err(err) = self.finish(oldest, &mut in_flight).await
            {
                result = Err(err);
                break;
            }
        }
        // On an error, the rest is left un-acknowledged: the broker redelivers it to the next
        // worker.
        result?;
        // Batches in hand are committed and acknowledged, or (shutdown interrupted a retry)
        // left un-acknowledged for redelivery.
        while let Some(oldest) = in_flight.pop_front() {
            self.finish(oldest, &mut in_flight).await?;
        }
        if cancel.is_cancelled() {
            self.transport.shutdown().await;
        }
        self.flush_summaries(true);
        tracing::info!("worker stopped");
        Ok(())
    }

    /// Logs the summaries of dead letters and stale acknowledgements that are due (all that is
    /// left when `stopping`).
    fn flush_summaries(&mut self, stopping: bool) {
        let now = Instant::now();
        self.dead_letter_log.flush(now, stopping);
        self.stale_log.flush(now, stopping);
    }

    /// Upkeep and a database probe. `Ok(false)`: shutdown interrupted it.
    async fn maintain(&mut self) -> Result<bool, PipelineError> {
        match self
            .broker_op(async |transport| transport.maintain().await)
            .await
        {
            Ok(()) => {}
            Err(Stopped::Cancelled) => return Ok(false),
            Err(Stopped::Fatal(err) | Stopped::Stale(err)) => {
                return Err(PipelineError::Broker(err));
            }
        }
        if Instant::now() >= self.next_prune {
            self.next_prune = Instant::now() + PRUNE_INTERVAL;
            self.spawn_prune();
        }
        // Any failure of the probe is waited out: it only asks whether the database answers.
        let context = self.context.clone();
        let answered = context
            .persist_while(|| context.store.ping(), |_| true)
            .await;
        Ok(matches!(answered, Ok(Some(()))))
    }

    /// Prunes, on its own task, the attempts of messages last seen longer ago than the
    /// dead-letter retention (they left the broker without settling here: purged, expired).
    fn spawn_prune(&self) {
        let context = self.context.clone();
        let retention = self.settings.dead_letter_retention;
        crate::task::spawn(async move {
            match context
                .store
                .prune_deliveries(&context.source, retention)
                .await
            {
                Ok(0) => {}
                Ok(pruned) => tracing::info!(
                    pruned,
                    "pruned the attempts of messages not seen within the dead-letter retention"
                ),
                Err(err) => {
                    tracing::debug!(error = %ErrorChain(&err), "cannot prune recorded attempts")
                }
            }
        });
    }

    /// Forgets, on its own task, the recorded attempts of settled messages (only redelivered
    /// ones have any). Best effort: what is left is pruned after the retention.
    fn spawn_forget(&self, settled: &[&Message<T::Receipt>]) {
        let keys: Vec<String> = settled
            .iter()
            .filter(|message| message.delivery_count > 1)
            .map(|message| message.idempotency_key.clone())
            .collect();
        if keys.is_empty() {
            return;
        }
        let context = self.context.clone();
        crate::task::spawn(async move {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            if let Err(err) = context
                .store
                .forget_deliveries(&context.source, &keys)
                .await
            {
                tracing::debug!(error = %ErrorChain(&err), "cannot forget the attempts of settled messages");
            }
        });
    }
}
