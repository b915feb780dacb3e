//! Receiving: `ReceiveMessage` long polls of at most ten messages (all system and message
//! attributes), their messages converted, the FIFO rule applied (see the module doc of the
//! transport) and what this worker now holds recorded.

use aws_sdk_sqs::types::MessageSystemAttributeName;

use super::Sqs;
use super::classify::Addressed;
use super::delete_plan::BATCH_LIMIT;
use super::queues::Queues;
use super::receive::{Received, SqsDelivery, convert, sort_received};
use crate::transport::{Transport as _, TransportError};

impl Sqs {
    /// One `ReceiveMessage` of up to `count` messages.
    pub(super) async fn receive_once(
        &self,
        queues: &Queues,
        count: usize,
        wait_seconds: u32,
    ) -> Result<Vec<aws_sdk_sqs::types::Message>, TransportError> {
        let mut call = self
            .client
            .receive_message()
            .queue_url(&queues.url)
            .max_number_of_messages(i32::try_from(count.clamp(1, BATCH_LIMIT)).unwrap_or(10))
            .wait_time_seconds(i32::try_from(wait_seconds).unwrap_or(20))
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All");
        if let Some(seconds) = self.settings.spec.visibility_timeout_seconds {
            call = call.visibility_timeout(i32::try_from(seconds).unwrap_or(i32::MAX));
        }
        if queues.fifo {
            call = call.receive_request_attempt_id(format!("{:016x}", fastrand::u64(..)));
        }
        let output = call
            .customize()
            .config_override(
                aws_sdk_sqs::config::Builder::default()
                    .timeout_config(self.receive_timeouts.clone()),
            )
            .send()
            .await
            .map_err(|err| self.errors.error("ReceiveMessage", Addressed::Source, err))?;
        self.errors.source_absence.reached();
        Ok(output.messages.unwrap_or_default())
    }

    /// Converts received messages, applies the FIFO rule (see the module doc) and records
    /// what this worker now holds.
    pub(super) async fn deliver(
        &self,
        queues: &Queues,
        raw: Vec<aws_sdk_sqs::types::Message>,
    ) -> Vec<SqsDelivery> {
        let received: Vec<Received> = raw
            .into_iter()
            .map(|message| convert(&self.source, queues.fifo, message))
            .collect();
        let sorted = sort_received(received);
        if !sorted.skipped.is_empty() {
            self.metrics
                .without_receipt
                .inc_by(sorted.skipped.len() as u64);
            tracing::warn!(
                count = sorted.skipped.len(),
                ids = ?sorted.skipped,
                "SQS delivered messages without a receipt handle; skipped (they return when their visibility expires)"
            );
        }
        if !sorted.released.is_empty() {
            self.metrics.released.inc_by(sorted.released.len() as u64);
            tracing::info!(
                count = sorted.released.len(),
                "made later messages of their FIFO groups visible again, behind a message that could not be delivered"
            );
            self.release(queues, &sorted.released).await;
        }
        if let Some(lease) = self.lease() {
            self.held.received(&sorted.messages, lease);
        }
        sorted.messages
    }
}
