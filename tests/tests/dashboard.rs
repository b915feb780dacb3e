//! The chart's Grafana dashboard (`charts/switchboard/files/dashboard.json`) against a real
//! Prometheus (`scripts/prometheus.sh`) scraping a real worker every second while it stores a
//! Redis stream under load: every panel's query, with the `adapter` variable set, returns data.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use switchboard_tests::Fixture;
use switchboard_tests::prometheus::Prometheus;
use switchboard_tests::servers::workspace_path;
use switchboard_tests::wait::wait_for;

const DASHBOARD: &str = "charts/switchboard/files/dashboard.json";
/// Grafana's `$__rate_interval` for a 1 s scrape interval: a few samples per window.
const RATE_INTERVAL: &str = "10s";

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
                expr.contains(r#"adapter=~"$adapter""#),
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

/// The first sample's value of an instant-query result.
fn value(samples: &[Value]) -> Option<f64> {
    samples.first()?["value"][1].as_str()?.parse().ok()
}

#[tokio::test]
async fn every_dashboard_panel_query_returns_data_from_a_worker_under_load() -> Result<()> {
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(workspace_path(DASHBOARD))?)?;
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("orders", "batchSize: 100", "format: json")?;
    let worker = fx.worker(&manifest, "w1")?;
    let adapter = "test/orders";
    let queries = panel_queries(&dashboard, adapter)?;
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
    let prometheus = Prometheus::start("switchboard-worker", &[worker.metrics_port])?;

    // Load: every poll (every 25 ms or so) produces 100 entries, one of them not JSON (a dead
    // letter), so the worker keeps storing while the queries are waited on.
    let mut produced = 0u64;
    let mut empty: Vec<String> = Vec::new();
    wait_for(
        Duration::from_secs(90),
        "every panel query returns data",
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
            let outcome = produce.and(answers).map(|answers| {
                empty = answers
                    .into_iter()
                    .filter(|(_, samples)| *samples == 0)
                    .map(|(query, _)| query)
                    .collect();
                empty.is_empty()
            });
            async move { outcome }
        },
    )
    .await
    .with_context(|| {
        format!(
            "queries without data: {empty:#?}\n{}\n{}",
            prometheus.log_tail(),
            worker.log_tail()
        )
    })?;

    // Under load for real: messages stored per second, a finite end-to-end latency, dead letters.
    let stored = value(&prometheus.query(&format!(
        r#"sum(rate(switchboard_messages_stored_total{{adapter="{adapter}"}}[{RATE_INTERVAL}]))"#
    ))?);
    ensure!(
        stored.is_some_and(|rate| rate > 0.0),
        "stored/s: {stored:?}"
    );
    let p99 = value(&prometheus.query(&format!(
        r#"histogram_quantile(0.99, sum by (le) (rate(switchboard_end_to_end_latency_seconds_bucket{{adapter="{adapter}"}}[{RATE_INTERVAL}])))"#
    ))?);
    ensure!(
        p99.is_some_and(|p99| p99.is_finite() && p99 > 0.0),
        "end-to-end p99: {p99:?}"
    );
    let dead = value(&prometheus.query(&format!(
        r#"switchboard_dead_letter_messages{{adapter="{adapter}"}}"#
    ))?);
    ensure!(
        dead.is_some_and(|dead| dead > 0.0),
        "dead letters: {dead:?}"
    );

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
    println!(
        "{} panel queries answered; {produced} messages produced, {:.0} stored/s, end-to-end p99 {:.3} s",
        queries.len(),
        stored.unwrap_or_default(),
        p99.unwrap_or_default()
    );
    Ok(())
}
