//! Bearer tokens for the gateway: a static token, or OAuth2 client credentials (RFC 6749
//! §4.4) fetched from the token endpoint with a small hyper client of our own (no `oauth2`
//! crate: one form POST and one JSON answer do not need it, and hyper is already built).
//!
//! - **Cached**, and refreshed *before* it expires: at `expires_in` minus a margin of a tenth
//!   of the lifetime, at least [`MIN_MARGIN`] (a JWT's `exp` is in whole seconds, so a token
//!   can end up to a second before `expires_in` says, and a call still has to reach the
//!   gateway) but never more than half the lifetime, at most [`MAX_MARGIN`] (so a 5 s token is
//!   refreshed after 4 s, an hour's 30 s before its end). Without `expires_in` a token is
//!   reused for [`UNKNOWN_LIFETIME`] at most.
//! - **One refresh at a time**: the cache is behind an async lock held across the refresh;
//!   callers that arrive meanwhile wait and then take the new token.
//! - **Generations**: every token fetched is one generation newer than the last, and a caller
//!   gets the generation with the token. **On a 401** the caller reports the generation it
//!   sent ([`TokenProvider::refused`]): only a 401 on the *current* generation invalidates the
//!   token, so the one refresh that follows serves every caller; a caller whose 401 was on an
//!   older generation (it was in flight while the token was replaced) retries with the
//!   current token without invalidating anything. A revocation thus costs one token request,
//!   however many calls were in flight with the revoked token.
//! - **Never logged or exported**: [`Token`] prints as `<token>`; error texts of the token
//!   endpoint are redacted. The token request follows no redirect (see `http.rs`).

use std::fmt;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::Bytes;
use prometheus_client::metrics::counter::Counter;
use serde::Deserialize;
use switchboard_api::source::gateway::{CLIENT_SECRET_ENV, TOKEN_ENV};
use tokio::sync::Mutex;

use super::http::HttpClient;
use crate::transport::TransportError;
use crate::transport::sqs::classify::redact;

/// The most a token is refreshed ahead of its expiry.
const MAX_MARGIN: Duration = Duration::from_secs(30);
/// The least a token is refreshed ahead of its expiry (when it lives two of these at least).
const MIN_MARGIN: Duration = Duration::from_secs(1);
/// How long a token whose lifetime the endpoint did not say is reused.
const UNKNOWN_LIFETIME: Duration = Duration::from_secs(60);
/// One token request.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(10);

/// A bearer token; never shown.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<token>")
    }
}

/// The client-credentials grant's settings.
#[derive(Debug, Clone)]
pub struct ClientCredentials {
    pub token_url: String,
    pub client_id: String,
    pub client_secret: Token,
    pub scopes: Vec<String>,
    pub audience: Option<String>,
}

/// Where tokens come from.
#[derive(Debug, Clone)]
pub enum TokenSource {
    Static(Token),
    ClientCredentials(ClientCredentials),
}

impl TokenSource {
    /// The source `auth` describes, its secret read from the environment. Fails fatally
    /// naming the variable when it is not set.
    pub fn from_spec(auth: &switchboard_api::GatewayAuth) -> Result<Self, TransportError> {
        let env = |name: &'static str| {
            std::env::var(name)
                .ok()
                .filter(|value| !value.trim().is_empty())
                .map(|value| Token(value.trim().to_owned()))
                .ok_or_else(|| {
                    TransportError::fatal(
                        name,
                        "is not set (the operator sets it from the Secret reference)",
                        None,
                    )
                })
        };
        match &auth.oauth2 {
            Some(oauth2) => Ok(Self::ClientCredentials(ClientCredentials {
                token_url: oauth2.token_url.clone(),
                client_id: oauth2.client_id.clone(),
                client_secret: env(CLIENT_SECRET_ENV)?,
                scopes: oauth2.scopes.clone(),
                audience: oauth2.audience.clone(),
            })),
            None => Ok(Self::Static(env(TOKEN_ENV)?)),
        }
    }
}

/// A token to send, and its generation (0 for a static token; 1, 2, … as they are fetched).
#[derive(Debug, Clone)]
pub struct Issued {
    pub token: Token,
    pub generation: u64,
}

#[derive(Debug)]
struct Cached {
    issued: Issued,
    /// When the next call fetches a new one.
    refresh_at: Instant,
    /// The gateway refused it (401): the next fetch is one a refusal forced.
    refused: bool,
}

/// What became of a token the gateway refused (401).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterRefusal {
    /// It was of an older generation than the current token: retry with the current one.
    Outdated,
    /// It was the current token, now invalidated: the next [`TokenProvider::token`] fetches a
    /// new one (one fetch for every caller).
    Invalidated,
    /// It is still the current token (a static one, or `invalidate` was not asked).
    Kept,
}

/// Tokens, cached and refreshed; shared by every call of the transport and its probe.
#[derive(Debug)]
pub struct TokenProvider {
    source: TokenSource,
    http: HttpClient,
    cache: Mutex<Option<Cached>>,
    fetched: Counter,
    forced: Counter,
}

