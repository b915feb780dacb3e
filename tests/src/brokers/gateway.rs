//! The gateway of seed 004 for the tests: an HTTP server implementing its protocol in front of
//! a real ElasticMQ, validating bearer tokens like a real gateway (RS256 signature against the
//! OAuth2 server's JWKS, `exp`, `aud`), with hooks to make it answer an error status for a
//! while and to revoke the tokens it has seen.
//!
//! The protocol (every call carries `X-Service: sqs`, as a header or a query parameter, and
//! `Authorization: Bearer <JWT>`; `queue` names the queue; errors are
//! `{"error": code, "message": text}`):
//!
//! | call | request | answer |
//! |---|---|---|
//! | send | `POST /?queue=Q` `{messageBody (base64), messageAttributes: {values}, delaySeconds}` | 200 `{messageId}` |
//! | receive | `GET /?queue=Q&maxNumberOfMessages&waitTimeSeconds&visibilityTimeoutSeconds[&project]` | 200 `{messages: [{messageId, receiptHandle, body (base64), attributes: {values}, receiveCount, sentTimestamp}]}` |
//! | delete | `DELETE /?queue=Q` `{receiptHandle}` | 204; 410 `ReceiptHandleIsInvalid` |
//! | change visibility | `PATCH /?queue=Q` `{receiptHandle, visibilityTimeoutSeconds}` | 204; 410 |
//! | send to DLQ | `POST /dlq?queue=Q` `{messageId, receiptHandle, reason, messageBody, messageAttributes}` | 200 `{messageId}` (written to `Q-dlq`; the original is deleted by the caller's delete) |
//! | stats | `GET /stats?queue=Q[&project]` | 200 `{availableMessages, inFlightMessages, deadLetterMessages, totalProcessed, averageDelaySecs}` |
//! | purge | `DELETE /purge?queue=Q` | 200 `{purged}` |
//! | health | `GET /health` | 200 `{status: "ok"}`, 502 when SQS is unreachable |
//!
//! A missing queue is 404 `QueueDoesNotExist`, an unreachable SQS 502. Bodies are stored in
//! SQS as the base64 text the sender gave, so any bytes survive the round trip.
//!
//! With a [`TestCa`] the gateway serves HTTPS only, with a certificate for `127.0.0.1` issued
//! by that CA (generated in the test, trusted by nothing else).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::ProvideErrorMetadata;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName};
use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::hydra::{Hydra, OAuthClient};
use super::sqs::{ElasticMq, string_attributes};
use super::{BrokerFixture, SqsBroker};
use crate::Fixture;
use crate::servers::{free_port, http_get};

/// A CA made for one test and the certificate of the gateway (`127.0.0.1`, `localhost`) it
/// issued.
pub struct TestCa {
    /// The CA's certificate, PEM: what a client must trust.
    pub ca_pem: String,
    /// The server's certificate (for `localhost` and 127.0.0.1) and its PKCS#8 key, PEM: for
    /// servers that read files (PostgreSQL's `ssl_cert_file`, `ssl_key_file`).
    pub cert_pem: String,
    pub key_pem: String,
    server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    pub fn generate() -> Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "switchboard test CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca.self_signed(&ca_key)?;
        let key = KeyPair::generate()?;
        let mut leaf = CertificateParams::new(vec!["localhost".to_owned()])?;
        leaf.subject_alt_names
            .push(rcgen::SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        leaf.distinguished_name
            .push(DnType::CommonName, "switchboard test gateway");
        let leaf = leaf.signed_by(&key, &ca, &ca_key)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )?;
        Ok(Self {
            ca_pem: ca.pem(),
            cert_pem: leaf.pem(),
            key_pem: key.serialize_pem(),
            server: Arc::new(server),
        })
    }
}

