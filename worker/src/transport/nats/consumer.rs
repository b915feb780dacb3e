//! The durable pull consumer the worker needs, and how an existing one may differ from it:
//! a difference that changes delivery is refused (fatal, naming the setting), never fixed by
//! recreating the consumer (which would lose its acknowledgement state). The one exception is a
//! delivery limit: the worker counts deliveries itself, so the consumer it needs has none, and
//! the limit older workers set (`maxDeliveries + 1`) is lifted in place.

use std::time::Duration;

use async_nats::datetime::DateTime;
use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, pull};
use switchboard_api::{NatsDeliverPolicy, NatsSource};

use crate::transport::TransportError;

/// What the consumer's MaxDeliver must be: unlimited. The server never stops delivering a
/// message on its own (a worker killed during a last delivery would leave it neither stored nor
/// dead-lettered); the worker dead-letters a message delivered more than
/// `delivery.maxDeliveries` times.
pub const UNLIMITED: i64 = -1;

/// The consumer configuration for `spec`, starting at `start` (the deliver policy of `spec`
/// for a consumer created the first time; see [`Start`]).
pub fn desired(spec: &NatsSource, start: &Start) -> pull::Config {
    pull::Config {
        durable_name: Some(spec.consumer.clone()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(u64::from(spec.ack_wait_seconds)),
        max_deliver: UNLIMITED,
        filter_subject: spec.filter_subject.clone().unwrap_or_default(),
        deliver_policy: start.policy(spec),
        // Unlimited: the server's default (1,000) is less than what the workers hold at a large
        // batchSize (each holds up to four batches), and fetches would then stall. Each worker
        // bounds what it holds itself.
        max_ack_pending: -1,
        ..Default::default()
    }
}

/// Where a consumer the worker creates starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// `spec.source.nats.deliverPolicy`: the consumer is created for the first time.
    Configured,
    /// At this stream sequence: after the highest one stored (a lost consumer), or at 1 (a
    /// re-created stream, all of whose messages are new).
    Sequence(u64),
    /// At the messages published since this time: the creation of the `deliverPolicy: new`
    /// consumer that was lost before anything was stored.
    Time(DateTime),
}

impl Start {
    fn policy(&self, spec: &NatsSource) -> DeliverPolicy {
        match self {
            Start::Configured => match spec.deliver_policy {
                NatsDeliverPolicy::All => DeliverPolicy::All,
                NatsDeliverPolicy::New => DeliverPolicy::New,
            },
            Start::Sequence(start_sequence) => DeliverPolicy::ByStartSequence {
                start_sequence: *start_sequence,
            },
            Start::Time(start_time) => DeliverPolicy::ByStartTime {
                start_time: *start_time,
            },
        }
    }
}

/// The deliver policy's name; a consumer the worker re-created after a loss (by start
/// sequence or time) counts as the configured policy.
fn deliver_policy_name(policy: &DeliverPolicy, configured: &str) -> String {
    match policy {
        DeliverPolicy::All => "all".into(),
        DeliverPolicy::New => "new".into(),
        DeliverPolicy::Last => "last".into(),
        DeliverPolicy::LastPerSubject => "last_per_subject".into(),
        DeliverPolicy::ByStartSequence { .. } | DeliverPolicy::ByStartTime { .. } => {
            configured.into()
        }
    }
}

/// What an existing consumer needs before the worker may use it.
#[derive(Debug, PartialEq, Eq)]
pub enum Fit {
    /// Usable as it is.
    Usable,
    /// Usable once its MaxDeliver is lifted (the limit an older worker set).
    LiftDeliveryLimit,
}

/// Refuses an existing consumer whose configuration differs from `wanted` in a way that
/// matters, naming the setting to change (or the consumer to delete).
/// `max_deliveries` is `spec.delivery.maxDeliveries`: the limit older workers set on the
/// consumer (`maxDeliveries + 1`) is lifted; any other limit is refused.
pub fn check_existing(
    existing: &consumer::Config,
    wanted: &pull::Config,
    name: &str,
    max_deliveries: u64,
) -> Result<Fit, TransportError> {
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
    let older_workers_limit = i64::try_from(max_deliveries.saturating_add(1)).ok();
    let fit = match existing.max_deliver {
        limit if limit <= 0 => Fit::Usable,
        limit if Some(limit) == older_workers_limit => Fit::LiftDeliveryLimit,
        limit => {
            return conflict(
                "spec.delivery.maxDeliveries",
                format!(
                    "max_deliver {limit}: the server would stop delivering a message the worker has neither stored nor dead-lettered (the worker needs -1, unlimited, and counts deliveries itself)"
                ),
            );
        }
    };
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
    let configured = deliver_policy_name(&wanted.deliver_policy, "");
    let policy = deliver_policy_name(&existing.deliver_policy, &configured);
    if !configured.is_empty() && policy != configured {
        return conflict(
            "spec.source.nats.deliverPolicy",
            format!("deliver policy {policy}, not {configured}"),
        );
    }
    Ok(fit)
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

    fn setting(result: Result<Fit, TransportError>) -> String {
        match result.expect_err("conflict").kind() {
            ErrorKind::Fatal { setting } => setting.clone(),
            other => panic!("expected a fatal error, got {other:?}"),
        }
    }

    #[test]
    fn desired_consumer_has_no_delivery_limit_of_its_own() {
        let config = desired(
            &spec(serde_json::json!({"filterSubject": "orders.eu.>"})),
            &Start::Configured,
        );
        assert_eq!(config.durable_name.as_deref(), Some("workers"));
        assert_eq!(config.ack_policy, AckPolicy::Explicit);
        assert_eq!(config.ack_wait, Duration::from_secs(30));
        assert_eq!(config.max_deliver, -1);
        assert_eq!(config.max_ack_pending, -1);
        assert_eq!(config.filter_subject, "orders.eu.>");
        assert_eq!(
            check_existing(&existing(&config), &config, "workers", 5).expect("usable"),
            Fit::Usable
        );
    }

    #[test]
    fn the_limit_older_workers_set_is_lifted_and_a_re_created_consumer_is_accepted() {
        let source = spec(serde_json::json!({"deliverPolicy": "new"}));
        let wanted = desired(&source, &Start::Configured);
        let mut older = existing(&wanted);
        older.max_deliver = 6;
        assert_eq!(
            check_existing(&older, &wanted, "workers", 5).expect("lifted"),
            Fit::LiftDeliveryLimit
        );
        let recreated = existing(&desired(&source, &Start::Sequence(293)));
        assert_eq!(
            recreated.deliver_policy,
            DeliverPolicy::ByStartSequence {
                start_sequence: 293
            }
        );
        assert_eq!(
            check_existing(&recreated, &wanted, "workers", 5).expect("usable"),
            Fit::Usable
        );
    }

    #[test]
    fn each_conflicting_field_is_named() {
        let wanted = desired(&spec(serde_json::json!({})), &Start::Configured);
        let differ = |change: fn(&mut consumer::Config)| {
            let mut existing = existing(&wanted);
            change(&mut existing);
            setting(check_existing(&existing, &wanted, "workers", 5))
        };
        assert_eq!(
            differ(|c| c.ack_wait = Duration::from_secs(60)),
            "spec.source.nats.ackWaitSeconds"
        );
        assert_eq!(differ(|c| c.max_deliver = 3), "spec.delivery.maxDeliveries");
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
