//! Intake: a received batch classified before anything is stored (undecodable, past
//! `maxDeliveries`, not a valid payload or envelope: poison; the rest: events with their
//! external id and idempotency key), and its store task started.

use std::time::Instant;

use switchboard_api::Envelope;
use switchboard_store::{Dedup, Lookup, NewEvent};
use tracing::Instrument as _;

use super::settle::InFlight;
use super::spans::Links;
use super::store::Origin;
use super::{Pipeline, spans};
use crate::envelope::{self, PayloadRules, Unwrapped};
use crate::payload::{Poison, PoisonReason, fields_json, payload_json, storable_text};
use crate::trace_context::{self, Found};
use crate::transport::identity::{id_in_scope, idempotency_key};
use crate::transport::{IDEMPOTENCY_KEY_HEADER, Message, Transport};

impl<T: Transport> Pipeline<T> {
    /// Classifies a received batch and starts storing what can be stored.
    pub(super) fn start(&self, batch: Vec<Message<T::Receipt>>) -> InFlight<T::Receipt> {
        let settings = &self.settings;
        let count = batch.len() as u64;
        self.metrics.received.inc_by(count);
        self.metrics.batch_size.observe(count as f64);
        let redelivered = batch.iter().filter(|m| m.delivery_count > 1).count();
        self.metrics.redelivered.inc_by(redelivered as u64);

        let mut poison = Vec::new();
        let mut stored = Vec::with_capacity(batch.len());
        let mut events = Vec::with_capacity(batch.len());
        let mut origins = Vec::with_capacity(batch.len());
        let mut redelivered = Vec::new();
        let mut links = Links::default();
        for (index, message) in batch.iter().enumerate() {
            let event = match self.refused(message) {
                Some(verdict) => Err(verdict),
                None => self.new_event(message),
            };
            match event {
                Ok((event, trace)) => {
                    self.note_trace(trace, &mut links);
                    events.push(event);
                    origins.push(Origin {
                        position: message.position.clone(),
                        enqueued_at_ms: message.enqueued_at_ms,
                    });
                    if message.delivery_count > 1 {
                        redelivered.push((message.idempotency_key.clone(), message.delivery_count));
                    }
                    stored.push(index);
                }
                Err(verdict) => poison.push((index, verdict)),
            }
        }
        let span = spans::batch(
            &settings.messaging,
            batch.len(),
            batch.first().map_or("", |m| m.external_id.as_str()),
            batch.last().map_or("", |m| m.external_id.as_str()),
            links,
        );
        let task = (!events.is_empty()).then(|| {
            let context = self.context.clone();
            let step = spans::step(&span, &settings.messaging, "store");
            crate::task::spawn(
                async move { context.store_events(events, origins, redelivered).await }
                    .instrument(step),
            )
        });
        InFlight {
            batch,
            stored,
            poison,
            task,
            extend_at: self
                .transport
                .lease()
                .map(|lease| Instant::now() + lease / 2),
            span,
        }
    }

    /// Why `message` is poison before it is even read: undecodable, or delivered more often
    /// than `maxDeliveries` (where the pipeline counts deliveries).
    fn refused(&self, message: &Message<T::Receipt>) -> Option<Poison> {
        let max_deliveries = self.settings.max_deliveries;
        if let Some(detail) = &message.undecodable {
            Some(Poison {
                reason: PoisonReason::Undecodable,
                detail: detail.clone(),
            })
        } else if self.count_deliveries && message.delivery_count > max_deliveries {
            Some(Poison {
                reason: PoisonReason::MaxDeliveries,
                detail: format!(
                    "delivered {} times without being stored; delivery.maxDeliveries is {}",
                    message.delivery_count, max_deliveries
                ),
            })
        } else {
            None
        }
    }

    /// Counts a malformed trace context; keeps a valid one to link to while spans are exported
    /// (at most [`spans::MAX_LINKS`]; the rest only counted).
    fn note_trace(&self, trace: Found, links: &mut Links) {
        match trace {
            Found::Valid(context) if switchboard_telemetry::traces::exporting() => {
                if links.kept.len() < spans::MAX_LINKS {
                    links.kept.extend(context.span_context());
                } else {
                    links.dropped += 1;
                }
            }
            Found::Malformed => {
                self.metrics.malformed_trace_contexts.inc();
            }
            _ => {}
        }
    }

