//! Settling a stored batch. The order is a pure plan ([`plan`]): the batch's dead letters are
//! written (and confirmed by the broker) first, then every settled message is acknowledged
//! once, in receive order; so a cumulative acknowledgement can never pass an unwritten dead
//! letter, and dead letters not written leave the whole batch un-acknowledged. Batches are
//! settled oldest first ([`settle_oldest`]): a younger batch stored first waits for the older
//! one's acknowledgement.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use switchboard_store::Dedup;
use switchboard_telemetry::ErrorChain;
use tracing::Instrument as _;

use super::store::StoreTask;
use super::{Pipeline, PipelineError, Stopped, spans};
use crate::payload::{Poison, PoisonReason};
use crate::transport::{
    Attempt, Attempts, DeadLetter, ErrorKind, HELD, IDEMPOTENCY_KEY_HEADER, IN_FLIGHT, Message,
    Transport, TransportError,
};

/// A received batch whose events are being stored.
pub(super) struct InFlight<R> {
    pub(super) batch: Vec<Message<R>>,
    /// Indexes into `batch` of the messages handed to the store task, in its order.
    pub(super) stored: Vec<usize>,
    /// Messages found poison before storing: (index into `batch`, reason, detail).
    pub(super) poison: Vec<(usize, Poison)>,
    pub(super) task: Option<StoreTask>,
    /// When the broker's lease on the batch should next be extended (brokers with a lease).
    pub(super) extend_at: Option<Instant>,
    /// The batch's span (size, first and last message): its store task and its settling run
    /// in it.
    pub(super) span: tracing::Span,
}

impl<R> InFlight<R> {
    /// Whether its store task is still running.
    pub(super) fn storing(&self) -> bool {
        self.task.as_ref().is_some_and(|task| !task.is_finished())
    }
}

/// Whether the oldest of the batches held (`storing`: whether each one's store task is still
/// running, oldest first, the one just received last) is settled now: once it is stored, or
/// when the stores running or the batches held reach their limits, or when no batch may be
/// received ahead (`ahead` false: the database is down, or keeping the leases of the batches
/// held is strained; then settling waits for its store). Never a younger one first:
/// acknowledgements go in receive order, and a younger batch already stored waits without
/// taking a store's place.
pub(super) fn settle_oldest(storing: &[bool], ahead: bool) -> bool {
    let running = storing.iter().filter(|&&storing| storing).count();
    storing.first().is_some_and(|&oldest| !oldest)
        || running >= IN_FLIGHT
        || storing.len() >= HELD
        || (!ahead && !storing.is_empty())
}

/// How one message of a batch was settled.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Settled {
    /// Stored, or a duplicate of a stored message: acknowledge it.
    Done,
    /// Poison: write its dead letter, then acknowledge it.
    Poison(Poison),
}

/// What settling a batch does, in this order (indexes into the batch).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// The dead letters to write, confirmed, before anything is acknowledged.
    pub(super) dead_letters: Vec<usize>,
    /// Then the messages to acknowledge, once, in receive order: every settled one (a message
    /// not settled, `None`, stays un-acknowledged for redelivery).
    pub(super) acknowledge: Vec<usize>,
}

/// The settle plan of a batch from what became of each of its messages.
pub(super) fn plan(settled: &[Option<Settled>]) -> Plan {
    let indexes = |keep: fn(&Settled) -> bool| {
        settled
            .iter()
            .enumerate()
            .filter_map(|(index, settled)| settled.as_ref().is_some_and(keep).then_some(index))
            .collect()
    };
    Plan {
        dead_letters: indexes(|settled| matches!(settled, Settled::Poison(_))),
        acknowledge: indexes(|_| true),
    }
}

/// How many dead-lettered keys a worker remembers.
const RECENT_LETTERS: usize = 10_000;

/// Idempotency keys this worker dead-lettered lately, the oldest forgotten first.
#[derive(Debug, Default)]
pub(super) struct RecentLetters {
    keys: HashSet<String>,
    order: VecDeque<String>,
}

