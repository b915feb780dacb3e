//! The connection: `NATS_URL` and at most one way to authenticate, from the environment the
//! operator fills from the Secret refs; which failures are misconfiguration.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::{Client, ConnectErrorKind, ConnectOptions, Event};
use prometheus_client::metrics::counter::Counter;
use tracing::Instrument as _;

use crate::transport::TransportError;

/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request (JetStream API call, PubAck) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the client pings the server: a connection that went silent (no FIN, no RST: a
/// dropped route, a frozen proxy) is given up after two unanswered pings and dialled again.
/// async-nats' default, 60 s, left a worker on a dead connection for minutes.
const PING_INTERVAL: Duration = Duration::from_secs(10);

/// How the worker authenticates.
#[derive(Clone)]
pub enum Auth {
    None,
    /// A credentials file's content (`NATS_CREDENTIALS`).
    Credentials(String),
    /// An NKey seed (`NATS_NKEY`).
    Nkey(String),
    /// `NATS_USER` and `NATS_PASSWORD`.
    UserPassword(String, String),
    /// `NATS_TOKEN`.
    Token(String),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Auth::None => "None",
            Auth::Credentials(_) => "Credentials(<redacted>)",
            Auth::Nkey(_) => "Nkey(<redacted>)",
            Auth::UserPassword(..) => "UserPassword(<redacted>)",
            Auth::Token(_) => "Token(<redacted>)",
        })
    }
}

impl Auth {
    /// From the environment: at most one of the methods may be set.
    pub fn from_env() -> Result<Self, TransportError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let mut set = Vec::new();
        let credentials = var("NATS_CREDENTIALS");
        let nkey = var("NATS_NKEY");
        let user = var("NATS_USER");
        let password = var("NATS_PASSWORD");
        let token = var("NATS_TOKEN");
        for (name, value) in [
            ("NATS_CREDENTIALS", credentials.is_some()),
            ("NATS_NKEY", nkey.is_some()),
            ("NATS_USER", user.is_some()),
            ("NATS_TOKEN", token.is_some()),
        ] {
            if value {
                set.push(name);
            }
        }
        if set.len() > 1 {
            return Err(TransportError::fatal(
                set.join("/"),
                "set at most one way to authenticate to NATS",
                None,
            ));
        }
        Ok(match (credentials, nkey, user, password, token) {
            (Some(creds), ..) => Auth::Credentials(creds),
            (_, Some(seed), ..) => Auth::Nkey(seed),
            (_, _, Some(user), Some(password), _) => Auth::UserPassword(user, password),
            (_, _, Some(_), None, _) | (_, _, None, Some(_), _) => {
                return Err(TransportError::fatal(
                    "NATS_USER/NATS_PASSWORD",
                    "a user needs a password and a password a user",
                    None,
                ));
            }
            (_, _, _, _, Some(token)) => Auth::Token(token),
            _ => Auth::None,
        })
    }

    /// The setting to fix when the server refuses these credentials.
    fn setting(&self) -> &'static str {
        match self {
            Auth::None => "NATS_URL",
            Auth::Credentials(_) => "NATS_CREDENTIALS",
            Auth::Nkey(_) => "NATS_NKEY",
            Auth::UserPassword(..) => "NATS_USER/NATS_PASSWORD",
            Auth::Token(_) => "NATS_TOKEN",
        }
    }
}

/// Everything needed to open a connection (the transport's and the probe's).
#[derive(Clone)]
pub struct Connector {
    /// `NATS_URL`: one or more comma-separated server URLs (never logged: it may hold
    /// credentials).
    pub url: String,
    pub auth: Auth,
    /// The client name the server shows (`switchboard-worker/<pod>`).
    pub name: String,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("url", &"<redacted>")
            .field("auth", &self.auth)
            .field("name", &self.name)
            .finish()
    }
}

/// What the connection reports to the transport.
#[derive(Debug, Clone)]
pub struct ConnectionEvents {
    /// Set on every reconnection: the consumer is re-bound before the next fetch.
    pub reconnected: Arc<AtomicBool>,
    pub reconnects: Counter,
    disconnected: Arc<AtomicBool>,
}

