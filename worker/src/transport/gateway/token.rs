//! Bearer tokens for the gateway: a static token, or OAuth2 client credentials (RFC 6749
//! §4.4) fetched from the token endpoint with a small hyper client of our own (no `oauth2`
//! crate: one form POST and one JSON answer do not need it, and hyper is already built).
//!
//! - **Cached**, and refreshed *before* it expires: at `expires_in` minus a margin of a tenth
//!   of the lifetime, at most [`MAX_MARGIN`] (so a 5 s token is refreshed after 4.5 s, an
//!   hour's 30 s before its end). Without `expires_in` a token is reused for
//!   [`UNKNOWN_LIFETIME`] at most.
//! - **One refresh at a time**: the cache is behind an async lock held across the refresh;
//!   callers that arrive meanwhile wait and then take the new token.
//! - **On a 401** the caller invalidates the token it used ([`TokenProvider::invalidate`]): the
//!   next call fetches a new one, unless another caller already replaced it.
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
/// How long a token whose lifetime the endpoint did not say is reused.
const UNKNOWN_LIFETIME: Duration = Duration::from_secs(60);
/// One token request.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(10);

/// A bearer token; never shown.
#[derive(Clone, PartialEq, Eq)]
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

#[derive(Debug)]
struct Cached {
    token: Token,
    /// When the next call fetches a new one.
    refresh_at: Instant,
}

/// Tokens, cached and refreshed; shared by every call of the transport and its probe.
#[derive(Debug)]
pub struct TokenProvider {
    source: TokenSource,
    http: HttpClient,
    cache: Mutex<Option<Cached>>,
    fetched: Counter,
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
    lifetime - (lifetime / 10).min(MAX_MARGIN)
}

impl TokenProvider {
    /// `fetched` counts token requests.
    pub fn new(source: TokenSource, http: HttpClient, fetched: Counter) -> Self {
        Self {
            source,
            http,
            cache: Mutex::new(None),
            fetched,
        }
    }

    /// A token to use now.
    pub async fn token(&self) -> Result<Token, TransportError> {
        let credentials = match &self.source {
            TokenSource::Static(token) => return Ok(token.clone()),
            TokenSource::ClientCredentials(credentials) => credentials,
        };
        let mut cache = self.cache.lock().await;
        if let Some(cached) = cache.as_ref()
            && Instant::now() < cached.refresh_at
        {
            return Ok(cached.token.clone());
        }
        let fetched_at = Instant::now();
        let (token, lifetime) = self.fetch(credentials).await?;
        let lifetime = lifetime.unwrap_or(UNKNOWN_LIFETIME);
        *cache = Some(Cached {
            token: token.clone(),
            refresh_at: fetched_at + refresh_after(lifetime),
        });
        Ok(token)
    }

    /// The gateway refused `token`: the next [`TokenProvider::token`] fetches a new one,
    /// unless the cache already holds another.
    pub async fn invalidate(&self, token: &Token) {
        let mut cache = self.cache.lock().await;
        if cache.as_ref().is_some_and(|cached| &cached.token == token) {
            *cache = None;
        }
    }

    /// Whether tokens can be refreshed (a static one cannot).
    pub fn refreshes(&self) -> bool {
        matches!(self.source, TokenSource::ClientCredentials(_))
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
            .map_err(|err| TransportError::transient("the OAuth2 token request failed", err))?;
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
    use super::*;

    #[test]
    fn tokens_are_refreshed_a_tenth_of_their_lifetime_early_at_most_thirty_seconds() {
        assert_eq!(
            refresh_after(Duration::from_secs(5)),
            Duration::from_millis(4500)
        );
        assert_eq!(
            refresh_after(Duration::from_secs(3600)),
            Duration::from_secs(3570)
        );
        assert_eq!(refresh_after(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_token_never_shows_in_debug_output() {
        let source = TokenSource::Static(Token("eyJ.secret.token".into()));
        assert!(!format!("{source:?}").contains("secret"));
    }

    #[tokio::test]
    async fn a_static_token_is_used_as_it_is_and_invalidating_it_changes_nothing() {
        let provider = TokenProvider::new(
            TokenSource::Static(Token("t1".into())),
            HttpClient::new(None).expect("client"),
            Counter::default(),
        );
        let token = provider.token().await.expect("token");
        provider.invalidate(&token).await;
        assert_eq!(provider.token().await.expect("token").expose(), "t1");
        assert!(!provider.refreshes());
    }
}
