//! A real OpenTelemetry Collector (`scripts/otelcol.sh` builds it once from the Go module proxy,
//! cached, or takes `OTELCOL_BIN`) as a child process on random loopback ports: the OTLP
//! receiver (gRPC and HTTP) and the file exporter writing each export as one OTLP JSON line,
//! which [`Collector::spans`] reads back.

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::Fixture;
use crate::control_plane::log_tail;
use crate::servers::{free_ports, stop_child};
use crate::wait::{wait_for, wait_until};
use anyhow::{Context, Result, ensure};
use nix::sys::signal::Signal;

/// The collector release `scripts/otelcol.sh` builds (its `OTELCOL_VERSION`).
pub const OTELCOL_VERSION: &str = "0.161.0";

/// How often the file exporter flushes what it received to its file.
const FLUSH_INTERVAL: &str = "100ms";

/// A collector of our own, its configuration, log and span file in the fixture's directory.
#[derive(Debug)]
pub struct Collector {
    http_port: u16,
    grpc_port: u16,
    spans_file: PathBuf,
    log_file: PathBuf,
    child: Child,
}

impl Collector {
    /// Starts a collector receiving OTLP on two free loopback ports and waits until both accept
    /// connections.
    pub fn start(fx: &Fixture) -> Result<Self> {
        let binary = binary()?;
        let [http_port, grpc_port] = free_ports()?;
        let dir = tempfile::Builder::new()
            .prefix("otelcol-")
            .tempdir_in(fx.dir.path())?
            .keep();
        let spans_file = dir.join("spans.jsonl");
        let log_file = dir.join("otelcol.log");
        // JSON is YAML: the collector's file provider reads either.
        let config = serde_json::json!({
            "receivers": {"otlp": {"protocols": {
                "grpc": {"endpoint": format!("127.0.0.1:{grpc_port}")},
                "http": {"endpoint": format!("127.0.0.1:{http_port}")},
            }}},
            "exporters": {"file": {
                "path": spans_file,
                "format": "json",
                "flush_interval": FLUSH_INTERVAL,
            }},
            "service": {
                // No metrics endpoint of its own (it would listen on :8888).
                "telemetry": {"metrics": {"level": "none"}},
                "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
            },
        });
        let config_file = dir.join("otelcol.yaml");
        std::fs::write(&config_file, config.to_string())?;
        let log = std::fs::File::create(&log_file)?;
        let child = Command::new(&binary)
            .arg(format!("--config=file:{}", config_file.display()))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut collector = Self {
            http_port,
            grpc_port,
            spans_file,
            log_file,
            child,
        };
        let listening = |port| TcpStream::connect(("127.0.0.1", port)).is_ok();
        wait_until(Duration::from_secs(30), "the collector listens", || {
            matches!(collector.child.try_wait(), Ok(Some(_)))
                || listening(http_port) && listening(grpc_port)
        })
        .with_context(|| collector.log_tail())?;
        ensure!(
            collector.child.try_wait()?.is_none(),
            "the collector exited at start\n{}",
            collector.log_tail()
        );
        Ok(collector)
    }

    /// `http://127.0.0.1:PORT`: OTLP/HTTP (`/v1/traces`).
    pub fn http_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// `http://127.0.0.1:PORT`: OTLP/gRPC.
    pub fn grpc_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc_port)
    }

    /// The OTLP/HTTP port.
    pub fn http_port(&self) -> u16 {
        self.http_port
    }

    /// Every span the file exporter wrote so far, in the order received. A line still being
    /// written (no newline yet) is left for the next call.
    pub fn spans(&self) -> Result<Vec<Span>> {
        let text = self.exported_text()?;
        let mut spans = Vec::new();
        for line in text.lines().filter(|line| !line.trim().is_empty()) {
            let export: wire::Export = serde_json::from_str(line)
                .with_context(|| format!("an OTLP JSON line of the file exporter: {line}"))?;
            spans.extend(export.into_spans());
        }
        Ok(spans)
    }

    /// Every complete line the file exporter wrote so far, as written (OTLP JSON): for greps
    /// over everything exported (no secret in any attribute, event or resource).
    pub fn exported_text(&self) -> Result<String> {
        let mut text = match std::fs::read_to_string(&self.spans_file) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(err) => return Err(err).context(self.spans_file.display().to_string()),
        };
        text.truncate(text.rfind('\n').map_or(0, |end| end + 1));
        Ok(text)
    }

    /// Polls [`Collector::spans`] until `predicate` holds for them or `timeout` passes; returns
    /// the spans it held for.
    pub async fn wait_for_spans(
        &self,
        timeout: Duration,
        what: &str,
        predicate: impl Fn(&[Span]) -> bool,
    ) -> Result<Vec<Span>> {
        let found = std::sync::Mutex::new(Vec::new());
        let (predicate, found_ref) = (&predicate, &found);
        wait_for(timeout, what, move || async move {
            let spans = self.spans()?;
            let holds = predicate(&spans);
            *found_ref.lock().unwrap_or_else(|err| err.into_inner()) = spans;
            Ok(holds)
        })
        .await
        .map_err(|err| err.context(self.log_tail()))?;
        Ok(found.into_inner().unwrap_or_else(|err| err.into_inner()))
    }

    /// The last lines of the collector's log.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_file, 30)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        stop_child(&mut self.child, Signal::SIGTERM, Duration::from_secs(10));
    }
}

