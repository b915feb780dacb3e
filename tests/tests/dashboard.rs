//! The chart's Grafana dashboard (`charts/switchboard/files/dashboard.json`) against a real
//! Prometheus (`scripts/prometheus.sh`) scraping two real worker replicas every second while they
//! store a Redis stream under load: every panel's query, with the `adapter` variable set, returns
//! data, and the panels of queue-wide gauges (every replica reports the whole queue's backlog and
//! pending) show the queue's figure, not one per replica added up. The operator's panels against
//! a real operator reconciling an adapter on a real kube-apiserver, scraped the same way.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use switchboard_tests::Fixture;
use switchboard_tests::control_plane::{OPERATOR_TIMEOUT, OperatorEnv, adapter_manifest};
use switchboard_tests::prometheus::Prometheus;
use switchboard_tests::servers::workspace_path;
use switchboard_tests::wait::wait_for;

const DASHBOARD: &str = "charts/switchboard/files/dashboard.json";
/// Grafana's `$__rate_interval` for a 1 s scrape interval: a few samples per window.
const RATE_INTERVAL: &str = "10s";
/// The operator's metrics: its panels are checked against an operator, the others against
/// workers.
const OPERATOR_METRICS: &str = "switchboard_operator_";
/// The operator's metrics without an `adapter` label: their panels show every adapter's.
const OPERATOR_WIDE_METRICS: [&str; 1] = ["switchboard_operator_reconcile_failures_total"];