/// The token endpoint's answer.
#[derive(Deserialize)]
struct Granted {
    access_token: String,
    #[serde(default)]
    expires_in: Option<f64>,
}

/// How long before `lifetime` ends the token is refreshed.
pub fn refresh_after(lifetime: Duration) -> Duration {
    let margin = (lifetime / 10)
        .clamp(MIN_MARGIN, MAX_MARGIN)
        .min(lifetime / 2);
    lifetime - margin
}

impl TokenProvider {
    /// `fetched` counts token requests, `forced` those a refusal (401) of the current token
    /// caused.
    pub fn new(source: TokenSource, http: HttpClient, fetched: Counter, forced: Counter) -> Self {
        Self {
            source,
            http,
            cache: Mutex::new(None),
            fetched,
            forced,
        }
    }

    /// A token to use now.
    pub async fn token(&self) -> Result<Issued, TransportError> {
        let credentials = match &self.source {
            TokenSource::Static(token) => {
                return Ok(Issued {
                    token: token.clone(),
                    generation: 0,
                });
            }
            TokenSource::ClientCredentials(credentials) => credentials,
        };
        let mut cache = self.cache.lock().await;
        if let Some(cached) = cache.as_ref()
            && Instant::now() < cached.refresh_at
        {
            return Ok(cached.issued.clone());
        }
        let fetched_at = Instant::now();
        let (token, lifetime) = self.fetch(credentials).await?;
        let lifetime = lifetime.unwrap_or(UNKNOWN_LIFETIME);
        if cache.as_ref().is_some_and(|cached| cached.refused) {
            self.forced.inc();
        }
        let issued = Issued {
            token,
            generation: cache.as_ref().map_or(0, |cached| cached.issued.generation) + 1,
        };
        *cache = Some(Cached {
            issued: issued.clone(),
            refresh_at: fetched_at + refresh_after(lifetime),
            refused: false,
        });
        Ok(issued)
    }

    /// The gateway refused (401) a token of `generation`. When that is the current token and
    /// `invalidate`, the next [`TokenProvider::token`] fetches a new one.
    pub async fn refused(&self, generation: u64, invalidate: bool) -> AfterRefusal {
        let mut cache = self.cache.lock().await;
        match cache.as_mut() {
            Some(cached) if cached.issued.generation > generation => AfterRefusal::Outdated,
            Some(cached) if invalidate => {
                cached.refused = true;
                cached.refresh_at = Instant::now();
                AfterRefusal::Invalidated
            }
            _ => AfterRefusal::Kept,
        }
    }

