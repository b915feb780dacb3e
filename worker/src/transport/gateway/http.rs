//! The HTTP client the gateway transport and its token provider share: HTTP/1.1 on hyper (the
//! AWS SDK already builds it), TLS by rustls on ring — always verified — with the public web
//! roots plus the CA certificates of the file `GATEWAY_CA_FILE` names (`spec.source.gateway.tls`,
//! mounted by the operator), a timeout on every call, and **no redirects** (hyper follows none;
//! a 3xx is an answer like any other). A peer whose certificate does not verify is a fatal
//! error naming `spec.source.gateway.tls`: no call is ever sent to an unverified peer.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use switchboard_api::source::gateway::CA_ENV;

/// The setting a CA problem is reported under.
pub const CA_SETTING: &str = "spec.source.gateway.tls (GATEWAY_CA_FILE)";
use switchboard_telemetry::ErrorChain;

use crate::transport::TransportError;

/// Connecting (TCP and TLS) never takes longer than this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Answers larger than this are refused (a receive of ten 256 KiB messages, base64, fits).
const MAX_ANSWER_BYTES: usize = 8 << 20;

/// A call that got no complete answer (no connection, a timeout, a cut connection, a peer
/// whose certificate does not verify).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct CallFailed {
    message: String,
    /// The peer's certificate did not verify.
    untrusted: bool,
}

impl CallFailed {
    fn new(message: String) -> Self {
        Self {
            message,
            untrusted: false,
        }
    }

    /// The error of `what` (`gateway receive`, `the OAuth2 token request`) to `url`: fatal
    /// naming the TLS setting when the peer's certificate did not verify, transient otherwise.
    pub fn error(self, what: &str, url: &str) -> TransportError {
        if self.untrusted {
            TransportError::fatal(
                CA_SETTING,
                format!(
                    "{what}: the TLS certificate of {url} is not trusted ({self}); set \
                     spec.source.gateway.tls.caConfigMapRef or caSecretRef to the CA that issued it"
                ),
                None,
            )
        } else {
            TransportError::transient(format!("{what} got no answer"), self)
        }
    }
}

/// Whether `err` or an error it wraps is a certificate rustls refused. hyper-rustls wraps the
/// handshake's `rustls::Error` in two `io::Error`s, whose `source()` skips the wrapped error:
/// an `io::Error` is unwrapped with `get_ref` instead.
fn is_untrusted(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(err) = next {
        if matches!(
            err.downcast_ref::<rustls::Error>(),
            Some(rustls::Error::InvalidCertificate(_))
        ) {
            return true;
        }
        next = match err.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    false
}

/// The CA certificates (PEM) of the file `GATEWAY_CA_FILE` names; `None` when it is not set.
/// `required` (the spec has `tls`): its absence is fatal.
pub fn extra_ca(required: bool) -> Result<Option<String>, TransportError> {
    match std::env::var(CA_ENV) {
        Ok(path) if !path.trim().is_empty() => std::fs::read_to_string(path.trim())
            .map(Some)
            .map_err(|err| {
                TransportError::fatal(CA_SETTING, format!("cannot read {path}: {err}"), None)
            }),
        _ if required => Err(TransportError::fatal(
            CA_ENV,
            "is not set (the operator sets it to the file of spec.source.gateway.tls)",
            None,
        )),
        _ => Ok(None),
    }
}

/// A complete answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

/// Cheap to clone: clones share the connection pool.
#[derive(Debug, Clone)]
pub struct HttpClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl HttpClient {
    /// A client trusting the web roots and the PEM certificates in `extra_ca_pem`. Fails
    /// fatally (naming the TLS setting) when that holds no usable certificate.
    pub fn new(extra_ca_pem: Option<&str>) -> Result<Self, TransportError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(pem) = extra_ca_pem.filter(|pem| !pem.trim().is_empty()) {
            let certificates: Vec<CertificateDer<'static>> =
                CertificateDer::pem_slice_iter(pem.as_bytes())
                    .collect::<Result<_, _>>()
                    .map_err(|err| {
                        TransportError::fatal(
                            CA_SETTING,
                            format!("not PEM certificates: {err}"),
                            None,
                        )
                    })?;
            let (added, _ignored) = roots.add_parsable_certificates(certificates);
            if added == 0 {
                return Err(TransportError::fatal(
                    CA_SETTING,
                    "holds no usable CA certificate",
                    None,
                ));
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|err| {
                TransportError::fatal(CA_SETTING, format!("cannot configure TLS: {err}"), None)
            })?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self { client })
    }

    /// Sends `request` and reads the whole answer, within `timeout`.
    pub async fn send(
        &self,
        request: http::Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Answer, CallFailed> {
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|err| CallFailed {
                    message: ErrorChain(&err).to_string(),
                    untrusted: is_untrusted(&err),
                })?;
            let status = response.status().as_u16();
            let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|err| CallFailed::new(format!("reading the answer: {err}")))?
                .to_bytes();
            Ok(Answer { status, body })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(CallFailed::new(format!(
                "no answer within {} s",
                timeout.as_secs_f32()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_that_is_not_pem_is_fatal_naming_the_variable() {
        let err = HttpClient::new(Some("not a certificate")).expect_err("refused");
        assert!(err.to_string().starts_with(CA_SETTING), "{err}");
        assert!(HttpClient::new(None).is_ok());
    }
}
