//! The calls of the SQS dead-letter reader through the AWS API ([`LetterQueue`] for [`Sqs`]):
//! `ReceiveMessage`, `ChangeMessageVisibility`, `DeleteMessage` on the dead-letter queue,
//! `SendMessage` to the source (to a FIFO source with a `MessageDeduplicationId` made from the
//! key and the letter's own id, [`deduplication_id`]), `GetQueueAttributes` to count.

use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{
    Message as SqsMessage, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use sha2::{Digest, Sha256};

use super::Sqs;
use super::classify::Addressed;
use super::reader::{LetterQueue, Received};
use crate::transport::reader::StoredLetter;
use crate::transport::{Transport, TransportError};

impl Sqs {
    fn dead_letter_url(&self) -> Result<String, TransportError> {
        Ok(self.queues()?.dead_letter_url.clone())
    }

    fn source_url(&self) -> &str {
        self.queues.as_ref().map_or("?", |q| q.url.as_str())
    }
}

/// A received message as the reader takes it; `None` without a receipt handle (it comes back
/// when its visibility expires).
fn received(message: SqsMessage) -> Option<Received> {
    let handle = message.receipt_handle?;
    let sent_ms = message
        .attributes
        .unwrap_or_default()
        .get(&MessageSystemAttributeName::SentTimestamp)
        .and_then(|ms| ms.parse::<u64>().ok());
    let attributes = message
        .message_attributes
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(name, value)| {
            let bytes = match (value.string_value, value.binary_value) {
                (Some(text), _) => text.into_bytes(),
                (None, Some(blob)) => blob.into_inner(),
                (None, None) => return None,
            };
            Some((name, bytes))
        })
        .collect();
    Some(Received {
        id: message.message_id.unwrap_or_default(),
        handle,
        body: message.body.unwrap_or_default().into_bytes(),
        attributes,
        sent_ms,
    })
}

impl LetterQueue for Sqs {
    fn destination(&self) -> String {
        format!(
            "SQS queue {}",
            self.queues
                .as_ref()
                .map_or("?", |q| q.dead_letter_url.as_str())
        )
    }

    fn source(&self) -> String {
        format!("SQS queue {}", self.source_url())
    }

    fn key_scope(&self) -> &str {
        Transport::source(self)
    }

    fn origin(&self, written: &str) -> String {
        format!("SQS queue {written}")
    }

    fn caveats(&self) -> Vec<String> {
        let fifo = self.queues.as_ref().is_some_and(|q| q.fifo);
        vec![if fifo {
            "the source is a FIFO queue: redriven letters (oldest first) join their MessageGroupId \
             behind what was sent since they dead-lettered"
                .to_owned()
        } else {
            "a standard SQS queue keeps no order: redriven letters are delivered like new messages"
                .to_owned()
        }]
    }

