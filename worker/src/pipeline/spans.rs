//! The batch's spans for OpenTelemetry (exported only when the environment configures an
//! exporter, see `switchboard_telemetry::traces`): one `process {destination}` consumer span
//! per batch, from its receipt until it is settled, linked to each message's own trace context
//! (at most [`MAX_LINKS`]), with a `store` and a `settle` span inside it. The batch span is a
//! root: a producer's trace is linked to, never continued (deferred work, as OpenTelemetry's
//! messaging conventions advise).
//!
//! The names and attributes only an exported span needs are set only when spans are exported:
//! the log lines of the batch show its size, first and last message as before.

use opentelemetry::trace::SpanContext;
use switchboard_api::source::Messaging;
use switchboard_telemetry::traces::{self, KeyValue};
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The most messages a batch span links to (OpenTelemetry's default link limit); the
/// attribute `switchboard.links_dropped` counts the rest.
pub const MAX_LINKS: usize = 128;

/// The message contexts a batch span links to, and how many more there were.
#[derive(Debug, Default)]
pub(super) struct Links {
    pub kept: Vec<SpanContext>,
    pub dropped: usize,
}

/// The span of a received batch of `size` messages (`first` and `last` their external ids).
pub(super) fn batch(
    messaging: &Messaging,
    size: usize,
    first: &str,
    last: &str,
    links: Links,
) -> Span {
    let span = tracing::info_span!(
        target: traces::SPAN_TARGET,
        "batch",
        otel.name = Empty,
        otel.kind = Empty,
        size,
        first = %first,
        last = %last,
    );
    if traces::exporting() {
        let mut attributes = attributes(messaging, "process");
        attributes.push(KeyValue::new("messaging.batch.message_count", size as i64));
        if links.dropped > 0 {
            let dropped = links.dropped as i64;
            attributes.push(KeyValue::new("switchboard.links_dropped", dropped));
        }
        let name = format!("process {}", messaging.destination);
        traces::describe(&span, &name, "consumer", attributes);
        for link in links.kept {
            span.add_link(link);
        }
    }
    span
}

/// A step of the batch in `parent`: `store` (its transaction) or `settle` (dead letters and
/// acknowledgements, with the messaging attributes).
pub(super) fn step(parent: &Span, messaging: &Messaging, operation: &'static str) -> Span {
    let span = tracing::info_span!(
        target: traces::SPAN_TARGET,
        parent: parent,
        "step",
        otel.name = Empty,
        otel.kind = Empty
    );
    if traces::exporting() {
        let attributes = match operation {
            "settle" => attributes(messaging, operation),
            _ => Vec::new(),
        };
        traces::describe(&span, operation, "internal", attributes);
    }
    span
}

fn attributes(messaging: &Messaging, operation: &'static str) -> Vec<KeyValue> {
    let mut attributes = vec![
        KeyValue::new("messaging.system", messaging.system),
        KeyValue::new("messaging.operation.type", operation),
        KeyValue::new("messaging.operation.name", operation),
        KeyValue::new("messaging.destination.name", messaging.destination.clone()),
    ];
    if let Some(group) = &messaging.consumer_group {
        attributes.push(KeyValue::new(
            "messaging.consumer.group.name",
            group.clone(),
        ));
    }
    attributes
}
