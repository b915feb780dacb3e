//! Reading a QueueAdapter manifest from YAML: the file a user would `kubectl apply`.

use crate::{GROUP, InvalidSpec, QueueAdapter, VERSION};

/// Why a manifest could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest is not a valid QueueAdapter")]
    Parse(#[source] serde_yaml_ng::Error),
    #[error(
        "manifest has apiVersion {found:?} and kind {kind:?}; expected {GROUP}/{VERSION} QueueAdapter"
    )]
    WrongKind { found: String, kind: String },
    #[error("manifest has no metadata.name")]
    MissingName,
    #[error(
        "metadata.name must be at most 63 characters (it names the worker's Deployment), got {0}"
    )]
    NameTooLong(usize),
    #[error(transparent)]
    Invalid(#[from] InvalidSpec),
}

/// Parses and validates a QueueAdapter manifest.
pub fn load_manifest(yaml: &str) -> Result<QueueAdapter, ManifestError> {
    let value: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(yaml).map_err(ManifestError::Parse)?;
    let api_version = value
        .get("apiVersion")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let kind = value
        .get("kind")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    if api_version != format!("{GROUP}/{VERSION}") || kind != "QueueAdapter" {
        return Err(ManifestError::WrongKind {
            found: api_version.to_owned(),
            kind: kind.to_owned(),
        });
    }
    let adapter: QueueAdapter = serde_yaml_ng::from_value(value).map_err(ManifestError::Parse)?;
    let name_len = adapter
        .metadata
        .name
        .as_deref()
        .map_or(0, |n| n.chars().count());
    if name_len == 0 {
        return Err(ManifestError::MissingName);
    }
    if name_len > 63 {
        return Err(ManifestError::NameTooLong(name_len));
    }
    adapter.spec.validate()?;
    Ok(adapter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PayloadFormat, RedisMode, StartFrom};

    const ISSUE_MANIFEST: &str = r#"
apiVersion: switchboard.dev/v1alpha1
kind: QueueAdapter
metadata: {name: orders, namespace: default}
spec:
  source: {redis: {mode: stream, stream: orders, group: switchboard}}
  target: {queue: orders}
  delivery: {batchSize: 200, maxDeliveries: 3, claimIdleSeconds: 5}
"#;

    #[test]
    fn minimal_stream_manifest_loads_with_defaults() {
        let adapter = load_manifest(ISSUE_MANIFEST).expect("valid manifest");
        assert_eq!(adapter.adapter_name(), "default/orders");
        let spec = &adapter.spec;
        assert!(spec.enabled);
        let redis = spec.source.redis.as_ref().expect("redis source");
        assert_eq!(redis.mode, RedisMode::Stream);
        assert_eq!(redis.stream.as_deref(), Some("orders"));
        assert_eq!(redis.body_field, "body");
        assert_eq!(redis.start_from, StartFrom::Earliest);
        assert_eq!(spec.delivery.batch_size, 200);
        assert_eq!(spec.delivery.max_deliveries, 3);
        assert_eq!(spec.delivery.claim_idle_seconds, 5);
        assert_eq!(spec.payload.format, PayloadFormat::Auto);
        assert_eq!(spec.payload.max_bytes, 1_048_576);
        assert_eq!(spec.workload.replicas, 1);
    }

    #[test]
    fn stream_mode_without_stream_names_the_field() {
        let yaml = ISSUE_MANIFEST.replace("stream: orders, ", "");
        let err = load_manifest(&yaml).expect_err("must be rejected");
        assert!(
            err.to_string().contains("spec.source.redis.stream"),
            "{err}"
        );
    }

    #[test]
    fn out_of_range_batch_size_names_the_field() {
        let yaml = ISSUE_MANIFEST.replace("batchSize: 200", "batchSize: 0");
        let err = load_manifest(&yaml).expect_err("must be rejected");
        assert!(err.to_string().contains("spec.delivery.batchSize"), "{err}");
    }

    #[test]
    fn missing_source_names_the_field() {
        let yaml = ISSUE_MANIFEST.replace(
            "source: {redis: {mode: stream, stream: orders, group: switchboard}}",
            "source: {}",
        );
        let err = load_manifest(&yaml).expect_err("must be rejected");
        assert!(err.to_string().contains("spec.source"), "{err}");
    }

    #[test]
    fn unknown_mode_is_a_parse_error() {
        let yaml = ISSUE_MANIFEST.replace("mode: stream", "mode: firehose");
        assert!(matches!(load_manifest(&yaml), Err(ManifestError::Parse(_))));
    }

    #[test]
    fn overlong_name_is_rejected_like_the_api_server_does() {
        let yaml = ISSUE_MANIFEST.replace("name: orders,", &format!("name: {},", "a".repeat(64)));
        assert!(matches!(
            load_manifest(&yaml),
            Err(ManifestError::NameTooLong(64))
        ));
    }

    #[test]
    fn wrong_kind_is_rejected() {
        let yaml = ISSUE_MANIFEST.replace("kind: QueueAdapter", "kind: Deployment");
        assert!(matches!(
            load_manifest(&yaml),
            Err(ManifestError::WrongKind { .. })
        ));
    }
}
