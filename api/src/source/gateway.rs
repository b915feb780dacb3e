//! `spec.source.gateway`: an SQS queue reached through an HTTP gateway that takes JWT bearer
//! tokens (`X-Service: sqs`), instead of the AWS API.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Broker, MissingSecret, SecretEnv};
use crate::{Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};

/// The environment variable holding a static bearer token.
pub const TOKEN_ENV: &str = "GATEWAY_TOKEN";
/// The environment variable holding the OAuth2 client secret.
pub const CLIENT_SECRET_ENV: &str = "GATEWAY_CLIENT_SECRET";
/// The environment variable holding extra CA certificates (PEM) the gateway's and the token
/// endpoint's certificates may chain to.
pub const CA_ENV: &str = "GATEWAY_CA_PEM";

/// How the worker reads from the gateway.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.queue == oldSelf.queue").message("spec.source.gateway.queue is immutable (message ids of another queue would be taken for redeliveries); create a new QueueAdapter instead")
)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySource {
    /// The gateway's base URL (`https://api.example.com`). Certificates are verified against
    /// the public web roots and `caSecretRef`.
    #[schemars(length(min = 1, max = 2048), regex(pattern = r"^https?://"))]
    pub url: String,
    /// The queue behind the gateway (`orders`). Cannot be changed after creation.
    #[schemars(length(min = 1, max = 80))]
    pub queue: String,
    /// Only messages of this project (the `project` attribute); every message sent by
    /// `switchboard-worker send` carries it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub project: Option<String>,
    /// The service the gateway routes to (the `X-Service` header).
    #[serde(default = "default_service")]
    #[schemars(length(min = 1, max = 63))]
    pub service: String,
    /// How the worker authenticates: a static token, or OAuth2 client credentials.
    pub auth: GatewayAuth,
    /// The Secret key holding extra CA certificates in PEM (`GATEWAY_CA_PEM` in the pod), for a
    /// gateway or token endpoint with a private CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
    /// How long a received message stays hidden from other consumers. Default: the queue's.
    /// While a batch is still being stored past half of it, the worker extends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 43200))]
    pub visibility_timeout_seconds: Option<u32>,
    /// How long one receive waits for messages when the queue is empty (long polling).
    #[serde(default = "default_wait_time_seconds")]
    #[schemars(range(min = 1, max = 20))]
    pub wait_time_seconds: u32,
}

/// Exactly one way to get a bearer token.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("has(self.tokenSecretRef) != has(self.oauth2)").message("spec.source.gateway.auth: exactly one of tokenSecretRef and oauth2 must be set")
)]
#[serde(rename_all = "camelCase")]
pub struct GatewayAuth {
    /// The Secret key holding a static JWT (`GATEWAY_TOKEN` in the pod). It is never
    /// refreshed: when it expires the worker reports the gateway unavailable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,
    /// OAuth2 client credentials: tokens are fetched from `tokenUrl`, cached, and refreshed
    /// before they expire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oauth2: Option<OAuth2ClientCredentials>,
}

/// The OAuth2 client-credentials grant (RFC 6749 §4.4).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OAuth2ClientCredentials {
    /// The token endpoint (`https://auth.example.com/oauth2/token`). Redirects are not
    /// followed.
    #[schemars(length(min = 1, max = 2048), regex(pattern = r"^https?://"))]
    pub token_url: String,
    /// The client id.
    #[schemars(length(min = 1, max = 253))]
    pub client_id: String,
    /// The Secret key holding the client secret (`GATEWAY_CLIENT_SECRET` in the pod).
    /// Required in Kubernetes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_secret_ref: Option<SecretKeyRef>,
    /// Scopes to request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
    /// The audience to request (the gateway checks the token's `aud`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    pub audience: Option<String>,
}

impl Broker for GatewaySource {
    fn kind(&self) -> &'static str {
        "gateway"
    }

    fn mode(&self) -> &'static str {
        if self.auth.oauth2.is_some() {
            "oauth2"
        } else {
            "static-token"
        }
    }

    fn guarantee(&self) -> DeliveryGuarantee {
        DeliveryGuarantee::AtLeastOnce
    }

    fn secret_env(&self) -> Result<Vec<SecretEnv<'_>>, MissingSecret> {
        let credential = match (&self.auth.token_secret_ref, &self.auth.oauth2) {
            (Some(token), _) => SecretEnv {
                env: TOKEN_ENV,
                secret: token,
            },
            (None, Some(oauth2)) => SecretEnv {
                env: CLIENT_SECRET_ENV,
                secret: oauth2.client_secret_ref.as_ref().ok_or(MissingSecret {
                    field: "spec.source.gateway.auth.oauth2.clientSecretRef",
                    env: CLIENT_SECRET_ENV,
                })?,
            },
            (None, None) => {
                return Err(MissingSecret {
                    field: "spec.source.gateway.auth.tokenSecretRef",
                    env: TOKEN_ENV,
                });
            }
        };
        let mut env = vec![credential];
        if let Some(ca) = &self.ca_secret_ref {
            env.push(SecretEnv {
                env: CA_ENV,
                secret: ca,
            });
        }
        Ok(env)
    }

    fn strip_secrets(&mut self) {
        self.auth.token_secret_ref = None;
        if let Some(oauth2) = &mut self.auth.oauth2 {
            oauth2.client_secret_ref = None;
        }
        self.ca_secret_ref = None;
    }

    fn validate(&self, delivery: &Delivery, fail: &mut dyn FnMut(FieldError)) {
        let mut error = |field: &'static str, message: &str| {
            fail(FieldError {
                field,
                message: message.to_owned(),
            });
        };
        let is_url = |url: &str| url.starts_with("https://") || url.starts_with("http://");
        if !is_url(&self.url) {
            error(
                "spec.source.gateway.url",
                "must be an https:// (or http://) URL",
            );
        }
        if self.queue.is_empty() || self.queue.len() > 80 {
            error("spec.source.gateway.queue", "must be 1 to 80 characters");
        }
        if self.service.is_empty() {
            error("spec.source.gateway.service", "must not be empty");
        }
        if self.project.as_deref().is_some_and(str::is_empty) {
            error("spec.source.gateway.project", "must not be empty");
        }
        match (&self.auth.token_secret_ref, &self.auth.oauth2) {
            (Some(_), None) => {}
            (None, Some(oauth2)) => {
                if !is_url(&oauth2.token_url) {
                    error(
                        "spec.source.gateway.auth.oauth2.tokenUrl",
                        "must be an https:// (or http://) URL",
                    );
                }
                if oauth2.client_id.is_empty() {
                    error(
                        "spec.source.gateway.auth.oauth2.clientId",
                        "must not be empty",
                    );
                }
            }
            _ => error(
                "spec.source.gateway.auth",
                "exactly one of tokenSecretRef and oauth2 must be set",
            ),
        }
        if !(1..=20).contains(&self.wait_time_seconds) {
            error("spec.source.gateway.waitTimeSeconds", "must be 1 to 20");
        }
        if self
            .visibility_timeout_seconds
            .is_some_and(|seconds| !(1..=43_200).contains(&seconds))
        {
            error(
                "spec.source.gateway.visibilityTimeoutSeconds",
                "must be 1 to 43200",
            );
        }
        for field in delivery.dead_letter.set_fields() {
            error(
                field,
                "is not for source gateway; the gateway's dead-letter operation decides where dead letters go",
            );
        }
    }
}

fn default_service() -> String {
    "sqs".into()
}

fn default_wait_time_seconds() -> u32 {
    20
}
