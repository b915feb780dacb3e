//! One call of the gateway's protocol, and the one mapping of its answers to what the worker
//! does (the seed's error table):
//!
//! | answer | meaning | the worker |
//! |---|---|---|
//! | 2xx | done | — |
//! | 401 | missing, expired or revoked token | on the current token: invalidates it, fetches a new one (one fetch for all the calls refused) and sends the call once more; on an older one (replaced while the call was in flight): sends it again with the current token; a 401 on the token fetched after the call's own refusal is an authentication failure: transient (backoff, readiness false, the log names the token endpoint), counted by `…_gateway_auth_failures_total` |
//! | 403 | the token is valid but its claims do not allow this | transient, naming the queue and the claims to check (the grant can be fixed without a new spec) |
//! | 404 | the queue does not exist | fatal, naming `spec.source.gateway.queue`; once `prepare` found the queue, transient until it has been missing for 120 s (deleted and created again) |
//! | 410 | the receipt handle is no longer valid | stale receipt |
//! | 429, 502, 503, 504, no answer | overloaded or unreachable | transient, counted by the circuit breaker |
//! | other | — | transient, the gateway's message (redacted) in the log |

use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use prometheus_client::metrics::counter::Counter;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use switchboard_api::GatewaySource;

use super::breaker::CircuitBreaker;
use super::http::{Answer, HttpClient};
use super::token::{AfterRefusal, TokenProvider};
use crate::transport::TransportError;
use crate::transport::sqs::classify::{QueueAbsence, redact};

/// A call other than a long poll.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How much longer than its `waitTimeSeconds` a long poll may take.
pub const LONG_POLL_MARGIN: Duration = Duration::from_secs(10);
/// The most times one call is sent with a token (an outdated one, the current one, a new one).
const MAX_SENDS: u32 = 3;

/// An error answer: `{"error": code, "message": text}`.
#[derive(Debug, Default, Deserialize)]
struct Refusal {
    #[serde(default)]
    error: String,
    #[serde(default)]
    message: String,
}

/// The gateway refused a call (the source of a [`TransportError`]).
#[derive(Debug, thiserror::Error)]
#[error("HTTP {status} {code}: {message}")]
pub struct Refused {
    pub status: u16,
    pub code: String,
    pub message: String,
}

/// What a call needs to say about itself.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// For errors: `receive`, `delete`, …
    pub name: &'static str,
    pub method: &'a http::Method,
    /// `/`, `/dlq`, `/stats`, …
    pub path: &'static str,
    pub timeout: Duration,
}

/// The gateway of one adapter: where it is, which queue, and how calls are authenticated.
#[derive(Debug, Clone)]
pub struct Gateway {
    http: HttpClient,
    base: String,
    queue: String,
    /// The setting that names `queue`, for errors.
    queue_setting: &'static str,
    service: String,
    project: Option<String>,
    audience: Option<String>,
    scopes: Vec<String>,
    tokens: Arc<TokenProvider>,
    breaker: Arc<CircuitBreaker>,
    counters: AuthCounters,
    absence: QueueAbsence,
}

/// What the calls count of authentication.
#[derive(Debug, Clone)]
pub struct AuthCounters {
    /// 401 answers (each followed by a retry, unless it is an auth failure).
    pub unauthorized: Counter,
    /// Calls that failed with 401 after their retry.
    pub failures: Counter,
}

impl Gateway {
    pub fn new(
        spec: &GatewaySource,
        http: HttpClient,
        tokens: Arc<TokenProvider>,
        breaker: Arc<CircuitBreaker>,
        counters: AuthCounters,
    ) -> Self {
        let oauth2 = spec.auth.oauth2.as_ref();
        Self {
            http,
            base: spec.url.trim_end_matches('/').to_owned(),
            queue: spec.queue.clone(),
            queue_setting: "spec.source.gateway.queue",
            service: spec.service.clone(),
            project: spec.project.clone(),
            audience: oauth2.and_then(|o| o.audience.clone()),
            scopes: oauth2.map(|o| o.scopes.clone()).unwrap_or_default(),
            tokens,
            breaker,
            counters,
            absence: QueueAbsence::default(),
        }
    }

    /// The same gateway (its client, tokens and circuit breaker) for the queue `queue`, named
    /// by the setting `setting`, without the spec's project (its messages are not the
    /// project's own: dead letters carry the original attributes in `x-dlq-attributes`).
    pub fn for_queue(&self, queue: &str, setting: &'static str) -> Self {
        Self {
            queue: queue.to_owned(),
            queue_setting: setting,
            project: None,
            absence: QueueAbsence::default(),
            ..self.clone()
        }
    }

    /// `prepare` found the queue: from now on its absence is waited for (see [`QueueAbsence`]).
    pub fn queue_found(&mut self) {
        self.absence.found();
    }

    pub fn queue(&self) -> &str {
        &self.queue
    }