/// (panel title, query) of every panel target, with `$adapter` and `$__rate_interval` set.
fn panel_queries(dashboard: &Value, adapter: &str) -> Result<Vec<(String, String)>> {
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().context("panels")? {
        let title = panel["title"].as_str().context("a panel title")?;
        let targets = panel["targets"].as_array().context("panel targets")?;
        ensure!(!targets.is_empty(), "panel {title} has no query");
        for target in targets {
            let expr = target["expr"]
                .as_str()
                .with_context(|| format!("panel {title}: a target without expr"))?;
            ensure!(
                expr.contains(r#"adapter=~"$adapter""#)
                    || OPERATOR_WIDE_METRICS
                        .iter()
                        .any(|metric| expr.contains(metric)),
                "panel {title}: {expr} is not per adapter"
            );
            let query = expr
                .replace("$adapter", adapter)
                .replace("$__rate_interval", RATE_INTERVAL);
            ensure!(
                !query.contains('$'),
                "panel {title}: a variable left in {query}"
            );
            queries.push((title.to_owned(), query));
        }
    }
    Ok(queries)
}

/// (panel title, query) pairs.
type Queries = Vec<(String, String)>;

/// The (worker, operator) panel queries.
fn worker_and_operator_queries(dashboard: &Value, adapter: &str) -> Result<(Queries, Queries)> {
    let (operator, worker) = panel_queries(dashboard, adapter)?
        .into_iter()
        .partition(|(_, query)| query.contains(OPERATOR_METRICS));
    Ok((worker, operator))
}

/// The first sample's value of an instant-query result.
fn value(samples: &[Value]) -> Option<f64> {
    samples.first()?["value"][1].as_str()?.parse().ok()
}

/// Every sample's value of an instant-query result.
fn values(samples: &[Value]) -> Vec<f64> {
    samples
        .iter()
        .filter_map(|sample| sample["value"][1].as_str()?.parse().ok())
        .collect()
}

/// The queue's own figures, from Redis: the group's (lag, pending) of stream `stream`.
fn group_figures(fx: &Fixture, stream: &str) -> Result<(f64, f64)> {
    let mut conn = fx.redis.connection()?;
    let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(&mut conn)?;
    let group = groups
        .iter()
        .find(|group| {
            matches!(group.get("name"), Some(redis::Value::BulkString(name)) if name == b"switchboard")
        })
        .context("the group `switchboard`")?;
    let figure = |field: &str| match group.get(field) {
        Some(redis::Value::Int(n)) => Ok(*n as f64),
        other => anyhow::bail!("XINFO GROUPS {field}: {other:?}"),
    };
    Ok((figure("lag")?, figure("pending")?))
}

/// Under load: (messages stored per second, end-to-end p99), both positive and finite.
fn load_figures(prometheus: &Prometheus, adapter: &str) -> Result<Option<(f64, f64)>> {
    let stored = value(&prometheus.query(&format!(
        r#"sum(rate(switchboard_messages_stored_total{{adapter="{adapter}"}}[{RATE_INTERVAL}]))"#
    ))?);
    let p99 = value(&prometheus.query(&format!(
        r#"histogram_quantile(0.99, sum by (le) (rate(switchboard_end_to_end_latency_seconds_bucket{{adapter="{adapter}"}}[{RATE_INTERVAL}])))"#
    ))?);
    Ok(stored
        .zip(p99)
        .filter(|(stored, p99)| *stored > 0.0 && p99.is_finite() && *p99 > 0.0))
}

/// The value of the panel `title`'s only query.
fn panel_value(prometheus: &Prometheus, queries: &[(String, String)], title: &str) -> Result<f64> {
    let (_, query) = queries
        .iter()
        .find(|(panel, _)| panel == title)
        .with_context(|| format!("a panel {title}"))?;
    value(&prometheus.query(query)?).with_context(|| format!("{title}: {query} has no value"))
}

/// Queue-wide gauges: with the database read-only nothing is stored or acknowledged, so the
/// queue's backlog and pending hold still; both replicas report them, and the Backlog and
/// Pending panels show the queue's figures, not twice them.
async fn queue_wide_panels_count_the_queue_once(
    fx: &Fixture,
    prometheus: &Prometheus,
    queries: &[(String, String)],
    adapter: &str,
) -> Result<()> {
    fx.set_read_only(true).await?;
    fx.produce(
        "orders",
        (0..5000).map(|n| format!(r#"{{"held":{n}}}"#).into_bytes()),
    )?;
    let mut seen = String::new();
    wait_for(
        Duration::from_secs(60),
        "the Backlog and Pending panels show the queue's figures",
        || {
            let outcome = (|| {
                let (lag, pending) = group_figures(fx, "orders")?;
                let per_replica = |metric: &str| -> Result<Vec<f64>> {
                    Ok(values(
                        &prometheus.query(&format!(r#"{metric}{{adapter="{adapter}"}}"#))?,
                    ))
                };
                let backlog_series = per_replica("switchboard_backlog_messages")?;
                let pending_series = per_replica("switchboard_pending_messages")?;
                let backlog = panel_value(prometheus, queries, "Backlog")?;
                let pending_panel = panel_value(prometheus, queries, "Pending")?;
                seen = format!(
                    "queue: lag {lag}, pending {pending}; replicas: backlog {backlog_series:?}, \
                     pending {pending_series:?}; panels: Backlog {backlog}, Pending {pending_panel}"
                );
                Ok(lag > 0.0
                    && pending > 0.0
                    && backlog_series == [lag, lag]
                    && pending_series == [pending, pending]
                    && backlog == lag
                    && pending_panel == pending)
            })();
            async move { outcome }
        },
    )
    .await
    .with_context(|| seen.clone())?;
    println!("two replicas, one queue: {seen}");
    fx.set_read_only(false).await
}

/// `switchboard_adapter_info` selects adapters by what they read (every Redis adapter here)
/// and joins on `adapter`: one series per replica, the same labels.
fn adapter_info_selects_and_joins(prometheus: &Prometheus, adapter: &str) -> Result<()> {
    let info = prometheus.query(&format!(
        r#"switchboard_adapter_info{{adapter="{adapter}",system="redis"}}"#
    ))?;
    ensure!(
        info.len() == 2
            && info.iter().all(|sample| {
                let labels = &sample["metric"];
                labels["namespace"] == "test"
                    && labels["name"] == "orders"
                    && labels["destination"] == "orders"
                    && labels["consumer_group"] == "switchboard"
            }),
        "adapter_info of both replicas: {info:?}"
    );
    let joined = prometheus.query(
        r#"max by (adapter) (switchboard_backlog_messages) * on (adapter) group_left (system, destination) max by (adapter, system, destination) (switchboard_adapter_info{system="redis"})"#,
    )?;
    ensure!(
        joined.len() == 1 && joined[0]["metric"]["destination"] == "orders",
        "the backlog of every Redis adapter, by destination: {joined:?}"
    );
    Ok(())
}

#[tokio::test]
async fn dashboard_panels_return_data_and_count_queue_wide_gauges_once_with_two_replicas()
-> Result<()> {
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(workspace_path(DASHBOARD))?)?;
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("orders", "batchSize: 100", "format: json")?;
    let worker = fx.worker(&manifest, "w1")?;
    let replica = fx.worker(&manifest, "w2")?;
    let adapter = "test/orders";
    let (queries, _) = worker_and_operator_queries(&dashboard, adapter)?;
    let titles: Vec<&str> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|panel| panel["title"].as_str())
        .collect();
    for wanted in [
        "Throughput",
        "End-to-end latency",
        "Commit duration",
        "Backlog",
        "Oldest message age",
        "Pending",
        "Dead letters",
        "Redeliveries",
        "Dependencies up",
    ] {
        ensure!(titles.contains(&wanted), "no panel {wanted}: {titles:?}");
    }
    let prometheus = Prometheus::start(
        "switchboard-worker",
        &[worker.metrics_port, replica.metrics_port],
    )?;

    // Load: every poll (every 25 ms or so) produces 100 entries, one of them not JSON (a dead
    // letter), so the worker keeps storing while the queries are waited on.
    let mut produced = 0u64;
    let mut empty: Vec<String> = Vec::new();
    let mut load = None;
    wait_for(
        Duration::from_secs(90),
        "every panel query returns data, messages are stored, the end-to-end p99 is finite",
        || {
            let bodies: Vec<Vec<u8>> = (produced..produced + 100)
                .map(|n| match n % 100 {
                    0 => b"not json".to_vec(),
                    _ => format!(r#"{{"order":{n}}}"#).into_bytes(),
                })
                .collect();
            produced += 100;
            let produce = fx.produce("orders", bodies);
            let answers: Result<Vec<(String, usize)>> = queries
                .iter()
                .map(|(title, query)| {
                    Ok((format!("{title}: {query}"), prometheus.query(query)?.len()))
                })
                .collect();
            let figures = load_figures(&prometheus, adapter);
            let outcome = produce.and(answers).and_then(|answers| {
                empty = answers
                    .into_iter()
                    .filter(|(_, samples)| *samples == 0)
                    .map(|(query, _)| query)
                    .collect();
                load = figures?;
                Ok(empty.is_empty() && load.is_some())
            });
            async move { outcome }
        },
    )
    .await
    .with_context(|| {
        format!(
            "queries without data: {empty:#?}, stored/s and p99: {load:?}\n{}\n{}",
            prometheus.log_tail(),
            worker.log_tail()
        )
    })?;
    let scraped = prometheus.query(r#"up{job="switchboard-worker"}"#)?;
    ensure!(
        values(&scraped) == [1.0, 1.0],
        "both replicas are scraped: {scraped:?}"
    );

    // Under load for real (checked while producing, above): messages stored per second, a
    // finite end-to-end latency; and dead letters.
    let dead = value(&prometheus.query(&format!(
        r#"switchboard_dead_letter_messages{{adapter="{adapter}"}}"#
    ))?);
    ensure!(
        dead.is_some_and(|dead| dead > 0.0),
        "dead letters: {dead:?}"
    );

    queue_wide_panels_count_the_queue_once(&fx, &prometheus, &queries, adapter)
        .await
        .with_context(|| worker.log_tail())?;
    adapter_info_selects_and_joins(&prometheus, adapter)?;

    // The `adapter` variable lists the adapter.
    let variable = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == "adapter")
        .context("an `adapter` template variable")?;
    let definition = variable["definition"].as_str().unwrap_or_default();
    let (metric, label) = definition
        .strip_prefix("label_values(")
        .and_then(|rest| rest.strip_suffix(')'))
        .and_then(|args| args.split_once(", "))
        .with_context(|| format!("`adapter` is label_values(metric, label): {definition}"))?;
    let values = prometheus.api(&format!("label/{label}/values"), &[("match[]", metric)])?;
    ensure!(
        values
            .as_array()
            .is_some_and(|v| v.iter().any(|v| v == adapter)),
        "{definition} lists {values}, not {adapter}"
    );
    let (stored, p99) = load.unwrap_or_default();
    println!(
        "{} panel queries answered; {produced} messages produced, {stored:.0} stored/s, end-to-end p99 {p99:.3} s",
        queries.len(),
    );
    Ok(())
}

/// The panel queries of `title`, in the order of its targets.
fn queries_of<'a>(queries: &'a [(String, String)], title: &str) -> Vec<&'a str> {
    queries
        .iter()
        .filter(|(panel, _)| panel == title)
        .map(|(_, query)| query.as_str())
        .collect()
}

/// An instant query's samples as `label value → sample value` (`""` for a sample without it).
fn by_label(prometheus: &Prometheus, query: &str, label: &str) -> Result<BTreeMap<String, f64>> {
    Ok(prometheus
        .query(query)?
        .iter()
        .filter_map(|sample| {
            let key = sample["metric"][label].as_str().unwrap_or_default();
            Some((key.to_owned(), sample["value"][1].as_str()?.parse().ok()?))
        })
        .collect())
}

/// Waits until `check` holds for [`by_label`] of `query` and `label`; returns what it last saw.
async fn wait_panel(
    prometheus: &Prometheus,
    what: &str,
    (query, label): (&str, &str),
    check: impl Fn(&BTreeMap<String, f64>) -> bool,
) -> Result<BTreeMap<String, f64>> {
    let mut seen = BTreeMap::new();
    wait_for(OPERATOR_TIMEOUT, what, || {
        let outcome = by_label(prometheus, query, label).map(|now| {
            seen = now;
            check(&seen)
        });
        async move { outcome }
    })
    .await
    .with_context(|| format!("{query} by {label}: {seen:?}"))?;
    Ok(seen)
}

#[tokio::test]
async fn operator_panels_show_each_adapters_workers_and_ready_and_the_reconcile_failures()
-> Result<()> {
    const WORKERS: &str = "Workers and Ready (operator)";
    const FAILURES: &str = "Reconcile failures (operator)";
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(workspace_path(DASHBOARD))?)?;
    let adapter = format!("{}/orders", OperatorEnv::NAMESPACE);
    let (_, queries) = worker_and_operator_queries(&dashboard, &adapter)?;
    let (Ok([workers, ready]), Ok([failures])) = (
        <[&str; 2]>::try_from(queries_of(&queries, WORKERS)),
        <[&str; 1]>::try_from(queries_of(&queries, FAILURES)),
    ) else {
        anyhow::bail!("panels {WORKERS} (workers, Ready) and {FAILURES} (one query): {queries:?}");
    };
    let mut env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-0", &[])?;
    let prometheus = Prometheus::start("switchboard-operator", &[operator.metrics_addr.port()])?;
    let states = |available: f64, desired: f64| {
        move |seen: &BTreeMap<String, f64>| {
            seen.get("available") == Some(&available)
                && seen.get("desired") == Some(&desired)
                && seen.len() == 2
        }
    };
    let ready_is = |value: f64| {
        let adapter = adapter.clone();
        move |seen: &BTreeMap<String, f64>| seen.len() == 1 && seen.get(&adapter) == Some(&value)
    };

    // Two workers wanted, none available yet (no kubelet here): the panel says so, Ready is 0.
    env.apply_adapter(&adapter_manifest("orders", "  workload: {replicas: 2}\n"))
        .await?;
    let waiting = wait_panel(
        &prometheus,
        "2 desired, 0 available",
        (workers, "state"),
        states(0.0, 2.0),
    )
    .await
    .with_context(|| operator.log_tail())?;
    wait_panel(&prometheus, "not Ready", (ready, "adapter"), ready_is(0.0)).await?;
    // Both available: the panel follows, and Ready turns 1.
    env.mark_deployment_available("orders-worker").await?;
    let running = wait_panel(
        &prometheus,
        "2 desired, 2 available",
        (workers, "state"),
        states(2.0, 2.0),
    )
    .await
    .with_context(|| operator.log_tail())?;
    wait_panel(&prometheus, "Ready", (ready, "adapter"), ready_is(1.0)).await?;
    println!("{WORKERS}: {waiting:?}, then {running:?}");

    // Every category's series is there, at 0; then the database goes down while the adapter
    // changes: its reconciles fail, and the panel shows them as database failures.
    wait_panel(&prometheus, "no failures", (failures, "category"), |seen| {
        seen.contains_key("database") && seen.values().all(|rate| *rate == 0.0)
    })
    .await?;
    env.fixture.postgres.stop();
    env.apply_adapter(&adapter_manifest("orders", "  workload: {replicas: 3}\n"))
        .await?;
    let failing = wait_panel(
        &prometheus,
        "database failures",
        (failures, "category"),
        |seen| seen.get("database").is_some_and(|rate| *rate > 0.0),
    )
    .await
    .with_context(|| operator.log_tail())?;
    println!("{FAILURES}: {failing:?}");
    Ok(())
}
