//! Acknowledging: `DeleteMessageBatch` calls of ten planned by `delete_plan.rs` (a FIFO
//! group's messages in order), each entry's result read (a 200 response can still fail
//! entries): an invalid receipt handle is stale, anything else is retried.

use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use futures::future::join_all;

use super::Sqs;
use super::classify::{self, Addressed};
use super::delete_plan::{DeletePlan, Outcome};
use super::queues::Queues;
use super::receive::SqsDelivery;
use crate::transport::{Acked, ErrorKind, TransportError};

impl Sqs {
    /// Deletes `messages` (settled, in receive order) round by round of the plan.
    pub(super) async fn delete(&self, messages: &[&SqsDelivery]) -> Result<Acked, TransportError> {
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
                            ErrorKind::StaleReceipt => Outcome::Stale,
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
                && err.kind() == &ErrorKind::Transient
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

    /// One `DeleteMessageBatch` of `entries` (indices into `messages`): the outcome of each.
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
}
