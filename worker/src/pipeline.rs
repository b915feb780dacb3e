//! The store-then-ack loop: receive a batch → store it in one transaction → acknowledge it.
//!
//! Nothing is acknowledged before its todo is committed. The settle order lives here only:
//! store the batch → write its dead letters (confirmed by the broker) → acknowledge everything
//! settled once, in receive order; so a cumulative acknowledgement can never pass an unwritten
//! dead letter. Poison is dead-lettered without holding up the rest of its batch. A failing dependency is retried
//! with backoff, logged once per outage, and reported through readiness; shutdown is checked
//! between batches, and a batch in hand is finished or left un-acknowledged.
//!
//! Up to [`IN_FLIGHT`] batches are stored at once (each in its own transaction, on its own
//! connection): while one commits, the next is received and starts committing. Batches are
//! still acknowledged one by one, in the order they were received, each only after its own
//! commit; a batch stored before an older one waits for it without counting as a store, so up
//! to [`HELD`] batches are held.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use switchboard_api::{Envelope, PayloadFormat};
use switchboard_store::{
    AttemptRecord, Dedup, IngestBatch, KeptLetter, NewEvent, Store, StoreError, Stored,
    WorkerReport,
};
use switchboard_telemetry::ErrorChain;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::envelope::{self, PayloadRules, Unwrapped};
use crate::health::{Dependency, Health, now_ms};
use crate::metrics::Metrics;
use crate::payload::{Poison, PoisonReason, fields_json, payload_json, storable_text};
use crate::transport::{
    Attempt, Attempts, DeadLetter, ErrorKind, IDEMPOTENCY_KEY_HEADER, Message, Position,
    QueueHealth, QueueProbe, Transport, TransportError, UNSETTLED,
};

/// How long past its own next deadline the loop may be silent before `/healthz` fails.
const LIVENESS_SLACK: Duration = Duration::from_secs(60);

/// Batches stored concurrently: they keep PostgreSQL busy while the loop waits on the broker
/// (a NATS acknowledgement's confirmation, a fetch). Three left a quarter of the CPU idle
/// behind NATS and Kafka on 2 cores (docs/PERFORMANCE.md).
pub const IN_FLIGHT: usize = 4;

/// Batches received and not yet acknowledged: those being stored, and stored ones waiting for
/// an older batch's commit (acknowledgements go in receive order).
pub const HELD: usize = IN_FLIGHT + 2;

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
}

/// How often the attempts of messages that never settled are pruned.
const PRUNE_INTERVAL: Duration = Duration::from_secs(3600);

#[derive(Debug, Default)]
struct OutageState {
    backoff: Backoff,
    down_since: Option<Instant>,
    up_since: Option<Instant>,
}

/// One dependency's health: backoff, readiness, the `dependency_up` gauge, and one log line
/// per state change (not per retry). Shared by the loop and the store tasks.
#[derive(Debug)]
struct Monitor {
    dependency: Dependency,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    state: Mutex<OutageState>,
}

impl Monitor {
    fn new(dependency: Dependency, health: Arc<Health>, metrics: Arc<Metrics>) -> Self {
        Self {
            dependency,
            health,
            metrics,
            state: Mutex::default(),
        }
    }

    fn up(&self) {
        self.health.set_up(self.dependency, true);
        self.metrics.set_up(self.dependency, true);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.backoff.reset();
        if state.down_since.is_some() || state.up_since.is_none() {
            state.up_since = Some(Instant::now());
        }
        if let Some(since) = state.down_since.take() {
            tracing::info!(
                dependency = self.dependency.as_str(),
                down_for = ?since.elapsed(),
                "dependency recovered"
            );
        }
    }

    /// Records a failure of an attempt begun at `attempted` and waits out the backoff.
    /// Returns `false` if shutdown interrupted it. An attempt begun before the last recovery
    /// (a concurrent task's stale failure) does not start a new outage.
    async fn back_off(
        &self,
        err: &(dyn std::error::Error + Sync),
        attempted: Instant,
        cancel: &CancellationToken,
    ) -> bool {
        self.metrics.dependency_error(self.dependency);
        let delay = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let stale =
                state.down_since.is_none() && state.up_since.is_some_and(|up| up > attempted);
            if !stale {
                self.health
                    .set_down(self.dependency, &ErrorChain(err).to_string());
                self.metrics.set_up(self.dependency, false);
                if state.down_since.is_none() {
                    state.down_since = Some(Instant::now());
                    tracing::warn!(
                        dependency = self.dependency.as_str(),
                        error = %ErrorChain(err),
                        "dependency unavailable; retrying with backoff"
                    );
                }
            }
            state.backoff.next_delay()
        };
        self.health.beat(delay + LIVENESS_SLACK);
        tokio::select! {
            () = cancel.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        }
    }
}

