//! Registering metrics, shared by the worker and the operator: a metric under its name (and,
//! for one release, under its old name too), and a family's series created up front so that
//! they are exported at zero.

use std::hash::Hash;

use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::registry::{Metric, Registry};

/// `metric` registered in `registry` under `name`; returned for the caller to keep.
pub fn register<M: Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// [`register`] under `name` and, for one release, under its old name `alias` too: one metric
/// under both names, so that dashboards and alerts on the old name keep working. `prefix` is
/// the registry's, to name the new metric in full in the alias's help.
pub fn register_aliased<M: Metric + Clone>(
    registry: &mut Registry,
    prefix: &str,
    name: &str,
    alias: &str,
    help: &str,
    metric: M,
) -> M {
    let metric = register(registry, name, help, metric);
    registry.register(
        alias,
        format!("{help} (deprecated name of {prefix}_{name}, removed in the next release)"),
        metric.clone(),
    );
    metric
}

/// Creates the series of every label set of `all`, so that they are exported (at zero) before
/// anything happens.
pub fn create_series<S, M, C>(family: &Family<S, M, C>, all: impl IntoIterator<Item = S>)
where
    S: Clone + Hash + Eq,
    C: MetricConstructor<M>,
{
    for labels in all {
        drop(family.get_or_create(&labels));
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;

    use super::*;

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct Labels {
        outcome: &'static str,
    }

    #[test]
    fn an_aliased_metric_is_one_series_under_both_names() {
        let mut registry = Registry::with_prefix("app");
        let family = register_aliased(
            &mut registry,
            "app",
            "new_name",
            "old_name",
            "Things done",
            Family::<Labels, Counter>::default(),
        );
        family.get_or_create(&Labels { outcome: "ok" }).inc_by(3);
        let text = crate::encode(&registry);
        assert!(
            text.contains(r#"app_new_name_total{outcome="ok"} 3"#),
            "{text}"
        );
        assert!(
            text.contains(r#"app_old_name_total{outcome="ok"} 3"#),
            "{text}"
        );
        assert!(
            text.contains("deprecated name of app_new_name, removed"),
            "{text}"
        );
    }

    #[test]
    fn created_series_are_exported_at_zero() {
        let mut registry = Registry::default();
        let family = register(
            &mut registry,
            "outcomes",
            "Outcomes",
            Family::<Labels, Counter>::default(),
        );
        create_series(
            &family,
            [Labels { outcome: "ok" }, Labels { outcome: "failed" }],
        );
        let text = crate::encode(&registry);
        assert!(text.contains(r#"outcomes_total{outcome="ok"} 0"#), "{text}");
        assert!(
            text.contains(r#"outcomes_total{outcome="failed"} 0"#),
            "{text}"
        );
    }
}