/// Accepts TLS connections only: a client that refuses the certificate never gets to send a
/// request (counted in [`Hooks::handshake_failures`]).
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    hooks: Arc<Hooks>,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((stream, addr)) = self.tcp.accept().await else {
                continue;
            };
            let handshake =
                tokio::time::timeout(Duration::from_secs(5), self.acceptor.accept(stream)).await;
            match handshake {
                Ok(Ok(tls)) => return (tls, addr),
                _ => {
                    self.hooks
                        .handshake_failures
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// What the gateway checks in every token.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// ElasticMQ's endpoint.
    pub sqs_endpoint: String,
    /// The OAuth2 server's public port, serving `/.well-known/jwks.json`.
    pub jwks_port: u16,
    /// The audience every token must name in `aud`.
    pub audience: String,
    /// HTTPS with this CA's certificate; plain HTTP without.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// What the tests can make the gateway do, and what it counts. Survives restarts.
#[derive(Debug, Default)]
pub struct Hooks {
    /// Answer this status to every authenticated call until the instant.
    failing: Mutex<Option<(StatusCode, Instant)>>,
    /// Token ids (`jti`) seen so far, and those revoked.
    seen: Mutex<HashSet<String>>,
    revoked: Mutex<HashSet<String>>,
    /// Every bearer token presented (to check that none leaks into logs or metrics).
    tokens: Mutex<HashSet<String>>,
    /// Answers by status code.
    answers: Mutex<BTreeMap<u16, u64>>,
    /// Calls refused because their token had expired (each also counted as a 401).
    expired: AtomicU64,
    /// Messages deleted through the gateway.
    deleted: AtomicU64,
    /// TLS handshakes that failed (a client that does not trust the certificate).
    handshake_failures: AtomicU64,
    /// Queues whose dead letters are refused (413), as a gateway refuses what its SQS will
    /// never take.
    refused_dead_letters: Mutex<HashSet<String>>,
    /// Receives are held unanswered while set (a hung gateway).
    hang_receives: std::sync::atomic::AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Hooks {
    /// Every authenticated call is answered `status` for `duration`.
    pub fn fail_for(&self, status: StatusCode, duration: Duration) {
        *lock(&self.failing) = Some((status, Instant::now() + duration));
    }

    /// Ends a [`Hooks::fail_for`] early.
    pub fn stop_failing(&self) {
        *lock(&self.failing) = None;
    }

    /// Revokes every token presented so far: their next use is answered 401.
    pub fn revoke_seen_tokens(&self) -> usize {
        let seen: Vec<String> = lock(&self.seen).drain().collect();
        let count = seen.len();
        lock(&self.revoked).extend(seen);
        count
    }

    /// How many valid tokens were presented since the last revocation.
    pub fn seen_tokens(&self) -> usize {
        lock(&self.seen).len()
    }

    /// The bearer tokens presented so far.
    pub fn tokens(&self) -> Vec<String> {
        lock(&self.tokens).iter().cloned().collect()
    }

    /// From now on, every dead letter of queue `queue` is refused with 413 `MessageTooLong`.
    pub fn refuse_dead_letters_of(&self, queue: &str) {
        lock(&self.refused_dead_letters).insert(queue.to_owned());
    }

    /// Holds every receive unanswered (`true`), or answers them again (`false`).
    pub fn hang_receives(&self, hang: bool) {
        self.hang_receives.store(hang, Ordering::SeqCst);
    }

    /// How many TLS handshakes failed.
    pub fn handshake_failures(&self) -> u64 {
        self.handshake_failures.load(Ordering::Relaxed)
    }

    /// How many calls were refused because their token had expired.
    pub fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    /// How many calls were answered with `status`.
    pub fn answered(&self, status: u16) -> u64 {
        lock(&self.answers).get(&status).copied().unwrap_or(0)
    }

    fn count(&self, status: StatusCode) {
        *lock(&self.answers).entry(status.as_u16()).or_default() += 1;
    }
}

/// An RSA public key: modulus and exponent, big-endian.
type RsaKey = (Vec<u8>, Vec<u8>);

struct Shared {
    config: GatewayConfig,
    sqs: Client,
    hooks: Arc<Hooks>,
    /// RSA public keys by key id.
    keys: Mutex<HashMap<String, RsaKey>>,
}

/// The gateway, serving on a fixed loopback port on its own thread and runtime.
pub struct Gateway {
    port: u16,
    shared: Arc<Shared>,
    running: Option<(oneshot::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").field("port", &self.port).finish()
    }
}

impl Gateway {
    /// Starts the gateway on a free port, waiting until it accepts connections.
    pub fn start(config: GatewayConfig) -> Result<Self> {
        let shared = Arc::new(Shared {
            sqs: super::sqs::sqs_client(&config.sqs_endpoint, "us-east-1"),
            config,
            hooks: Arc::default(),
            keys: Mutex::default(),
        });
        // A reserved port, not `bind(0)`'s: `restart` binds it again.
        let port = free_port()?;
        let listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
        let mut gateway = Self {
            port,
            shared,
            running: None,
        };
        gateway.serve(listener)?;
        Ok(gateway)
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS); the same across restarts.
    pub fn url(&self) -> String {
        let scheme = if self.shared.config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    pub fn hooks(&self) -> Arc<Hooks> {
        self.shared.hooks.clone()
    }

    /// Stops serving: open connections are cut.
    pub fn stop(&mut self) {
        if let Some((stop, thread)) = self.running.take() {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }

    /// Stops, then serves again on the same port.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let listener = std::net::TcpListener::bind(("127.0.0.1", self.port))
            .with_context(|| format!("binding the gateway's port {} again", self.port))?;
        self.serve(listener)
    }

    fn serve(&mut self, listener: std::net::TcpListener) -> Result<()> {
        listener.set_nonblocking(true)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let shared = self.shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("gateway-{}", self.port))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("gateway runtime");
                runtime.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("gateway listener");
                    let app = axum::Router::new()
                        .route(
                            "/",
                            get(receive).post(send).delete(delete).patch(visibility),
                        )
                        .route("/dlq", post(dead_letter))
                        .route("/stats", get(stats))
                        .route("/purge", axum::routing::delete(purge))
                        .route("/health", get(health))
                        .with_state(shared.clone());
                    match shared.config.tls.clone() {
                        None => serve_until(listener, app, stopped).await,
                        Some(config) => {
                            let listener = TlsListener {
                                tcp: listener,
                                acceptor: tokio_rustls::TlsAcceptor::from(config),
                                hooks: shared.hooks.clone(),
                            };
                            serve_until(listener, app, stopped).await;
                        }
                    }
                });
                // Dropping the runtime ends every connection task.
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        self.running = Some((stop, thread));
        Ok(())
    }
}

/// Serves `app` on `listener` until `stopped`.
async fn serve_until<L>(listener: L, app: axum::Router, stopped: oneshot::Receiver<()>)
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    tokio::select! {
        _ = axum::serve(listener, app) => {}
        _ = stopped => {}
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop();
    }
}

