//! The store-then-ack loop: receive a batch → store it in one transaction → acknowledge it.
//!
//! Nothing is acknowledged before its todo is committed. Poison is dead-lettered (and only then
//! acknowledged) without holding up the rest of its batch. A failing dependency is retried
//! with backoff, logged once per outage, and reported through readiness; shutdown is checked
//! between batches, and a batch in hand is finished or left un-acknowledged.
//!
//! Up to [`IN_FLIGHT`] batches are stored at once (each in its own transaction, on its own
//! connection): while one commits, the next is received and starts committing. Batches are
//! still acknowledged one by one, in the order they were received, each only after its own
//! commit.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use switchboard_api::PayloadFormat;
use switchboard_store::{Dedup, IngestBatch, NewEvent, Store, StoreError, Stored};
use switchboard_telemetry::ErrorChain;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::health::{Dependency, Health, now_ms};
use crate::metrics::Metrics;
use crate::payload::{Poison, PoisonReason, fields_json, payload_json};
use crate::transport::{DeadLetter, Message, QueueHealth, Transport, TransportError};

/// How long past its own next deadline the loop may be silent before `/healthz` fails.
const LIVENESS_SLACK: Duration = Duration::from_secs(60);

/// Batches stored concurrently. Two keep PostgreSQL busy while the loop receives and acks.
pub const IN_FLIGHT: usize = 3;

/// What the loop does with each batch.
#[derive(Debug, Clone)]
pub struct PipelineSettings {
    pub queue: String,
    pub batch_size: usize,
    pub max_deliveries: u64,
    pub format: PayloadFormat,
    pub max_bytes: usize,
    /// Testing hook: abort the process after this many commits, before acknowledging.
    pub abort_after_commits: Option<u64>,
}

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
                self.health.set_up(self.dependency, false);
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

/// What a store task needs; shared by every task of the loop.
#[derive(Debug)]
struct StoreContext {
    store: Store,
    source: String,
    queue: String,
    dedup: Dedup,
    database: Monitor,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
}

/// What the store task made of each event: stored (or a duplicate), or poison PostgreSQL refused.
type Outcomes = Vec<Result<Stored, Poison>>;

