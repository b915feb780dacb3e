//! Redis pub/sub: **at-most-once**. Messages published while the worker is subscribed are
//! stored in batches (flushed at `batchSize` or after a short linger); there is no
//! acknowledgement, so a message published while no worker is subscribed, or held in memory when
//! the worker dies, is lost. After a lost connection the worker re-subscribes with backoff.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use redis::aio::PubSub;
use switchboard_store::Dedup;
use tokio::time::{Instant, timeout, timeout_at};

use super::redis_conn::{
    BLOCK, CONTROL_TIMEOUT, Connection, Origin, body_hash, dead_letter_record, open, redis_error,
};
use super::{DeadLetter, Message, QueueHealth, Transport, TransportError};
use crate::health::now_ms;
use crate::metrics::Metrics;

/// How long a batch waits for more messages once the first has arrived.
const LINGER: Duration = Duration::from_millis(50);

/// Everything the pub/sub transport needs to know.
#[derive(Debug, Clone)]
pub struct PubSubSettings {
    /// `namespace/name` of the adapter.
    pub adapter: String,
    pub channel: String,
    /// `channel` is a glob pattern (PSUBSCRIBE).
    pub pattern: bool,
    pub consumer: String,
    pub dead_letter_list: String,
}

/// The Redis pub/sub transport.
pub struct RedisPubSub {
    settings: PubSubSettings,
    source: String,
    client: redis::Client,
    subscription: Option<PubSub>,
    /// Whether a subscription existed before: the next one is a reconnect.
    subscribed_before: bool,
    control: Connection,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for RedisPubSub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPubSub")
            .field("settings", &self.settings)
            .field("subscribed", &self.subscription.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisPubSub {
    pub fn new(
        settings: PubSubSettings,
        redis_url: &str,
        metrics: Arc<Metrics>,
    ) -> Result<Self, TransportError> {
        let client = open(redis_url)?;
        Ok(Self {
            source: format!("redis:{}", settings.adapter),
            control: Connection::new(client.clone(), CONTROL_TIMEOUT),
            client,
            settings,
            subscription: None,
            subscribed_before: false,
            metrics,
        })
    }

    async fn subscribe(&mut self) -> Result<(), TransportError> {
        if self.subscription.is_some() {
            return Ok(());
        }
        let mut pubsub = timeout(CONTROL_TIMEOUT, self.client.get_async_pubsub())
            .await
            .map_err(|_| super::redis_conn::protocol("SUBSCRIBE", "timed out connecting"))?
            .map_err(redis_error("SUBSCRIBE"))?;
        let channel = self.settings.channel.clone();
        let subscribed = if self.settings.pattern {
            pubsub.psubscribe(&channel).await
        } else {
            pubsub.subscribe(&channel).await
        };
        subscribed.map_err(redis_error("SUBSCRIBE"))?;
        if self.subscribed_before {
            self.metrics.reconnects.inc();
            tracing::info!(channel = %channel, "re-subscribed after the connection was lost");
        } else {
            tracing::info!(channel = %channel, pattern = self.settings.pattern, "subscribed");
        }
        self.subscribed_before = true;
        self.subscription = Some(pubsub);
        Ok(())
    }

    fn to_message(&self, msg: &redis::Msg) -> Message {
        let body = msg.get_payload_bytes().to_vec();
        let hash = body_hash(&body);
        let mut headers = vec![(
            "channel".to_owned(),
            msg.get_channel_name().as_bytes().to_vec(),
        )];
        if let Ok(pattern) = msg.get_pattern::<String>() {
            headers.push(("pattern".to_owned(), pattern.into_bytes()));
        }
        Message {
            receipt: hash.clone(),
            external_id: format!("sha256:{hash}"),
            idempotency_key: format!("{}:sha256:{hash}", self.source),
            body,
            headers,
            delivery_count: 1,
            enqueued_at_ms: Some(now_ms()),
            position: None,
        }
    }

    fn lost(&mut self) -> TransportError {
        self.subscription = None;
        super::redis_conn::protocol("SUBSCRIBE", "connection lost")
    }
}

impl Transport for RedisPubSub {
    fn source(&self) -> &str {
        &self.source
    }

    fn dedup(&self) -> Dedup {
        Dedup::BodyHash
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        self.subscribe().await
    }

    async fn receive(&mut self, max: usize, block: bool) -> Result<Vec<Message>, TransportError> {
        self.subscribe().await?;
        let Some(subscription) = self.subscription.as_mut() else {
            return Ok(Vec::new());
        };
        let mut stream = subscription.on_message();
        let wait = if block { BLOCK } else { Duration::ZERO };
        let first = match timeout(wait, stream.next()).await {
            Err(_) => return Ok(Vec::new()),
            Ok(None) => {
                drop(stream);
                return Err(self.lost());
            }
            Ok(Some(msg)) => msg,
        };
        let mut received = vec![first];
        let deadline = Instant::now() + LINGER;
        let mut connection_lost = false;
        while received.len() < max {
            match timeout_at(deadline, stream.next()).await {
                Ok(Some(msg)) => received.push(msg),
                Ok(None) => {
                    connection_lost = true;
                    break;
                }
                Err(_) => break,
            }
        }
        drop(stream);
        if connection_lost {
            // Keep what arrived; the next receive re-subscribes.
            self.subscription = None;
        }
        Ok(received.iter().map(|msg| self.to_message(msg)).collect())
    }

    async fn ack(&mut self, _messages: &[&Message]) -> Result<(), TransportError> {
        Ok(())
    }

    async fn dead_letter(&mut self, letters: &[DeadLetter<'_>]) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        let origin = Origin {
            kind: "channel",
            name: &self.settings.channel,
            adapter: &self.settings.adapter,
            consumer: &self.settings.consumer,
        };
        let mut cmd = redis::cmd("LPUSH");
        cmd.arg(&self.settings.dead_letter_list);
        for letter in letters {
            cmd.arg(dead_letter_record(letter, origin));
        }
        self.control.query("LPUSH", &cmd).await.map(drop)
    }

    async fn maintain(&mut self) -> Result<QueueHealth, TransportError> {
        Ok(QueueHealth::default())
    }

    fn maintenance_interval(&self) -> Duration {
        Duration::from_secs(30)
    }
}
