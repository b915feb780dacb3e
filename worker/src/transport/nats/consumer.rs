//! The durable pull consumer the worker needs, and how an existing one may differ from it:
//! a difference that changes delivery is refused (fatal, naming the setting), never fixed by
//! recreating the consumer (which would lose its acknowledgement state).

use std::time::Duration;

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, pull};
use switchboard_api::{NatsDeliverPolicy, NatsSource};

use crate::transport::TransportError;

/// The consumer configuration for `spec`, with `max_deliveries` from `spec.delivery`: the
/// server delivers a message at most `max_deliveries + 1` times, so the worker sees the last
/// delivery and dead-letters it itself.
pub fn desired(spec: &NatsSource, max_deliveries: u64) -> pull::Config {
    pull::Config {
        durable_name: Some(spec.consumer.clone()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(u64::from(spec.ack_wait_seconds)),
        max_deliver: i64::try_from(max_deliveries.saturating_add(1)).unwrap_or(i64::MAX),
        filter_subject: spec.filter_subject.clone().unwrap_or_default(),
        deliver_policy: match spec.deliver_policy {
            NatsDeliverPolicy::All => DeliverPolicy::All,
            NatsDeliverPolicy::New => DeliverPolicy::New,
        },
        // Unlimited: the server's default (1,000) is less than what the workers hold at a large
        // batchSize (each holds up to four batches), and fetches would then stall. Each worker
        // bounds what it holds itself.
        max_ack_pending: -1,
        ..Default::default()
    }
}

fn deliver_policy_name(policy: &DeliverPolicy) -> &'static str {
    match policy {
        DeliverPolicy::All => "all",
        DeliverPolicy::New => "new",
        DeliverPolicy::Last => "last",
        DeliverPolicy::LastPerSubject => "last_per_subject",
        DeliverPolicy::ByStartSequence { .. } => "by_start_sequence",
        DeliverPolicy::ByStartTime { .. } => "by_start_time",
    }
}

/// Refuses an existing consumer whose configuration differs from `wanted` in a way that
/// matters, naming the setting to change (or the consumer to delete).
pub fn check_existing(
    existing: &consumer::Config,
    wanted: &pull::Config,
    name: &str,
) -> Result<(), TransportError> {
    let conflict = |setting: &str, what: String| {
        Err(TransportError::fatal(
            setting,
            format!(
                "the existing consumer {name} has {what}; change the setting to match, or delete the consumer so the worker creates it"
            ),
            None,
        ))
    };
    if existing.ack_policy != AckPolicy::Explicit {
        return conflict(
            "spec.source.nats.consumer",
            format!(
                "ack policy {:?} (the worker needs explicit acknowledgement)",
                existing.ack_policy
            ),
        );
    }
    if existing.ack_wait != wanted.ack_wait {
        return conflict(
            "spec.source.nats.ackWaitSeconds",
            format!(
                "ack_wait {} s, not {} s",
                existing.ack_wait.as_secs_f64(),
                wanted.ack_wait.as_secs()
            ),
        );
    }
    if existing.max_deliver != wanted.max_deliver {
        return conflict(
            "spec.delivery.maxDeliveries",
            format!(
                "max_deliver {} (the worker needs delivery.maxDeliveries + 1 = {})",
                existing.max_deliver, wanted.max_deliver
            ),
        );
    }
    let filters: Vec<&str> = if existing.filter_subjects.is_empty() {
        Some(existing.filter_subject.as_str())
            .filter(|f| !f.is_empty())
            .into_iter()
            .collect()
    } else {
        existing
            .filter_subjects
            .iter()
            .map(String::as_str)
            .collect()
    };
    let wanted_filters: Vec<&str> = Some(wanted.filter_subject.as_str())
        .filter(|f| !f.is_empty())
        .into_iter()
        .collect();
    if filters != wanted_filters {
        return conflict(
            "spec.source.nats.filterSubject",
            format!("filter subjects {filters:?}, not {wanted_filters:?}"),
        );
    }
    if deliver_policy_name(&existing.deliver_policy) != deliver_policy_name(&wanted.deliver_policy)
    {
        return conflict(
            "spec.source.nats.deliverPolicy",
            format!(
                "deliver policy {}, not {}",
                deliver_policy_name(&existing.deliver_policy),
                deliver_policy_name(&wanted.deliver_policy)
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ErrorKind;

    fn spec(extra: serde_json::Value) -> NatsSource {
        let mut value = serde_json::json!({"stream": "ORDERS", "consumer": "workers"});
        value
            .as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        serde_json::from_value(value).expect("spec")
    }

    /// The configuration the server reports for a consumer created with `config`.
    fn existing(config: &pull::Config) -> consumer::Config {
        serde_json::from_value(serde_json::to_value(config).expect("json")).expect("config")
    }

    fn setting(result: Result<(), TransportError>) -> String {
        match result.expect_err("conflict").kind() {
            ErrorKind::Fatal { setting } => setting.clone(),
            other => panic!("expected a fatal error, got {other:?}"),
        }
    }

    #[test]
    fn desired_consumer_lets_the_worker_see_the_last_delivery() {
        let config = desired(
            &spec(serde_json::json!({"filterSubject": "orders.eu.>"})),
            5,
        );
        assert_eq!(config.durable_name.as_deref(), Some("workers"));
        assert_eq!(config.ack_policy, AckPolicy::Explicit);
        assert_eq!(config.ack_wait, Duration::from_secs(30));
        assert_eq!(config.max_deliver, 6);
        assert_eq!(config.max_ack_pending, -1);
        assert_eq!(config.filter_subject, "orders.eu.>");
        assert!(check_existing(&existing(&config), &config, "workers").is_ok());
    }

    #[test]
    fn each_conflicting_field_is_named() {
        let wanted = desired(&spec(serde_json::json!({})), 5);
        let differ = |change: fn(&mut consumer::Config)| {
            let mut existing = existing(&wanted);
            change(&mut existing);
            setting(check_existing(&existing, &wanted, "workers"))
        };
        assert_eq!(
            differ(|c| c.ack_wait = Duration::from_secs(60)),
            "spec.source.nats.ackWaitSeconds"
        );
        assert_eq!(
            differ(|c| c.max_deliver = -1),
            "spec.delivery.maxDeliveries"
        );
        assert_eq!(
            differ(|c| c.ack_policy = AckPolicy::All),
            "spec.source.nats.consumer"
        );
        assert_eq!(
            differ(|c| c.filter_subject = "orders.us".into()),
            "spec.source.nats.filterSubject"
        );
        assert_eq!(
            differ(|c| c.deliver_policy = DeliverPolicy::Last),
            "spec.source.nats.deliverPolicy"
        );
    }
}