impl StoreContext {
    /// Stores a batch in one transaction, retrying while the database is unavailable.
    /// `Ok(None)`: shutdown interrupted a retry. `Err`: PostgreSQL refused the data.
    async fn ingest(
        &self,
        events: &[NewEvent],
        checkpoint: Option<(u64, u64)>,
    ) -> Result<Option<Vec<Stored>>, StoreError> {
        let batch = IngestBatch {
            source: &self.source,
            queue: &self.queue,
            dedup: self.dedup,
            checkpoint,
            events,
        };
        loop {
            let started = Instant::now();
            match self.store.ingest_batch(&batch).await {
                Ok(stored) => {
                    self.metrics
                        .commit_seconds
                        .observe(started.elapsed().as_secs_f64());
                    self.database.up();
                    return Ok(Some(stored));
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

    /// Stores the events in one transaction. If PostgreSQL rejects the batch's data, stores them
    /// one by one to find the rows it refuses. `None`: shutdown interrupted a retry.
    async fn store_events(&self, events: Vec<NewEvent>, origins: Vec<Origin>) -> Option<Outcomes> {
        let checkpoint = origins.iter().filter_map(|o| o.position).max();
        let outcomes = match self.ingest(&events, checkpoint).await {
            Ok(stored) => stored?.into_iter().map(Ok).collect(),
            Err(err) => {
                tracing::warn!(
                    error = %ErrorChain(&err),
                    size = events.len(),
                    "database rejected a batch; storing its messages one by one to find the bad ones"
                );
                let mut outcomes = Vec::with_capacity(events.len());
                for (event, origin) in events.iter().zip(&origins) {
                    match self
                        .ingest(std::slice::from_ref(event), origin.position)
                        .await
                    {
                        Ok(stored) => outcomes.extend(stored?.into_iter().map(Ok)),
                        Err(err) => outcomes.push(Err(Poison {
                            reason: PoisonReason::Rejected,
                            detail: ErrorChain(&err).to_string(),
                        })),
                    }
                }
                outcomes
            }
        };
        self.record(&outcomes, &origins);
        Some(outcomes)
    }

    /// Which of `messages` already have an event (native ids only): stored by an earlier
    /// delivery whose acknowledgement was lost. Retries while the database is unavailable;
    /// `None`: shutdown interrupted a retry.
    async fn stored_before(&self, messages: &[&Message]) -> Option<Vec<bool>> {
        let ids: Vec<&str> = messages.iter().map(|m| m.external_id.as_str()).collect();
        loop {
            let started = Instant::now();
            match self.store.events_exist(&self.source, &ids).await {
                Ok(found) => {
                    self.database.up();
                    return Some(found);
                }
                Err(err) if err.is_retryable() => {
                    if !self.database.back_off(&err, started, &self.cancel).await {
                        return None;
                    }
                }
                // Cannot tell: dead-letter them, as if they had never been stored.
                Err(err) => {
                    tracing::warn!(error = %ErrorChain(&err), "cannot check whether messages past maxDeliveries were stored");
                    return Some(vec![false; messages.len()]);
                }
            }
        }
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
#[derive(Debug, Clone, Copy)]
struct Origin {
    position: Option<(u64, u64)>,
    enqueued_at_ms: Option<u64>,
}

/// A received batch whose events are being stored.
struct InFlight {
    batch: Vec<Message>,
    /// Indexes into `batch` of the messages handed to the store task, in its order.
    stored: Vec<usize>,
    /// Messages found poison before storing: (index into `batch`, reason, detail).
    poison: Vec<(usize, Poison)>,
    task: Option<JoinHandle<Option<Outcomes>>>,
}

/// The loop for one adapter and one transport.
#[derive(Debug)]
pub struct Pipeline<T> {
    transport: T,
    settings: PipelineSettings,
    context: Arc<StoreContext>,
    broker: Monitor,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    cancel: CancellationToken,
    commits: u64,
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
            queue: settings.queue.clone(),
            dedup: transport.dedup(),
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
        }
    }

    fn monitor(&self, dependency: Dependency) -> &Monitor {
        match dependency {
            Dependency::Broker => &self.broker,
            Dependency::Database => &self.context.database,
        }
    }

    /// Runs a broker operation until it succeeds, backing off on failures. `None`: shutdown
    /// interrupted a retry.
    async fn broker_op<R>(
        &mut self,
        mut op: impl AsyncFnMut(&mut T) -> Result<R, TransportError>,
    ) -> Option<R> {
        let mut failed = Vec::new();
        loop {
            let attempted = Instant::now();
            match op(&mut self.transport).await {
                Ok(value) => {
                    self.broker.up();
                    for dependency in failed {
                        self.monitor(dependency).up();
                    }
                    return Some(value);
                }
                Err(err) => {
                    let dependency = err.dependency();
                    if !failed.contains(&dependency) {
                        failed.push(dependency);
                    }
                    if !self
                        .monitor(dependency)
                        .back_off(&err, attempted, &self.cancel)
                        .await
                    {
                        return None;
                    }
                }
            }
        }
    }

    /// Runs until cancelled; then finishes (or abandons, un-acknowledged) the batches in hand.
    pub async fn run(mut self) {
        if self
            .broker_op(async |transport| transport.prepare().await)
            .await
            .is_none()
        {
            return;
        }
        self.health.set_started();
        tracing::info!(source = %self.context.source, queue = %self.settings.queue, "worker started");
        let cancel = self.cancel.clone();
        let interval = self.transport.maintenance_interval();
        let mut next_maintenance = Instant::now();
        let mut in_flight: VecDeque<InFlight> = VecDeque::new();
        while !cancel.is_cancelled() {
            self.health.beat(Duration::from_secs(1) + LIVENESS_SLACK);
            if Instant::now() >= next_maintenance {
                if !self.maintain().await {
                    break;
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
            match received {
                Ok(batch) if batch.is_empty() => {
                    self.broker.up();
                    if let Some(oldest) = in_flight.pop_front() {
                        self.finish(oldest).await;
                    }
                }
                Ok(batch) => {
                    self.broker.up();
                    in_flight.push_back(self.start(batch));
                    if in_flight.len() >= IN_FLIGHT
                        && let Some(oldest) = in_flight.pop_front()
                    {
                        self.finish(oldest).await;
                    }
                }
                Err(err) => {
                    let monitor = self.monitor(err.dependency());
                    if !monitor.back_off(&err, attempted, &cancel).await {
                        break;
                    }
                }
            }
        }
        // Batches in hand are committed and acknowledged, or (shutdown interrupted a retry)
        // left un-acknowledged for redelivery.
        while let Some(oldest) = in_flight.pop_front() {
            self.finish(oldest).await;
        }
        if cancel.is_cancelled() {
            self.transport.shutdown().await;
        }
        tracing::info!("worker stopped");
    }

    /// Upkeep and gauges. Returns `false` if shutdown interrupted it.
    async fn maintain(&mut self) -> bool {
        let Some(queue) = self
            .broker_op(async |transport| transport.maintain().await)
            .await
        else {
            return false;
        };
        self.record_queue_health(queue);
        let context = self.context.clone();
        loop {
            let attempted = Instant::now();
            match context.store.ping().await {
                Ok(()) => {
                    context.database.up();
                    return true;
                }
                Err(err) => {
                    if !context
                        .database
                        .back_off(&err, attempted, &self.cancel)
                        .await
                    {
                        return false;
                    }
                }
            }
        }
    }

    fn record_queue_health(&self, queue: QueueHealth) {
        let gauge = |value: Option<u64>| i64::try_from(value.unwrap_or(0)).unwrap_or(i64::MAX);
        self.metrics.backlog.set(gauge(queue.backlog));
        self.metrics.pending.set(gauge(queue.pending));
        self.metrics
            .oldest_pending_age_seconds
            .set(queue.oldest_pending_age.unwrap_or_default().as_secs_f64());
    }

    /// Classifies a received batch and starts storing what can be stored.
    fn start(&self, batch: Vec<Message>) -> InFlight {
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
        for (index, message) in batch.iter().enumerate() {
            if message.delivery_count > settings.max_deliveries {
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
            match payload_json(&message.body, settings.format, settings.max_bytes) {
                Ok(payload) => {
                    events.push(NewEvent {
                        external_id: message.external_id.clone(),
                        idempotency_key: message.idempotency_key.clone(),
                        payload,
                        headers: fields_json(&message.headers),
                    });
                    origins.push(Origin {
                        position: message.position,
                        enqueued_at_ms: message.enqueued_at_ms,
                    });
                    stored.push(index);
                }
                Err(verdict) => poison.push((index, verdict)),
            }
        }
        let task = (!events.is_empty()).then(|| {
            let context = self.context.clone();
            tokio::spawn(async move { context.store_events(events, origins).await })
        });
        InFlight {
            batch,
            stored,
            poison,
            task,
        }
    }

    /// Waits for a batch's commit, then acknowledges what was stored and dead-letters the poison.
    /// Returns early, leaving the batch un-acknowledged, if shutdown interrupted a retry.
    async fn finish(&mut self, in_flight: InFlight) {
        let InFlight {
            batch,
            stored,
            mut poison,
            task,
        } = in_flight;
        let mut acks = Vec::with_capacity(batch.len());
        if let Some(task) = task {
            let outcomes = match task.await {
                Ok(Some(outcomes)) => outcomes,
                Ok(None) => return,
                Err(err) => {
                    tracing::error!(error = %err, "store task failed; the batch stays un-acknowledged");
                    return;
                }
            };
            for (index, outcome) in stored.into_iter().zip(outcomes) {
                match outcome {
                    Ok(_) => acks.push(&batch[index]),
                    Err(verdict) => poison.push((index, verdict)),
                }
            }
            self.commits += 1;
            if self.settings.abort_after_commits == Some(self.commits) {
                tracing::error!(
                    "SWITCHBOARD_TEST_ABORT_AFTER_COMMITS reached: aborting between commit and ack"
                );
                std::process::abort();
            }
        }

        // Past maxDeliveries but stored already (a crash between an earlier commit and its
        // ack): acknowledge it as the duplicate it is, rather than dead-letter a stored message.
        let overdue: Vec<usize> = poison
            .iter()
            .filter(|(_, verdict)| verdict.reason == PoisonReason::MaxDeliveries)
            .map(|(index, _)| *index)
            .collect();
        if !overdue.is_empty() && self.context.dedup == Dedup::NativeId {
            let messages: Vec<&Message> = overdue.iter().map(|&index| &batch[index]).collect();
            // Shutdown interrupted the check: leave them un-acknowledged, for redelivery.
            let found = self.context.stored_before(&messages).await;
            let (stored, unknown): (Vec<usize>, Vec<usize>) = match found {
                Some(found) => (
                    overdue
                        .into_iter()
                        .zip(found)
                        .filter_map(|(index, exists)| exists.then_some(index))
                        .collect(),
                    Vec::new(),
                ),
                None => (Vec::new(), overdue),
            };
            poison.retain(|(index, _)| !stored.contains(index) && !unknown.contains(index));
            self.metrics.duplicates.inc_by(stored.len() as u64);
            acks.extend(stored.into_iter().map(|index| &batch[index]));
        }

        if !acks.is_empty()
            && self
                .broker_op(async |transport| transport.ack(&acks).await)
                .await
                .is_some()
        {
            self.metrics.acked.inc_by(acks.len() as u64);
        }

        if !poison.is_empty() {
            let letters: Vec<DeadLetter<'_>> = poison
                .into_iter()
                .map(|(index, verdict)| DeadLetter {
                    message: &batch[index],
                    reason: verdict.reason,
                    error: verdict.detail,
                })
                .collect();
            let written = self
                .broker_op(async |transport| transport.dead_letter(&letters).await)
                .await
                .is_some();
            if written {
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
        }
    }
}
