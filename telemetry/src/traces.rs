//! OpenTelemetry traces, configured by the standard environment and off unless it names an
//! exporter endpoint: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`),
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` (+ `_ARG`); `OTEL_SDK_DISABLED=true` or
//! `OTEL_TRACES_EXPORTER=none` turn it off. The protocol is OTLP over HTTP with protobuf (the
//! Collector's port 4318): another `OTEL_EXPORTER_OTLP_PROTOCOL` is refused naming the
//! setting. TLS is verified against the public web roots plus the CA file
//! `OTEL_EXPORTER_OTLP_CERTIFICATE` names.
//!
//! Only spans of the target [`SPAN_TARGET`] (a worker's batch and its steps, an operator's
//! reconcile) and the warnings and errors inside them are exported; `RUST_LOG` cannot turn
//! those spans off while traces are exported.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
pub use opentelemetry::KeyValue;
use opentelemetry::trace::{Status, TraceContextExt as _, TracerProvider as _};
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{SpanExporter, WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tracing::{Span, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// The one protocol spoken.
const PROTOCOL: &str = "http/protobuf";
/// An export that got no answer within this is given up (`OTEL_EXPORTER_OTLP_TIMEOUT` may
/// shorten it: the exporter's own deadline).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Answers larger than this are refused (a collector answers with a few bytes).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// The target of the spans that are exported (`tracing::info_span!(target: SPAN_TARGET, …)`),
/// named for OpenTelemetry by [`describe`].
pub const SPAN_TARGET: &str = "switchboard_traces";

/// Set once spans are exported: what only an exported span needs (links, attributes that logs
/// do not show) is not worked out otherwise.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether this process exports spans.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Names `span` for export — its fields `otel.name` and `otel.kind` (declared
/// `tracing::field::Empty`, so that log lines do not show them) — and sets `attributes`; only
/// when spans are exported.
pub fn describe(
    span: &Span,
    name: &str,
    kind: &'static str,
    attributes: impl IntoIterator<Item = KeyValue>,
) {
    if exporting() {
        span.record("otel.name", name);
        span.record("otel.kind", kind);
        for attribute in attributes {
            span.set_attribute(attribute.key, attribute.value);
        }
    }
}

/// The trace id of the current span, when spans are exported and it is sampled (metric
/// exemplars).
pub fn current_trace_id() -> Option<String> {
    if !exporting() {
        return None;
    }
    let context = Span::current().context();
    let span = context.span();
    let span = span.span_context();
    (span.is_valid() && span.is_sampled()).then(|| span.trace_id().to_string())
}

/// Marks `span` failed with `error` (its whole cause chain), when spans are exported.
pub fn fail(span: &Span, error: &dyn std::error::Error) {
    if exporting() {
        span.set_status(Status::error(crate::ErrorChain(error).to_string()));
    }
}

/// A setting of the environment that cannot work: the process exits naming it.
#[derive(Debug, thiserror::Error)]
#[error("{setting}: {message}")]
pub struct TracesError {
    pub setting: &'static str,
    message: String,
}

impl TracesError {
    fn new(setting: &'static str, message: impl Into<String>) -> Self {
        Self {
            setting,
            message: message.into(),
        }
    }
}

/// The trace exporter of the process, if the environment configured one. Dropping it without
/// [`Traces::shutdown`] loses the spans not exported yet.
#[derive(Debug, Default)]
pub struct Traces {
    provider: Option<SdkTracerProvider>,
}

impl Traces {
    /// Whether spans are exported.
    pub fn enabled(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports what is left (bounded by the exporter's timeout) and stops the exporter.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            // The exporter's thread waits on an HTTP call that runs on this runtime: block
            // another thread, not the runtime's.
            let result = tokio::task::spawn_blocking(move || provider.shutdown()).await;
            if let Ok(Err(err)) = result {
                tracing::warn!(error = %err, "the last spans were not exported");
            }
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.trim().is_empty())
}

/// Whether the environment asks for traces to be exported.
fn wanted() -> Result<bool, TracesError> {
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(false);
    }
    match env("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
        None | Some("otlp") => {}
        Some("none") => return Ok(false),
        Some(other) => {
            return Err(TracesError::new(
                "OTEL_TRACES_EXPORTER",
                format!("`{other}` is not supported: use `otlp` or `none`"),
            ));
        }
    }
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(protocol) = env(name)
            && protocol.trim() != PROTOCOL
        {
            return Err(TracesError::new(
                if name.contains("TRACES") {
                    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
                } else {
                    "OTEL_EXPORTER_OTLP_PROTOCOL"
                },
                format!(
                    "`{}` is not supported: use `{PROTOCOL}` (the Collector's OTLP/HTTP port, \
                     4318)",
                    protocol.trim()
                ),
            ));
        }
    }
    Ok(env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        || env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some())
}

/// The exporter and its layer for `service` (the default `service.name`), or `None` when the
/// environment configures no export. Must be called inside the Tokio runtime.
pub(crate) fn layer<S>(
    service: &'static str,
) -> Result<Option<(Traces, impl Layer<S>)>, TracesError>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    if !wanted()? {
        return Ok(None);
    }
    let client = ExportClient::new()?;
    let exporter = SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_http_client(client)
        .build()
        .map_err(|err| TracesError::new("OTEL_EXPORTER_OTLP_ENDPOINT", err.to_string()))?;
    // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, read by the default detectors, win.
    let mut resource = Resource::builder();
    if env("OTEL_SERVICE_NAME").is_none() && !resource_names_service() {
        resource = resource.with_service_name(service);
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer(service);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_level(true)
        // Nothing here reads OpenTelemetry's current context; activating it on every enter of
        // a span (a batch's spans are entered by every poll) would only cost.
        .with_context_activation(false);
    EXPORTING.store(true, Ordering::Relaxed);
    Ok(Some((
        Traces {
            provider: Some(provider),
        },
        Exported(layer),
    )))
}

fn resource_names_service() -> bool {
    env("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attributes| {
        attributes
            .split(',')
            .any(|pair| pair.split('=').next().map(str::trim) == Some("service.name"))
    })
}

/// The exporter's HTTP client: hyper with rustls (always verified), each call run on the
/// runtime that set traces up — the SDK's exporter thread only waits for it.
#[derive(Debug, Clone)]
struct ExportClient {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
}

impl ExportClient {
    fn new() -> Result<Self, TracesError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(path) = env("OTEL_EXPORTER_OTLP_CERTIFICATE") {
            let setting = "OTEL_EXPORTER_OTLP_CERTIFICATE";
            let certificates: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&path)
                .and_then(Iterator::collect)
                .map_err(|err| TracesError::new(setting, format!("cannot read {path}: {err}")))?;
            if certificates.is_empty() {
                return Err(TracesError::new(
                    setting,
                    format!("{path} holds no PEM certificate"),
                ));
            }
            for certificate in certificates {
                roots.add(certificate).map_err(|err| {
                    TracesError::new(setting, format!("a certificate in {path}: {err}"))
                })?;
            }
        }
        let tls = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            TracesError::new("OTEL_EXPORTER_OTLP_ENDPOINT", "traces need a Tokio runtime")
        })?;
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            runtime,
        })
    }

    async fn call(
        client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
        request: Request<Bytes>,
    ) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let request = hyper::Request::from_parts(parts, Full::new(body));
        let answer = tokio::time::timeout(CALL_TIMEOUT, async {
            let response = client.request(request).await?;
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, MAX_ANSWER_BYTES).collect().await?;
            Ok::<_, HttpError>(Response::from_parts(parts, body.to_bytes()))
        })
        .await;
        answer.map_err(|_| HttpError::from("the OTLP endpoint did not answer in time"))?
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let call = Self::call(self.client.clone(), request);
        self.runtime
            .spawn(call)
            .await
            .map_err(|err| HttpError::from(format!("the export call stopped: {err}")))?
    }
}

/// The exporting layer, shown only the spans of [`SPAN_TARGET`] and the warnings and errors.
/// Not a per-layer filter: tracing-subscriber's per-layer filter state is thread-local and
/// went wrong under the worker's interleaved tasks (spans disabled for the log and the export
/// alike, seen as missing `settle` spans and log lines without their batch); this wrapper keeps
/// no state of its own and leaves filtering to the one global `RUST_LOG` filter.
struct Exported<L>(L);

fn exported(metadata: &tracing::Metadata<'_>) -> bool {
    metadata.target() == SPAN_TARGET
}

impl<L> Exported<L> {
    fn sees<S>(id: &tracing::span::Id, ctx: &Context<'_, S>) -> bool
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        ctx.metadata(id).is_some_and(exported)
    }
}

impl<S, L> Layer<S> for Exported<L>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    L: Layer<S>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        self.0.on_register_dispatch(subscriber);
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.0.on_layer(subscriber);
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        if exported(attrs.metadata()) {
            self.0.on_new_span(attrs, id, ctx);
        }
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: Context<'_, S>,
    ) {
        if Self::sees(id, &ctx) {
            self.0.on_record(id, values, ctx);
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        if *event.metadata().level() <= tracing::Level::WARN {
            self.0.on_event(event, ctx);
        }
    }

    fn on_enter(&self, id: &tracing::span::Id, ctx: Context<'_, S>) {
        if Self::sees(id, &ctx) {
            self.0.on_enter(id, ctx);
        }
    }

    fn on_exit(&self, id: &tracing::span::Id, ctx: Context<'_, S>) {
        if Self::sees(id, &ctx) {
            self.0.on_exit(id, ctx);
        }
    }

    fn on_close(&self, id: tracing::span::Id, ctx: Context<'_, S>) {
        if Self::sees(&id, &ctx) {
            self.0.on_close(id, ctx);
        }
    }

    // tracing-opentelemetry's span extension (`set_attribute`, `add_link`, `set_status`) finds
    // its layer by downcasting the subscriber: the wrapped layer must answer for itself.
    #[allow(unsafe_code)]
    unsafe fn downcast_raw(&self, id: std::any::TypeId) -> Option<*const ()> {
        if id == std::any::TypeId::of::<Self>() {
            Some(self as *const Self as *const ())
        } else {
            // SAFETY: forwarding to the wrapped layer, which upholds the same contract.
            unsafe { self.0.downcast_raw(id) }
        }
    }
}
