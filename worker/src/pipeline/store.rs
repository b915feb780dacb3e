//! The store layer of the loop: the only room that writes to PostgreSQL. A batch is stored in
//! one transaction (bisected when PostgreSQL refuses some of its rows), attempts of redelivered
//! messages are recorded, and dead letters the broker refuses are kept.

use std::sync::Arc;
use std::time::{Duration, Instant};

use switchboard_store::{
    AttemptRecord, Dedup, IngestBatch, KeptLetter, NewEvent, Store, StoreError, Stored,
};
use switchboard_telemetry::ErrorChain;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::monitor::Monitor;
use crate::health::now_ms;
use crate::metrics::{Metrics, TraceExemplar};
use crate::payload::{Poison, PoisonReason, fields_json, storable_text};
use crate::transport::{Attempt, DeadLetter, Position, TransportError, UNSETTLED};

/// What a store task needs; shared by every task of the loop.
#[derive(Debug)]
pub(super) struct StoreContext {
    pub(super) store: Store,
    pub(super) source: String,
    /// This worker's consumer name, recorded with each attempt.
    pub(super) worker: String,
    pub(super) queue: String,
    pub(super) dedup: Dedup,
    pub(super) database: Monitor,
    pub(super) metrics: Arc<Metrics>,
    pub(super) cancel: CancellationToken,
}

/// What the store task made of each event: stored (or a duplicate), or poison PostgreSQL refused.
pub(super) type Outcomes = Vec<Result<Stored, Poison>>;

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
            self.metrics.commit_seconds.observe(
                started.elapsed().as_secs_f64(),
                trace_exemplar(),
                None,
            );
        }
        Ok(stored)
    }

    /// Runs `op` until it succeeds, backing off while the database is unavailable. `Ok(None)`:
    /// shutdown interrupted a retry. `Err`: PostgreSQL refused the data, or the statement.
    async fn persist<T, F>(&self, op: impl FnMut() -> F) -> Result<Option<T>, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        self.persist_while(op, StoreError::is_retryable).await
    }

    /// The one store retry loop: runs `op` until it succeeds, backing off after the failures
    /// `retry` accepts. `Ok(None)`: shutdown interrupted a retry. `Err`: a failure `retry`
    /// refused.
    pub(super) async fn persist_while<T, F>(
        &self,
        mut op: impl FnMut() -> F,
        retry: fn(&StoreError) -> bool,
    ) -> Result<Option<T>, StoreError>
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
                Err(err) if retry(&err) => {
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
    pub(super) async fn store_events(
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
        let mut pending = Vec::with_capacity(1);
        pending.push(0..events.len());
        let mut split = false;
        while let Some(range) = pending.pop() {
            let positions = highest_positions(
                origins[range.clone()]
                    .iter()
                    .filter_map(|o| o.position.as_ref()),
            );
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
    pub(super) async fn recorded_attempts(
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
    pub(super) async fn stored_before(
        &self,
        ids: &[&str],
    ) -> Result<Option<Vec<bool>>, StoreError> {
        self.retrying(
            "cannot check whether messages past maxDeliveries were stored",
            || self.store.events_exist(&self.source, ids),
            || vec![false; ids.len()],
        )
        .await
    }

    /// Keeps dead letters the broker's dead-letter destination refused for good in PostgreSQL's
    /// `dead_letters` table (one statement; a message kept already is not kept twice), waiting
    /// out a database outage. `Ok(false)`: shutdown interrupted the wait (the batch is left
    /// un-acknowledged); never acknowledged without its row.
    pub(super) async fn keep_dead_letters<R>(
        &self,
        refused: &[&DeadLetter<'_, R>],
        answer: &TransportError,
    ) -> Result<bool, StoreError> {
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
        let Some(new) = self
            .persist(|| self.store.keep_dead_letters(&self.source, &kept))
            .await?
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

    fn record(&self, outcomes: &Outcomes, origins: &[Origin]) {
        let now = now_ms();
        let exemplar = trace_exemplar();
        for (outcome, origin) in outcomes.iter().zip(origins) {
            match outcome {
                Ok(Stored::New | Stored::NewEventOnly) => {
                    self.metrics.stored.inc();
                    if let Some(enqueued) = origin.enqueued_at_ms {
                        let latency = Duration::from_millis(now.saturating_sub(enqueued));
                        self.metrics.end_to_end_seconds.observe(
                            latency.as_secs_f64(),
                            exemplar.clone(),
                            None,
                        );
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
pub(super) struct Origin {
    pub(super) position: Option<Position>,
    pub(super) enqueued_at_ms: Option<u64>,
}

/// The store task of one batch.
pub(super) type StoreTask = JoinHandle<Result<Option<Outcomes>, StoreError>>;

/// The exemplar of what the current batch observes: its trace, when it is exported and sampled.
fn trace_exemplar() -> Option<TraceExemplar> {
    switchboard_telemetry::traces::current_trace_id().map(|trace_id| TraceExemplar { trace_id })
}
