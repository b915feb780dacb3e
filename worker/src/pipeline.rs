//! The store-then-ack loop: receive a batch → store it in one transaction → acknowledge it.
//!
//! Nothing is acknowledged before its todo is committed. Poison is dead-lettered (and only then
//! acknowledged) without holding up the rest of its batch. A failing dependency is retried
//! with backoff, logged once per outage, and reported through readiness; shutdown is checked
//! between batches, and a batch in hand is finished or left un-acknowledged.

use std::sync::Arc;
use std::time::{Duration, Instant};

use switchboard_api::PayloadFormat;
use switchboard_store::{IngestBatch, NewEvent, Store, StoreError, Stored};
use switchboard_telemetry::ErrorChain;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::health::{Dependency, Health, now_ms};
use crate::metrics::Metrics;
use crate::payload::{Poison, PoisonReason, fields_json, payload_json};
use crate::transport::{DeadLetter, Message, QueueHealth, Transport, TransportError};

/// How long past its own next deadline the loop may be silent before `/healthz` fails.
const LIVENESS_SLACK: Duration = Duration::from_secs(60);

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

/// A failed step, from either side.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl StepError {
    fn dependency(&self) -> Dependency {
        match self {
            StepError::Transport(err) => err.dependency(),
            StepError::Store(_) => Dependency::Database,
        }
    }

    fn is_retryable(&self) -> bool {
        match self {
            StepError::Transport(_) => true,
            StepError::Store(err) => err.is_retryable(),
        }
    }
}

#[derive(Debug, Default)]
struct DependencyState {
    backoff: Backoff,
    down_since: Option<Instant>,
}

