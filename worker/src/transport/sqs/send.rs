//! `switchboard-worker send` for SQS sources: one `SendMessage` to the adapter's queue, with
//! the client, the credentials and the checks of the transport itself.

use super::Sqs;
use super::classify::Addressed;
use super::letter_queue::attribute;
use super::reader::MAX_ATTRIBUTES;
use crate::transport::TransportError;

/// The message group of a message sent to a FIFO queue without a `MessageGroupId` attribute.
const DEFAULT_GROUP: &str = "send";

impl Sqs {
    /// Sends `body` to the source queue with `attributes` as message attributes; returns its
    /// MessageId. On a FIFO queue the `MessageGroupId` attribute (default `send`) is the
    /// message group, not an attribute, and `chunk_id` the deduplication id.
    pub async fn send(
        &self,
        body: &[u8],
        attributes: &[(String, String)],
    ) -> Result<String, TransportError> {
        let queues = self.queues()?;
        let body = std::str::from_utf8(body).map_err(|err| {
            TransportError::protocol(format!("an SQS message body is text: not UTF-8 ({err})"))
        })?;
        let group = attributes
            .iter()
            .find(|(name, _)| name == "MessageGroupId")
            .map_or(DEFAULT_GROUP, |(_, group)| group.as_str());
        let kept: Vec<&(String, String)> = attributes
            .iter()
            .filter(|(name, _)| !(queues.fifo && name == "MessageGroupId"))
            .collect();
        if kept.len() > MAX_ATTRIBUTES {
            return Err(TransportError::protocol(format!(
                "{} message attributes: SQS allows {MAX_ATTRIBUTES}",
                kept.len()
            )));
        }
        let mut send = self
            .client
            .send_message()
            .queue_url(&queues.url)
            .message_body(body);
        for (name, value) in &kept {
            send = send.message_attributes(name, attribute(value.as_bytes())?);
        }
        if queues.fifo {
            let chunk = kept
                .iter()
                .find(|(name, _)| name == "chunk_id")
                .map(|(_, id)| id.clone());
            send = send
                .message_group_id(group)
                .set_message_deduplication_id(chunk);
        }
        let sent = send
            .send()
            .await
            .map_err(|err| self.errors.error("SendMessage", Addressed::Source, err))?;
        Ok(sent.message_id.unwrap_or_default())
    }
}