    async fn fetch(
        &self,
        credentials: &ClientCredentials,
    ) -> Result<(Token, Option<Duration>), TransportError> {
        const URL: &str = "spec.source.gateway.auth.oauth2.tokenUrl";
        let form = {
            let mut form = form_urlencoded::Serializer::new(String::new());
            form.append_pair("grant_type", "client_credentials")
                .append_pair("client_id", &credentials.client_id)
                .append_pair("client_secret", credentials.client_secret.expose());
            if !credentials.scopes.is_empty() {
                form.append_pair("scope", &credentials.scopes.join(" "));
            }
            if let Some(audience) = &credentials.audience {
                form.append_pair("audience", audience);
            }
            form.finish()
        };
        let request = http::Request::post(credentials.token_url.as_str())
            .header("content-type", "application/x-www-form-urlencoded")
            .header("accept", "application/json")
            .body(Full::new(Bytes::from(form)))
            .map_err(|err| TransportError::fatal(URL, format!("not a usable URL: {err}"), None))?;
        self.fetched.inc();
        let answer = self
            .http
            .send(request, TOKEN_TIMEOUT)
            .await
            .map_err(|err| err.error("the OAuth2 token request", &credentials.token_url))?;
        match answer.status {
            200 => {
                let granted: Granted = serde_json::from_slice(&answer.body).map_err(|err| {
                    TransportError::protocol(format!(
                        "the OAuth2 token endpoint answered something else than a token: {err}"
                    ))
                })?;
                let lifetime = granted
                    .expires_in
                    .filter(|seconds| seconds.is_finite() && *seconds > 0.0)
                    .map(Duration::from_secs_f64);
                Ok((Token(granted.access_token), lifetime))
            }
            300..=399 => Err(TransportError::fatal(
                URL,
                format!(
                    "the token endpoint answered a redirect ({}), which is not followed: set the final URL",
                    answer.status
                ),
                None,
            )),
            400 | 401 | 403 => {
                let text = redact(&String::from_utf8_lossy(&answer.body));
                let setting = if text.contains("invalid_scope") {
                    "spec.source.gateway.auth.oauth2.scopes"
                } else if text.contains("invalid_client") || text.contains("unauthorized_client") {
                    "spec.source.gateway.auth.oauth2.clientId/GATEWAY_CLIENT_SECRET"
                } else {
                    "spec.source.gateway.auth.oauth2"
                };
                Err(TransportError::fatal(
                    setting,
                    format!(
                        "the OAuth2 token endpoint refused the client credentials ({}): {text}",
                        answer.status
                    ),
                    None,
                ))
            }
            status => Err(TransportError::protocol(format!(
                "the OAuth2 token endpoint answered {status}: {}",
                redact(&String::from_utf8_lossy(&answer.body))
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    #[test]
    fn tokens_are_refreshed_a_tenth_of_their_lifetime_early_at_least_a_second_at_most_thirty() {
        let after = |ms| refresh_after(Duration::from_millis(ms)).as_millis();
        assert_eq!(after(5_000), 4_000, "a second early");
        assert_eq!(after(20_000), 18_000, "a tenth early");
        assert_eq!(after(3_600_000), 3_570_000, "thirty seconds early");
        assert_eq!(after(1_500), 750, "never more than half the lifetime early");
        assert_eq!(after(0), 0);
    }

    #[test]
    fn a_token_never_shows_in_debug_output() {
        let source = TokenSource::Static(Token("eyJ.secret.token".into()));
        assert!(!format!("{source:?}").contains("secret"));
    }

    #[tokio::test]
    async fn a_static_token_is_used_as_it_is_and_a_refusal_keeps_it() {
        let provider = TokenProvider::new(
            TokenSource::Static(Token("t1".into())),
            HttpClient::new(None).expect("client"),
            Counter::default(),
            Counter::default(),
        );
        let issued = provider.token().await.expect("token");
        assert_eq!(
            provider.refused(issued.generation, true).await,
            AfterRefusal::Kept
        );
        assert_eq!(provider.token().await.expect("token").token.expose(), "t1");
    }

    /// A token endpoint on a loopback port answering every request with a new token
    /// (`t1`, `t2`, …) living an hour; counts the requests.
    async fn token_endpoint() -> (String, Arc<AtomicU64>) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!(
            "http://{}/oauth2/token",
            listener.local_addr().expect("addr")
        );
        let requests = Arc::new(AtomicU64::new(0));
        let counted = requests.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::spawn(async move {
                    // The request: headers, then a form body of `content-length` bytes.
                    let mut request = Vec::new();
                    let mut buffer = [0u8; 4096];
                    loop {
                        let read = stream.read(&mut buffer).await.unwrap_or(0);
                        request.extend_from_slice(&buffer[..read]);
                        let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
                        let complete = text.split_once("\r\n\r\n").is_some_and(|(head, body)| {
                            head.lines()
                                .find_map(|line| line.strip_prefix("content-length:"))
                                .and_then(|length| length.trim().parse::<usize>().ok())
                                .is_some_and(|length| body.len() >= length)
                        });
                        if read == 0 || complete {
                            break;
                        }
                    }
                    let body = format!(r#"{{"access_token":"t{n}","expires_in":3600}}"#);
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        });
        (url, requests)
    }

    #[tokio::test]
    async fn many_refusals_of_one_generation_cost_one_refresh_and_outdated_ones_none() {
        let (token_url, requests) = token_endpoint().await;
        let forced = Counter::default();
        let provider = Arc::new(TokenProvider::new(
            TokenSource::ClientCredentials(ClientCredentials {
                token_url,
                client_id: "worker".into(),
                client_secret: Token("secret".into()),
                scopes: vec![],
                audience: None,
            }),
            HttpClient::new(None).expect("client"),
            Counter::default(),
            forced.clone(),
        ));
        let first = provider.token().await.expect("token");
        assert_eq!(
            (first.generation, first.token.expose()),
            (1, "t1"),
            "the first token"
        );
        // 32 calls in flight with generation 1 all get a 401 at once.
        let retried = futures::future::join_all((0..32).map(|_| {
            let provider = provider.clone();
            async move {
                let refusal = provider.refused(1, true).await;
                (refusal, provider.token().await.expect("token"))
            }
        }))
        .await;
        let invalidated = retried
            .iter()
            .filter(|(refusal, _)| *refusal == AfterRefusal::Invalidated)
            .count();
        assert!(invalidated >= 1, "the current generation was invalidated");
        for (_, issued) in &retried {
            assert_eq!(
                (issued.generation, issued.token.expose()),
                (2, "t2"),
                "every caller retries with the one new token"
            );
        }
        assert_eq!(requests.load(Ordering::SeqCst), 2, "one refresh for all");
        assert_eq!(forced.get(), 1, "counted as forced by a refusal");
        // A late 401 of generation 1 (a call that was still in flight) changes nothing.
        assert_eq!(provider.refused(1, true).await, AfterRefusal::Outdated);
        assert_eq!(provider.token().await.expect("token").generation, 2);
        // A 401 on the new token after the caller's one renewal keeps it.
        assert_eq!(provider.refused(2, false).await, AfterRefusal::Kept);
        assert_eq!(requests.load(Ordering::SeqCst), 2);
    }
}
