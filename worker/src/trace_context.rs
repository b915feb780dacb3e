//! A message's W3C trace context, read from its headers the same way for every broker (stream
//! fields, SQS and gateway message attributes, NATS, AMQP and Kafka headers, and a CloudEvent's
//! distributed-tracing extension once [`crate::envelope`] has unwrapped it): `traceparent` and
//! `tracestate` (any case), else `ce-traceparent` and `ce-tracestate`, else an SQS
//! `AWSTraceHeader` (X-Ray's `Root=1-…;Parent=…;Sampled=…`) turned into a `traceparent`.
//!
//! A value that is not valid is ignored and counted, never a reason to refuse the message: it
//! stays in the event's headers as it came.

use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

/// The trace context a todo keeps (`todos.traceparent`, `todos.tracestate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// Normalised to version `00`: `00-{trace id}-{parent id}-{flags}`.
    pub traceparent: String,
    /// Kept only beside a valid `traceparent`, and only if it is valid itself.
    pub tracestate: Option<String>,
}

/// What a message's headers say about its trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// No trace header.
    None,
    Valid(TraceContext),
    /// A trace header whose value is not valid (ignored, counted).
    Malformed,
}

/// The longest `tracestate` kept (W3C: at most 32 members; 512 bytes is what propagators
/// must be able to pass on).
const MAX_TRACESTATE: usize = 512;

/// The trace context of a message with `headers`.
pub fn of(headers: &[(String, Vec<u8>)]) -> Found {
    let header = |name: &str| {
        headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_slice())
    };
    for (parent, state) in [
        ("traceparent", "tracestate"),
        ("ce-traceparent", "ce-tracestate"),
    ] {
        if let Some(value) = header(parent) {
            return match parse_traceparent(value) {
                Some(traceparent) => Found::Valid(TraceContext {
                    traceparent,
                    tracestate: header(state).and_then(parse_tracestate),
                }),
                None => Found::Malformed,
            };
        }
    }
    match header("AWSTraceHeader") {
        Some(value) => match parse_xray(value) {
            Some(traceparent) => Found::Valid(TraceContext {
                traceparent,
                tracestate: None,
            }),
            None => Found::Malformed,
        },
        None => Found::None,
    }
}

