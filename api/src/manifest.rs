//! Reading a QueueAdapter manifest from YAML: the file a user would `kubectl apply`.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

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
    /// Fields the QueueAdapter type does not have (misspelled or unsupported): the API server
    /// rejects them under strict field validation, so the worker does too.
    #[error("{}", UnknownFields(.0))]
    UnknownFields(Vec<UnknownField>),
    /// A field whose value has the wrong type or is out of the type's range.
    #[error("{}{field}: {message}", at_line(*line))]
    InvalidValue {
        /// The field's path, e.g. `spec.delivery.batchSize`.
        field: String,
        line: Option<usize>,
        message: String,
    },
    #[error("manifest has no metadata.name")]
    MissingName,
    #[error(
        "metadata.name must be at most 63 characters (it names the worker's Deployment), got {0}"
    )]
    NameTooLong(usize),
    /// A name the API server would refuse.
    #[error("{}{field} {value:?} is not {rule}", at_line(*line))]
    InvalidName {
        /// `metadata.name` or `metadata.namespace`.
        field: &'static str,
        line: Option<usize>,
        value: String,
        rule: &'static str,
    },
    #[error(transparent)]
    Invalid(#[from] InvalidSpec),
}

/// A manifest field that is not part of the QueueAdapter type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownField {
    /// The field's path, e.g. `spec.delivery.bachSize`.
    pub path: String,
    /// The 1-based line of the field's key in the manifest, when it could be found.
    pub line: Option<usize>,
}

struct UnknownFields<'a>(&'a [UnknownField]);

impl fmt::Display for UnknownFields<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, field) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(
                f,
                "{}{}: unknown field (not part of {GROUP}/{VERSION} QueueAdapter)",
                at_line(field.line),
                field.path
            )?;
        }
        Ok(())
    }
}

fn at_line(line: Option<usize>) -> String {
    line.map(|line| format!("line {line}: "))
        .unwrap_or_default()
}

/// Parses and validates a QueueAdapter manifest.
///
/// Strict like `kubectl apply` with server-side field validation: unknown fields, values of
/// the wrong type and names the API server refuses are errors naming the field and its line.
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
    let adapter = deserialize_strictly(yaml)?;
    let name = adapter.metadata.name.as_deref().unwrap_or_default();
    let name_len = name.chars().count();
    if name_len == 0 {
        return Err(ManifestError::MissingName);
    }
    if name_len > 63 {
        return Err(ManifestError::NameTooLong(name_len));
    }
    if !is_dns1123_subdomain(name) {
        return Err(ManifestError::InvalidName {
            field: "metadata.name",
            line: key_line(yaml, &["metadata", "name"]),
            value: name.to_owned(),
            rule: "a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', starting and \
                   ending with a letter or digit)",
        });
    }
    if let Some(namespace) = adapter.metadata.namespace.as_deref()
        && !is_dns1123_label(namespace)
    {
        return Err(ManifestError::InvalidName {
            field: "metadata.namespace",
            line: key_line(yaml, &["metadata", "namespace"]),
            value: namespace.to_owned(),
            rule: "a DNS-1123 label (at most 63 lowercase letters, digits and '-', starting and \
                   ending with a letter or digit)",
        });
    }
    adapter.spec.validate()?;
    Ok(adapter)
}