/// `$OTELCOL_BIN`, else the binary `scripts/otelcol.sh` builds into the cache.
fn binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("OTELCOL_BIN").filter(|v| !v.is_empty()) {
        return Ok(path.into());
    }
    let path = crate::brokers::cache_dir()?
        .join(format!("otelcol-{OTELCOL_VERSION}"))
        .join("otelcol");
    ensure!(
        path.is_file(),
        "the OpenTelemetry Collector {OTELCOL_VERSION} is not built in {}: run `make otelcol` \
         (or `scripts/otelcol.sh`; needs Go, see docs/testing.md), or set OTELCOL_BIN to an \
         otelcol binary with the otlp receiver and the file exporter",
        path.display()
    );
    Ok(path)
}

/// One span as the collector received it, with its resource's and scope's names.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// The resource's attributes (`service.name`, …).
    pub resource: BTreeMap<String, AttributeValue>,
    /// The instrumentation scope's name.
    pub scope: String,
    pub name: String,
    pub kind: SpanKind,
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// 16 lowercase hex digits.
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub status: Status,
    pub attributes: BTreeMap<String, AttributeValue>,
    pub links: Vec<Link>,
    pub events: Vec<Event>,
}

impl Span {
    /// The resource's `service.name`.
    pub fn service_name(&self) -> Option<&str> {
        self.resource.get("service.name")?.as_str()
    }

    /// The string attribute `key`.
    pub fn attribute_str(&self, key: &str) -> Option<&str> {
        self.attributes.get(key)?.as_str()
    }
}

/// A span's link to another span's context.
#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    pub trace_id: String,
    pub span_id: String,
    pub trace_state: String,
    pub attributes: BTreeMap<String, AttributeValue>,
}

/// A span's event (an exception recorded on it, …).
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub name: String,
    pub attributes: BTreeMap<String, AttributeValue>,
}

/// A span's status.
#[derive(Clone, Debug, PartialEq)]
pub struct Status {
    pub code: StatusCode,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusCode {
    Unset,
    Ok,
    Error,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Unspecified,
    Internal,
    Server,
    Client,
    Producer,
    Consumer,
}

/// An attribute's value, typed as OTLP carries it (`intValue` is a JSON string there).
#[derive(Clone, Debug, PartialEq)]
pub enum AttributeValue {
    String(String),
    Bool(bool),
    Int(i64),
    Double(f64),
    /// Base64, as in OTLP JSON.
    Bytes(String),
    Array(Vec<AttributeValue>),
    Map(BTreeMap<String, AttributeValue>),
    /// An empty value.
    Empty,
}

impl AttributeValue {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(text) => Some(text),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Self::Int(number) => Some(*number),
            _ => None,
        }
    }
}

/// OTLP JSON as the file exporter writes it (lowerCamelCase fields, hex ids, enums as numbers).
mod wire {
    use std::collections::BTreeMap;

    use serde::Deserialize;
    use serde_json::Value;