/// Why the loop stopped for good: retrying cannot fix it, the worker exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Broker(TransportError),
    #[error("the worker cannot store messages")]
    Database(#[source] StoreError),
}

/// What a store task needs; shared by every task of the loop.
#[derive(Debug)]
struct StoreContext {
    store: Store,
    source: String,
    /// This worker's consumer name, recorded with each attempt.
    worker: String,
    queue: String,
    dedup: Dedup,
    database: Monitor,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
}

/// What the store task made of each event: stored (or a duplicate), or poison PostgreSQL refused.
type Outcomes = Vec<Result<Stored, Poison>>;

/// The highest position per partition among `positions`.
fn highest_positions<'a>(positions: impl Iterator<Item = &'a Position>) -> Vec<Position> {
    let mut highest: Vec<Position> = Vec::new();
    for position in positions {
        match highest
            .iter_mut()
            .find(|p| p.partition == position.partition)
        {
            Some(known) if *known >= *position => {}
            Some(known) => *known = position.clone(),
            None => highest.push(position.clone()),
        }
    }
    highest
}

impl StoreContext {
    /// Stores a batch in one transaction, retrying while the database is unavailable.
    /// `Ok(None)`: shutdown interrupted a retry. `Err`: PostgreSQL refused the data, or the
    /// statement.
    async fn ingest(
        &self,
        events: &[NewEvent],
        positions: &[Position],
    ) -> Result<Option<Vec<Stored>>, StoreError> {
        let batch = IngestBatch {
            source: &self.source,
            queue: &self.queue,
            dedup: self.dedup,
            positions,
            events,
        };
        let started = Instant::now();
        let stored = self.persist(|| self.store.ingest_batch(&batch)).await?;
        if stored.is_some() {
            self.metrics
                .commit_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        Ok(stored)
    }

    /// Runs `op` until it succeeds, backing off while the database is unavailable. `Ok(None)`:
    /// shutdown interrupted a retry. `Err`: PostgreSQL refused the data, or the statement.
    async fn persist<T, F>(&self, mut op: impl FnMut() -> F) -> Result<Option<T>, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        loop {
            let started = Instant::now();
            match op().await {
                Ok(value) => {
                    self.database.up();
                    return Ok(Some(value));
                }
                Err(err) if err.is_retryable() => {
                    if !self.database.back_off(&err, started, &self.cancel).await {
                        return Ok(None);
                    }
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Stores the events in one transaction. If PostgreSQL rejects the batch's data, splits it
    /// in halves (and those halves, …) to find the rows it refuses: they are poison
    /// (`rejected`), their neighbours are stored. `Ok(None)`: shutdown interrupted a retry;
    /// `Err`: a statement PostgreSQL can never run (fatal).
    async fn store_events(
        &self,
        events: Vec<NewEvent>,
        origins: Vec<Origin>,
        redelivered: Vec<(String, u64)>,
    ) -> Result<Option<Outcomes>, StoreError> {
        if !redelivered.is_empty() && !self.record_attempts(&redelivered).await? {
            return Ok(None);
        }
        // Every range ends stored or split, and a single event stored or poison.
        let unsettled = Err(Poison {
            reason: PoisonReason::Rejected,
            detail: String::new(),
        });
        let mut outcomes: Outcomes = vec![unsettled; events.len()];
        // Ranges of `events` still to store, the next one last.
        let mut pending = vec![0..events.len()];
        let mut split = false;
        while let Some(range) = pending.pop() {
            let positions =
                highest_positions(origins[range.clone()].iter().filter_map(|o| o.position.as_ref()));
            match self.ingest(&events[range.clone()], &positions).await {
                Ok(None) => return Ok(None),
                Ok(Some(stored)) => {
                    for (slot, stored) in outcomes[range].iter_mut().zip(stored) {
                        *slot = Ok(stored);
                    }
                }
                Err(err) if err.is_fatal() => return Err(err),
                Err(err) if range.len() == 1 => {
                    outcomes[range.start] = Err(Poison {
                        reason: PoisonReason::Rejected,
                        detail: ErrorChain(&err).to_string(),
                    });
                }
                Err(err) => {
                    if !split {
                        split = true;
                        tracing::warn!(
                            error = %ErrorChain(&err),
                            size = events.len(),
                            "database rejected a batch; splitting it to find the messages it refuses"
                        );
                    }
                    let middle = range.start + range.len() / 2;
                    pending.push(middle..range.end);
                    pending.push(range.start..middle);
                }
            }
        }
        self.record(&outcomes, &origins);
        Ok(Some(outcomes))
    }

    /// Runs `op` against the database, retrying while it is unavailable. `Ok(None)`: shutdown
    /// interrupted a retry; `Err`: a statement PostgreSQL can never run. Any other refusal is
    /// logged (`what` says what could not be done) and answered with `fallback`.
    async fn retrying<T, F>(
        &self,
        what: &str,
        op: impl FnMut() -> F,
        fallback: impl FnOnce() -> T,
    ) -> Result<Option<T>, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        match self.persist(op).await {
            Err(err) if !err.is_fatal() => {
                tracing::warn!(error = %ErrorChain(&err), "{what}");
                Ok(Some(fallback()))
            }
            result => result,
        }
    }

    /// Records the receipt of redelivered messages (key, delivery count) before they are
    /// stored, so a message that never settles (its worker dies, or loses its lease) still has
    /// its attempts when it finally dead-letters. `Ok(false)`: shutdown interrupted a retry. A
    /// refused statement is logged and skipped: the history is context, not the message.
    async fn record_attempts(&self, redelivered: &[(String, u64)]) -> Result<bool, StoreError> {
        let attempts: Vec<String> = redelivered
            .iter()
            .map(|(_, count)| Attempt::new(*count, &self.worker, UNSETTLED, None).to_json())
            .collect();
        let records: Vec<AttemptRecord<'_>> = redelivered
            .iter()
            .zip(&attempts)
            .map(|((key, count), attempt)| AttemptRecord {
                key,
                count: *count,
                attempt,
            })
            .collect();
        let recorded = self
            .retrying(
                "cannot record the attempts of redelivered messages",
                || self.store.record_attempts(&self.source, &records),
                || (),
            )
            .await?;
        Ok(recorded.is_some())
    }

    /// The recorded attempts of `keys` (JSON arrays by key); `None`: shutdown interrupted a
    /// retry. A refused statement gives no history.
    async fn recorded_attempts(
        &self,
        keys: &[&str],
    ) -> Result<Option<std::collections::HashMap<String, String>>, StoreError> {
        self.retrying(
            "cannot read the attempts of dead-lettered messages",
            || self.store.attempts(&self.source, keys),
            Default::default,
        )
        .await
    }

    /// Which of `ids` already have an event (native ids only): stored by an earlier delivery
    /// whose acknowledgement was lost. `None`: shutdown interrupted a retry. When it cannot
    /// tell, they are dead-lettered as if they had never been stored.
    async fn stored_before(&self, ids: &[&str]) -> Result<Option<Vec<bool>>, StoreError> {
        self.retrying(
            "cannot check whether messages past maxDeliveries were stored",
            || self.store.events_exist(&self.source, ids),
            || vec![false; ids.len()],
        )
        .await
    }

    fn record(&self, outcomes: &Outcomes, origins: &[Origin]) {
        let now = now_ms();
        for (outcome, origin) in outcomes.iter().zip(origins) {
            match outcome {
                Ok(Stored::New | Stored::NewEventOnly) => {
                    self.metrics.stored.inc();
                    if let Some(enqueued) = origin.enqueued_at_ms {
                        let latency = Duration::from_millis(now.saturating_sub(enqueued));
                        self.metrics
                            .end_to_end_seconds
                            .observe(latency.as_secs_f64());
                    }
                }
                Ok(Stored::Duplicate) => {
                    self.metrics.duplicates.inc();
                }
                Err(_) => {}
            }
        }
    }
}

/// The broker facts a store task needs about each event.
#[derive(Debug, Clone)]
struct Origin {
    position: Option<Position>,
    enqueued_at_ms: Option<u64>,
}

/// The store task of one batch.
type StoreTask = JoinHandle<Result<Option<Outcomes>, StoreError>>;

/// A received batch whose events are being stored.
struct InFlight<R> {
    batch: Vec<Message<R>>,
    /// Indexes into `batch` of the messages handed to the store task, in its order.
    stored: Vec<usize>,
    /// Messages found poison before storing: (index into `batch`, reason, detail).
    poison: Vec<(usize, Poison)>,
    task: Option<StoreTask>,
    /// When the broker's lease on the batch should next be extended (brokers with a lease).
    extend_at: Option<Instant>,
}

impl<R> InFlight<R> {
    /// Whether its store task is still running.
    fn storing(&self) -> bool {
        self.task.as_ref().is_some_and(|task| !task.is_finished())
    }
}

/// How one message of a batch was settled.
enum Settled {
    /// Stored, or a duplicate of a stored message: acknowledge it.
    Done,
    /// Poison: write its dead letter, then acknowledge it.
    Poison(Poison),
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
            database: Monitor::new(Dependency::Database, health.clone(), metrics.clone()),
            metrics: metrics.clone(),
            cancel: cancel.clone(),
        });
        Self {
            broker: Monitor::new(Dependency::Broker, health.clone(), metrics.clone()),
            transport,
            settings,
            context,
            metrics,
            health,
            cancel,
            commits: 0,
            count_deliveries: true,
            next_prune: Instant::now(),
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
        self.health.set_started();
        tracing::info!(source = %self.context.source, queue = %self.settings.queue, "worker started");
        let probe = self.spawn_probe();
        let result = self.receive_until_cancelled().await;
        probe.abort();
        result
    }

    /// Reads the queue's health on its own task, so the gauges move while the loop waits on
    /// the database (or anything else); a second task reports the latest reading to the
    /// `worker_reports` table, which the operator turns into the adapter's status.
    fn spawn_probe(&self) -> JoinHandle<()> {
        let mut probe = self.transport.probe();
        let interval = self.transport.maintenance_interval();
        let metrics = self.metrics.clone();
        let health = self.health.clone();
        let (latest, reading) = tokio::sync::watch::channel(None);
        let reporter = tokio::spawn(report_queue_health(
            self.context.store.clone(),
            self.settings.adapter.clone(),
            self.settings.worker.clone(),
            reading,
            health.clone(),
        ));
        tokio::spawn(async move {
            // Aborting the probe task drops the reporter with it.
            let _reporter = AbortOnDrop(reporter);
            loop {
                let queue = match probe.queue_health().await {
                    Ok(queue) => {
                        let waiting = queue.backlog.unwrap_or(0) + queue.pending.unwrap_or(0);
                        health.set_work_waiting(waiting > 0);
                        record_queue_health(&metrics, queue);
                        Some(queue)
                    }
                    // The loop reports broker outages; the gauges keep their last value.
                    Err(err) => {
                        tracing::debug!(error = %ErrorChain(&err), "queue health unavailable");
                        None
                    }
                };
                latest.send_replace(Some(queue));
                tokio::time::sleep(interval.min(REPORT_INTERVAL)).await;
            }
        })
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
                    // The oldest batch is settled once stored, or when the stores running
                    // or the batches held reach their limits; a younger batch already
                    // stored waits for it without taking a store's place.
                    let stored = in_flight.front().is_some_and(|oldest| !oldest.storing());
                    let storing = in_flight.iter().filter(|batch| batch.storing()).count();
                    if stored || storing >= IN_FLIGHT || in_flight.len() >= HELD {
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
        tracing::info!("worker stopped");
        Ok(())
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
        let context = self.context.clone();
        loop {
            let attempted = Instant::now();
            match context.store.ping().await {
                Ok(()) => {
                    context.database.up();
                    return Ok(true);
                }
                Err(err) => {
                    if !context
                        .database
                        .back_off(&err, attempted, &self.cancel)
                        .await
                    {
                        return Ok(false);
                    }
                }
            }
        }
    }

    /// Prunes, on its own task, the attempts of messages last seen longer ago than the
    /// dead-letter retention (they left the broker without settling here: purged, expired).
    fn spawn_prune(&self) {
        let context = self.context.clone();
        let retention = self.settings.dead_letter_retention;
        tokio::spawn(async move {
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
        tokio::spawn(async move {
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

    /// Classifies a received batch and starts storing what can be stored.
    fn start(&self, batch: Vec<Message<T::Receipt>>) -> InFlight<T::Receipt> {
        let settings = &self.settings;
        let count = batch.len() as u64;
        self.metrics.received.inc_by(count);
        self.metrics.batch_size.observe(count as f64);
        let redelivered = batch.iter().filter(|m| m.delivery_count > 1).count();
        self.metrics.redelivered.inc_by(redelivered as u64);

        let mut poison = Vec::new();
        let mut stored = Vec::with_capacity(batch.len());
        let mut events = Vec::with_capacity(batch.len());
        let mut origins = Vec::with_capacity(batch.len());
        let mut redelivered = Vec::new();
        for (index, message) in batch.iter().enumerate() {
            if let Some(detail) = &message.undecodable {
                poison.push((
                    index,
                    Poison {
                        reason: PoisonReason::Undecodable,
                        detail: detail.clone(),
                    },
                ));
                continue;
            }
            if self.count_deliveries && message.delivery_count > settings.max_deliveries {
                let detail = format!(
                    "delivered {} times without being stored; delivery.maxDeliveries is {}",
                    message.delivery_count, settings.max_deliveries
                );
                poison.push((
                    index,
                    Poison {
                        reason: PoisonReason::MaxDeliveries,
                        detail,
                    },
                ));
                continue;
            }
            match self.new_event(message) {
                Ok(event) => {
                    events.push(event);
                    origins.push(Origin {
                        position: message.position.clone(),
                        enqueued_at_ms: message.enqueued_at_ms,
                    });
                    if message.delivery_count > 1 {
                        redelivered.push((message.idempotency_key.clone(), message.delivery_count));
                    }
                    stored.push(index);
                }
                Err(verdict) => poison.push((index, verdict)),
            }
        }
        let task = (!events.is_empty()).then(|| {
            let context = self.context.clone();
            tokio::spawn(async move { context.store_events(events, origins, redelivered).await })
        });
        InFlight {
            batch,
            stored,
            poison,
            task,
            extend_at: self
                .transport
                .lease()
                .map(|lease| Instant::now() + lease / 2),
        }
    }

    /// The external id and idempotency key of `message` without an envelope: its own, or for a
    /// redriven copy on a broker with native ids, the original's (its
    /// [`IDEMPOTENCY_KEY_HEADER`], when that names this source).
    fn identity(&self, message: &Message<T::Receipt>) -> (String, String) {
        let source = &self.context.source;
        let redriven = (self.context.dedup == Dedup::NativeId)
            .then(|| {
                message
                    .headers
                    .iter()
                    .find(|(name, _)| name == IDEMPOTENCY_KEY_HEADER)
            })
            .flatten()
            .and_then(|(_, value)| std::str::from_utf8(value).ok())
            .and_then(|key| {
                let id = key.strip_prefix(source.as_str())?.strip_prefix(':')?;
                (!id.is_empty()).then(|| (id.to_owned(), key.to_owned()))
            });
        let (id, key) = redriven
            .unwrap_or_else(|| (message.external_id.clone(), message.idempotency_key.clone()));
        (storable(id), storable(key))
    }

    /// The event to store for `message`: its body and headers, or what its envelope holds.
    fn new_event(&self, message: &Message<T::Receipt>) -> Result<NewEvent, Poison> {
        let settings = &self.settings;
        let rules = PayloadRules {
            format: settings.format,
            max_bytes: settings.max_bytes,
        };
        let Unwrapped {
            event_id,
            payload,
            headers,
        } = match settings.envelope {
            Envelope::None => {
                let (external_id, idempotency_key) = self.identity(message);
                return Ok(NewEvent {
                    external_id,
                    idempotency_key,
                    payload: payload_json(&message.body, settings.format, settings.max_bytes)?,
                    headers: fields_json(&message.headers),
                });
            }
            Envelope::CloudEvents => envelope::cloud_event(&message.body, &message.headers, rules)?,
            Envelope::Sns => envelope::sns_notification(&message.body, &message.headers, rules)?,
        };
        Ok(NewEvent {
            idempotency_key: storable(format!("{}:{event_id}", self.context.source)),
            external_id: storable(event_id),
            payload,
            headers: fields_json(&headers),
        })
    }

    /// Waits for a store task. Meanwhile, where the broker has a lease, extends it for this
    /// batch and the others in flight each time half of it has passed.
    async fn await_stored(
        &mut self,
        task: &mut StoreTask,
        extend_at: &mut Option<Instant>,
        batch: &[Message<T::Receipt>],
        others: &mut VecDeque<InFlight<T::Receipt>>,
    ) -> Result<Option<Outcomes>, PipelineError> {
        loop {
            let due = others
                .iter()
                .filter_map(|other| other.extend_at)
                .chain(*extend_at)
                .min();
            let joined = match due {
                None => task.await,
                Some(due) => tokio::select! {
                    joined = &mut *task => joined,
                    () = tokio::time::sleep_until(due.into()) => {
                        self.extend_leases(extend_at, batch, others).await?;
                        continue;
                    }
                },
            };
            return match joined {
                Ok(Ok(outcomes)) => Ok(outcomes),
                Ok(Err(err)) => Err(PipelineError::Database(err)),
                Err(err) => {
                    tracing::error!(error = %err, "store task failed; the batch stays un-acknowledged");
                    Ok(None)
                }
            };
        }
    }

    /// Extends the lease of every batch whose extension is due.
    async fn extend_leases(
        &mut self,
        extend_at: &mut Option<Instant>,
        batch: &[Message<T::Receipt>],
        others: &mut VecDeque<InFlight<T::Receipt>>,
    ) -> Result<(), PipelineError> {
        let Some(lease) = self.transport.lease() else {
            return Ok(());
        };
        let now = Instant::now();
        let next = Some(now + lease / 2);
        let due = |at: &Option<Instant>| at.is_some_and(|at| at <= now);
        let mut messages: Vec<&Message<T::Receipt>> = Vec::new();
        if due(extend_at) {
            messages.extend(batch);
            *extend_at = next;
        }
        for other in others.iter_mut() {
            if due(&other.extend_at) {
                other.extend_at = next;
                let other: &InFlight<T::Receipt> = other;
                messages.extend(&other.batch);
            }
        }
        if messages.is_empty() {
            return Ok(());
        }
        let extended = messages.len();
        match self
            .broker_op(async |transport| transport.extend_lease(&messages).await)
            .await
        {
            Ok(()) => {
                self.metrics.leases_extended.inc_by(extended as u64);
                Ok(())
            }
            // The messages went back to the broker; their acknowledgements will be stale.
            Err(Stopped::Stale(err)) => {
                tracing::warn!(error = %ErrorChain(&err), "could not extend the lease of messages being stored");
                Ok(())
            }
            Err(Stopped::Cancelled) => Ok(()),
            Err(Stopped::Fatal(err)) => Err(PipelineError::Broker(err)),
        }
    }

    /// Waits for a batch's commit, then settles it: dead letters are written first (and
    /// confirmed), then everything settled is acknowledged once, in receive order. Returns
    /// early, leaving the batch un-acknowledged, if shutdown interrupted a retry.
    async fn finish(
        &mut self,
        in_flight: InFlight<T::Receipt>,
        others: &mut VecDeque<InFlight<T::Receipt>>,
    ) -> Result<(), PipelineError> {
        let InFlight {
            batch,
            stored,
            poison,
            task,
            mut extend_at,
        } = in_flight;
        let mut settled: Vec<Option<Settled>> = (0..batch.len()).map(|_| None).collect();
        for (index, verdict) in poison {
            settled[index] = Some(Settled::Poison(verdict));
        }
        if let Some(mut task) = task {
            let Some(outcomes) = self
                .await_stored(&mut task, &mut extend_at, &batch, others)
                .await?
            else {
                return Ok(());
            };
            for (index, outcome) in stored.into_iter().zip(outcomes) {
                settled[index] = Some(match outcome {
                    Ok(_) => Settled::Done,
                    Err(verdict) => Settled::Poison(verdict),
                });
            }
            self.commits += 1;
            if self.settings.abort_after_commits == Some(self.commits) {
                tracing::error!(
                    "SWITCHBOARD_TEST_ABORT_AFTER_COMMITS reached: aborting between commit and ack"
                );
                std::process::abort();
            }
        }
        if !self
            .acknowledge_overdue_duplicates(&batch, &mut settled)
            .await?
        {
            return Ok(());
        }

        let poison: Vec<(&Message<T::Receipt>, &Poison)> = settled
            .iter()
            .zip(&batch)
            .filter_map(|(settled, message)| match settled {
                Some(Settled::Poison(verdict)) => Some((message, verdict)),
                _ => None,
            })
            .collect();
        let Some(letters) = self.with_attempts(&poison).await? else {
            return Ok(());
        };
        if !letters.is_empty() {
            match self
                .broker_op(async |transport| transport.write_dead_letters(&letters).await)
                .await
            {
                Ok(()) => {}
                // Not written: nothing of the batch is acknowledged (a cumulative
                // acknowledgement would pass the unwritten dead letter).
                Err(Stopped::Cancelled) => return Ok(()),
                Err(Stopped::Stale(err)) => {
                    tracing::warn!(error = %ErrorChain(&err), "dead letters were not written; the batch is left for redelivery");
                    return Ok(());
                }
                Err(Stopped::Fatal(err)) => {
                    let ErrorKind::DeadLettersRefused { letters: refused } = err.kind() else {
                        return Err(PipelineError::Broker(err));
                    };
                    // The others were written: these are kept in PostgreSQL instead, so that
                    // their originals can be acknowledged with the rest of the batch.
                    let refused: Vec<&DeadLetter<'_, T::Receipt>> = refused
                        .iter()
                        .filter_map(|&index| letters.get(index))
                        .collect();
                    if !self.keep_in_database(&refused, &err).await? {
                        return Ok(());
                    }
                }
            }
            for letter in &letters {
                self.metrics.dead_lettered(letter.reason);
                tracing::warn!(
                    id = %letter.message.external_id,
                    reason = letter.reason.as_str(),
                    delivery_count = letter.message.delivery_count,
                    error = %letter.error,
                    "dead-lettered message"
                );
            }
        }

        let acks: Vec<&Message<T::Receipt>> = settled
            .iter()
            .zip(&batch)
            .filter_map(|(settled, message)| settled.is_some().then_some(message))
            .collect();
        self.spawn_forget(&acks);
        self.acknowledge(acks).await?;
        self.health.progressed();
        Ok(())
    }

    /// Keeps dead letters the broker's dead-letter destination refused for good in PostgreSQL's
    /// `dead_letters` table (one statement; a message kept already is not kept twice), waiting
    /// out a database outage. `false`: shutdown interrupted the wait (the batch is left
    /// un-acknowledged); never acknowledged without its row.
    async fn keep_in_database(
        &self,
        refused: &[&DeadLetter<'_, T::Receipt>],
        answer: &TransportError,
    ) -> Result<bool, PipelineError> {
        let answer = storable_text(&ErrorChain(answer).to_string()).into_owned();
        let owned: Vec<(String, String, String, String, String)> = refused
            .iter()
            .map(|letter| {
                let message = letter.message;
                (
                    storable_text(&message.idempotency_key).into_owned(),
                    storable_text(&message.external_id).into_owned(),
                    fields_json(&message.headers),
                    storable_text(&letter.error).into_owned(),
                    letter.attempts.to_json(),
                )
            })
            .collect();
        let kept: Vec<KeptLetter<'_>> = refused
            .iter()
            .zip(&owned)
            .map(|(letter, (key, id, headers, error, attempts))| KeptLetter {
                idempotency_key: key,
                external_id: id,
                body: &letter.message.body,
                headers,
                reason: letter.reason.as_str(),
                error,
                delivery_count: letter.message.delivery_count,
                attempts,
                refused_because: &answer,
            })
            .collect();
        let source = &self.context.source;
        let Some(new) = self
            .context
            .persist(|| self.context.store.keep_dead_letters(source, &kept))
            .await
            .map_err(PipelineError::Database)?
        else {
            return Ok(false);
        };
        self.metrics.kept_in_database.inc_by(kept.len() as u64);
        tracing::warn!(
            count = kept.len(),
            new,
            broker_answer = %answer,
            "the dead-letter destination refused letters for good; kept them in PostgreSQL's dead_letters table"
        );
        Ok(true)
    }

    /// The dead letters of `poison`, each with its recorded attempts and this last one.
    /// `None`: shutdown interrupted reading them (the batch is left un-acknowledged).
    async fn with_attempts<'m>(
        &self,
        poison: &[(&'m Message<T::Receipt>, &Poison)],
    ) -> Result<Option<Vec<DeadLetter<'m, T::Receipt>>>, PipelineError> {
        if poison.is_empty() {
            return Ok(Some(Vec::new()));
        }
        // Only redeliveries have recorded attempts: poison on its first delivery needs no
        // database.
        let keys: Vec<&str> = poison
            .iter()
            .filter(|(message, _)| message.delivery_count > 1)
            .map(|(message, _)| message.idempotency_key.as_str())
            .collect();
        let recorded = if keys.is_empty() {
            Default::default()
        } else {
            match self
                .context
                .recorded_attempts(&keys)
                .await
                .map_err(PipelineError::Database)?
            {
                Some(recorded) => recorded,
                None => return Ok(None),
            }
        };
        Ok(Some(
            poison
                .iter()
                .map(|(message, verdict)| {
                    let last = Attempt::new(
                        message.delivery_count,
                        &self.settings.worker,
                        verdict.reason.as_str(),
                        Some(&verdict.detail),
                    );
                    DeadLetter {
                        message,
                        reason: verdict.reason,
                        error: verdict.detail.clone(),
                        attempts: Attempts::ending_with(
                            recorded.get(&message.idempotency_key).map(String::as_str),
                            last,
                        ),
                    }
                })
                .collect(),
        ))
    }

    /// Past maxDeliveries but stored already (a crash between an earlier commit and its ack):
    /// settled as the duplicate it is, rather than dead-letter a stored message. Returns
    /// `false` when shutdown interrupted the check (the batch is left un-acknowledged).
    async fn acknowledge_overdue_duplicates(
        &self,
        batch: &[Message<T::Receipt>],
        settled: &mut [Option<Settled>],
    ) -> Result<bool, PipelineError> {
        if self.context.dedup != Dedup::NativeId {
            return Ok(true);
        }
        let overdue: Vec<usize> = settled
            .iter()
            .enumerate()
            .filter_map(|(index, settled)| match settled {
                Some(Settled::Poison(verdict)) if verdict.reason == PoisonReason::MaxDeliveries => {
                    Some(index)
                }
                _ => None,
            })
            .collect();
        if overdue.is_empty() {
            return Ok(true);
        }
        // The id its event would have: under an envelope, the envelope's (a message whose
        // envelope does not parse was never stored).
        let (overdue, ids): (Vec<usize>, Vec<String>) = overdue
            .into_iter()
            .filter_map(|index| {
                let message = &batch[index];
                match self.settings.envelope {
                    Envelope::None => Some(self.identity(message).0),
                    Envelope::CloudEvents | Envelope::Sns => {
                        self.new_event(message).ok().map(|event| event.external_id)
                    }
                }
                .map(|id| (index, id))
            })
            .unzip();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let found = self
            .context
            .stored_before(&ids)
            .await
            .map_err(PipelineError::Database)?;
        let Some(found) = found else {
            return Ok(false);
        };
        for (index, exists) in overdue.into_iter().zip(found) {
            if exists {
                settled[index] = Some(Settled::Done);
                self.metrics.duplicates.inc();
            }
        }
        Ok(true)
    }

    /// Acknowledges `acks` (in receive order); retries what the broker failed to take, counts
    /// and drops what it calls stale.
    async fn acknowledge(
        &mut self,
        mut acks: Vec<&Message<T::Receipt>>,
    ) -> Result<(), PipelineError> {
        while !acks.is_empty() {
            let attempted = Instant::now();
            let report = match self
                .broker_op(async |transport| transport.ack(&acks).await)
                .await
            {
                Ok(report) => report,
                Err(Stopped::Cancelled) => return Ok(()),
                Err(Stopped::Stale(err)) => {
                    self.stale(acks.len(), &err);
                    return Ok(());
                }
                Err(Stopped::Fatal(err)) => return Err(PipelineError::Broker(err)),
            };
            let taken = acks.len() - report.stale.len() - report.retry.len();
            self.metrics.acked.inc_by(taken as u64);
            if !report.stale.is_empty() {
                let err =
                    TransportError::stale("the broker refused receipts as no longer valid", None);
                self.stale(report.stale.len(), &err);
            }
            if report.retry.is_empty() {
                return Ok(());
            }
            acks = report.retry.iter().map(|&index| acks[index]).collect();
            let err = TransportError::protocol(format!(
                "the broker did not take {} acknowledgements",
                acks.len()
            ));
            if !self.broker.back_off(&err, attempted, &self.cancel).await {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Receipts that can never be acknowledged: counted and dropped (the broker redelivers the
    /// messages and their keys deduplicate them). Logged once per call, not per receipt.
    fn stale(&self, count: usize, err: &TransportError) {
        self.metrics.stale_receipts.inc_by(count as u64);
        tracing::warn!(
            count,
            error = %ErrorChain(err),
            "acknowledgements refused as stale; the broker redelivers and deduplication collapses them"
        );
    }
}

/// `text` as a text column holds it (see [`storable_text`]), without a copy when it is already.
fn storable(text: String) -> String {
    match storable_text(&text) {
        std::borrow::Cow::Borrowed(_) => text,
        std::borrow::Cow::Owned(encoded) => encoded,
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Every [`REPORT_INTERVAL`], writes the probe's latest reading (`Some(None)`: the broker did not
/// answer) as this worker's report. A write that fails (the database is down) is skipped: the
/// report ages out and the operator says so.
async fn report_queue_health(
    store: Store,
    adapter: String,
    worker: String,
    mut reading: tokio::sync::watch::Receiver<Option<Option<QueueHealth>>>,
    health: Arc<Health>,
) {
    loop {
        let latest = *reading.borrow_and_update();
        if let Some(queue) = latest {
            let report = worker_report(&adapter, &worker, queue, &health);
            match tokio::time::timeout(REPORT_INTERVAL, store.report_worker(&report)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    tracing::debug!(error = %ErrorChain(&err), "cannot write the worker report")
                }
                Err(_) => tracing::debug!("writing the worker report timed out"),
            }
        }
        tokio::time::sleep(REPORT_INTERVAL).await;
    }
}

/// What this worker tells the operator: the queue's figures (`None` when the broker did not
/// answer) and whether its dependencies are up.
fn worker_report(
    adapter: &str,
    worker: &str,
    queue: Option<QueueHealth>,
    health: &Health,
) -> WorkerReport {
    let now = SystemTime::now();
    let queue = queue.unwrap_or_default();
    WorkerReport {
        adapter: adapter.to_owned(),
        worker: worker.to_owned(),
        reported_at: now,
        backlog: queue.backlog,
        pending: queue.pending,
        oldest_since: queue
            .oldest_pending_age
            .filter(|age| !age.is_zero())
            .and_then(|age| now.checked_sub(age)),
        dead_letters: queue.dead_letters,
        broker_up: health.is_up(Dependency::Broker),
        database_up: health.is_up(Dependency::Database),
    }
}

fn record_queue_health(metrics: &Metrics, queue: QueueHealth) {
    let gauge = |value: Option<u64>| i64::try_from(value.unwrap_or(0)).unwrap_or(i64::MAX);
    metrics.backlog.set(gauge(queue.backlog));
    metrics.pending.set(gauge(queue.pending));
    metrics
        .oldest_pending_age_seconds
        .set(queue.oldest_pending_age.unwrap_or_default().as_secs_f64());
    if let Some(dead_letters) = queue.dead_letters {
        metrics.dead_letters.set(gauge(Some(dead_letters)));
    }
    if let Some(age) = queue.oldest_dead_letter_age {
        metrics
            .oldest_dead_letter_age_seconds
            .set(age.as_secs_f64());
    }
}
