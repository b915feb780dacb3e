//! What the envelope suite (tests/tests/envelope.rs) needs of a broker beyond
//! [`BrokerFixture`]: the error each dead letter carries.

use anyhow::{Context, Result};

use super::{
    AmqpBroker, BrokerFixture, KafkaBroker, NatsBroker, RedisListBroker, RedisStreamBroker,
    SqsBroker,
};
use crate::Fixture;

/// A broker whose dead letters the envelope suite reads.
#[allow(async_fn_in_trait)]
pub trait EnvelopeBroker: BrokerFixture {
    /// The error each dead letter of `name` carries, in the order of
    /// [`BrokerFixture::dead_letters`].
    async fn dead_letter_errors(&self, fx: &Fixture, name: &str) -> Result<Vec<String>>;
}

impl EnvelopeBroker for RedisStreamBroker {
    async fn dead_letter_errors(&self, fx: &Fixture, name: &str) -> Result<Vec<String>> {
        fx.stream_entries(&format!("{name}.dlq"))?
            .iter()
            .map(|letter| crate::field(letter, "last_error"))
            .collect()
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

impl<const CLASSIC: bool> EnvelopeBroker for AmqpBroker<CLASSIC> {
    async fn dead_letter_errors(&self, _fx: &Fixture, name: &str) -> Result<Vec<String>> {
        Ok(values(
            self.dead_letters_with(name, "x-switchboard-error").await?,
        ))
    }
}

impl EnvelopeBroker for KafkaBroker {
    async fn dead_letter_errors(&self, _fx: &Fixture, name: &str) -> Result<Vec<String>> {
        Ok(values(self.dead_letters_with(name, "x-dlq-error").await?))
    }
}
