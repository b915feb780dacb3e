//! `spec.source.gateway`: an SQS queue reached through an HTTP gateway that takes JWT bearer
//! tokens (`X-Service: sqs`), instead of the AWS API.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Broker, Messaging, FileSource, MissingSecret, MountedFile, SecretEnv};
use crate::{Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};

/// The environment variable holding a static bearer token.
pub const TOKEN_ENV: &str = "GATEWAY_TOKEN";
/// The environment variable holding the OAuth2 client secret.
pub const CLIENT_SECRET_ENV: &str = "GATEWAY_CLIENT_SECRET";
/// The environment variable holding the path of a file of extra CA certificates (PEM) the
/// gateway's and the token endpoint's certificates may chain to.
pub const CA_ENV: &str = "GATEWAY_CA_FILE";
/// Where the operator mounts `tls`'s CA in the worker pod, read-only.
pub const CA_DIR: &str = "/etc/switchboard-gateway-ca";
/// The file name of the CA in [`CA_DIR`].
pub const CA_FILE: &str = "ca.crt";

/// How the worker reads from the gateway.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.queue == oldSelf.queue").message("spec.source.gateway.queue is immutable (message ids of another queue would be taken for redeliveries); create a new QueueAdapter instead"),
    validation = Rule::new("!has(self.deadLetter) || self.deadLetter.queue != self.queue").message("spec.source.gateway.deadLetter.queue must name the dead-letter queue, not spec.source.gateway.queue")
)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySource {
    /// The gateway's base URL (`https://api.example.com`). Certificates are always verified:
    /// against the public web roots and `tls`'s CA.
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
    /// A private CA the gateway's and the token endpoint's certificates may chain to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<GatewayTls>,
    /// How long a received message stays hidden from other consumers. Default: the queue's.
    /// While a batch is still being stored past half of it, the worker extends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 43200))]
    pub visibility_timeout_seconds: Option<u32>,
    /// How long one receive waits for messages when the queue is empty (long polling).
    #[serde(default = "default_wait_time_seconds")]
    #[schemars(range(min = 1, max = 20))]
    pub wait_time_seconds: u32,
    /// The gateway's dead-letter queue, for `switchboard-worker dlq`: set, the command lists,
    /// shows, redrives and purges the letters through the gateway; unset, it cannot read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<GatewayDeadLetter>,
}

/// Where the gateway keeps this queue's dead letters (`POST /dlq` writes them there).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct GatewayDeadLetter {
    /// The dead-letter queue's name as the gateway serves it (`orders-dlq`): the command
    /// receives, deletes and changes the visibility of its letters with the gateway's calls
    /// for any queue, `queue=<this name>`.
    #[schemars(length(min = 1, max = 80))]
    pub queue: String,
}

/// TLS to the gateway and the token endpoint, always verified: the CA given here is trusted in
/// addition to the public web roots.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("has(self.caConfigMapRef) != has(self.caSecretRef)").message("spec.source.gateway.tls: exactly one of caConfigMapRef and caSecretRef must be set")
)]
#[serde(rename_all = "camelCase")]
pub struct GatewayTls {
    /// The ConfigMap key holding the CA certificates (PEM), mounted read-only in the worker pod
    /// (`GATEWAY_CA_FILE` is its path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_config_map_ref: Option<ConfigMapKeyRef>,
    /// The Secret key holding the CA certificates (PEM), mounted read-only in the worker pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
}

