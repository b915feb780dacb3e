//! The consumer's session: its connection and channel (QoS, `basic.consume`), opened when
//! there is none, dropped when it fails, subscribed again on a new channel after a long idle
//! spell. Each session (and each resubscription) is a new channel generation.

use std::collections::BTreeMap;
use std::time::Instant;

use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};

use super::classify::Addressed;
use super::connection::{call, connect, open_channel};
use super::{Amqp, CALL_TIMEOUT, IDLE_RESUBSCRIBE, delivery_limit};
use crate::transport::{HELD, TransportError};

/// The consumer's connection and channel.
pub struct Session {
    pub generation: u64,
    pub connection: Connection,
    pub consume: Channel,
    pub consumer: Consumer,
    /// Delivery tag → arrival (Unix ms) of every delivery not acknowledged yet.
    pub outstanding: BTreeMap<u64, u64>,
    /// When the consumer last delivered (or was subscribed).
    pub last_delivery: Instant,
}

impl Session {
    fn alive(&self) -> bool {
        self.connection.status().connected() && self.consume.status().connected()
    }
}

impl Amqp {
    /// Opens a session: connection, declarations, the delivery-limit check, QoS and consumer.
    async fn open_session(&mut self) -> Result<(), TransportError> {
        let names = &self.names;
        let connection = connect(names, &self.url, &self.settings.consumer).await?;
        self.declare_queues(&connection).await?;
        delivery_limit::check(
            names,
            &connection,
            &self.settings.spec.queue,
            self.settings.max_deliveries,
        )
        .await?;
        let (consume, consumer) = self.subscribe(&connection).await?;
        self.generations += 1;
        self.metrics.session_opened();
        if self.generations == 1 {
            tracing::info!(
                queue = %self.settings.spec.queue,
                prefetch = self.prefetch(),
                dead_letters = %self.names.dead_letter,
                "RabbitMQ queue ready"
            );
        }
        self.buffer.clear();
        self.session = Some(Session {
            generation: self.generations,
            connection,
            consume,
            consumer,
            outstanding: BTreeMap::new(),
            last_delivery: Instant::now(),
        });
        self.held.record(&BTreeMap::new());
        Ok(())
    }

    /// What the pipeline holds at most: its batches in flight and the one being received. A
    /// prefetch of one batch would make every batch wait for the previous one's ack.
    fn prefetch(&self) -> u16 {
        u16::try_from(self.settings.batch_size.max(1) * (HELD + 1)).unwrap_or(u16::MAX)
    }

    /// A channel of `connection` with QoS and a consumer of the queue.
    async fn subscribe(
        &self,
        connection: &Connection,
    ) -> Result<(Channel, Consumer), TransportError> {
        let names = &self.names;
        let consume = open_channel(names, connection).await?;
        call(
            names,
            "basic.qos",
            Addressed::Connection,
            consume.basic_qos(self.prefetch(), BasicQosOptions::default()),
        )
        .await?;
        let consumer = call(
            names,
            "basic.consume",
            Addressed::Queue,
            consume.basic_consume(
                self.settings.spec.queue.as_str().into(),
                format!("switchboard-{}", self.settings.consumer).into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        Ok((consume, consumer))
    }

    /// Subscribes again on a new channel of the session's connection when the session has
    /// held nothing and received nothing for [`IDLE_RESUBSCRIBE`]. A consumer can be lost
    /// without a word: RabbitMQ 3.10 does not cancel a quorum queue's consumer when the queue is
    /// deleted and declared again, and then checks the new queue's messages out to the old
    /// consumer, which never delivers them. Closing its channel puts them back.
    pub(super) async fn resubscribe_if_idle(&mut self) -> Result<(), TransportError> {
        let Some(session) = self.session.as_ref() else {
            return Ok(());
        };
        if !session.outstanding.is_empty()
            || !self.buffer.is_empty()
            || session.last_delivery.elapsed() < IDLE_RESUBSCRIBE
        {
            return Ok(());
        }
        let subscribed = self.subscribe(&session.connection).await;
        let Some(session) = self.session.as_mut() else {
            return Ok(());
        };
        let (consume, consumer) = match subscribed {
            Ok(subscribed) => subscribed,
            Err(err) => {
                self.lose_session();
                return Err(err);
            }
        };
        tracing::debug!("idle: subscribed again on a new channel");
        let old = std::mem::replace(&mut session.consume, consume);
        session.consumer = consumer;
        self.generations += 1;
        session.generation = self.generations;
        session.last_delivery = Instant::now();
        let _ = tokio::time::timeout(CALL_TIMEOUT, old.close(200, "resubscribed".into())).await;
        Ok(())
    }

    /// The live session, opened if there is none (or the last one failed).
    pub(super) async fn session(&mut self) -> Result<&mut Session, TransportError> {
        if self.session.as_ref().is_some_and(|s| !s.alive()) {
            self.lose_session();
        }
        if self.session.is_none() {
            self.open_session().await?;
        }
        self.session
            .as_mut()
            .ok_or_else(|| TransportError::protocol("no RabbitMQ session"))
    }

    /// Drops the session: RabbitMQ puts back what it held, and its receipts become stale.
    pub(super) fn lose_session(&mut self) {
        self.buffer.clear();
        if let Some(session) = self.session.take() {
            self.held.record(&BTreeMap::new());
            crate::task::spawn(async move {
                let _ = tokio::time::timeout(
                    CALL_TIMEOUT,
                    session.connection.close(200, "reconnecting".into()),
                )
                .await;
            });
        }
    }
}