/// The loop for one adapter and one transport.
#[derive(Debug)]
pub struct Pipeline<T> {
    transport: T,
    store: Store,
    settings: PipelineSettings,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    cancel: CancellationToken,
    broker: DependencyState,
    database: DependencyState,
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
        Self {
            transport,
            store,
            settings,
            metrics,
            health,
            cancel,
            broker: DependencyState::default(),
            database: DependencyState::default(),
            commits: 0,
        }
    }

    fn state(&mut self, dependency: Dependency) -> &mut DependencyState {
        match dependency {
            Dependency::Broker => &mut self.broker,
            Dependency::Database => &mut self.database,
        }
    }

    fn mark_up(&mut self, dependency: Dependency) {
        self.health.set_up(dependency, true);
        self.metrics.set_up(dependency, true);
        let state = self.state(dependency);
        state.backoff.reset();
        if let Some(since) = state.down_since.take() {
            tracing::info!(
                dependency = dependency.as_str(),
                down_for = ?since.elapsed(),
                "dependency recovered"
            );
        }
    }

    /// Records a failure and waits out the backoff. Returns `false` if shutdown interrupted it.
    async fn back_off(&mut self, err: &StepError) -> bool {
        let dependency = err.dependency();
        self.metrics.dependency_error(dependency);
        self.health.set_up(dependency, false);
        self.metrics.set_up(dependency, false);
        let state = self.state(dependency);
        if state.down_since.is_none() {
            state.down_since = Some(Instant::now());
            tracing::warn!(
                dependency = dependency.as_str(),
                error = %ErrorChain(err),
                "dependency unavailable; retrying with backoff"
            );
        }
        let delay = state.backoff.next_delay();
        self.health.beat(delay + LIVENESS_SLACK);
        tokio::select! {
            () = self.cancel.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        }
    }

    /// Runs `op` until it succeeds, backing off on retryable errors. `Ok(None)`: shutdown came
    /// first. `Err`: a non-retryable error.
    async fn retry<R>(
        &mut self,
        primary: Dependency,
        mut op: impl AsyncFnMut(&mut T, &Store) -> Result<R, StepError>,
    ) -> Result<Option<R>, StepError> {
        let mut failed = Vec::new();
        loop {
            match op(&mut self.transport, &self.store).await {
                Ok(value) => {
                    self.mark_up(primary);
                    for dependency in failed {
                        self.mark_up(dependency);
                    }
                    return Ok(Some(value));
                }
                Err(err) if err.is_retryable() => {
                    if !failed.contains(&err.dependency()) {
                        failed.push(err.dependency());
                    }
                    if !self.back_off(&err).await {
                        return Ok(None);
                    }
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// `retry` for operations whose errors are all retryable.
    async fn retry_transient<R>(
        &mut self,
        primary: Dependency,
        op: impl AsyncFnMut(&mut T, &Store) -> Result<R, StepError>,
    ) -> Option<R> {
        match self.retry(primary, op).await {
            Ok(value) => value,
            Err(err) => {
                tracing::error!(error = %ErrorChain(&err), "unexpected permanent error");
                None
            }
        }
    }

    /// Runs until cancelled.
    pub async fn run(mut self) {
        let ready = self
            .retry_transient(Dependency::Broker, async |transport, _| {
                Ok(transport.prepare().await?)
            })
            .await;
        if ready.is_none() {
            return;
        }
        self.health.set_started();
        tracing::info!(source = %self.transport.source(), queue = %self.settings.queue, "worker started");
        let cancel = self.cancel.clone();
        let interval = self.transport.maintenance_interval();
        let mut next_maintenance = Instant::now();
        while !cancel.is_cancelled() {
            self.health.beat(Duration::from_secs(1) + LIVENESS_SLACK);
            if Instant::now() >= next_maintenance {
                if !self.maintain().await {
                    break;
                }
                next_maintenance = Instant::now() + interval;
            }
            let batch_size = self.settings.batch_size;
            let received = tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                received = self.transport.receive(batch_size) => received,
            };
            match received {
                Ok(batch) => {
                    self.mark_up(Dependency::Broker);
                    if !batch.is_empty() {
                        self.process_batch(batch).await;
                    }
                }
                Err(err) => {
                    if !self.back_off(&StepError::from(err)).await {
                        break;
                    }
                }
            }
        }
        if cancel.is_cancelled() {
            self.transport.shutdown().await;
        }
        tracing::info!("worker stopped");
    }

    /// Upkeep and gauges. Returns `false` if shutdown interrupted it.
    async fn maintain(&mut self) -> bool {
        let Some(queue) = self
            .retry_transient(Dependency::Broker, async |transport, _| {
                Ok(transport.maintain().await?)
            })
            .await
        else {
            return false;
        };
        self.record_queue_health(queue);
        self.retry_transient(Dependency::Database, async |_, store| {
            Ok(store.ping().await?)
        })
        .await
        .is_some()
    }

    fn record_queue_health(&self, queue: QueueHealth) {
        let gauge = |value: Option<u64>| i64::try_from(value.unwrap_or(0)).unwrap_or(i64::MAX);
        self.metrics.backlog.set(gauge(queue.backlog));
        self.metrics.pending.set(gauge(queue.pending));
        self.metrics
            .oldest_pending_age_seconds
            .set(queue.oldest_pending_age.unwrap_or_default().as_secs_f64());
    }

    /// Store, dead-letter and acknowledge one batch. Returns early (leaving the rest
    /// un-acknowledged) only when shutdown interrupts a retry.
    async fn process_batch(&mut self, batch: Vec<Message>) {
        let settings = self.settings.clone();
        let count = batch.len() as u64;
        self.metrics.received.inc_by(count);
        self.metrics.batch_size.observe(count as f64);
        let redelivered = batch.iter().filter(|m| m.delivery_count > 1).count();
        self.metrics.redelivered.inc_by(redelivered as u64);

        let mut letters = Vec::new();
        let mut events = Vec::with_capacity(batch.len());
        let mut stored_messages = Vec::with_capacity(batch.len());
        for message in &batch {
            if message.delivery_count > settings.max_deliveries {
                letters.push(DeadLetter {
                    message,
                    reason: PoisonReason::MaxDeliveries,
                    error: format!(
                        "delivered {} times without being stored; delivery.maxDeliveries is {}",
                        message.delivery_count, settings.max_deliveries
                    ),
                });
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
                    stored_messages.push(message);
                }
                Err(poison) => letters.push(poison_letter(message, poison)),
            }
        }

        let mut acks = Vec::with_capacity(batch.len());
        if !events.is_empty() {
            let Some(outcomes) = self.store_events(&events, &stored_messages).await else {
                return;
            };
            for (message, outcome) in stored_messages.into_iter().zip(outcomes) {
                match outcome {
                    Ok(_) => acks.push(message),
                    Err(poison) => letters.push(poison_letter(message, poison)),
                }
            }
            self.commits += 1;
            if settings.abort_after_commits == Some(self.commits) {
                tracing::error!(
                    "SWITCHBOARD_TEST_ABORT_AFTER_COMMITS reached: aborting between commit and ack"
                );
                std::process::abort();
            }
        }

        if !letters.is_empty() {
            let sent = self
                .retry_transient(Dependency::Broker, async |transport, _| {
                    Ok(transport.dead_letter(&letters).await?)
                })
                .await;
            if sent.is_none() {
                return;
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

        if !acks.is_empty() {
            let acked = self
                .retry_transient(Dependency::Broker, async |transport, _| {
                    Ok(transport.ack(&acks).await?)
                })
                .await;
            if acked.is_some() {
                self.metrics.acked.inc_by(acks.len() as u64);
            }
        }
    }

    /// Stores the events in one transaction. If PostgreSQL rejects the batch's data, stores
    /// them one by one to find the rows it refuses. `None`: shutdown interrupted a retry.
    async fn store_events(
        &mut self,
        events: &[NewEvent],
        messages: &[&Message],
    ) -> Option<Vec<Result<Stored, Poison>>> {
        let checkpoint = messages.iter().filter_map(|m| m.position).max();
        match self.ingest(events, checkpoint).await {
            Ok(Some(outcomes)) => {
                self.record_stored(&outcomes, messages);
                Some(outcomes.into_iter().map(Ok).collect())
            }
            Ok(None) => None,
            Err(err) => {
                tracing::warn!(
                    error = %ErrorChain(&err),
                    size = events.len(),
                    "database rejected a batch; storing its messages one by one to find the bad ones"
                );
                let mut results = Vec::with_capacity(events.len());
                for (event, message) in events.iter().zip(messages) {
                    match self
                        .ingest(std::slice::from_ref(event), message.position)
                        .await
                    {
                        Ok(Some(outcomes)) => {
                            self.record_stored(&outcomes, std::slice::from_ref(message));
                            results.extend(outcomes.into_iter().map(Ok));
                        }
                        Ok(None) => return None,
                        Err(err) => results.push(Err(Poison {
                            reason: PoisonReason::Rejected,
                            detail: ErrorChain(&err).to_string(),
                        })),
                    }
                }
                Some(results)
            }
        }
    }

    async fn ingest(
        &mut self,
        events: &[NewEvent],
        checkpoint: Option<(u64, u64)>,
    ) -> Result<Option<Vec<Stored>>, StepError> {
        let queue = self.settings.queue.clone();
        let source = self.transport.source().to_owned();
        let batch = IngestBatch {
            source: &source,
            queue: &queue,
            dedup: self.transport.dedup(),
            checkpoint,
            events,
        };
        let started = Instant::now();
        let result = self
            .retry(Dependency::Database, async |_, store| {
                Ok(store.ingest_batch(&batch).await?)
            })
            .await;
        if let Ok(Some(_)) = &result {
            self.metrics
                .commit_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        result
    }

    fn record_stored(&self, outcomes: &[Stored], messages: &[&Message]) {
        let now = now_ms();
        for (outcome, message) in outcomes.iter().zip(messages) {
            match outcome {
                Stored::New | Stored::NewEventOnly => {
                    self.metrics.stored.inc();
                    if let Some(enqueued) = message.enqueued_at_ms {
                        let latency = Duration::from_millis(now.saturating_sub(enqueued));
                        self.metrics
                            .end_to_end_seconds
                            .observe(latency.as_secs_f64());
                    }
                }
                Stored::Duplicate => {
                    self.metrics.duplicates.inc();
                }
            }
        }
    }
}

fn poison_letter(message: &Message, poison: Poison) -> DeadLetter<'_> {
    DeadLetter {
        message,
        reason: poison.reason,
        error: poison.detail,
    }
}