type AppState = Arc<Shared>;

/// An error answer of the protocol.
struct Failure(StatusCode, &'static str, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": self.1, "message": self.2}))).into_response()
    }
}

type Answer = Result<Response, Failure>;

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Shared {
    /// Checks the service, the token and the hooks; counts the answer when it is a refusal.
    async fn admit(
        &self,
        headers: &HeaderMap,
        query: &HashMap<String, String>,
    ) -> Result<(), Failure> {
        let result = self.check(headers, query).await;
        if let Err(Failure(status, ..)) = &result {
            self.hooks.count(*status);
        }
        result
    }

    async fn check(
        &self,
        headers: &HeaderMap,
        query: &HashMap<String, String>,
    ) -> Result<(), Failure> {
        let service = headers
            .get("x-service")
            .and_then(|v| v.to_str().ok())
            .or(query.get("X-Service").map(String::as_str));
        if service != Some("sqs") {
            return Err(Failure(
                StatusCode::BAD_REQUEST,
                "UnknownService",
                format!("X-Service must be sqs, got {service:?}"),
            ));
        }
        let token = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| {
                Failure(
                    StatusCode::UNAUTHORIZED,
                    "Unauthorized",
                    "no bearer token".into(),
                )
            })?;
        lock(&self.hooks.tokens).insert(token.to_owned());
        let claims = self.verify(token).await?;
        let jti = claims["jti"].as_str().unwrap_or_default().to_owned();
        if lock(&self.hooks.revoked).contains(&jti) {
            return Err(Failure(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "the token was revoked".into(),
            ));
        }
        lock(&self.hooks.seen).insert(jti);
        let failing = *lock(&self.hooks.failing);
        if let Some((status, until)) = failing
            && Instant::now() < until
        {
            let message = match status {
                StatusCode::FORBIDDEN => format!(
                    "the token's claims do not allow queue {}: claim scp lacks queue:{}",
                    query.get("queue").map_or("", String::as_str),
                    query.get("queue").map_or("", String::as_str)
                ),
                _ => "the gateway is overloaded".into(),
            };
            let code = if status == StatusCode::FORBIDDEN {
                "Forbidden"
            } else {
                "Unavailable"
            };
            return Err(Failure(status, code, message));
        }
        Ok(())
    }

    /// The claims of `token` once its RS256 signature, `exp` and `aud` check out.
    async fn verify(&self, token: &str) -> Result<Value, Failure> {
        let unauthorized =
            |message: &str| Failure(StatusCode::UNAUTHORIZED, "Unauthorized", message.to_owned());
        let parts: Vec<&str> = token.split('.').collect();
        let [header, payload, signature] = parts[..] else {
            return Err(unauthorized("not a JWT"));
        };
        let decode = |part: &str| URL_SAFE_NO_PAD.decode(part).ok();
        let header: Value = decode(header)
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .ok_or_else(|| unauthorized("malformed JWT header"))?;
        if header["alg"] != "RS256" {
            return Err(unauthorized("only RS256 tokens are accepted"));
        }
        let kid = header["kid"].as_str().unwrap_or_default().to_owned();
        let key = match self.key(&kid) {
            Some(key) => key,
            None => {
                self.refresh_keys().await;
                self.key(&kid)
                    .ok_or_else(|| unauthorized("unknown signing key"))?
            }
        };
        let signature = decode(signature).ok_or_else(|| unauthorized("malformed signature"))?;
        let signed = &token[..header_and_payload_len(token)];
        ring::signature::RsaPublicKeyComponents {
            n: &key.0,
            e: &key.1,
        }
        .verify(
            &ring::signature::RSA_PKCS1_2048_8192_SHA256,
            signed.as_bytes(),
            &signature,
        )
        .map_err(|_| unauthorized("bad signature"))?;
        let claims: Value = decode(payload)
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .ok_or_else(|| unauthorized("malformed claims"))?;
        if claims["exp"].as_u64().is_none_or(|exp| exp <= now_secs()) {
            self.hooks.expired.fetch_add(1, Ordering::Relaxed);
            return Err(unauthorized("the token has expired"));
        }
        let audience = &self.config.audience;
        let has_audience = match &claims["aud"] {
            Value::String(aud) => aud == audience,
            Value::Array(auds) => auds.iter().any(|aud| aud == audience),
            _ => false,
        };
        if !has_audience {
            return Err(Failure(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!("claim aud does not name {audience}"),
            ));
        }
        Ok(claims)
    }

    fn key(&self, kid: &str) -> Option<RsaKey> {
        lock(&self.keys).get(kid).cloned()
    }

    /// Reads the JWKS again (a key rotated, or the first call).
    async fn refresh_keys(&self) {
        let port = self.config.jwks_port;
        let Ok(Ok((200, body))) =
            tokio::task::spawn_blocking(move || http_get(port, "/.well-known/jwks.json")).await
        else {
            return;
        };
        let Ok(jwks) = serde_json::from_str::<Value>(&body) else {
            return;
        };
        let mut keys = lock(&self.keys);
        for key in jwks["keys"].as_array().into_iter().flatten() {
            let part = |name: &str| {
                key[name]
                    .as_str()
                    .and_then(|v| URL_SAFE_NO_PAD.decode(v).ok())
            };
            if let (Some(kid), Some(n), Some(e)) = (key["kid"].as_str(), part("n"), part("e")) {
                keys.insert(kid.to_owned(), (n, e));
            }
        }
    }

    async fn queue_url(&self, queue: Option<&String>) -> Result<String, Failure> {
        let queue = queue.ok_or_else(|| {
            Failure(
                StatusCode::BAD_REQUEST,
                "MissingParameter",
                "queue is required".into(),
            )
        })?;
        let output = self
            .sqs
            .get_queue_url()
            .queue_name(queue)
            .send()
            .await
            .map_err(|err| sqs_failure(&err))?;
        output.queue_url.ok_or_else(|| {
            Failure(
                StatusCode::BAD_GATEWAY,
                "BadGateway",
                "GetQueueUrl returned no URL".into(),
            )
        })
    }

    /// Counts and returns a successful answer.
    fn ok(&self, status: StatusCode, body: Option<Value>) -> Answer {
        self.hooks.count(status);
        Ok(match body {
            Some(body) => (status, Json(body)).into_response(),
            None => status.into_response(),
        })
    }
}

