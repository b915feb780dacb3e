//! Redis: a stream (consumer group), a reliable list or a pub/sub channel.

use switchboard_api::{QueueAdapter, RedisMode, RedisSource};

use super::{Context, Letters, Loop, Plugin};
use crate::transport::redis::list::{ListSettings, RedisList};
use crate::transport::redis::pubsub::{PubSubSettings, RedisPubSub};
use crate::transport::redis::reader::{ListReader, PubSubReader, StreamReader};
use crate::transport::redis::stream::{RedisStream, StreamSettings};
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
}
