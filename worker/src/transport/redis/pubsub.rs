//! Redis pub/sub: **at-most-once**. Messages published while the worker is subscribed are
//! stored in batches (flushed at `batchSize` or after a short linger); there is no
//! acknowledgement, so a message published while no worker is subscribed, or held in memory when
//! the worker dies, is lost. After a lost connection the worker re-subscribes with backoff.

use std::time::Duration;

use futures::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use redis::aio::PubSub;
use switchboard_store::Dedup;
use tokio::time::{Instant, timeout, timeout_at};

use super::{
    BLOCK, CONTROL_TIMEOUT, Connection, NamedKey, Origin, dead_letter_record, integer, open,
    protocol, redis_error, refused_by_dead_letter_key,
};
use crate::health::now_ms;
use crate::metrics::broker_reconnects;
use crate::transport::identity::{body_hash, body_id, idempotency_key};
use crate::transport::{
    Acked, DeadLetter, Message, QueueHealth, QueueProbe, Transport, TransportError,
};

/// Published messages have nothing to acknowledge.
type Published = Message<()>;

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
    /// Subscriptions re-established after the connection was lost.
    reconnects: Counter,
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
        registry: &mut Registry,
    ) -> Result<Self, TransportError> {
        let client = open(redis_url)?;
        Ok(Self {
            reconnects: broker_reconnects(registry, &settings.adapter, None),
            source: format!("redis:{}", settings.adapter),
            control: Connection::new(client.clone(), CONTROL_TIMEOUT).naming(vec![NamedKey::new(
                &settings.dead_letter_list,
                "spec.delivery.deadLetter.list",
                "list",
            )]),
            client,
            settings,
            subscription: None,
            subscribed_before: false,
        })
    }

    async fn subscribe(&mut self) -> Result<(), TransportError> {
        if self.subscription.is_some() {
            return Ok(());
        }
        let mut pubsub = timeout(CONTROL_TIMEOUT, self.client.get_async_pubsub())
            .await
            .map_err(|_| protocol("SUBSCRIBE", "timed out connecting"))?
            .map_err(redis_error("SUBSCRIBE"))?;
        let channel = self.settings.channel.clone();
        let subscribed = if self.settings.pattern {
            pubsub.psubscribe(&channel).await
        } else {
            pubsub.subscribe(&channel).await
        };
        subscribed.map_err(redis_error("SUBSCRIBE"))?;
        if self.subscribed_before {
            self.reconnects.inc();
            tracing::info!(channel = %channel, "re-subscribed after the connection was lost");
        } else {
            tracing::info!(channel = %channel, pattern = self.settings.pattern, "subscribed");
        }
        self.subscribed_before = true;
        self.subscription = Some(pubsub);
        Ok(())
    }

    fn to_message(&self, msg: &redis::Msg) -> Published {
        let body = msg.get_payload_bytes().to_vec();
        let external_id = body_id(&body_hash(&body));
        let mut headers = vec![(
            "channel".to_owned(),
            msg.get_channel_name().as_bytes().to_vec(),
        )];
        if let Ok(pattern) = msg.get_pattern::<String>() {
            headers.push(("pattern".to_owned(), pattern.into_bytes()));
        }
        Message {
            receipt: (),
            idempotency_key: idempotency_key(&self.source, &external_id),
            external_id,
            body,
            headers,
            delivery_count: 1,
            enqueued_at_ms: Some(now_ms()),
            position: None,
            undecodable: None,
        }
    }

    fn lost(&mut self) -> TransportError {
        self.subscription = None;
        protocol("SUBSCRIBE", "connection lost")
    }
}

/// A channel has no queue to report on; its dead-letter list's length is read.
#[derive(Debug)]
pub struct NoQueue {
    conn: Connection,
    dead_letter_list: String,
}

impl QueueProbe for NoQueue {
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let mut llen = redis::cmd("LLEN");
        llen.arg(&self.dead_letter_list);
        Ok(QueueHealth {
            dead_letters: integer(&self.conn.query("LLEN", &llen).await?),
            ..QueueHealth::default()
        })
    }
}

impl Transport for RedisPubSub {
    type Receipt = ();
    type Probe = NoQueue;

    fn source(&self) -> &str {
        &self.source
    }

    fn endpoint(&self) -> String {
        self.control.endpoint()
    }

    fn dedup(&self) -> Dedup {
        Dedup::BodyHash
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        self.subscribe().await
    }

    async fn receive(&mut self, max: usize, block: bool) -> Result<Vec<Published>, TransportError> {
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

    async fn ack(&mut self, _messages: &[&Published]) -> Result<Acked, TransportError> {
        Ok(Acked::all())
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, ()>],
    ) -> Result<(), TransportError> {
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
        self.control
            .query("LPUSH", &cmd)
            .await
            .map(drop)
            .map_err(|err| refused_by_dead_letter_key(err, letters.len()))
    }

    async fn maintain(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    fn maintenance_interval(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn probe(&self) -> NoQueue {
        NoQueue {
            conn: Connection::new(self.client.clone(), CONTROL_TIMEOUT),
            dead_letter_list: self.settings.dead_letter_list.clone(),
        }
    }
}