fn is_lower_hex(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn is_zero(text: &str) -> bool {
    text.bytes().all(|b| b == b'0')
}

/// A `traceparent` by W3C Trace Context level 1: version `00` exactly 55 characters; a later
/// version at least that, its first four fields read as version `00`'s; version `ff`, upper
/// case hex and all-zero ids are invalid.
fn parse_traceparent(value: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(value).ok()?.trim_matches([' ', '\t']);
    let version = text.get(..2)?;
    if !is_lower_hex(version) || version == "ff" {
        return None;
    }
    if version == "00" && text.len() != 55 {
        return None;
    }
    if text.len() > 55 && text.as_bytes()[55] != b'-' {
        return None;
    }
    let fields = text.get(..55)?;
    let mut parts = fields.split('-');
    let (_, trace_id, parent_id, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let valid = trace_id.len() == 32
        && parent_id.len() == 16
        && flags.len() == 2
        && [trace_id, parent_id, flags].into_iter().all(is_lower_hex)
        && !is_zero(trace_id)
        && !is_zero(parent_id);
    valid.then(|| format!("00-{trace_id}-{parent_id}-{flags}"))
}

/// A `tracestate` worth passing on: printable ASCII, at most [`MAX_TRACESTATE`] bytes, every
/// member `key=value`.
fn parse_tracestate(value: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(value).ok()?.trim_matches([' ', '\t']);
    let valid = !text.is_empty()
        && text.len() <= MAX_TRACESTATE
        && text.bytes().all(|b| (0x20..0x7f).contains(&b))
        && text
            .split(',')
            .map(|member| member.trim_matches([' ', '\t']))
            .filter(|member| !member.is_empty())
            .all(|member| {
                member
                    .split_once('=')
                    .is_some_and(|(k, v)| !k.is_empty() && !v.is_empty())
            });
    valid.then(|| text.to_owned())
}

/// X-Ray's `Root=1-{8 hex}-{24 hex};Parent={16 hex};Sampled={0|1}` (fields in any order,
/// `Sampled` optional) as a `traceparent`.
fn parse_xray(value: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(value).ok()?;
    let (mut root, mut parent, mut sampled) = (None, None, "0");
    for field in text.split(';') {
        match field.trim().split_once('=')? {
            ("Root", value) => root = Some(value),
            ("Parent", value) => parent = Some(value),
            ("Sampled", "1") => sampled = "1",
            ("Sampled", _) => sampled = "0",
            _ => {}
        }
    }
    let mut root = root?.split('-');
    let (one, time, unique) = (root.next()?, root.next()?, root.next()?);
    if one != "1" || root.next().is_some() || time.len() != 8 || unique.len() != 24 {
        return None;
    }
    let traceparent = format!(
        "00-{}{}-{}-0{sampled}",
        time.to_ascii_lowercase(),
        unique.to_ascii_lowercase(),
        parent?.to_ascii_lowercase()
    );
    parse_traceparent(traceparent.as_bytes())
}

impl TraceContext {
    /// The remote span this context names, to link to.
    pub fn span_context(&self) -> Option<SpanContext> {
        let mut parts = self.traceparent.split('-').skip(1);
        let trace_id = TraceId::from_hex(parts.next()?).ok()?;
        let span_id = SpanId::from_hex(parts.next()?).ok()?;
        let flags = u8::from_str_radix(parts.next()?, 16).ok()?;
        let state = self
            .tracestate
            .as_deref()
            .and_then(|state| state.parse::<TraceState>().ok())
            .unwrap_or_default();
        Some(SpanContext::new(
            trace_id,
            span_id,
            TraceFlags::new(flags),
            true,
            state,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    fn valid(traceparent: &str, tracestate: Option<&str>) -> Found {
        Found::Valid(TraceContext {
            traceparent: traceparent.to_owned(),
            tracestate: tracestate.map(str::to_owned),
        })
    }

    #[test]
    fn a_traceparent_and_its_tracestate_are_read_in_any_case() {
        let found = of(&headers(&[
            ("TraceParent", PARENT),
            ("TRACESTATE", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
        ]));
        assert_eq!(
            found,
            valid(PARENT, Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"))
        );
    }

    #[test]
    fn a_cloud_events_extension_is_read_when_there_is_no_traceparent_header() {
        assert_eq!(
            of(&headers(&[("ce-traceparent", PARENT)])),
            valid(PARENT, None)
        );
    }

    #[test]
    fn an_x_ray_header_becomes_a_traceparent() {
        let found = of(&headers(&[(
            "AWSTraceHeader",
            "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1",
        )]));
        assert_eq!(
            found,
            valid(
                "00-5759e988bd862e3fe1be46a994272793-53995c3f42cd8ad8-01",
                None
            )
        );
    }

    #[test]
    fn malformed_values_are_malformed_never_a_context() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(
                of(&headers(&[("traceparent", bad)])),
                Found::Malformed,
                "{bad:?}"
            );
        }
        let not_utf8 = vec![("traceparent".to_owned(), vec![0xff, 0xfe])];
        assert_eq!(of(&not_utf8), Found::Malformed);
        assert_eq!(
            of(&headers(&[("AWSTraceHeader", "Root=2-1-2;Parent=x")])),
            Found::Malformed
        );
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields() {
        let later = format!("cc{}-what-comes-next", &PARENT[2..]);
        assert_eq!(
            of(&headers(&[("traceparent", &later)])),
            valid(PARENT, None)
        );
    }

    #[test]
    fn an_invalid_tracestate_is_dropped_and_the_traceparent_kept() {
        let long = format!("k={}", "v".repeat(600));
        for bad in ["no-equals-sign", "k=\u{7}", long.as_str()] {
            assert_eq!(
                of(&headers(&[("traceparent", PARENT), ("tracestate", bad)])),
                valid(PARENT, None),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn no_trace_header_is_none() {
        assert_eq!(of(&headers(&[("kind", "order")])), Found::None);
    }

    #[test]
    fn the_context_names_the_remote_span_to_link_to() {
        let context = TraceContext {
            traceparent: PARENT.to_owned(),
            tracestate: Some("congo=t61rcWkgMzE".to_owned()),
        };
        let span = context.span_context().expect("span context");
        assert_eq!(
            span.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(span.span_id().to_string(), "00f067aa0ba902b7");
        assert!(span.is_sampled() && span.is_remote());
        assert_eq!(span.trace_state().get("congo"), Some("t61rcWkgMzE"));
    }
}