/// The length of `header.payload`, the signed part of a JWT.
fn header_and_payload_len(token: &str) -> usize {
    token.rfind('.').unwrap_or(token.len())
}

/// What an SQS failure is to the gateway's caller.
fn sqs_failure<E: ProvideErrorMetadata + std::fmt::Debug>(
    err: &aws_sdk_sqs::error::SdkError<E, aws_sdk_sqs::config::http::HttpResponse>,
) -> Failure {
    match err.code() {
        Some(code) if code.contains("NonExistentQueue") || code.contains("QueueDoesNotExist") => {
            Failure(
                StatusCode::NOT_FOUND,
                "QueueDoesNotExist",
                "the queue does not exist".into(),
            )
        }
        Some(code)
            if code.contains("ReceiptHandleIsInvalid")
                || code.contains("InvalidParameterValue") =>
        {
            Failure(
                StatusCode::GONE,
                "ReceiptHandleIsInvalid",
                "the receipt handle is no longer valid".into(),
            )
        }
        Some(code) => Failure(
            StatusCode::BAD_GATEWAY,
            "BadGateway",
            format!("SQS answered {code}"),
        ),
        None => Failure(
            StatusCode::BAD_GATEWAY,
            "BadGateway",
            "SQS is unreachable".into(),
        ),
    }
}

