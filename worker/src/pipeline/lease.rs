//! Leases: while a batch is stored, the broker's lease on it (and on the other batches held)
//! is extended each time half of it has passed.

use std::collections::VecDeque;
use std::time::Instant;

use switchboard_telemetry::ErrorChain;

use super::settle::InFlight;
use super::store::{Outcomes, StoreTask};
use super::{Pipeline, PipelineError, Stopped};
use crate::transport::{Message, Transport};

impl<T: Transport> Pipeline<T> {
    /// Waits for a store task. Meanwhile, where the broker has a lease, extends it for this
    /// batch and the others in flight each time half of it has passed.
    pub(super) async fn await_stored(
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

    /// Extends the lease of every batch whose extension is due (`batch`, whose next extension
    /// is `extend_at`, and `others`); a no-op on brokers without a lease. An extension that
    /// takes over a quarter of the lease (a broker that extends one message per call, a short
    /// lease, many batches held) strains the leases for one lease: meanwhile no batch is
    /// received ahead, so fewer are held and extended, instead of extensions taking all the
    /// time and crowding out the stores and acknowledgements
    /// ([`settle_oldest`](super::settle::settle_oldest)).
    pub(super) async fn extend_leases(
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
        let started = Instant::now();
        let outcome = self
            .broker_op(async |transport| transport.extend_lease(&messages).await)
            .await;
        if started.elapsed() > lease / 4 {
            self.leases_strained_until = Some(Instant::now() + lease);
        }
        match outcome {
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

    /// Whether a batch may be received before the oldest held is settled: not while the
    /// database is down (the batches in hand wait out the outage; more would only be held and
    /// extended), nor for a lease after an extension strained the leases
    /// ([`Self::extend_leases`]).
    pub(super) fn receive_ahead(&self) -> bool {
        !self.context.database.is_down()
            && self
                .leases_strained_until
                .is_none_or(|until| Instant::now() >= until)
    }
}