/// Deserializes the manifest text, collecting every field the types ignore and naming the
/// field of a type error.
fn deserialize_strictly(yaml: &str) -> Result<QueueAdapter, ManifestError> {
    let mut ignored: Vec<Vec<String>> = Vec::new();
    // The derived type leaves `apiVersion` and `kind` to the caller, who checked them already.
    let mut collect = |path: serde_ignored::Path<'_>| {
        let path = segments(&path);
        if !matches!(path.as_slice(), [key] if key == "apiVersion" || key == "kind") {
            ignored.push(path);
        }
    };
    let result: Result<QueueAdapter, _> = serde_path_to_error::deserialize(
        serde_ignored::Deserializer::new(serde_yaml_ng::Deserializer::from_str(yaml), &mut collect),
    );
    // A misspelled required field also shows up as a missing one: name the misspelling first.
    if !ignored.is_empty() {
        let fields = ignored
            .iter()
            .map(|path| UnknownField {
                path: path.join("."),
                line: key_line(yaml, &path.iter().map(String::as_str).collect::<Vec<_>>()),
            })
            .collect();
        return Err(ManifestError::UnknownFields(fields));
    }
    result.map_err(|err| {
        let mut field = err.path().to_string();
        let inner = err.into_inner();
        let line = inner.location().map(|location| location.line());
        let mut message = bare_message(&inner, &field);
        // serde names a missing field's parent: name the field itself, as the API server does.
        if let Some(missing) = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'))
        {
            field = match field.as_str() {
                "." => missing.to_owned(),
                parent => format!("{parent}.{missing}"),
            };
            message = "required, and missing".to_owned();
        }
        if field == "." {
            return ManifestError::Parse(inner);
        }
        ManifestError::InvalidValue {
            message,
            field,
            line,
        }
    })
}

/// The YAML error's message without the path and position it carries itself.
fn bare_message(err: &serde_yaml_ng::Error, field: &str) -> String {
    let text = err.to_string();
    let text = match text.rfind(" at line ") {
        Some(at) if err.location().is_some() => &text[..at],
        _ => &text[..],
    };
    text.strip_prefix(&format!("{field}: "))
        .unwrap_or(text)
        .to_owned()
}

/// The keys of an ignored field's path; sequence positions become their index.
fn segments(path: &serde_ignored::Path<'_>) -> Vec<String> {
    use serde_ignored::Path;
    let mut keys = match path {
        Path::Root => return Vec::new(),
        Path::Seq { parent, .. }
        | Path::Map { parent, .. }
        | Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => segments(parent),
    };
    match path {
        Path::Seq { index, .. } => keys.push(index.to_string()),
        Path::Map { key, .. } => keys.push(key.clone()),
        _ => {}
    }
    keys
}

const FOUND: &str = "switchboard: key found";

/// The 1-based line of the key at `path` in `yaml` (mapping keys; a sequence position is its
/// index): walks the document again and stops with an error at that key, whose position the
/// YAML parser reports.
fn key_line(yaml: &str, path: &[&str]) -> Option<usize> {
    if path.is_empty() {
        return None;
    }
    let err = Locate(path)
        .deserialize(serde_yaml_ng::Deserializer::from_str(yaml))
        .err()?;
    err.to_string()
        .contains(FOUND)
        .then(|| err.location().map(|location| location.line()))
        .flatten()
}

struct Locate<'p, 'a>(&'p [&'a str]);

impl<'de> DeserializeSeed<'de> for Locate<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Locate<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let (first, rest) = self.0.split_first().expect("path is not empty");
        let mut index = 0usize;
        loop {
            let found = if index.to_string() == *first && !rest.is_empty() {
                seq.next_element_seed(Locate(rest))?
            } else {
                seq.next_element::<IgnoredAny>()?.map(|_| ())
            };
            if found.is_none() {
                return Ok(());
            }
            index += 1;
        }
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (first, rest) = self.0.split_first().expect("path is not empty");
        while let Some(matched) = map.next_key_seed(MatchKey {
            key: first,
            last: rest.is_empty(),
        })? {
            if matched {
                map.next_value_seed(Locate(rest))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// A mapping key: `true` when it is the one looked for; an error carrying its position when
/// it is the last step of the path.
struct MatchKey<'a> {
    key: &'a str,
    last: bool,
}

impl<'de> DeserializeSeed<'de> for MatchKey<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MatchKey<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping key")
    }
    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        match (key == self.key, self.last) {
            (true, true) => Err(E::custom(FOUND)),
            (matched, _) => Ok(matched),
        }
    }
}

