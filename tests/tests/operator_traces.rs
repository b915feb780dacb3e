//! The operator's traces (issue 33, acceptance 3) against a real etcd + kube-apiserver,
//! PostgreSQL and OpenTelemetry Collector (tests/src/otel.rs): each reconcile is exported as a
//! span `reconcile QueueAdapter` naming the adapter, a failed one with an error status, and no
//! secret appears anywhere in what is exported; the worker Deployment carries the OTLP
//! environment the operator was given for its workers.

use anyhow::{Context, Result, ensure};
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, OperatorProcess, adapter_manifest, condition, pod_template,
};
use switchboard_tests::otel::{Collector, Span, SpanKind, StatusCode};

const WORKER_ENDPOINT: &str = "http://collector.obs:4318";

/// A value no span may contain, different in every run.
fn secret(what: &str) -> String {
    let random: String = (0..16).map(|_| fastrand::alphanumeric()).collect();
    format!("s3cr3t-{what}-{random}")
}

/// Whether `span` is the reconcile span of adapter `shop/orders` at `generation`, exported by
/// the operator.
fn is_reconcile(span: &Span, generation: i64) -> bool {
    span.name == "reconcile QueueAdapter"
        && span.service_name() == Some("switchboard-operator")
        && span.attribute_str("switchboard.adapter") == Some("shop/orders")
        && span
            .attributes
            .get("k8s.object.generation")
            .and_then(|v| v.as_i64())
            == Some(generation)
}

/// The worker's `OTEL_*` environment as the operator wrote it into the Deployment, in order.
async fn worker_otel_env(env: &OperatorEnv) -> Result<Vec<(String, String)>> {
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;
    let (_, container) = pod_template(&deployment)?;
    Ok(container
        .env
        .iter()
        .flatten()
        .filter(|var| var.name.starts_with("OTEL_"))
        .map(|var| (var.name.clone(), var.value.clone().unwrap_or_default()))
        .collect())
}

#[tokio::test]
async fn reconcile_spans_are_exported_with_the_adapter_failed_ones_as_errors_and_no_secret()
-> Result<()> {
    let mut env = OperatorEnv::start().await?;
    let collector = Collector::start(&env.fixture)?;
    // Secrets the operator only references (it cannot read Secrets) and the password of its
    // own database URL (trust authentication: PostgreSQL never asks for it).
    let (redis_password, worker_db_password, operator_db_password) =
        (secret("redis"), secret("worker-db"), secret("operator-db"));
    let redis_url = format!("redis://:{redis_password}@127.0.0.1:6379/0");
    let worker_db_url = format!(
        "postgres://switchboard:{worker_db_password}@db.internal:5432/todos?sslmode=require"
    );
    let operator_db_url = format!(
        "postgres://postgres:{operator_db_password}@127.0.0.1:{}/postgres",
        env.fixture.postgres.port()
    );
    let ns = OperatorEnv::NAMESPACE;
    env.plane.put_secret(ns, "redis", "url", &redis_url).await?;
    env.plane
        .put_secret(ns, "switchboard-db", "url", &worker_db_url)
        .await?;
    let endpoint = collector.http_endpoint();
    let operator = OperatorProcess::start_with_env(
        &env.plane.operator_kubeconfig,
        &operator_db_url,
        env.fixture.dir.path(),
        "operator-a",
        &[
            "--worker-otlp-endpoint",
            WORKER_ENDPOINT,
            "--worker-traces-sampler",
            "parentbased_traceidratio",
            "--worker-traces-sampler-arg",
            "0.25",
        ],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )?;

    env.apply_adapter(&adapter_manifest("orders", "")).await?;
    env.wait_adapter("orders", "Reconciled=True", |a| {
        condition(a, "Reconciled").is_some_and(|c| c.status == "True")
    })
    .await
    .with_context(|| operator.log_tail())?;
    let spans = collector
        .wait_for_spans(
            OPERATOR_TIMEOUT,
            "the reconcile span of generation 1",
            |spans| spans.iter().any(|span| is_reconcile(span, 1)),
        )
        .await
        .with_context(|| operator.log_tail())?;
    let span = spans
        .iter()
        .find(|span| is_reconcile(span, 1))
        .context("found")?;
    ensure!(span.kind == SpanKind::Internal, "{span:#?}");
    ensure!(
        span.attribute_str("k8s.namespace.name") == Some(ns),
        "{span:#?}"
    );
    ensure!(span.status.code != StatusCode::Error, "{span:#?}");

    // The workers get the OTLP environment the operator was given for them.
    let worker_env = worker_otel_env(&env).await?;
    let expected = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", WORKER_ENDPOINT),
        ("OTEL_SERVICE_NAME", "switchboard-worker"),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "k8s.namespace.name=shop,k8s.pod.name=$(HOSTNAME),switchboard.adapter=shop/orders",
        ),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
    ]
    .map(|(name, value)| (name.to_owned(), value.to_owned()));
    ensure!(worker_env == expected, "{worker_env:#?}");

    // A reconcile that fails (its database is down): the span says so, with the error.
    env.fixture.postgres.stop();
    env.apply_adapter(&adapter_manifest("orders", "  workload: {replicas: 2}\n"))
        .await?;
    let failed = |span: &Span| {
        is_reconcile(span, 2)
            && span.status.code == StatusCode::Error
            && !span.status.message.is_empty()
    };
    let spans = collector
        .wait_for_spans(
            OPERATOR_TIMEOUT,
            "a failed reconcile span of generation 2",
            |spans| spans.iter().any(failed),
        )
        .await
        .with_context(|| operator.log_tail())?;
    let span = spans.iter().find(|span| failed(span)).context("found")?;
    ensure!(
        span.status.message.to_lowercase().contains("database"),
        "the status names what failed: {span:#?}"
    );

    // Nothing exported, in any attribute, event, status or resource, holds a secret.
    let exported = collector.exported_text()?;
    ensure!(exported.contains("reconcile QueueAdapter"), "{exported}");
    for (what, value) in [
        ("the Redis password", &redis_password),
        ("the Redis URL", &redis_url),
        ("the worker's database password", &worker_db_password),
        ("the worker's database URL", &worker_db_url),
        ("the operator's database password", &operator_db_password),
        ("the operator's database URL", &operator_db_url),
    ] {
        ensure!(!exported.contains(value.as_str()), "{what} is exported");
    }
    ensure!(!exported.contains("s3cr3t"), "a secret is exported");
    Ok(())
}
