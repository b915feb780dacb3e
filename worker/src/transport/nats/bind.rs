//! Binding: the stream read (a re-creation noticed by its creation time), the dead-letter
//! stream made sure of, and the durable pull consumer bound: created where it is missing,
//! refused where it differs, its delivery limit lifted; bound again after a reconnection, a
//! failed fetch or a stall.

use std::sync::atomic::Ordering;
use std::time::Instant;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::Config;
use async_nats::jetstream::context::{ConsumerInfoErrorKind, GetStreamErrorKind};
use async_nats::jetstream::stream::{self, ConsumerErrorKind, ConsumerUpdateErrorKind};
use async_nats::jetstream::{self, ErrorCode};
use switchboard_api::NatsDeliverPolicy;

use super::consumer::{self, Fit, Start};
use super::{Bound, CONSUMER_SETTING, FETCH_EXPIRY, Incarnation, Nats, STREAM_SETTING};
use crate::transport::TransportError;

impl Nats {
    /// Connects, reads the stream, makes sure of the dead-letter stream and binds the consumer.
    pub(super) async fn bind(&mut self) -> Result<(), TransportError> {
        let client = self.client().await?;
        let js = jetstream::new(client.clone());
        let (stream, recreated) = self.read_stream(&js).await?;
        self.ensure_dead_letter_stream(&js).await?;
        self.dead_letter_ready = true;
        let consumer = self.bind_consumer(&stream, recreated).await?;
        if self.bound.is_none() {
            tracing::info!(
                stream = %self.settings.spec.stream,
                consumer = %self.settings.spec.consumer,
                ack_wait_seconds = self.settings.spec.ack_wait_seconds,
                "NATS consumer ready"
            );
        }
        self.bound = Some(Bound {
            client,
            js,
            stream,
            consumer,
        });
        self.events.reconnected.store(false, Ordering::Release);
        Ok(())
    }

    /// Reads the stream: fatal when it is missing. A creation time other than the one read
    /// before means the stream was deleted and created again: said once, and what was held
    /// of the old incarnation is forgotten. Returns the stream and whether it was re-created.
    async fn read_stream(
        &mut self,
        js: &jetstream::Context,
    ) -> Result<(stream::Stream, bool), TransportError> {
        let name = &self.settings.spec.stream;
        let stream = js.get_stream(name).await.map_err(|err| match err.kind() {
            GetStreamErrorKind::JetStream(js) if js.error_code() == ErrorCode::STREAM_NOT_FOUND => {
                self.stream_missing()
            }
            GetStreamErrorKind::InvalidStreamName | GetStreamErrorKind::EmptyName => {
                TransportError::fatal(STREAM_SETTING, "not a valid stream name", None)
            }
            _ => TransportError::transient("could not read the NATS stream", err),
        })?;
        let current = Incarnation::new(stream.cached_info().created);
        let recreated = match self.incarnation.replace(current.clone()) {
            Some(earlier) if earlier != current => {
                tracing::warn!(
                    stream = %name,
                    earlier_created = %humantime::format_rfc3339_nanos(earlier.created.into()),
                    created = %humantime::format_rfc3339_nanos(current.created.into()),
                    "the NATS stream was deleted and created again: its sequences restarted at 1 and its consumer went with it; its messages are new ones (stored under the new incarnation), read from its first message"
                );
                self.held.clear();
                self.dead_lettered.clear();
                self.consumer_created = None;
                true
            }
            _ => false,
        };
        Ok((stream, recreated))
    }

    /// The stream does not exist: misconfiguration at start (fatal); once read, it was deleted
    /// and is waited for (an operator re-creating it).
    fn stream_missing(&self) -> TransportError {
        let stream = &self.settings.spec.stream;
        if self.incarnation.is_some() {
            TransportError::protocol(format!(
                "stream {stream} is gone (deleted); waiting for it to be created again"
            ))
        } else {
            TransportError::fatal(
                STREAM_SETTING,
                format!("stream {stream} does not exist"),
                None,
            )
        }
    }

    /// Where a consumer the worker creates starts: at 1 on a re-created stream; after the
    /// highest stream sequence stored; at the creation time of the lost `new` consumer it
    /// replaces; else (the first creation) at `deliverPolicy`.
    async fn start(&self, recreated: bool) -> Result<Start, TransportError> {
        if recreated {
            return Ok(Start::Sequence(1));
        }
        let stored = self
            .store
            .position(&self.source, &self.incarnation()?.tag)
            .await
            .map_err(TransportError::checkpoint)?;
        Ok(
            match (
                stored.as_deref().and_then(|p| p.first()),
                self.consumer_created,
            ) {
                (Some(&seq), _) => Start::Sequence(u64::try_from(seq).unwrap_or(0) + 1),
                (None, Some(created))
                    if self.settings.spec.deliver_policy == NatsDeliverPolicy::New =>
                {
                    Start::Time(created)
                }
                (None, _) => Start::Configured,
            },
        )
    }

    /// The consumer, created if missing (see [`Nats::start`]), refused if it differs.
    async fn bind_consumer(
        &mut self,
        stream: &stream::Stream,
        recreated: bool,
    ) -> Result<PullConsumer, TransportError> {
        match stream.consumer_info(&self.settings.spec.consumer).await {
            Ok(info) => self.bind_existing(stream, info).await,
            Err(err) => match err.kind() {
                ConsumerInfoErrorKind::NotFound => self.create_consumer(stream, recreated).await,
                ConsumerInfoErrorKind::StreamNotFound => Err(self.stream_missing()),
                ConsumerInfoErrorKind::InvalidName => Err(TransportError::fatal(
                    CONSUMER_SETTING,
                    "not a valid consumer name",
                    None,
                )),
                _ => Err(TransportError::transient(
                    "could not read the NATS consumer",
                    err,
                )),
            },
        }
    }