    /// The external id and idempotency key of `message` without an envelope: its own, or for a
    /// redriven copy on a broker with native ids, the original's (its
    /// [`IDEMPOTENCY_KEY_HEADER`], when that names this source's key scope).
    fn identity(&self, message: &Message<T::Receipt>) -> (String, String) {
        let scope = self.transport.key_scope();
        let redriven = (self.context.dedup == Dedup::NativeId)
            .then(|| {
                message
                    .headers
                    .iter()
                    .find(|(name, _)| name == IDEMPOTENCY_KEY_HEADER)
            })
            .flatten()
            .and_then(|(_, value)| std::str::from_utf8(value).ok())
            .and_then(|key| id_in_scope(key, scope).map(|id| (id.to_owned(), key.to_owned())));
        let (id, key) = redriven
            .unwrap_or_else(|| (message.external_id.clone(), message.idempotency_key.clone()));
        (storable(id), storable(key))
    }

    /// The external id the event of `message` has if it was stored: under an envelope, the
    /// envelope's (`None`: its envelope does not parse, so it was never stored).
    pub(super) fn event_id(&self, message: &Message<T::Receipt>) -> Option<String> {
        match self.settings.envelope {
            Envelope::None => Some(self.identity(message).0),
            Envelope::CloudEvents | Envelope::Sns => self
                .new_event(message)
                .ok()
                .map(|(event, _)| event.external_id),
        }
    }

    /// The event to store for `message`: its body and headers, or what its envelope holds;
    /// with the trace context those headers carry.
    fn new_event(&self, message: &Message<T::Receipt>) -> Result<(NewEvent, Found), Poison> {
        let settings = &self.settings;
        let rules = PayloadRules {
            format: settings.format,
            max_bytes: settings.max_bytes,
        };
        let Unwrapped {
            event_id,
            payload,
            headers,
        } = match settings.envelope {
            Envelope::None => {
                let (external_id, idempotency_key) = self.identity(message);
                // The broker's time dates its own id only: not a redriven copy's original key.
                let broker_time = self
                    .transport
                    .stable_enqueue_time()
                    .then(|| message.enqueued_at_ms.and_then(|ms| i64::try_from(ms).ok()))
                    .flatten();
                let lookup = match broker_time {
                    _ if external_id != message.external_id => Lookup::Everywhere,
                    Some(ms) if self.context.dedup == Dedup::NativeId => Lookup::Since(ms),
                    _ => Lookup::Untimed,
                };
                let event = NewEvent {
                    external_id,
                    idempotency_key,
                    payload: payload_json(&message.body, settings.format, settings.max_bytes)?,
                    headers: fields_json(&message.headers),
                    traceparent: None,
                    tracestate: None,
                    lookup,
                };
                return Ok(traced(event, &message.headers));
            }
            Envelope::CloudEvents => envelope::cloud_event(&message.body, &message.headers, rules)?,
            Envelope::Sns => envelope::sns_notification(&message.body, &message.headers, rules)?,
        };
        // The envelope's id is unique within the source (RabbitMQ's too: these keys never had
        // the queue in them, and a stored key must keep deduplicating). A producer's retry
        // repeats it with another broker time: looked for among the keys kept without one.
        let event = NewEvent {
            idempotency_key: storable(idempotency_key(&self.context.source, &event_id)),
            external_id: storable(event_id),
            payload,
            headers: fields_json(&headers),
            traceparent: None,
            tracestate: None,
            lookup: Lookup::Untimed,
        };
        Ok(traced(event, &headers))
    }
}

/// `event` with the trace context of `headers` (its todo keeps a valid one).
fn traced(mut event: NewEvent, headers: &[(String, Vec<u8>)]) -> (NewEvent, Found) {
    let found = trace_context::of(headers);
    if let Found::Valid(context) = &found {
        event.traceparent = Some(context.traceparent.clone());
        event.tracestate = context.tracestate.clone();
    }
    (event, found)
}

/// `text` as a text column holds it (see [`storable_text`]), without a copy when it is already.
fn storable(text: String) -> String {
    match storable_text(&text) {
        std::borrow::Cow::Borrowed(_) => text,
        std::borrow::Cow::Owned(encoded) => encoded,
    }
}