    async fn count(&self) -> Result<Option<u64>, TransportError> {
        let output = self
            .client
            .get_queue_attributes()
            .queue_url(self.dead_letter_url()?)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|err| {
                self.errors
                    .error("GetQueueAttributes", Addressed::DeadLetter, err)
            })?;
        let attributes = output.attributes.unwrap_or_default();
        let number = |name| attributes.get(&name).and_then(|v| v.parse::<u64>().ok());
        Ok(
            number(QueueAttributeName::ApproximateNumberOfMessages).map(|visible| {
                visible
                    + number(QueueAttributeName::ApproximateNumberOfMessagesNotVisible).unwrap_or(0)
            }),
        )
    }

    async fn receive(&self, max: usize, hold: i32) -> Result<Vec<Received>, TransportError> {
        let output = self
            .client
            .receive_message()
            .queue_url(self.dead_letter_url()?)
            .max_number_of_messages(i32::try_from(max).unwrap_or(10))
            .visibility_timeout(hold)
            .wait_time_seconds(0)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|err| {
                self.errors
                    .error("ReceiveMessage", Addressed::DeadLetter, err)
            })?;
        Ok(output
            .messages
            .unwrap_or_default()
            .into_iter()
            .filter_map(received)
            .collect())
    }

    async fn visibility(&self, handle: &str, seconds: i32) -> Result<(), TransportError> {
        self.client
            .change_message_visibility()
            .queue_url(self.dead_letter_url()?)
            .receipt_handle(handle)
            .visibility_timeout(seconds)
            .send()
            .await
            .map_err(|err| {
                self.errors
                    .error("ChangeMessageVisibility", Addressed::DeadLetter, err)
            })?;
        Ok(())
    }

    async fn delete(&self, handle: &str) -> Result<(), TransportError> {
        self.client
            .delete_message()
            .queue_url(self.dead_letter_url()?)
            .receipt_handle(handle)
            .send()
            .await
            .map_err(|err| {
                self.errors
                    .error("DeleteMessage", Addressed::DeadLetter, err)
            })?;
        Ok(())
    }

    async fn send(
        &self,
        letter: &StoredLetter,
        attributes: Vec<(String, Vec<u8>)>,
        key: &str,
    ) -> Result<(), TransportError> {
        let queues = self.queues()?;
        let mut send = self
            .client
            .send_message()
            .queue_url(&queues.url)
            .message_body(String::from_utf8_lossy(&letter.body));
        for (name, value) in attributes {
            send = send.message_attributes(name, attribute(&value)?);
        }
        if queues.fifo {
            let group = letter
                .headers
                .iter()
                .find(|(name, _)| name == "MessageGroupId")
                .map_or_else(
                    || "redriven".to_owned(),
                    |(_, group)| String::from_utf8_lossy(group).into_owned(),
                );
            send = send
                .message_group_id(group)
                .message_deduplication_id(deduplication_id(key, &letter.id));
        }
        send.send()
            .await
            .map_err(|err| self.errors.error("SendMessage", Addressed::Source, err))?;
        Ok(())
    }
}

/// The `MessageDeduplicationId` of a redriven copy of the dead letter `letter_id` sent to a
/// FIFO source with the key `key`: new for SQS each time the letter is dead-lettered again (a
/// letter dead-lettered again is a new message with a new id, so its next redrive is not
/// dropped as a duplicate of the last one within SQS's five-minute deduplication interval),
/// the same when the same dead letter is redriven again after a crash between its send and its
/// delete (SQS drops that second copy within the interval; after it, the copy carries the same
/// idempotency key and makes no second todo).
fn deduplication_id(key: &str, letter_id: &str) -> String {
    let mut digest = Sha256::new();
    digest.update(key.as_bytes());
    digest.update(b"\n");
    digest.update(letter_id.as_bytes());
    hex::encode(digest.finalize())
}

/// A message attribute: `String` when `value` is UTF-8, `Binary` otherwise.
pub(super) fn attribute(value: &[u8]) -> Result<MessageAttributeValue, TransportError> {
    let built = match std::str::from_utf8(value) {
        Ok(text) => MessageAttributeValue::builder()
            .data_type("String")
            .string_value(text)
            .build(),
        Err(_) => MessageAttributeValue::builder()
            .data_type("Binary")
            .binary_value(Blob::new(value))
            .build(),
    };
    built
        .map_err(|err| TransportError::protocol(format!("cannot build a message attribute: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_dead_lettering_of_a_letter_redrives_as_a_new_fifo_message() {
        let key = "sqs:shop/orders.fifo:m-1";
        let first = deduplication_id(key, "dlq-1");
        assert_eq!(first, deduplication_id(key, "dlq-1"), "a rerun: the same");
        assert_ne!(
            first,
            deduplication_id(key, "dlq-2"),
            "dead-lettered again: new"
        );
        assert_ne!(first, deduplication_id("sqs:shop/orders.fifo:m-2", "dlq-1"));
        assert!(first.len() <= 128, "SQS's limit");
    }
}