/// A DNS-1123 label: 1 to 63 lowercase ASCII letters, digits and '-', starting and ending with
/// a letter or digit (Kubernetes namespaces).
fn is_dns1123_label(text: &str) -> bool {
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let bytes = text.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes.iter().all(|&c| alnum(c) || c == b'-')
        && alnum(bytes[0])
        && alnum(bytes[bytes.len() - 1])
}

/// A DNS-1123 subdomain: DNS-1123 labels joined by '.', at most 253 characters (most
/// Kubernetes object names).
fn is_dns1123_subdomain(text: &str) -> bool {
    text.len() <= 253 && text.split('.').all(is_dns1123_label)
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
    fn unknown_mode_names_the_field_and_line() {
        let yaml = ISSUE_MANIFEST.replace("mode: stream", "mode: firehose");
        let err = load_manifest(&yaml).expect_err("must be rejected");
        let ManifestError::InvalidValue { field, line, .. } = &err else {
            panic!("expected an invalid value, got {err:?}");
        };
        assert_eq!(field, "spec.source.redis.mode");
        assert_eq!(*line, Some(6));
        assert!(err.to_string().contains("firehose"), "{err}");
    }

    /// Block style, one field per line: line numbers below are those of this text.
    const BLOCK_MANIFEST: &str = "\
apiVersion: switchboard.dev/v1alpha1
kind: QueueAdapter
metadata:
  name: orders
  namespace: shop
spec:
  source:
    redis:
      mode: stream
      stream: orders
      bodyField: body
  target:
    queue: orders
  payload:
    format: json
    maxBytes: 10
  delivery:
    batchSize: 100
    deadLetter:
      stream: orders.dlq
";

    fn unknown_fields(yaml: &str) -> Vec<UnknownField> {
        match load_manifest(yaml) {
            Err(ManifestError::UnknownFields(fields)) => fields,
            other => panic!("expected unknown fields, got {other:?}"),
        }
    }

    fn unknown(path: &str, line: usize) -> UnknownField {
        UnknownField {
            path: path.to_owned(),
            line: Some(line),
        }
    }

    #[test]
    fn block_manifest_loads_every_field() {
        let adapter = load_manifest(BLOCK_MANIFEST).expect("valid manifest");
        assert_eq!(adapter.spec.payload.max_bytes, 10);
        assert_eq!(
            adapter.spec.delivery.dead_letter.stream.as_deref(),
            Some("orders.dlq")
        );
    }

    #[test]
    fn misspelled_batch_size_is_rejected_with_its_line() {
        let yaml = BLOCK_MANIFEST.replace("batchSize:", "bachSize:");
        let fields = unknown_fields(&yaml);
        assert_eq!(fields, [unknown("spec.delivery.bachSize", 18)]);
        let err = load_manifest(&yaml).expect_err("rejected");
        assert_eq!(
            err.to_string(),
            "line 18: spec.delivery.bachSize: unknown field (not part of switchboard.dev/v1alpha1 QueueAdapter)"
        );
    }

    #[test]
    fn misspelled_max_bytes_is_rejected_with_its_line() {
        let yaml = BLOCK_MANIFEST.replace("maxBytes:", "maxByte:");
        assert_eq!(unknown_fields(&yaml), [unknown("spec.payload.maxByte", 16)]);
    }

    #[test]
    fn misspelled_dead_letter_is_rejected_with_its_line() {
        let yaml = BLOCK_MANIFEST.replace("deadLetter:", "deadLeter:");
        assert_eq!(
            unknown_fields(&yaml),
            [unknown("spec.delivery.deadLeter", 19)]
        );
    }

    #[test]
    fn misspelled_body_field_is_rejected_with_its_line() {
        let yaml = BLOCK_MANIFEST.replace("bodyField:", "bodyFeild:");
        assert_eq!(
            unknown_fields(&yaml),
            [unknown("spec.source.redis.bodyFeild", 11)]
        );
    }

    #[test]
    fn unsupported_broker_next_to_redis_is_rejected_with_its_line() {
        let yaml = BLOCK_MANIFEST.replace(
            "  target:\n",
            "    pulsar:\n      topic: orders\n  target:\n",
        );
        assert_eq!(unknown_fields(&yaml), [unknown("spec.source.pulsar", 12)]);
    }

    #[test]
    fn two_brokers_are_rejected_naming_the_source() {
        let yaml = BLOCK_MANIFEST.replace(
            "  target:\n",
            "    sqs:\n      queueUrl: https://sqs.example/orders\n  target:\n",
        );
        let err = load_manifest(&yaml).expect_err("one broker only");
        // The list of brokers comes from the registry (a new broker changes no test here).
        let expected = format!("spec.source: {}", crate::source::exactly_one_broker());
        assert!(
            err.to_string().contains(&expected) && expected.contains("(redis, sqs, "),
            "{err}"
        );
    }

    #[test]
    fn every_unknown_field_is_named_with_its_own_line() {
        let yaml = BLOCK_MANIFEST
            .replace("kind: QueueAdapter\n", "kind: QueueAdapter\nstatu: {}\n")
            .replace(
                "    queue: orders\n",
                "    queue: orders\n    stream: orders\n",
            )
            .replace("batchSize:", "bachSize:");
        // `stream` is a known key at line 11, but not under spec.target: the line found is the
        // one on the path.
        assert_eq!(
            unknown_fields(&yaml),
            [
                unknown("statu", 3),
                unknown("spec.target.stream", 15),
                unknown("spec.delivery.bachSize", 20),
            ]
        );
    }

    #[test]
    fn unknown_field_in_flow_style_is_found_on_its_line() {
        let yaml = ISSUE_MANIFEST.replace("batchSize: 200", "bachSize: 200");
        assert_eq!(
            unknown_fields(&yaml),
            [unknown("spec.delivery.bachSize", 8)]
        );
    }

    #[test]
    fn unknown_field_in_kubernetes_resources_is_rejected() {
        let yaml =
            format!("{BLOCK_MANIFEST}  workload:\n    resources:\n      limitz: {{cpu: 1}}\n");
        assert_eq!(
            unknown_fields(&yaml),
            [unknown("spec.workload.resources.limitz", 23)]
        );
        let yaml = yaml.replace("limitz", "limits");
        let adapter = load_manifest(&yaml).expect("known resources field");
        assert!(adapter.spec.workload.resources.is_some());
    }

    #[test]
    fn unknown_field_inside_a_list_item_is_found_on_its_line() {
        let yaml = format!(
            "{BLOCK_MANIFEST}  workload:\n    resources:\n      claims:\n        - name: gpu\n        - name: fpga\n          nmae: typo\n"
        );
        assert_eq!(
            unknown_fields(&yaml),
            [unknown("spec.workload.resources.claims.1.nmae", 26)]
        );
    }

    #[test]
    fn negative_batch_size_names_the_field_type_and_line() {
        let yaml = ISSUE_MANIFEST.replace("batchSize: 200", "batchSize: -5");
        let err = load_manifest(&yaml).expect_err("must be rejected");
        let ManifestError::InvalidValue {
            field,
            line,
            message,
        } = &err
        else {
            panic!("expected an invalid value, got {err:?}");
        };
        assert_eq!(field, "spec.delivery.batchSize");
        assert_eq!(*line, Some(8));
        assert!(
            message.contains("-5") && message.contains("expected u32"),
            "{message}"
        );
        assert!(!message.contains("line"), "position given once: {message}");
        assert!(
            err.to_string().starts_with(
                "line 8: spec.delivery.batchSize: invalid type: integer `-5`, expected u32"
            ),
            "{err}"
        );
    }

    #[test]
    fn text_for_a_number_names_the_field_and_line() {
        let yaml = BLOCK_MANIFEST.replace("maxBytes: 10", "maxBytes: ten");
        let err = load_manifest(&yaml).expect_err("must be rejected");
        assert!(
            matches!(&err, ManifestError::InvalidValue { field, line: Some(16), .. }
                if field == "spec.payload.maxBytes"),
            "{err:?}"
        );
    }

    #[test]
    fn envelope_defaults_to_none_and_an_unknown_one_names_the_field_and_line() {
        let adapter = load_manifest(BLOCK_MANIFEST).expect("valid");
        assert_eq!(adapter.spec.payload.envelope, crate::Envelope::None);
        for (value, envelope) in [
            ("cloudevents", crate::Envelope::CloudEvents),
            ("sns", crate::Envelope::Sns),
        ] {
            let yaml = BLOCK_MANIFEST.replace(
                "maxBytes: 10",
                &format!("maxBytes: 10\n    envelope: {value}"),
            );
            assert_eq!(
                load_manifest(&yaml).expect(value).spec.payload.envelope,
                envelope
            );
        }
        let yaml = BLOCK_MANIFEST.replace("maxBytes: 10", "maxBytes: 10\n    envelope: cloudevent");
        let err = load_manifest(&yaml).expect_err("must be rejected");
        assert!(
            matches!(&err, ManifestError::InvalidValue { field, line: Some(17), .. }
                if field == "spec.payload.envelope"),
            "{err:?}"
        );
    }

    fn invalid_name(yaml: &str) -> (&'static str, Option<usize>, String) {
        match load_manifest(yaml) {
            Err(ManifestError::InvalidName {
                field, line, value, ..
            }) => (field, line, value),
            other => panic!("expected an invalid name, got {other:?}"),
        }
    }

    #[test]
    fn non_ascii_name_is_rejected_like_the_api_server_does() {
        let yaml = BLOCK_MANIFEST.replace("name: orders", "name: ordérs");
        assert_eq!(
            invalid_name(&yaml),
            ("metadata.name", Some(4), "ordérs".to_owned())
        );
    }

    #[test]
    fn uppercase_and_underscore_name_is_rejected() {
        let yaml = BLOCK_MANIFEST.replace("name: orders", "name: Orders_X");
        assert_eq!(
            invalid_name(&yaml),
            ("metadata.name", Some(4), "Orders_X".to_owned())
        );
        let err = load_manifest(&yaml).expect_err("rejected");
        assert!(err.to_string().contains("DNS-1123 subdomain"), "{err}");
    }

    #[test]
    fn names_must_start_and_end_with_a_letter_or_digit() {
        for name in ["-orders", "orders-", "orders.", "a..b", "a.-b"] {
            let yaml = BLOCK_MANIFEST.replace("name: orders", &format!("name: \"{name}\""));
            assert_eq!(invalid_name(&yaml).0, "metadata.name", "{name}");
        }
    }

    #[test]
    fn dotted_and_dashed_names_are_valid() {
        let yaml = BLOCK_MANIFEST.replace("name: orders", "name: orders-v2.eu1");
        let adapter = load_manifest(&yaml).expect("valid subdomain");
        assert_eq!(adapter.adapter_name(), "shop/orders-v2.eu1");
    }

    #[test]
    fn non_ascii_namespace_is_rejected() {
        let yaml = BLOCK_MANIFEST.replace("namespace: shop", "namespace: déf");
        assert_eq!(
            invalid_name(&yaml),
            ("metadata.namespace", Some(5), "déf".to_owned())
        );
        let err = load_manifest(&yaml).expect_err("rejected");
        assert!(err.to_string().contains("DNS-1123 label"), "{err}");
    }

    #[test]
    fn dotted_or_long_namespace_is_rejected() {
        let yaml = BLOCK_MANIFEST.replace("namespace: shop", "namespace: shop.eu");
        assert_eq!(invalid_name(&yaml).0, "metadata.namespace");
        let yaml =
            BLOCK_MANIFEST.replace("namespace: shop", &format!("namespace: {}", "n".repeat(64)));
        assert_eq!(invalid_name(&yaml).0, "metadata.namespace");
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
