//! Queue health: `GetQueueAttributes` depth figures of the source and dead-letter queues on
//! the probe's own clone of the client, and the age of the oldest message this worker holds.

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::QueueAttributeName;

use super::Sqs;
use super::classify::{self, Addressed};
use super::in_flight::InFlight;
use super::queues::queue_url_of;
use crate::health::now_ms;
use crate::transport::{QueueHealth, QueueProbe, TransportError};

/// Reads the queue's depth on its own clone of the client.
#[derive(Debug, Clone)]
pub struct SqsProbe {
    client: Client,
    /// The queue's URL (`None` until `prepare` resolved a `queueName`).
    queue_url: Option<String>,
    queue_name: Option<String>,
    /// The dead-letter queue's URL, once `prepare` resolved it.
    dead_letter_url: Option<String>,
    errors: classify::Settings,
    held: InFlight,
}

impl Sqs {
    /// The probe of this transport's queues, with what `prepare` learnt of them so far.
    pub(super) fn new_probe(&self) -> SqsProbe {
        SqsProbe {
            client: self.client.clone(),
            queue_url: self
                .queues
                .as_ref()
                .map(|q| q.url.clone())
                .or_else(|| self.settings.spec.queue_url.clone()),
            queue_name: self.settings.spec.queue_name.clone(),
            dead_letter_url: self.queues.as_ref().map(|q| q.dead_letter_url.clone()),
            errors: self.errors.clone(),
            held: self.held.clone(),
        }
    }
}

impl SqsProbe {
    /// The numeric attributes `names` of queue `url`.
    async fn attributes(
        &self,
        url: &str,
        names: &[QueueAttributeName],
        addressed: Addressed,
    ) -> Result<std::collections::HashMap<QueueAttributeName, u64>, TransportError> {
        let output = self
            .client
            .get_queue_attributes()
            .queue_url(url)
            .set_attribute_names(Some(names.to_vec()))
            .send()
            .await
            .map_err(|err| self.errors.error("GetQueueAttributes", addressed, err))?;
        Ok(output
            .attributes()
            .into_iter()
            .flatten()
            .filter_map(|(name, value)| Some((name.clone(), value.parse().ok()?)))
            .collect())
    }
}

impl QueueProbe for SqsProbe {
    /// Backlog = `ApproximateNumberOfMessages` + `…Delayed`, pending =
    /// `ApproximateNumberOfMessagesNotVisible` (both queue-wide). The oldest pending age is
    /// that of the oldest message *this worker* holds (received, visibility not expired, not
    /// yet deleted), from its `SentTimestamp`: SQS reports the queue-wide figure only as the
    /// CloudWatch metric `ApproximateAgeOfOldestMessage`, which the SQS API (and SQS-compatible
    /// servers) do not offer.
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let url = match (&self.queue_url, &self.queue_name) {
            (Some(url), _) => url.clone(),
            (None, Some(name)) => {
                let url = queue_url_of(&self.client, &self.errors, name).await?;
                self.queue_url = Some(url.clone());
                url
            }
            (None, None) => return Ok(QueueHealth::default()),
        };
        use QueueAttributeName::{
            ApproximateNumberOfMessages as Visible, ApproximateNumberOfMessagesDelayed as Delayed,
            ApproximateNumberOfMessagesNotVisible as NotVisible,
        };
        let numbers = self
            .attributes(&url, &[Visible, NotVisible, Delayed], Addressed::Source)
            .await?;
        // The dead-letter queue's depth is for the gauge only: failing to read it is not an
        // outage of the source.
        let dead_letters = match &self.dead_letter_url {
            Some(dlq) => self
                .attributes(dlq, &[Visible, NotVisible], Addressed::DeadLetter)
                .await
                .ok()
                .map(|numbers| numbers.values().sum()),
            None => None,
        };
        Ok(QueueHealth {
            backlog: numbers
                .get(&Visible)
                .map(|v| v + numbers.get(&Delayed).unwrap_or(&0)),
            pending: numbers.get(&NotVisible).copied(),
            oldest_pending_age: Some(self.held.oldest_age(now_ms())),
            dead_letters,
            oldest_dead_letter_age: None,
        })
    }
}
