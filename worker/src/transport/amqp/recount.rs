//! Counting classic-queue redeliveries across worker crashes: each redelivery of the buffer is
//! published again (confirmed) with `x-switchboard-deliveries` one higher, and the redelivered
//! copy acknowledged, so the count travels with the message. Storing never waits on this
//! publish: a copy refused, blocked or unconfirmed leaves its redelivery in the buffer, delivered
//! with its count as it stands (logged once per episode).

use std::collections::HashSet;

use lapin::BasicProperties;
use lapin::options::BasicAckOptions;

use super::classify::Addressed;
use super::connection::call;
use super::delivery::{self, Count, Original};
use super::publisher::Outgoing;
use super::{Amqp, dead_letter};
use crate::transport::TransportError;

impl Amqp {
    /// Publishes every classic-queue redelivery of the buffer again with its count one higher,
    /// waits for the confirms, then acknowledges the redelivered copies and drops them from
    /// the buffer. A redelivery whose copy is not confirmed (refused, blocked, unconfirmed)
    /// stays in the buffer and is delivered with its count as it stands: storing never waits
    /// on this publish.
    pub(super) async fn recount_redeliveries(&mut self) -> Result<(), TransportError> {
        let recounts = self.recounts();
        if recounts.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = recounts
            .iter()
            .map(|(index, _)| {
                format!(
                    "recount:{}:{}",
                    self.generations, self.buffer[*index].delivery_tag
                )
            })
            .collect();
        let failure = self.publish_recounts(&recounts, &keys).await?;
        let mut confirmed = HashSet::new();
        for ((index, _), key) in recounts.iter().zip(&keys) {
            if self.publisher.confirmed(key) {
                confirmed.insert(*index);
            }
            self.publisher.forget(key);
        }
        self.report_recounts(recounts.len(), confirmed.len(), failure);
        if confirmed.is_empty() {
            return Ok(());
        }
        self.ack_recounted(&confirmed).await?;
        self.metrics.recounted.inc_by(confirmed.len() as u64);
        Ok(())
    }

    /// The classic-queue redeliveries of the buffer: their index, and the properties of their
    /// copy with the count one higher.
    fn recounts(&self) -> Vec<(usize, BasicProperties)> {
        self.buffer
            .iter()
            .enumerate()
            .filter_map(|(index, d)| {
                match delivery::count(d.redelivered, d.properties.headers().as_ref()) {
                    Count::Recount { next } => Some((index, next)),
                    Count::Known(_) => None,
                }
            })
            .map(|(index, next)| {
                let d = &self.buffer[index];
                let original = Original {
                    exchange: d.exchange.as_str().to_owned(),
                    routing_key: d.routing_key.as_str().to_owned(),
                    properties: d.properties.clone(),
                };
                (index, dead_letter::recounted(&original, next))
            })
            .collect()
    }

    /// Publishes the recounted copies to the queue under `keys`. Returns why some may be
    /// unconfirmed (a fatal error is returned as such).
    async fn publish_recounts(
        &mut self,
        recounts: &[(usize, BasicProperties)],
        keys: &[String],
    ) -> Result<Option<TransportError>, TransportError> {
        if self.publisher.blocked() {
            return Ok(Some(TransportError::protocol(
                "RabbitMQ blocks the publishing connection (a resource alarm)",
            )));
        }
        let queue = self.settings.spec.queue.as_str();
        let outgoing: Vec<Outgoing<'_>> = recounts
            .iter()
            .zip(keys)
            .map(|((index, properties), key)| Outgoing {
                key,
                exchange: "",
                routing_key: queue,
                body: &self.buffer[*index].data,
                properties,
            })
            .collect();
        let published = self
            .publisher
            .publish("re-publish of a redelivery", Addressed::Queue, &outgoing)
            .await;
        match published.retry {
            Some(err) if err.is_fatal() => Err(err),
            Some(err) => Ok(Some(err)),
            None => Ok(published.refusal.map(TransportError::protocol)),
        }
    }

    /// Counts the redeliveries not recounted, and logs once when recounting starts failing and
    /// once when it works again.
    fn report_recounts(
        &mut self,
        wanted: usize,
        confirmed: usize,
        failure: Option<TransportError>,
    ) {
        if confirmed < wanted {
            self.metrics
                .not_recounted
                .inc_by((wanted - confirmed) as u64);
            if !self.recount_failing {
                self.recount_failing = true;
                let error = failure.map(|err| err.to_string()).unwrap_or_default();
                tracing::warn!(
                    %error,
                    "classic-queue redeliveries are delivered without publishing them again with their count; a crash before they are stored does not count"
                );
            }
        } else if std::mem::take(&mut self.recount_failing) {
            tracing::info!("classic-queue redeliveries are recounted again");
        }
    }

    /// Acknowledges the redelivered copies at `indexes` of the buffer (their recounted copies
    /// are confirmed) and drops them from it.
    async fn ack_recounted(&mut self, indexes: &HashSet<usize>) -> Result<(), TransportError> {
        let Some(session) = self.session.as_mut() else {
            return Err(TransportError::protocol("no RabbitMQ session"));
        };
        let mut result = Ok(());
        for &index in indexes {
            let tag = self.buffer[index].delivery_tag;
            result = call(
                &self.names,
                "basic.ack",
                Addressed::Queue,
                session.consume.basic_ack(tag, BasicAckOptions::default()),
            )
            .await;
            if result.is_err() {
                break;
            }
            session.outstanding.remove(&tag);
        }
        self.held.record(&session.outstanding);
        if let Err(err) = result {
            self.lose_session();
            return Err(err);
        }
        let mut index = 0;
        self.buffer.retain(|_| {
            let keep = !indexes.contains(&index);
            index += 1;
            keep
        });
        Ok(())
    }
}
