//! A message's identity, decided here only: its external id when the broker gives none (its
//! body's hash), and the todo idempotency key built from it. Every transport and the pipeline's
//! intake (envelopes, redriven copies) build them with these functions, so a key written by one
//! release deduplicates against the next.

use sha2::{Digest, Sha256};

/// Hex SHA-256 of a body.
pub fn body_hash(body: &[u8]) -> String {
    hex::encode(Sha256::digest(body))
}

/// The external id of a message the broker gives no id: `sha256:` and its [`body_hash`] (two
/// messages with the same body are then one message).
pub fn body_id(hash: &str) -> String {
    format!("sha256:{hash}")
}

/// The todo idempotency key of the message `external_id` of `scope`: the source
/// (`{kind}:{adapter}`), or for a broker whose ids are unique only per queue (RabbitMQ), the
/// source and the queue (`{kind}:{adapter}:{queue}`).
pub fn idempotency_key(scope: &str, external_id: &str) -> String {
    // Sized once: built for every message received.
    [scope, ":", external_id].concat()
}

/// The external id in `key` when it is an idempotency key of `scope` (`{scope}:{id}`, the id
/// not empty).
pub fn id_in_scope<'k>(key: &'k str, scope: &str) -> Option<&'k str> {
    let id = key.strip_prefix(scope)?.strip_prefix(':')?;
    (!id.is_empty()).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_body_ids_keep_their_released_shape() {
        assert_eq!(
            body_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(body_id("ab"), "sha256:ab");
        assert_eq!(
            idempotency_key("sqs:shop/orders", "m-1"),
            "sqs:shop/orders:m-1"
        );
    }

    #[test]
    fn a_key_names_its_id_only_within_its_own_scope() {
        assert_eq!(
            id_in_scope("sqs:shop/orders:m-1", "sqs:shop/orders"),
            Some("m-1")
        );
        assert_eq!(id_in_scope("sqs:shop/orders:", "sqs:shop/orders"), None);
        assert_eq!(
            id_in_scope("sqs:shop/orders-2:m-1", "sqs:shop/orders"),
            None
        );
        assert_eq!(id_in_scope("sqs:shop/other:m-1", "sqs:shop/orders"), None);
    }
}