    pub fn project(&self) -> Option<&str> {
        self.project.as_deref()
    }

    pub fn service(&self) -> &str {
        &self.service
    }

    /// Sends `call` with query `query` (the queue is added) and JSON `body`, and decodes a
    /// JSON answer (`()` for none).
    pub async fn call<T: DeserializeOwned>(
        &self,
        call: Call<'_>,
        query: &[(&str, String)],
        body: Option<&serde_json::Value>,
    ) -> Result<T, TransportError> {
        let answer = self.exchange(call, query, body).await?;
        let body = if answer.body.is_empty() {
            &b"null"[..]
        } else {
            &answer.body[..]
        };
        serde_json::from_slice(body).map_err(|err| {
            TransportError::protocol(format!(
                "the gateway's answer to {} is not what the protocol says: {err}",
                call.name
            ))
        })
    }

    /// The call's answer, once it is a success; the error table otherwise.
    async fn exchange(
        &self,
        call: Call<'_>,
        query: &[(&str, String)],
        body: Option<&serde_json::Value>,
    ) -> Result<Answer, TransportError> {
        let url = {
            let mut encoded = form_urlencoded::Serializer::new(String::new());
            encoded
                .append_pair("X-Service", &self.service)
                .append_pair("queue", &self.queue);
            for (name, value) in query {
                encoded.append_pair(name, value);
            }
            format!("{}{}?{}", self.base, call.path, encoded.finish())
        };
        let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let mut sends = 0;
        let mut renewed = false;
        loop {
            let issued = self.tokens.token().await?;
            sends += 1;
            let request = http::Request::builder()
                .method(call.method.clone())
                .uri(url.as_str())
                .header("x-service", &self.service)
                .header("authorization", format!("Bearer {}", issued.token.expose()))
                .header("content-type", "application/json")
                .header("accept", "application/json")
                .body(Full::new(body.clone()))
                .map_err(|err| {
                    TransportError::fatal(
                        "spec.source.gateway.url",
                        format!("not a usable URL: {err}"),
                        None,
                    )
                })?;
            let permit = self.breaker.admit()?;
            let answer = match self.http.send(request, call.timeout).await {
                Ok(answer) => answer,
                Err(err) => {
                    permit.failed();
                    return Err(err.error(&format!("gateway {}", call.name), &self.base));
                }
            };
            if matches!(answer.status, 429 | 502 | 503 | 504) {
                permit.failed();
            } else {
                permit.succeeded();
            }
            if answer.status == 401 {
                self.counters.unauthorized.inc();
                let retry = match self.tokens.refused(issued.generation, !renewed).await {
                    AfterRefusal::Outdated => true,
                    AfterRefusal::Invalidated => {
                        renewed = true;
                        true
                    }
                    AfterRefusal::Kept => false,
                };
                if retry && sends < MAX_SENDS {
                    continue;
                }
                self.counters.failures.inc();
            }
            if (200..300).contains(&answer.status) {
                self.absence.reached();
                return Ok(answer);
            }
            return Err(self.refusal(call, &answer));
        }
    }

    /// The error table (see the module).
    fn refusal(&self, call: Call<'_>, answer: &Answer) -> TransportError {
        let parsed: Refusal = serde_json::from_slice(&answer.body).unwrap_or_default();
        let refused = Refused {
            status: answer.status,
            code: parsed.error,
            message: redact(&parsed.message),
        };
        let queue = &self.queue;
        match answer.status {
            401 => TransportError::transient(
                format!(
                    "gateway {}: the bearer token was refused twice (401); check the token \
                     (GATEWAY_TOKEN) or the OAuth2 client and its token endpoint",
                    call.name
                ),
                refused,
            ),
            403 => TransportError::transient(
                format!(
                    "gateway {}: queue {queue} (X-Service {}) is not allowed to this token (403); \
                     check the token's claims in the OAuth2 server: aud {}, scopes [{}]",
                    call.name,
                    self.service,
                    self.audience.as_deref().unwrap_or("(not requested)"),
                    self.scopes.join(" "),
                ),
                refused,
            ),
            404 if refused.code.contains("Queue") || refused.code.is_empty() => self.absence.error(
                self.queue_setting,
                &format!("gateway {}", call.name),
                &queue.to_string(),
                &format!("does not exist behind {} (404)", self.base),
                Box::new(refused),
            ),
            404 => TransportError::fatal(
                "spec.source.gateway.url",
                format!(
                    "gateway {}: {} has no {} (404): is it the gateway's base URL?",
                    call.name, self.base, call.path
                ),
                Some(Box::new(refused)),
            ),
            410 => TransportError::stale(
                format!(
                    "gateway {}: the receipt handle is no longer valid",
                    call.name
                ),
                Some(Box::new(refused)),
            ),
            _ => TransportError::transient(format!("gateway {} failed", call.name), refused),
        }
    }
}