/// A key of a ConfigMap in the adapter's namespace.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ConfigMapKeyRef {
    /// The ConfigMap's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key within the ConfigMap.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
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

    fn messaging(&self, _adapter: &str) -> Messaging {
        Messaging {
            system: "aws_sqs",
            destination: self.queue.clone(),
            consumer_group: None,
        }
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
        Ok(vec![credential])
    }

    fn mounted_files(&self) -> Vec<MountedFile<'_>> {
        let Some(tls) = &self.tls else {
            return Vec::new();
        };
        FileSource::ca(tls.ca_config_map_ref.as_ref(), tls.ca_secret_ref.as_ref())
            .map(|source| MountedFile {
                env: CA_ENV,
                volume: "gateway-ca",
                dir: CA_DIR,
                file: CA_FILE,
                source,
            })
            .into_iter()
            .collect()
    }

    fn strip_secrets(&mut self) {
        self.auth.token_secret_ref = None;
        if let Some(oauth2) = &mut self.auth.oauth2 {
            oauth2.client_secret_ref = None;
        }
        if let Some(tls) = &mut self.tls {
            tls.ca_secret_ref = None;
        }
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
        if let Some(message) = self.dead_letter_queue_error() {
            error("spec.source.gateway.deadLetter.queue", message);
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
        if let Some(tls) = &self.tls
            && tls.ca_config_map_ref.is_some() == tls.ca_secret_ref.is_some()
        {
            error(
                "spec.source.gateway.tls",
                "exactly one of caConfigMapRef and caSecretRef must be set",
            );
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

impl GatewaySource {
    /// What is wrong with `deadLetter.queue`, if it is set and wrong.
    fn dead_letter_queue_error(&self) -> Option<&'static str> {
        let queue = &self.dead_letter.as_ref()?.queue;
        if queue.is_empty() || queue.len() > 80 {
            Some("must be 1 to 80 characters")
        } else if *queue == self.queue {
            Some("must name the dead-letter queue, not spec.source.gateway.queue")
        } else {
            None
        }
    }
}

fn default_service() -> String {
    "sqs".into()
}

fn default_wait_time_seconds() -> u32 {
    20
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(tls: &str) -> GatewaySource {
        serde_yaml_ng::from_str(&format!(
            "{{url: 'https://gw.example', queue: orders, auth: {{tokenSecretRef: {{name: t, key: k}}}}{tls}}}"
        ))
        .expect("a gateway source")
    }

    fn errors(source: &GatewaySource) -> Vec<&'static str> {
        let mut fields = Vec::new();
        source.validate(&Delivery::default(), &mut |error| fields.push(error.field));
        fields
    }

    #[test]
    fn tls_takes_exactly_one_ca_and_mounts_it_read_only_as_a_file() {
        assert!(source("").mounted_files().is_empty());
        let map = source(", tls: {caConfigMapRef: {name: gateway-ca, key: ca.crt}}");
        assert!(errors(&map).is_empty());
        assert_eq!(
            map.mounted_files(),
            [MountedFile {
                env: CA_ENV,
                volume: "gateway-ca",
                dir: CA_DIR,
                file: CA_FILE,
                source: FileSource::ConfigMap {
                    name: "gateway-ca",
                    key: "ca.crt"
                },
            }]
        );
        let secret = source(", tls: {caSecretRef: {name: ca, key: pem}}");
        assert!(errors(&secret).is_empty());
        assert!(matches!(
            secret.mounted_files()[0].source,
            FileSource::Secret(SecretKeyRef { name, key }) if name == "ca" && key == "pem"
        ));
        for tls in [
            ", tls: {}",
            ", tls: {caSecretRef: {name: a, key: b}, caConfigMapRef: {name: a, key: b}}",
        ] {
            assert_eq!(errors(&source(tls)), ["spec.source.gateway.tls"], "{tls}");
        }
    }

    #[test]
    fn the_dead_letter_queue_is_optional_and_not_the_queue_itself() {
        let named = source(", deadLetter: {queue: orders-dlq}");
        assert!(errors(&named).is_empty());
        assert_eq!(
            named.dead_letter.map(|d| d.queue).as_deref(),
            Some("orders-dlq")
        );
        assert!(source("").dead_letter.is_none());
        assert_eq!(
            errors(&source(", deadLetter: {queue: orders}")),
            ["spec.source.gateway.deadLetter.queue"]
        );
    }
}