impl RecentLetters {
    pub(super) fn contains(&self, key: &str) -> bool {
        self.keys.contains(key)
    }

    pub(super) fn insert(&mut self, key: &str) {
        if self.keys.insert(key.to_owned()) {
            self.order.push_back(key.to_owned());
            if self.order.len() > RECENT_LETTERS
                && let Some(oldest) = self.order.pop_front()
            {
                self.keys.remove(&oldest);
            }
        }
    }
}

impl<T: Transport> Pipeline<T> {
    /// Waits for a batch's commit, then settles it by its [`plan`], in the batch's span.
    /// Returns early, leaving the batch un-acknowledged, if shutdown interrupted a retry or its
    /// dead letters were not written.
    pub(super) async fn finish(
        &mut self,
        in_flight: InFlight<T::Receipt>,
        others: &mut VecDeque<InFlight<T::Receipt>>,
    ) -> Result<(), PipelineError> {
        let span = in_flight.span.clone();
        self.settle(in_flight, others).instrument(span).await
    }

    async fn settle(
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
            span,
        } = in_flight;
        let mut settled: Vec<Option<Settled>> = vec![None; batch.len()];
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
        let step = spans::step(&span, &self.settings.messaging, "settle");
        let result = self
            .settle_stored(&batch, settled, &mut extend_at, others)
            .instrument(step.clone())
            .await;
        if let Err(err) = &result {
            switchboard_telemetry::traces::fail(&step, err);
            switchboard_telemetry::traces::fail(&span, err);
        }
        result
    }

    /// Settles a batch whose store is done (`settled`: every message's verdict): dead letters
    /// written and confirmed, then the acknowledgements, by its [`plan`].
    async fn settle_stored(
        &mut self,
        batch: &[Message<T::Receipt>],
        mut settled: Vec<Option<Settled>>,
        extend_at: &mut Option<Instant>,
        others: &mut VecDeque<InFlight<T::Receipt>>,
    ) -> Result<(), PipelineError> {
        if !self
            .acknowledge_overdue_duplicates(batch, &mut settled)
            .await?
        {
            return Ok(());
        }
        let plan = plan(&settled);
        let poison: Vec<(&Message<T::Receipt>, &Poison)> = plan
            .dead_letters
            .iter()
            .filter_map(|&index| match &settled[index] {
                Some(Settled::Poison(verdict)) => Some((&batch[index], verdict)),
                _ => None,
            })
            .collect();
        let poison = self.not_dead_lettered_yet(poison);
        // The batches held behind this one keep their lease while it is settled (each broker
        // call below can take a while): a lease run out would hand their messages to another
        // receive, and a poison message would be dead-lettered twice.
        self.extend_leases(extend_at, batch, others).await?;
        if !self.write_dead_letters(&poison).await? {
            return Ok(());
        }
        for (message, _) in &poison {
            self.recent_letters.insert(&message.idempotency_key);
        }
        self.extend_leases(extend_at, batch, others).await?;
        let acks: Vec<&Message<T::Receipt>> = plan
            .acknowledge
            .iter()
            .map(|&index| &batch[index])
            .collect();
        self.spawn_forget(&acks);
        self.acknowledge(acks).await?;
        self.health.progressed();
        Ok(())
    }

    /// `poison` without the messages this worker dead-lettered lately (native ids only): a copy
    /// received again, its lease run out while its batch waited its turn under a slow broker,
    /// is acknowledged as the duplicate it is, never dead-lettered twice. A redriven copy (it
    /// carries [`IDEMPOTENCY_KEY_HEADER`]) is a new delivery someone asked for, even where it
    /// keeps its original's native id (RabbitMQ's `message-id`): if it still fails it is
    /// dead-lettered again, at worst twice, never acknowledged away.
    fn not_dead_lettered_yet<'m>(
        &self,
        poison: Vec<(&'m Message<T::Receipt>, &'m Poison)>,
    ) -> Vec<(&'m Message<T::Receipt>, &'m Poison)> {
        if self.context.dedup != Dedup::NativeId {
            return poison;
        }
        let (again, poison): (Vec<_>, Vec<_>) = poison.into_iter().partition(|(message, _)| {
            self.recent_letters.contains(&message.idempotency_key)
                && !message
                    .headers
                    .iter()
                    .any(|(name, _)| name == IDEMPOTENCY_KEY_HEADER)
        });
        if !again.is_empty() {
            self.metrics.duplicates.inc_by(again.len() as u64);
            tracing::debug!(
                count = again.len(),
                "received again after their dead letters were written: acknowledged, not dead-lettered twice"
            );
        }
        poison
    }

    /// Writes the dead letters of `poison`, confirmed by the broker; those its destination
    /// refuses for good are kept in PostgreSQL. `false`: not written (shutdown, or receipts gone
    /// stale): nothing of the batch may be acknowledged, since a cumulative acknowledgement
    /// would pass the unwritten dead letter.
    async fn write_dead_letters(
        &mut self,
        poison: &[(&Message<T::Receipt>, &Poison)],
    ) -> Result<bool, PipelineError> {
        let Some(letters) = self.with_attempts(poison).await? else {
            return Ok(false);
        };
        if letters.is_empty() {
            return Ok(true);
        }
        match self
            .broker_op(async |transport| transport.write_dead_letters(&letters).await)
            .await
        {
            Ok(()) => {}
            Err(Stopped::Cancelled) => return Ok(false),
            Err(Stopped::Stale(err)) => {
                tracing::warn!(error = %ErrorChain(&err), "dead letters were not written; the batch is left for redelivery");
                return Ok(false);
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
                if !self
                    .context
                    .keep_dead_letters(&refused, &err)
                    .await
                    .map_err(PipelineError::Database)?
                {
                    return Ok(false);
                }
            }
        }
        for letter in &letters {
            self.metrics.dead_lettered(letter.reason);
        }
        self.dead_letter_log.add(&letters, Instant::now());
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
        let (overdue, ids): (Vec<usize>, Vec<String>) = overdue
            .into_iter()
            .filter_map(|index| Some((index, self.event_id(&batch[index])?)))
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
    pub(super) async fn acknowledge(
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
    /// messages and their keys deduplicate them). Summed up in the log, like dead letters.
    fn stale(&mut self, count: usize, err: &TransportError) {
        self.metrics.stale_receipts.inc_by(count as u64);
        self.stale_log.add(count, err, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    //! The settle order with a fake transport (no servers): each test drives the real pipeline
    //! code and reads what the transport was asked to do, in order.

    use std::sync::{Arc, Mutex, PoisonError};
    use std::time::Duration;
    use switchboard_api::source::Messaging;

    use futures::FutureExt as _;
    use switchboard_api::{DeliveryGuarantee, Envelope, PayloadFormat};
    use switchboard_store::{Store, Stored};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::health::Health;
    use crate::metrics::Metrics;
    use crate::pipeline::PipelineSettings;
    use crate::pipeline::store::Outcomes;
    use crate::transport::{Acked, QueueHealth, QueueProbe};

    /// What the transport was asked to do: dead letters written and acknowledgements, by
    /// external id.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        DeadLetters(Vec<String>),
        Ack(Vec<String>),
    }

    #[derive(Debug, Default)]
    struct Fake {
        calls: Arc<Mutex<Vec<Call>>>,
        /// The dead-letter destination's receipts are gone: nothing is written.
        letters_stale: bool,
        /// Positions (in each acknowledgement call) the broker refuses as stale.
        stale: Vec<usize>,
    }

    struct NoProbe;

    impl QueueProbe for NoProbe {
        async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
            Ok(QueueHealth::default())
        }
    }

    fn ids(messages: impl IntoIterator<Item = impl AsRef<Message<()>>>) -> Vec<String> {
        messages
            .into_iter()
            .map(|message| message.as_ref().external_id.clone())
            .collect()
    }

    impl Transport for Fake {
        type Receipt = ();
        type Probe = NoProbe;

        fn source(&self) -> &str {
            "fake:test/settle"
        }

        fn endpoint(&self) -> String {
            "fake:1".to_owned()
        }

        fn dedup(&self) -> Dedup {
            Dedup::NativeId
        }

        async fn prepare(&mut self) -> Result<(), TransportError> {
            Ok(())
        }

        async fn receive(&mut self, _: usize, _: bool) -> Result<Vec<Message<()>>, TransportError> {
            Ok(Vec::new())
        }

        async fn write_dead_letters(
            &mut self,
            letters: &[DeadLetter<'_, ()>],
        ) -> Result<(), TransportError> {
            self.record(Call::DeadLetters(ids(letters.iter().map(|l| l.message))));
            if self.letters_stale {
                return Err(TransportError::stale("the receipts are gone", None));
            }
            Ok(())
        }

        async fn ack(&mut self, messages: &[&Message<()>]) -> Result<Acked, TransportError> {
            self.record(Call::Ack(ids(messages.iter().copied())));
            Ok(Acked {
                stale: self.stale.clone(),
                retry: Vec::new(),
            })
        }

        async fn maintain(&mut self) -> Result<(), TransportError> {
            Ok(())
        }

        fn maintenance_interval(&self) -> Duration {
            Duration::from_secs(60)
        }

        fn probe(&self) -> NoProbe {
            NoProbe
        }
    }

    impl Fake {
        fn record(&self, call: Call) {
            self.calls
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(call);
        }
    }

    impl AsRef<Message<()>> for Message<()> {
        fn as_ref(&self) -> &Message<()> {
            self
        }
    }

    fn message(id: &str) -> Message<()> {
        Message {
            receipt: (),
            external_id: id.to_owned(),
            idempotency_key: format!("fake:test/settle:{id}"),
            body: b"{}".to_vec(),
            headers: Vec::new(),
            delivery_count: 1,
            enqueued_at_ms: None,
            position: None,
            undecodable: None,
        }
    }

    /// A pipeline over `fake` whose store is never reached: the batches below hold first
    /// deliveries only, and their store tasks are stand-ins.
    async fn pipeline(fake: Fake) -> (Pipeline<Fake>, Arc<Mutex<Vec<Call>>>) {
        let calls = fake.calls.clone();
        let store = Store::connect("postgres://127.0.0.1:1/never", 1, "settle-test")
            .await
            .expect("a lazy pool");
        let settings = PipelineSettings {
            adapter: "test/settle".to_owned(),
            worker: "w1".to_owned(),
            queue: "settle".to_owned(),
            batch_size: 10,
            max_deliveries: 5,
            format: PayloadFormat::Json,
            max_bytes: 1 << 20,
            envelope: Envelope::None,
            abort_after_commits: None,
            dead_letter_retention: Duration::from_secs(3600),
            messaging: Messaging {
                system: "test",
                destination: "settle".to_owned(),
                consumer_group: None,
            },
        };
        let metrics = Arc::new(Metrics::new(
            "test/settle",
            DeliveryGuarantee::AtLeastOnce,
            Metrics::registry(),
        ));
        let pipeline = Pipeline::new(
            fake,
            store,
            settings,
            metrics,
            Arc::new(Health::new()),
            CancellationToken::new(),
        );
        (pipeline, calls)
    }

    /// A batch of `ids` whose messages at `poison` were found poison before storing, the
    /// others handed to `task`.
    fn batch(ids: &[&str], poison: &[usize], task: StoreTask) -> InFlight<()> {
        InFlight {
            batch: ids.iter().map(|id| message(id)).collect(),
            stored: (0..ids.len()).filter(|i| !poison.contains(i)).collect(),
            poison: poison
                .iter()
                .map(|&index| {
                    let verdict = Poison {
                        reason: PoisonReason::InvalidJson,
                        detail: "not JSON".to_owned(),
                    };
                    (index, verdict)
                })
                .collect(),
            task: Some(task),
            extend_at: None,
            span: tracing::Span::none(),
        }
    }

    fn stored(count: usize) -> StoreTask {
        let outcomes: Outcomes = vec![Ok(Stored::New); count];
        tokio::spawn(async move { Ok(Some(outcomes)) })
    }

    fn calls(calls: &Mutex<Vec<Call>>) -> Vec<Call> {
        calls.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn call(kind: fn(Vec<String>) -> Call, ids: &[&str]) -> Call {
        kind(ids.iter().map(|id| (*id).to_owned()).collect())
    }

    #[test]
    fn the_plan_writes_dead_letters_then_acknowledges_every_settled_message_in_order() {
        let poison = Settled::Poison(Poison {
            reason: PoisonReason::InvalidJson,
            detail: String::new(),
        });
        assert_eq!(
            plan(&[Some(Settled::Done), Some(poison), None, Some(Settled::Done)]),
            Plan {
                dead_letters: vec![1],
                acknowledge: vec![0, 1, 3],
            }
        );
        assert_eq!(plan(&[]), Plan::default());
    }

    #[test]
    fn the_oldest_batch_is_settled_once_stored_or_at_the_limits_never_a_younger_one_first() {
        // A younger batch stored first waits for the older one.
        assert!(!settle_oldest(&[true, false], true));
        assert!(settle_oldest(&[false, true], true));
        // As many stores running as allowed: settle (wait for) the oldest.
        assert!(settle_oldest(&[true; IN_FLIGHT], true));
        assert!(!settle_oldest(&[true; IN_FLIGHT - 1], true));
        // As many batches held as allowed, most of them stored.
        let mut held = vec![false; HELD];
        held[0] = true;
        assert!(settle_oldest(&held, true));
        assert!(!settle_oldest(&held[..HELD - 1], true));
    }

    #[test]
    fn when_no_batch_may_be_received_ahead_the_oldest_is_settled_before_another_is_received() {
        assert!(settle_oldest(&[true], false));
        assert!(settle_oldest(&[true, true], false));
        assert!(!settle_oldest(&[true], true));
        assert!(!settle_oldest(&[], false));
    }

    #[tokio::test]
    async fn dead_letters_are_written_before_any_acknowledgement() {
        let (mut pipeline, log) = pipeline(Fake::default()).await;
        pipeline
            .finish(
                batch(&["a", "b", "c"], &[1], stored(2)),
                &mut VecDeque::new(),
            )
            .await
            .expect("settled");
        assert_eq!(
            calls(&log),
            [
                call(Call::DeadLetters, &["b"]),
                call(Call::Ack, &["a", "b", "c"])
            ]
        );
        assert_eq!(pipeline.metrics.acked.get(), 3);
    }

    #[tokio::test]
    async fn dead_letters_not_written_leave_the_whole_batch_unacknowledged() {
        let fake = Fake {
            letters_stale: true,
            ..Fake::default()
        };
        let (mut pipeline, log) = pipeline(fake).await;
        pipeline
            .finish(
                batch(&["a", "b", "c"], &[1], stored(2)),
                &mut VecDeque::new(),
            )
            .await
            .expect("left for redelivery, not an error");
        assert_eq!(calls(&log), [call(Call::DeadLetters, &["b"])]);
        assert_eq!(pipeline.metrics.acked.get(), 0);
    }

    #[tokio::test]
    async fn a_younger_batch_stored_first_waits_for_the_older_ones_acknowledgement() {
        let (mut pipeline, log) = pipeline(Fake::default()).await;
        let (commit, committed) = tokio::sync::oneshot::channel::<()>();
        let older_task: StoreTask = tokio::spawn(async move {
            committed.await.ok();
            let outcomes: Outcomes = vec![Ok(Stored::New); 2];
            Ok(Some(outcomes))
        });
        let older = batch(&["o1", "o2"], &[], older_task);
        let younger = batch(&["y1"], &[], stored(1));
        tokio::task::yield_now().await;
        // The loop's choice: the younger one is stored, the older one is not, so neither is
        // settled yet.
        assert!(!younger.storing());
        assert!(!settle_oldest(&[older.storing(), younger.storing()], true));
        let mut others = VecDeque::from([younger]);
        {
            let mut settling = std::pin::pin!(pipeline.finish(older, &mut others));
            assert!(
                settling.as_mut().now_or_never().is_none(),
                "waits for the commit"
            );
            assert_eq!(
                calls(&log),
                [],
                "nothing acknowledged before the older commit"
            );
            commit.send(()).expect("the store task waits");
            settling.await.expect("settled");
        }
        let younger = others.pop_front().expect("still held");
        pipeline
            .finish(younger, &mut others)
            .await
            .expect("settled");
        assert_eq!(
            calls(&log),
            [call(Call::Ack, &["o1", "o2"]), call(Call::Ack, &["y1"])]
        );
    }

    #[tokio::test]
    async fn a_poison_message_received_again_after_its_dead_letter_is_not_dead_lettered_twice() {
        let (mut pipeline, log) = pipeline(Fake::default()).await;
        pipeline
            .finish(batch(&["a", "p"], &[1], stored(1)), &mut VecDeque::new())
            .await
            .expect("settled");
        // The copy of `p` its lease let go of, received again before its ack.
        let mut again = batch(&["p", "b"], &[0], stored(1));
        again.batch[0].delivery_count = 2;
        pipeline
            .finish(again, &mut VecDeque::new())
            .await
            .expect("settled");
        assert_eq!(
            calls(&log),
            [
                call(Call::DeadLetters, &["p"]),
                call(Call::Ack, &["a", "p"]),
                call(Call::Ack, &["p", "b"])
            ]
        );
        assert_eq!(pipeline.metrics.duplicates.get(), 1);
    }

    #[tokio::test]
    async fn a_redriven_copy_keeping_its_native_id_is_dead_lettered_again_not_dropped() {
        let (mut pipeline, log) = pipeline(Fake::default()).await;
        pipeline
            .finish(batch(&["p"], &[0], stored(0)), &mut VecDeque::new())
            .await
            .expect("settled");
        // `dlq redrive` put it back with its key; the worker still fails it.
        let mut copy = batch(&["p"], &[0], stored(0));
        copy.batch[0]
            .headers
            .push((IDEMPOTENCY_KEY_HEADER.to_owned(), b"p".to_vec()));
        pipeline
            .finish(copy, &mut VecDeque::new())
            .await
            .expect("settled");
        assert_eq!(
            calls(&log),
            [
                call(Call::DeadLetters, &["p"]),
                call(Call::Ack, &["p"]),
                call(Call::DeadLetters, &["p"]),
                call(Call::Ack, &["p"])
            ]
        );
        assert_eq!(pipeline.metrics.duplicates.get(), 0);
    }

    #[tokio::test]
    async fn stale_receipts_are_counted_and_dropped_not_retried() {
        let fake = Fake {
            stale: vec![1],
            ..Fake::default()
        };
        let (mut pipeline, log) = pipeline(fake).await;
        pipeline
            .finish(
                batch(&["a", "b", "c"], &[], stored(3)),
                &mut VecDeque::new(),
            )
            .await
            .expect("settled");
        assert_eq!(calls(&log), [call(Call::Ack, &["a", "b", "c"])]);
        assert_eq!(pipeline.metrics.stale_receipts.get(), 1);
        assert_eq!(pipeline.metrics.acked.get(), 2);
    }
}