impl ConnectionEvents {
    pub fn new(reconnects: Counter) -> Self {
        Self {
            reconnected: Arc::default(),
            reconnects,
            disconnected: Arc::default(),
        }
    }
}

impl Connector {
    /// Connects. Refused credentials and TLS failures are fatal (they name the setting);
    /// anything else (refused connection, timeout) is transient. After the first connection
    /// the client reconnects by itself, forever; `events` hears about it.
    pub async fn connect(
        &self,
        events: Option<ConnectionEvents>,
    ) -> Result<Client, TransportError> {
        let mut options = ConnectOptions::new()
            .name(&self.name)
            .connection_timeout(CONNECT_TIMEOUT)
            .request_timeout(Some(REQUEST_TIMEOUT))
            .ping_interval(PING_INTERVAL)
            .max_reconnects(None::<usize>);
        options = match &self.auth {
            Auth::None => options,
            Auth::Credentials(creds) => options.credentials(creds).map_err(|err| {
                TransportError::fatal(
                    "NATS_CREDENTIALS",
                    "not a NATS credentials file",
                    Some(Box::new(err)),
                )
            })?,
            Auth::Nkey(seed) => options.nkey(seed.clone()),
            Auth::UserPassword(user, password) => {
                options.user_and_password(user.clone(), password.clone())
            }
            Auth::Token(token) => options.token(token.clone()),
        };
        let servers: Vec<&str> = self.url.split(',').map(str::trim).collect();
        if servers.iter().any(|url| url.starts_with("tls://")) {
            options = options.require_tls(true);
        }
        if let Some(events) = events {
            // The client calls back on its own task: its lines are put in the adapter's span.
            let span = tracing::Span::current();
            options = options.event_callback(move |event| {
                let events = events.clone();
                let span = span.clone();
                async move {
                    match event {
                        // The first connection is reported too: only one after a
                        // disconnection is a reconnection.
                        Event::Connected if events.disconnected.swap(false, Ordering::AcqRel) => {
                            events.reconnects.inc();
                            events.reconnected.store(true, Ordering::Release);
                            tracing::info!("reconnected to NATS");
                        }
                        Event::Disconnected => {
                            events.disconnected.store(true, Ordering::Release);
                            tracing::warn!("disconnected from NATS");
                        }
                        other => tracing::debug!(event = %other, "NATS client event"),
                    }
                }
                .instrument(span)
            });
        }
        let addrs: Vec<async_nats::ServerAddr> = servers
            .iter()
            .map(|url| url.parse())
            .collect::<Result<_, _>>()
            // The parse error quotes the URL, which may hold credentials: not kept.
            .map_err(|_| TransportError::fatal("NATS_URL", "not a NATS server URL", None))?;
        options
            .connect(addrs)
            .await
            .map_err(|err| match err.kind() {
                ConnectErrorKind::Authentication | ConnectErrorKind::AuthorizationViolation => {
                    TransportError::fatal(
                        self.auth.setting(),
                        "the NATS server refused the credentials",
                        Some(Box::new(err)),
                    )
                }
                ConnectErrorKind::Tls => TransportError::fatal(
                    "NATS_URL",
                    "TLS with the NATS server failed (the certificate is verified)",
                    Some(Box::new(err)),
                ),
                _ => TransportError::transient("could not connect to NATS", err),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_the_url_or_the_credentials() {
        let connector = Connector {
            url: "nats://app:hunter2@nats:4222".into(),
            auth: Auth::UserPassword("app".into(), "hunter2".into()),
            name: "switchboard-worker/w1".into(),
        };
        let shown = format!("{connector:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("app"),
            "{shown}"
        );
        assert_eq!(Auth::Token("t0ken".into()).setting(), "NATS_TOKEN");
    }

    #[tokio::test]
    async fn a_malformed_url_is_fatal_and_names_nats_url() {
        let connector = Connector {
            url: "nats://127.0.0.1:notaport".into(),
            auth: Auth::None,
            name: "test".into(),
        };
        let err = connector.connect(None).await.expect_err("malformed");
        assert_eq!(
            err.kind(),
            &crate::transport::ErrorKind::Fatal {
                setting: "NATS_URL".into()
            }
        );
        assert!(!err.to_string().contains("notaport"), "{err}");
    }
}