    use super::{AttributeValue, SpanKind, StatusCode, enum_number};

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub(super) struct Export {
        #[serde(default)]
        resource_spans: Vec<ResourceSpans>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ResourceSpans {
        #[serde(default)]
        resource: Attributed,
        #[serde(default)]
        scope_spans: Vec<ScopeSpans>,
    }

    #[derive(Default, Deserialize)]
    struct Attributed {
        #[serde(default)]
        attributes: Vec<KeyValue>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ScopeSpans {
        #[serde(default)]
        scope: Scope,
        #[serde(default)]
        spans: Vec<Span>,
    }

    #[derive(Default, Deserialize)]
    struct Scope {
        #[serde(default)]
        name: String,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Span {
        trace_id: String,
        span_id: String,
        #[serde(default)]
        parent_span_id: String,
        name: String,
        #[serde(default)]
        kind: Value,
        #[serde(default)]
        status: Status,
        #[serde(default)]
        attributes: Vec<KeyValue>,
        #[serde(default)]
        links: Vec<Link>,
        #[serde(default)]
        events: Vec<Event>,
    }

    #[derive(Default, Deserialize)]
    struct Status {
        #[serde(default)]
        code: Value,
        #[serde(default)]
        message: String,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Link {
        trace_id: String,
        span_id: String,
        #[serde(default)]
        trace_state: String,
        #[serde(default)]
        attributes: Vec<KeyValue>,
    }

    #[derive(Deserialize)]
    struct Event {
        name: String,
        #[serde(default)]
        attributes: Vec<KeyValue>,
    }

    #[derive(Deserialize)]
    pub(super) struct KeyValue {
        key: String,
        #[serde(default)]
        value: AnyValue,
    }

    #[derive(Default, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub(super) struct AnyValue {
        string_value: Option<String>,
        bool_value: Option<bool>,
        /// A JSON string (64-bit), or a number from a lenient writer.
        int_value: Option<Value>,
        double_value: Option<f64>,
        bytes_value: Option<String>,
        array_value: Option<Values<AnyValue>>,
        kvlist_value: Option<Values<KeyValue>>,
    }

    #[derive(Deserialize)]
    struct Values<T> {
        #[serde(default = "Vec::new")]
        values: Vec<T>,
    }

    impl Export {
        pub(super) fn into_spans(self) -> Vec<super::Span> {
            let mut out = Vec::new();
            for resource_spans in self.resource_spans {
                let resource = map(resource_spans.resource.attributes);
                for scope_spans in resource_spans.scope_spans {
                    for span in scope_spans.spans {
                        out.push(span.typed(&resource, &scope_spans.scope.name));
                    }
                }
            }
            out
        }
    }

    impl Span {
        fn typed(self, resource: &BTreeMap<String, AttributeValue>, scope: &str) -> super::Span {
            let kinds = [
                SpanKind::Unspecified,
                SpanKind::Internal,
                SpanKind::Server,
                SpanKind::Client,
                SpanKind::Producer,
                SpanKind::Consumer,
            ];
            let codes = [StatusCode::Unset, StatusCode::Ok, StatusCode::Error];
            super::Span {
                resource: resource.clone(),
                scope: scope.to_owned(),
                name: self.name,
                kind: enum_number(&self.kind, "SPAN_KIND_", &kinds),
                trace_id: self.trace_id.to_ascii_lowercase(),
                span_id: self.span_id.to_ascii_lowercase(),
                parent_span_id: self.parent_span_id.to_ascii_lowercase(),
                status: super::Status {
                    code: enum_number(&self.status.code, "STATUS_CODE_", &codes),
                    message: self.status.message,
                },
                attributes: map(self.attributes),
                links: self
                    .links
                    .into_iter()
                    .map(|link| super::Link {
                        trace_id: link.trace_id.to_ascii_lowercase(),
                        span_id: link.span_id.to_ascii_lowercase(),
                        trace_state: link.trace_state,
                        attributes: map(link.attributes),
                    })
                    .collect(),
                events: self
                    .events
                    .into_iter()
                    .map(|event| super::Event {
                        name: event.name,
                        attributes: map(event.attributes),
                    })
                    .collect(),
            }
        }
    }

    pub(super) fn map(attributes: Vec<KeyValue>) -> BTreeMap<String, AttributeValue> {
        attributes
            .into_iter()
            .map(|kv| (kv.key, kv.value.typed()))
            .collect()
    }

    impl AnyValue {
        fn typed(self) -> AttributeValue {
            if let Some(text) = self.string_value {
                AttributeValue::String(text)
            } else if let Some(flag) = self.bool_value {
                AttributeValue::Bool(flag)
            } else if let Some(number) = self.int_value {
                let parsed = match &number {
                    Value::String(text) => text.parse().ok(),
                    other => other.as_i64(),
                };
                parsed.map_or(AttributeValue::Empty, AttributeValue::Int)
            } else if let Some(number) = self.double_value {
                AttributeValue::Double(number)
            } else if let Some(bytes) = self.bytes_value {
                AttributeValue::Bytes(bytes)
            } else if let Some(array) = self.array_value {
                AttributeValue::Array(array.values.into_iter().map(AnyValue::typed).collect())
            } else if let Some(list) = self.kvlist_value {
                AttributeValue::Map(map(list.values))
            } else {
                AttributeValue::Empty
            }
        }
    }
}

/// An OTLP enum as JSON carries it: its number (what the file exporter writes) or its name
/// (`SPAN_KIND_CONSUMER`, which OTLP/JSON receivers accept too). Unknown → the first variant.
fn enum_number<T: Copy + std::fmt::Debug>(value: &serde_json::Value, prefix: &str, all: &[T]) -> T {
    let index = match value {
        serde_json::Value::Number(number) => number.as_u64().and_then(|n| usize::try_from(n).ok()),
        serde_json::Value::String(name) => {
            let name = name.strip_prefix(prefix).unwrap_or(name).replace('_', "");
            all.iter()
                .position(|variant| format!("{variant:?}").eq_ignore_ascii_case(&name))
        }
        _ => None,
    };
    all[index.filter(|&i| i < all.len()).unwrap_or(0)]
}
