//! Redis: a stream (consumer group), a reliable list or a pub/sub channel.

use switchboard_api::{QueueAdapter, RedisMode, RedisSource};

use super::{Context, Letters, Loop, Plugin};
use crate::transport::TransportError;
use crate::transport::identity::{body_hash, body_id};
use crate::transport::redis::list::{ListSettings, RedisList};
use crate::transport::redis::pubsub::{PubSubSettings, RedisPubSub};
use crate::transport::redis::reader::{ListReader, PubSubReader, StreamReader};
use crate::transport::redis::stream::{RedisStream, StreamSettings};
use crate::transport::redis::{CONTROL_TIMEOUT, Connection, NamedKey, open, text};
use crate::{WorkerError, env};

impl Plugin for RedisSource {
    fn title(&self) -> &'static str {
        match self.mode {
            RedisMode::Stream => "Redis stream",
            RedisMode::List => "Redis list",
            RedisMode::Pubsub => "Redis pub/sub",
        }
    }

    async fn run<L: Loop>(&self, context: Context<'_>, mut run: L) -> Result<(), WorkerError> {
        let url = env("REDIS_URL")?;
        let dead_letter = context.dead_letter();
        let (claim_idle, batch_size) = (context.claim_idle(), context.batch_size());
        let Context {
            name: adapter,
            consumer,
            store,
            ..
        } = context;
        match self.mode {
            RedisMode::Stream => {
                let stream = self.stream.clone().unwrap_or_default();
                let settings = StreamSettings {
                    adapter,
                    dead_letter_stream: self.dead_letter_key(dead_letter),
                    stream,
                    group: self.group.clone(),
                    consumer,
                    body_field: self.body_field.clone(),
                    start_from: self.start_from,
                    claim_idle,
                    batch_size,
                    dead_letter_retention: dead_letter.retention(),
                };
                let transport = RedisStream::new(settings, &url, store, run.registry())?;
                run.drive(transport, self).await
            }
            RedisMode::List => {
                let list = self.list.clone().unwrap_or_default();
                let settings = ListSettings {
                    adapter,
                    dead_letter_list: self.dead_letter_key(dead_letter),
                    list,
                    consumer,
                    heartbeat_ttl: claim_idle,
                    batch_size,
                    dead_letter_retention: dead_letter.retention(),
                };
                let transport = RedisList::new(settings, &url, run.registry())?;
                run.drive(transport, self).await
            }
            RedisMode::Pubsub => {
                tracing::warn!(
                    "pub/sub mode is AT-MOST-ONCE: messages published while no worker is subscribed, \
                     or in memory when the worker dies, are lost; use stream or list mode for durable work"
                );
                let channel = self.channel.clone().unwrap_or_default();
                let settings = PubSubSettings {
                    adapter,
                    dead_letter_list: self.dead_letter_key(dead_letter),
                    channel,
                    pattern: self.pattern,
                    consumer,
                };
                let transport = RedisPubSub::new(settings, &url, run.registry())?;
                run.drive(transport, self).await
            }
        }
    }

    async fn read_letters<D: Letters>(
        &self,
        adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        match self.mode {
            RedisMode::Stream => {
                let url = env("REDIS_URL")?;
                letters.read(StreamReader::new(adapter, self, &url)?).await
            }
            RedisMode::List => {
                let url = env("REDIS_URL")?;
                letters.read(ListReader::new(adapter, self, &url)?).await
            }
            RedisMode::Pubsub => {
                let url = env("REDIS_URL")?;
                letters.read(PubSubReader::new(adapter, self, &url)?).await
            }
        }
    }

    /// A stream entry (`XADD`: the body in `bodyField`, each header a field beside it; returns
    /// its entry id); a list record (`LPUSH`, as producers push: the body alone, whose hash is
    /// its id and its key); a pub/sub message (`PUBLISH` of the body alone to the channel, or
    /// to the `channel` header's under a pattern). A channel keeps nothing: a message no
    /// subscriber received is an error, as `dlq redrive` of pub/sub letters has it.
    async fn send(
        &self,
        _adapter: &QueueAdapter,
        body: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<String, WorkerError> {
        let mut conn = Connection::new(open(&env("REDIS_URL")?)?, CONTROL_TIMEOUT);
        let body_id = || body_id(&body_hash(body));
        match self.mode {
            RedisMode::Stream => {
                let stream = self.stream.clone().unwrap_or_default();
                let mut add = redis::cmd("XADD");
                add.arg(&stream).arg("*").arg(&self.body_field).arg(body);
                for (name, value) in headers.iter().filter(|(name, _)| *name != self.body_field) {
                    add.arg(name).arg(value);
                }
                let named = NamedKey::new(&stream, "spec.source.redis.stream", "stream");
                let reply = conn.naming(vec![named]).query("XADD", &add).await?;
                Ok(text(&reply).unwrap_or_default())
            }
            RedisMode::List => {
                let list = self.list.clone().unwrap_or_default();
                let mut push = redis::cmd("LPUSH");
                push.arg(&list).arg(body);
                let named = NamedKey::new(&list, "spec.source.redis.list", "list");
                conn.naming(vec![named]).query("LPUSH", &push).await?;
                Ok(body_id())
            }
            RedisMode::Pubsub => {
                let channel = publish_channel(self, headers)?;
                let mut publish = redis::cmd("PUBLISH");
                publish.arg(&channel).arg(body);
                match conn.query("PUBLISH", &publish).await? {
                    redis::Value::Int(receivers) if receivers > 0 => Ok(body_id()),
                    _ => Err(TransportError::protocol(format!(
                        "no subscriber on channel {channel} received the message (a channel \
                         keeps nothing): start the worker and send it again once it is subscribed"
                    ))
                    .into()),
                }
            }
        }
    }
}

/// The channel a pub/sub message goes to: the adapter's, or under a pattern the `channel`
/// header's (every pub/sub letter carries the channel it came from).
fn publish_channel(
    redis: &RedisSource,
    headers: &[(String, Vec<u8>)],
) -> Result<String, TransportError> {
    let channel = redis.channel.clone().unwrap_or_default();
    if !redis.pattern {
        return Ok(channel);
    }
    super::header_text(headers, "channel").ok_or_else(|| {
        TransportError::protocol(format!(
            "spec.source.redis.channel {channel} is a pattern: say which channel to \
                     publish on with a `channel` attribute (--attr channel=NAME)"
        ))
    })
}