    /// The existing consumer `info` describes: refused if it is a push consumer or differs in
    /// a setting that matters; the delivery limit an older worker set is lifted.
    async fn bind_existing(
        &mut self,
        stream: &stream::Stream,
        info: jetstream::consumer::Info,
    ) -> Result<PullConsumer, TransportError> {
        let spec = &self.settings.spec;
        if info.config.deliver_subject.is_some() {
            return Err(TransportError::fatal(
                CONSUMER_SETTING,
                format!(
                    "consumer {} is a push consumer; the worker needs a pull consumer",
                    spec.consumer
                ),
                None,
            ));
        }
        let wanted = consumer::desired(spec, &Start::Configured);
        let fit = consumer::check_existing(
            &info.config,
            &wanted,
            &spec.consumer,
            self.settings.max_deliveries,
        )?;
        if fit == Fit::LiftDeliveryLimit {
            lift_delivery_limit(stream, &info, &spec.consumer).await?;
        }
        self.consumer_created = Some(info.created);
        stream
            .get_consumer(&self.settings.spec.consumer)
            .await
            .map_err(|err| {
                TransportError::protocol(format!("could not bind the NATS consumer: {err}"))
            })
    }

    /// Creates the missing consumer, starting where [`Nats::start`] says.
    async fn create_consumer(
        &mut self,
        stream: &stream::Stream,
        recreated: bool,
    ) -> Result<PullConsumer, TransportError> {
        let spec = self.settings.spec.clone();
        let start = self.start(recreated).await?;
        let mut created = stream
            .create_consumer(consumer::desired(&spec, &start))
            .await
            .map_err(|err| match err.kind() {
                ConsumerErrorKind::JetStream(_) => TransportError::fatal(
                    CONSUMER_SETTING,
                    format!("the server refused to create consumer {}", spec.consumer),
                    Some(Box::new(err)),
                ),
                _ => TransportError::transient("could not create the NATS consumer", err),
            })?;
        if self.consumer_created.is_some() || start != Start::Configured {
            tracing::warn!(consumer = %spec.consumer, start = ?start, "the NATS consumer was missing; re-created it after what is stored");
        } else {
            tracing::info!(consumer = %spec.consumer, "created the NATS consumer");
        }
        self.consumer_created = Some(
            created
                .info()
                .await
                .map_err(|err| TransportError::transient("could not read the NATS consumer", err))?
                .created,
        );
        Ok(created)
    }

    /// Reads the stream and looks the consumer up again (re-creating it if the server lost
    /// it); then looks for deliveries the client could not decode.
    pub(super) async fn rebind(&mut self, why: &str) -> Result<(), TransportError> {
        let Some(bound) = &self.bound else {
            return Ok(());
        };
        let js = bound.js.clone();
        let (stream, recreated) = self.read_stream(&js).await?;
        let consumer = self.bind_consumer(&stream, recreated).await?;
        self.metrics.rebinds.inc();
        tracing::info!(reason = why, "re-bound the NATS consumer");
        if let Some(bound) = &mut self.bound {
            bound.consumer = consumer;
            bound.stream = stream;
        }
        self.rebind_due = false;
        self.quiet_since = None;
        Ok(())
    }

    /// After a blocking fetch returned nothing: a consumer quiet for 2 × [`FETCH_EXPIRY`]
    /// while the server holds undelivered messages for it is re-bound.
    pub(super) async fn check_stalled(&mut self) -> Result<(), TransportError> {
        let since = *self.quiet_since.get_or_insert_with(Instant::now);
        if since.elapsed() < 2 * FETCH_EXPIRY {
            return Ok(());
        }
        self.quiet_since = Some(Instant::now());
        let info =
            self.bound()?.consumer.get_info().await.map_err(|err| {
                TransportError::transient("could not read the NATS consumer", err)
            })?;
        if info.num_pending > 0 {
            tracing::warn!(
                num_pending = info.num_pending,
                "the NATS consumer delivered nothing while messages are pending"
            );
            self.rebind("stalled").await?;
        }
        Ok(())
    }
}

/// Lifts the delivery limit an older worker set on consumer `name` (`info`): the worker counts
/// deliveries itself. A server that refuses is fatal, naming `maxDeliveries`.
async fn lift_delivery_limit(
    stream: &stream::Stream,
    info: &jetstream::consumer::Info,
    name: &str,
) -> Result<(), TransportError> {
    let config_error =
        |err: serde_json::Error| TransportError::protocol(format!("consumer config: {err}"));
    let mut lifted: Config =
        serde_json::from_value(serde_json::to_value(&info.config).map_err(config_error)?)
            .map_err(config_error)?;
    lifted.max_deliver = consumer::UNLIMITED;
    stream
        .update_consumer(lifted)
        .await
        .map_err(|err| match err.kind() {
            ConsumerUpdateErrorKind::JetStream(_) => TransportError::fatal(
                "spec.delivery.maxDeliveries",
                format!(
                    "the server refused to lift the delivery limit of consumer {name} (max_deliver {}); delete the consumer so the worker creates it",
                    info.config.max_deliver
                ),
                Some(Box::new(err)),
            ),
            _ => TransportError::transient("could not update the NATS consumer", err),
        })?;
    tracing::warn!(
        consumer = %name,
        max_deliver = info.config.max_deliver,
        "lifted the delivery limit an older worker set on the NATS consumer: the worker counts deliveries itself"
    );
    Ok(())
}
