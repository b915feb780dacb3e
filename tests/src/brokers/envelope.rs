//! What the envelope suite (tests/tests/envelope.rs) needs of a broker beyond
//! [`BrokerFixture`]: the error each dead letter carries, and, where the broker has headers
//! (stream fields, message attributes, Kafka/NATS/AMQP headers), messages with headers.

use anyhow::{Context, Result};
use aws_sdk_sqs::types::MessageAttributeValue;

use super::kafka::Record;
use super::rabbitmq::text;
use super::{
    AmqpBroker, BrokerFixture, KafkaBroker, NatsBroker, RedisListBroker, RedisStreamBroker,
    SqsBroker,
};
use crate::Fixture;
use crate::brokers::sqs::sqs_error;

/// A broker whose dead letters the envelope suite reads.
#[allow(async_fn_in_trait)]
pub trait EnvelopeBroker: BrokerFixture {
    /// The error each dead letter of `name` carries, in the order of
    /// [`BrokerFixture::dead_letters`].
    async fn dead_letter_errors(&self, fx: &Fixture, name: &str) -> Result<Vec<String>>;
}

/// A broker whose messages carry headers beside their body.
#[allow(async_fn_in_trait)]
pub trait HeaderBroker: EnvelopeBroker {
    /// Adds one message with `body` and `headers`, as the broker carries headers.
    async fn produce_with_headers(
        &self,
        fx: &Fixture,
        name: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<()>;
}

impl EnvelopeBroker for RedisStreamBroker {
    async fn dead_letter_errors(&self, fx: &Fixture, name: &str) -> Result<Vec<String>> {
        fx.stream_entries(&format!("{name}.dlq"))?
            .iter()
            .map(|letter| crate::field(letter, "last_error"))
            .collect()
    }
}

impl HeaderBroker for RedisStreamBroker {
    /// An entry whose `body` field is the body and whose other fields are the headers.
    async fn produce_with_headers(
        &self,
        fx: &Fixture,
        name: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let mut conn = fx.redis.connection()?;
        let mut cmd = redis::cmd("XADD");
        cmd.arg(name).arg("*").arg("body").arg(body);
        for (field, value) in headers {
            cmd.arg(field).arg(value);
        }
        cmd.query::<String>(&mut conn)?;
        Ok(())
    }
}

impl EnvelopeBroker for RedisListBroker {
    async fn dead_letter_errors(&self, fx: &Fixture, name: &str) -> Result<Vec<String>> {
        let mut conn = fx.redis.connection()?;
        let records: Vec<String> = redis::cmd("LRANGE")
            .arg(format!("{name}.dlq"))
            .arg(0)
            .arg(-1)
            .query(&mut conn)?;
        records
            .iter()
            .map(|record| {
                let record: serde_json::Value = serde_json::from_str(record)?;
                record["last_error"]
                    .as_str()
                    .map(str::to_owned)
                    .with_context(|| format!("dead letter without last_error: {record}"))
            })
            .collect()
    }
}

impl EnvelopeBroker for SqsBroker {
    async fn dead_letter_errors(&self, _fx: &Fixture, name: &str) -> Result<Vec<String>> {
        Ok(self
            .dead_letter_messages(name)
            .await?
            .iter()
            .map(|letter| SqsBroker::attribute(letter, "x-dlq-error"))
            .collect())
    }
}

impl HeaderBroker for SqsBroker {
    /// A message whose headers are `String` message attributes.
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let url = self.url(name);
        let mut send = self
            .server
            .client()
            .send_message()
            .queue_url(&url)
            .message_body(std::str::from_utf8(body).context("an SQS body must be UTF-8")?);
        for (attribute, value) in headers {
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(*value)
                .build()?;
            send = send.message_attributes(*attribute, value);
        }
        send.send()
            .await
            .map_err(|err| sqs_error(&format!("SendMessage {url}"), err))?;
        Ok(())
    }
}

/// The second item of each pair: a header's text without its dead letter's body.
fn values(letters: Vec<(Vec<u8>, String)>) -> Vec<String> {
    letters.into_iter().map(|(_, value)| value).collect()
}

impl EnvelopeBroker for NatsBroker {
    async fn dead_letter_errors(&self, _fx: &Fixture, name: &str) -> Result<Vec<String>> {
        Ok(values(
            self.dead_letters_with(name, "Switchboard-Error").await?,
        ))
    }
}

impl HeaderBroker for NatsBroker {
    /// A message whose headers are NATS headers, published to the queue's subject.
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let mut map = async_nats::HeaderMap::new();
        for (header, value) in headers {
            map.insert(*header, *value);
        }
        let subject = Self::subject(name);
        self.server
            .jetstream()
            .publish_with_headers(subject.clone(), map, body.to_vec().into())
            .await
            .with_context(|| format!("publishing to {subject}"))?
            .await
            .with_context(|| format!("PubAck for {subject}"))?;
        Ok(())
    }
}

impl<const CLASSIC: bool> EnvelopeBroker for AmqpBroker<CLASSIC> {
    async fn dead_letter_errors(&self, _fx: &Fixture, name: &str) -> Result<Vec<String>> {
        Ok(values(
            self.dead_letters_with(name, "x-switchboard-error").await?,
        ))
    }
}

impl<const CLASSIC: bool> HeaderBroker for AmqpBroker<CLASSIC> {
    /// A message whose headers are string entries of its `headers` table.
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let mut table = lapin::types::FieldTable::default();
        for (header, value) in headers {
            table.insert((*header).into(), text(value));
        }
        let properties = Self::properties().with_headers(table);
        self.server
            .publish(name, [(body.to_vec(), properties)])
            .await
    }
}

impl EnvelopeBroker for KafkaBroker {
    async fn dead_letter_errors(&self, _fx: &Fixture, name: &str) -> Result<Vec<String>> {
        Ok(values(self.dead_letters_with(name, "x-dlq-error").await?))
    }
}

impl HeaderBroker for KafkaBroker {
    /// A record without a key whose headers are record headers.
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let record = Record {
            key: None,
            value: Some(body.to_vec()),
            headers: headers
                .iter()
                .map(|(header, value)| ((*header).to_owned(), Some(value.as_bytes().to_vec())))
                .collect(),
        };
        self.server.produce_records(name, vec![record]).await
    }
}
