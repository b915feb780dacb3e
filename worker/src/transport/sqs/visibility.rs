//! Changing the visibility of messages this worker holds (`ChangeMessageVisibilityBatch`):
//! extending the lease of a batch still being stored, and making held-back FIFO messages
//! visible again at once.

use aws_sdk_sqs::types::ChangeMessageVisibilityBatchRequestEntry;
use futures::future::join_all;

use super::Sqs;
use super::classify::{self, Addressed};
use super::delete_plan::BATCH_LIMIT;
use super::queues::Queues;
use super::receive::{Receipt, SqsDelivery};
use crate::transport::{Transport as _, TransportError};

/// The entries setting the visibility of the messages of `handles` to `seconds`, numbered in
/// order.
fn entries<'a>(
    handles: impl Iterator<Item = &'a str>,
    seconds: i32,
) -> Vec<ChangeMessageVisibilityBatchRequestEntry> {
    handles
        .enumerate()
        .filter_map(|(id, handle)| {
            ChangeMessageVisibilityBatchRequestEntry::builder()
                .id(id.to_string())
                .receipt_handle(handle)
                .visibility_timeout(seconds)
                .build()
                .ok()
        })
        .collect()
}

impl Sqs {
    /// Extends the visibility of `messages` to the visibility timeout, in calls of ten.
    pub(super) async fn extend_visibility(
        &self,
        messages: &[&SqsDelivery],
    ) -> Result<(), TransportError> {
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

    /// Makes FIFO messages visible again at once (best effort: on failure they come back when
    /// their visibility expires, which keeps the order just the same).
    pub(super) async fn release(&self, queues: &Queues, receipts: &[Receipt]) {
        for chunk in receipts.chunks(BATCH_LIMIT) {
            let handles = chunk.iter().map(|receipt| receipt.handle.as_str());
            let result = self
                .client
                .change_message_visibility_batch()
                .queue_url(&queues.url)
                .set_entries(Some(entries(handles, 0)))
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

    /// One `ChangeMessageVisibilityBatch` setting `messages`' visibility to `seconds`.
    async fn change_visibility(
        &self,
        queues: &Queues,
        messages: &[&SqsDelivery],
        seconds: i32,
    ) -> Result<(), TransportError> {
        let handles = messages
            .iter()
            .map(|message| message.receipt.handle.as_str());
        let output = self
            .client
            .change_message_visibility_batch()
            .queue_url(&queues.url)
            .set_entries(Some(entries(handles, seconds)))
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