/// Message attributes of the protocol: `{values: {name: text}}`.
#[derive(Debug, Default, Deserialize)]
struct Attributes {
    #[serde(default)]
    values: BTreeMap<String, String>,
}

fn sqs_attributes(
    values: &BTreeMap<String, String>,
) -> Result<HashMap<String, MessageAttributeValue>, Failure> {
    values
        .iter()
        .filter(|(_, value)| !value.is_empty())
        .map(|(name, value)| {
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(|err| {
                    Failure(StatusCode::BAD_REQUEST, "InvalidAttribute", err.to_string())
                })?;
            Ok((name.clone(), value))
        })
        .collect()
}

fn bad_request(message: String) -> Failure {
    Failure(StatusCode::BAD_REQUEST, "InvalidRequest", message)
}

/// A JSON request body, or 400.
fn json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Failure> {
    serde_json::from_slice(body).map_err(|err| bad_request(err.to_string()))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SendRequest {
    message_body: String,
    #[serde(default)]
    message_attributes: Attributes,
    #[serde(default)]
    delay_seconds: i32,
}

/// Sends one message (its body checked to be base64, stored as given) to `queue_url`.
async fn send_message(
    shared: &Shared,
    queue_url: &str,
    body: &str,
    attributes: &BTreeMap<String, String>,
    delay_seconds: i32,
) -> Answer {
    STANDARD
        .decode(body)
        .map_err(|err| bad_request(format!("messageBody is not base64: {err}")))?;
    let output = shared
        .sqs
        .send_message()
        .queue_url(queue_url)
        .message_body(body)
        .set_message_attributes(Some(sqs_attributes(attributes)?))
        .delay_seconds(delay_seconds)
        .send()
        .await
        .map_err(|err| sqs_failure(&err))?;
    shared.ok(
        StatusCode::OK,
        Some(json!({"messageId": output.message_id.unwrap_or_default()})),
    )
}

async fn send(
    State(shared): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Answer {
    shared.admit(&headers, &query).await?;
    let request: SendRequest = json_body(&body)?;
    let url = shared.queue_url(query.get("queue")).await?;
    send_message(
        &shared,
        &url,
        &request.message_body,
        &request.message_attributes.values,
        request.delay_seconds,
    )
    .await
}

async fn receive(
    State(shared): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Answer {
    shared.admit(&headers, &query).await?;
    if shared.hooks.hang_receives.load(Ordering::SeqCst) {
        // A hung gateway: the caller's own deadline is all that ends this call.
        std::future::pending::<()>().await;
    }
    let url = shared.queue_url(query.get("queue")).await?;
    let number = |name: &str, default: i32| -> Result<i32, Failure> {
        query.get(name).map_or(Ok(default), |v| {
            v.parse()
                .map_err(|_| bad_request(format!("{name} is not a number")))
        })
    };
    let mut call = shared
        .sqs
        .receive_message()
        .queue_url(&url)
        .max_number_of_messages(number("maxNumberOfMessages", 10)?)
        .wait_time_seconds(number("waitTimeSeconds", 0)?)
        .message_system_attribute_names(MessageSystemAttributeName::All)
        .message_attribute_names("All");
    if query.contains_key("visibilityTimeoutSeconds") {
        call = call.visibility_timeout(number("visibilityTimeoutSeconds", 30)?);
    }
    let output = call.send().await.map_err(|err| sqs_failure(&err))?;
    let project = query.get("project");
    let mut messages = Vec::new();
    for message in output.messages.unwrap_or_default() {
        let values: BTreeMap<String, Value> = message
            .message_attributes()
            .into_iter()
            .flatten()
            .filter_map(|(name, value)| Some((name.clone(), attribute_json(value)?)))
            .collect();
        let system = message.attributes();
        let system = |name: MessageSystemAttributeName| {
            system
                .and_then(|attributes| attributes.get(&name))
                .and_then(|value| value.parse::<u64>().ok())
        };
        if let Some(project) = project
            && values.get("project").and_then(Value::as_str) != Some(project.as_str())
        {
            // Another project's message: visible again at once, for its own consumers.
            let _ = shared
                .sqs
                .change_message_visibility()
                .queue_url(&url)
                .receipt_handle(message.receipt_handle().unwrap_or_default())
                .visibility_timeout(0)
                .send()
                .await;
            continue;
        }
        messages.push(json!({
            "messageId": message.message_id(),
            "receiptHandle": message.receipt_handle(),
            "body": message.body(),
            "attributes": {"values": values},
            "receiveCount": system(MessageSystemAttributeName::ApproximateReceiveCount).unwrap_or(1),
            "sentTimestamp": system(MessageSystemAttributeName::SentTimestamp),
        }));
    }
    shared.ok(StatusCode::OK, Some(json!({"messages": messages})))
}

/// An SQS message attribute as this gateway serves it: its text, except that a `Number`
/// attribute is served as a JSON number (as some gateways do: the protocol says text, so for
/// the worker such a message does not follow it).
fn attribute_json(value: &MessageAttributeValue) -> Option<Value> {
    let text = value.string_value()?;
    if value.data_type() == "Number"
        && let Ok(number) = text.parse::<serde_json::Number>()
    {
        return Some(Value::Number(number));
    }
    Some(Value::String(text.to_owned()))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReceiptRequest {
    receipt_handle: String,
    #[serde(default)]
    visibility_timeout_seconds: i32,
}

/// Deletes the message of a receipt handle (`delete`), or sets its visibility.
async fn receipt_call(
    shared: &Shared,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    body: &[u8],
    delete: bool,
) -> Answer {
    shared.admit(headers, query).await?;
    let request: ReceiptRequest = json_body(body)?;
    let url = shared.queue_url(query.get("queue")).await?;
    if delete {
        shared
            .sqs
            .delete_message()
            .queue_url(&url)
            .receipt_handle(&request.receipt_handle)
            .send()
            .await
            .map_err(|err| sqs_failure(&err))?;
        shared.hooks.deleted.fetch_add(1, Ordering::Relaxed);
    } else {
        shared
            .sqs
            .change_message_visibility()
            .queue_url(&url)
            .receipt_handle(&request.receipt_handle)
            .visibility_timeout(request.visibility_timeout_seconds)
            .send()
            .await
            .map_err(|err| sqs_failure(&err))?;
    }
    shared.ok(StatusCode::NO_CONTENT, None)
}

async fn delete(
    State(shared): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Answer {
    receipt_call(&shared, &query, &headers, &body, true).await
}

async fn visibility(
    State(shared): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Answer {
    receipt_call(&shared, &query, &headers, &body, false).await
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeadLetterRequest {
    message_id: String,
    reason: String,
    message_body: String,
    #[serde(default)]
    message_attributes: Attributes,
}

async fn dead_letter(
    State(shared): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Answer {
    shared.admit(&headers, &query).await?;
    let request: DeadLetterRequest = json_body(&body)?;
    if let Some(queue) = query.get("queue")
        && lock(&shared.hooks.refused_dead_letters).contains(queue)
    {
        shared.hooks.count(StatusCode::PAYLOAD_TOO_LARGE);
        return Err(Failure(
            StatusCode::PAYLOAD_TOO_LARGE,
            "MessageTooLong",
            "the dead-letter queue refuses this message".into(),
        ));
    }
    let dead_letter_queue = query.get("queue").map(|queue| format!("{queue}-dlq"));
    let url = shared.queue_url(dead_letter_queue.as_ref()).await?;
    let mut attributes = request.message_attributes.values;
    attributes
        .entry("x-dlq-reason".into())
        .or_insert(request.reason);
    attributes
        .entry("x-dlq-message-id".into())
        .or_insert(request.message_id);
    send_message(&shared, &url, &request.message_body, &attributes, 0).await
}

async fn stats(
    State(shared): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Answer {
    shared.admit(&headers, &query).await?;
    let url = shared.queue_url(query.get("queue")).await?;
    let dead_letter_queue = query.get("queue").map(|queue| format!("{queue}-dlq"));
    let counts = |url: String| {
        let sqs = shared.sqs.clone();
        async move {
            let output = sqs
                .get_queue_attributes()
                .queue_url(url)
                .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
                .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
                .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
                .send()
                .await
                .map_err(|err| sqs_failure(&err))?;
            let attributes = output.attributes.unwrap_or_default();
            let read = |name: QueueAttributeName| -> u64 {
                attributes
                    .get(&name)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            Ok::<_, Failure>((
                read(QueueAttributeName::ApproximateNumberOfMessages)
                    + read(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
                read(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
            ))
        }
    };
    let (available, in_flight) = counts(url).await?;
    let dead_letters = match shared.queue_url(dead_letter_queue.as_ref()).await {
        Ok(url) => counts(url).await.map(|(a, b)| a + b).unwrap_or(0),
        Err(_) => 0,
    };
    shared.ok(
        StatusCode::OK,
        Some(json!({
            "availableMessages": available,
            "inFlightMessages": in_flight,
            "deadLetterMessages": dead_letters,
            "totalProcessed": shared.hooks.deleted.load(Ordering::Relaxed),
            "averageDelaySecs": 0.0,
        })),
    )
}

async fn purge(
    State(shared): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Answer {
    shared.admit(&headers, &query).await?;
    let url = shared.queue_url(query.get("queue")).await?;
    let before = shared
        .sqs
        .get_queue_attributes()
        .queue_url(&url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .send()
        .await
        .map_err(|err| sqs_failure(&err))?
        .attributes
        .and_then(|a| {
            a.get(&QueueAttributeName::ApproximateNumberOfMessages)
                .cloned()
        })
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    shared
        .sqs
        .purge_queue()
        .queue_url(&url)
        .send()
        .await
        .map_err(|err| sqs_failure(&err))?;
    shared.ok(StatusCode::OK, Some(json!({"purged": before})))
}

async fn health(State(shared): State<AppState>) -> Answer {
    match shared.sqs.list_queues().send().await {
        Ok(_) => shared.ok(StatusCode::OK, Some(json!({"status": "ok"}))),
        Err(_) => {
            shared.hooks.count(StatusCode::BAD_GATEWAY);
            Err(Failure(
                StatusCode::BAD_GATEWAY,
                "BadGateway",
                "SQS is unreachable".into(),
            ))
        }
    }
}

/// `body` as the gateway stores it in SQS (base64).
pub fn encode_body(body: &[u8]) -> String {
    STANDARD.encode(body)
}

/// A body the gateway stored in SQS, decoded.
pub fn decode_body(stored: &str) -> Result<Vec<u8>> {
    match STANDARD.decode(stored) {
        Ok(body) => Ok(body),
        Err(err) => bail!("a body stored by the gateway is not base64 ({err}): {stored:?}"),
    }
}

/// The audience the test gateway requires, and the scope its clients get.
pub const AUDIENCE: &str = "https://gateway.switchboard.test";
pub const SCOPE: &str = "sqs";
/// The lifetime of access tokens in the contract suite.
const CONTRACT_TOKEN_LIFETIME: Duration = Duration::from_secs(60);

/// An SQS queue of a real ElasticMQ behind the test gateway, with tokens from a real Hydra.
#[derive(Debug)]
pub struct GatewayBroker {
    /// The queues behind the gateway (bodies stored base64, see the module).
    pub sqs: SqsBroker,
    pub hydra: Hydra,
    pub gateway: Gateway,
    pub client: OAuthClient,
}

impl GatewayBroker {
    /// ElasticMQ, Hydra issuing tokens that live `token_lifetime`, one client, and the
    /// gateway (over HTTPS with `ca`'s certificate, if given); with the environment a worker
    /// needs (the client secret).
    pub fn start_with(
        token_lifetime: Duration,
        ca: Option<&TestCa>,
    ) -> Result<(Self, Vec<(String, String)>)> {
        let server = ElasticMq::start()?;
        let sqs = SqsBroker {
            proxy: super::sqs::SqsProxy::start(server.port())?,
            server,
        };
        let hydra = Hydra::start(token_lifetime)?;
        let client = hydra.create_client(AUDIENCE, &[SCOPE])?;
        let gateway = Gateway::start(GatewayConfig {
            sqs_endpoint: sqs.server.endpoint(),
            jwks_port: hydra.public_port(),
            audience: AUDIENCE.to_owned(),
            tls: ca.map(|ca| ca.server.clone()),
        })?;
        let env = vec![(
            switchboard_api::source::gateway::CLIENT_SECRET_ENV.to_owned(),
            client.secret.clone(),
        )];
        Ok((
            Self {
                sqs,
                hydra,
                gateway,
                client,
            },
            env,
        ))
    }

    /// The body of `spec.source` for queue `name`, with more `gateway` fields (a YAML flow
    /// body such as `visibilityTimeoutSeconds: 4`, or empty).
    pub fn source(&self, name: &str, more: &str) -> String {
        let more = if more.is_empty() {
            String::new()
        } else {
            format!(", {more}")
        };
        format!(
            "gateway: {{url: \"{}\", queue: {name}, waitTimeSeconds: 1, auth: {{oauth2: \
             {{tokenUrl: \"{}\", clientId: \"{}\", audience: \"{AUDIENCE}\", scopes: [{SCOPE}]}}}}{more}}}",
            self.gateway.url(),
            self.hydra.token_url(),
            self.client.id,
        )
    }

    /// Creates queue `name` (visibility 2 s: a killed worker's messages come back quickly)
    /// and its dead-letter queue behind the gateway.
    pub async fn create_queues(&self, name: &str) -> Result<()> {
        let visibility = [(QueueAttributeName::VisibilityTimeout, "2")];
        self.sqs.server.create_queue(name, &visibility).await?;
        self.sqs
            .server
            .create_queue(&format!("{name}-dlq"), &[])
            .await?;
        Ok(())
    }
}

impl BrokerFixture for GatewayBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        Self::start_with(CONTRACT_TOKEN_LIFETIME, None)
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        self.create_queues(name).await?;
        // A lease of 5 s, not the 2 s of the SQS fixture: the gateway extends and acknowledges
        // one message per call, and with a 2 s lease a starved CI host spent the chaos run's
        // last worker on lease extensions (4,189 messages not settled within 300 s).
        Ok(self.source(name, "visibilityTimeoutSeconds: 5"))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    async fn produce(&self, _fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        let encoded = bodies.iter().map(|body| encode_body(body).into_bytes());
        self.sqs
            .server
            .send_bodies(&self.sqs.url(name), encoded)
            .await
            .map(drop)
    }

    async fn unacknowledged(&self, fx: &Fixture, name: &str) -> Result<u64> {
        self.sqs.unacknowledged(fx, name).await
    }

    async fn dead_letters(&self, fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        self.sqs
            .dead_letters(fx, name)
            .await?
            .into_iter()
            .map(|(stored, reason)| Ok((decode_body(&String::from_utf8(stored)?)?, reason)))
            .collect()
    }

    /// Restarts the gateway and the SQS server behind it.
    async fn restart(&mut self, fx: &mut Fixture) -> Result<()> {
        self.gateway.stop();
        self.sqs.restart(fx).await?;
        self.gateway.restart()
    }

    /// The gateway's (the worker's token requests go to the OAuth2 server, not counted here).
    fn address(&self, _fx: &Fixture) -> Result<String> {
        Ok(format!("127.0.0.1:{}", self.gateway.port))
    }

    /// The SQS server behind the gateway dies (SIGKILL) and comes back on its data; the
    /// gateway stays up and answers 502 meanwhile, as a real one in front of a failing SQS.
    async fn crash(&mut self, fx: &mut Fixture) -> Result<()> {
        self.sqs.crash(fx).await
    }

    /// Deletes and creates the queue behind the gateway again at once. Not after a worker call
    /// found it missing, as [`SqsBroker::recreate`] does: ElasticMQ leaves calls to a deleted
    /// queue unanswered for a while (a receive got no answer until the worker's 11 s deadline,
    /// and no call was answered 404 within the next 60 s), so that wait would time out. The
    /// gateway's messageId is SQS's MessageId, unique per send: a new queue's messages can
    /// never re-use one.
    async fn recreate(&self, _fx: &Fixture, name: &str) -> Result<()> {
        self.sqs.recreate_after(name, || true).await
    }

    /// A message whose headers are `String` message attributes, as a producer sends them to
    /// the SQS queue behind the gateway (which serves them as `attributes.values`).
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<()> {
        self.sqs
            .server
            .send_with_attributes(
                &self.sqs.url(name),
                encode_body(&body).into_bytes(),
                string_attributes(headers),
            )
            .await
            .map(drop)
    }

    /// A message whose `Number` attribute the gateway serves as a JSON number (`"n": 5`),
    /// where the protocol says every attribute value is a string.
    async fn produce_undecodable(&self, _fx: &Fixture, name: &str, body: Vec<u8>) -> Result<()> {
        self.sqs
            .server
            .send_with_attributes(
                &self.sqs.url(name),
                encode_body(&body).into_bytes(),
                vec![("n", "Number", b"5".to_vec())],
            )
            .await
            .map(drop)
    }

    /// The gateway refuses every dead letter of `name` with 413 `MessageTooLong`, as a gateway
    /// answers for a letter its SQS dead-letter queue will never take.
    async fn refuse_dead_letters(&self, _fx: &Fixture, name: &str) -> Result<()> {
        self.gateway.hooks().refuse_dead_letters_of(name);
        Ok(())
    }
}
