//! `make demo-k8s` (and the second half of `make demo`): the Kubernetes path on this machine,
//! without Docker. A local etcd + kube-apiserver, PostgreSQL and Redis; the operator running with
//! its least-privilege RBAC; `kubectl apply -f examples/orders-stream.yaml`; the worker Deployment
//! the operator renders is run the way a kubelet would (args, ConfigMap volume, env from the
//! Secrets); messages produced to Redis land as todos; `kubectl get qa` shows the adapter Ready.

use std::time::Instant;

use anyhow::{Context, Result, ensure};
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{OPERATOR_TIMEOUT, OperatorEnv, http_get};
use switchboard_tests::servers::workspace_path;
use switchboard_tests::wait::wait_for;

const MESSAGES: usize = 2_000;
const EXAMPLE: &str = "examples/orders-stream.yaml";
/// The worker metrics the closing block shows.
const WATCHED: [&str; 7] = [
    "switchboard_messages_stored_total",
    "switchboard_messages_duplicate_total",
    "switchboard_messages_dead_lettered_total",
    "switchboard_backlog_messages",
    "switchboard_oldest_pending_age_seconds",
    "switchboard_dead_letter_messages",
    "switchboard_dependency_up",
];

#[tokio::main]
async fn main() -> Result<()> {
    println!("== Switchboard demo, Kubernetes path: QueueAdapter → operator → worker → todos ==");
    let started = Instant::now();
    let env = OperatorEnv::start_in("default").await?;
    println!(
        "etcd + kube-apiserver ready in {:.1?}; CRD installed; PostgreSQL and Redis running",
        env.plane.started_in
    );
    println!("Secrets default/redis and default/switchboard-db (key url) point at them");
    let operator = env.start_operator("switchboard-operator-0", &[])?;
    println!(
        "operator started with the least-privilege token (charts/switchboard/files/operator-rules.yaml)"
    );

    let example = workspace_path(EXAMPLE);
    let applied = env
        .plane
        .kubectl_ok(&["apply", "-f", &example.display().to_string()])?;
    print!("$ kubectl apply -f {EXAMPLE}\n{applied}");
    let deployment = env
        .wait_deployment("orders-worker", "the operator renders the worker", |_| true)
        .await
        .with_context(|| operator.log_tail())?;
    println!(
        "$ kubectl get deploy,cm -l app.kubernetes.io/instance=orders\n{}",
        env.plane.kubectl_ok(&[
            "get",
            "deploy,cm",
            "-l",
            "app.kubernetes.io/instance=orders"
        ])?
    );

    let pod_name = "orders-worker-6b7f9c-x2k4q";
    let mut pod =
        LocalPod::start(&env.admin, &deployment, pod_name, env.fixture.dir.path()).await?;
    println!(
        "kubelet stand-in: pod {pod_name} runs `switchboard-worker {}` with env {:?} resolved from \
         the Secrets and the downward API",
        pod.args.join(" "),
        pod.env.keys().collect::<Vec<_>>()
    );
    wait_for(
        OPERATOR_TIMEOUT,
        "the pod's readiness probe passes",
        || async { Ok(pod.probe(pod.container.readiness_probe.as_ref()).await? == 200) },
    )
    .await
    .with_context(|| pod.log_tail())?;
    env.mark_deployment_available("orders-worker").await?;
    println!("readiness probe /readyz = 200; Deployment status reported available");

    let produced = Instant::now();
    let bodies =
        (0..MESSAGES).map(|i| format!(r#"{{"order":{i},"total_cents":{}}}"#, 100 + i).into_bytes());
    env.fixture.produce("orders", bodies)?;
    wait_for(OPERATOR_TIMEOUT, "every message is a todo", || async {
        Ok(env.fixture.todo_count("orders").await? == MESSAGES as i64
            && env.fixture.pending("orders", "switchboard")? == 0)
    })
    .await
    .with_context(|| pod.log_tail())?;
    println!(
        "XADD {MESSAGES} entries to stream orders → {} todos in queue orders in {:.1?}",
        env.fixture.todo_count("orders").await?,
        produced.elapsed()
    );
    ensure!(env.fixture.distinct_keys("orders").await? == MESSAGES as i64);
    let sample: Vec<(i64, String, serde_json::Value)> = sqlx::query_as(
        "SELECT id, idempotency_key, payload FROM todos WHERE queue = 'orders' ORDER BY id LIMIT 3",
    )
    .fetch_all(env.fixture.pool())
    .await?;
    println!("first todos:");
    for (id, key, payload) in sample {
        println!("  {id:>5}  {key}  {payload}");
    }
    let row: (String, bool, serde_json::Value) =
        sqlx::query_as("SELECT name, enabled, config FROM adapters WHERE name = 'default/orders'")
            .fetch_one(env.fixture.pool())
            .await?;
    println!("adapters row: {} enabled={} config={}", row.0, row.1, row.2);

    env.wait_adapter("orders", "the QueueAdapter is Ready", |adapter| {
        adapter.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
    })
    .await?;
    env.wait_adapter(
        "orders",
        "the workers' report reaches the status",
        |adapter| {
            adapter
                .status
                .as_ref()
                .and_then(|s| s.observed.as_ref())
                .is_some_and(|o| o.workers == 1 && o.backlog == Some(0))
        },
    )
    .await?;
    let (_, metrics) = http_get(pod.metrics_addr, "/metrics").await?;
    println!();
    println!("what to look at:");
    println!("$ curl -s <worker pod>:8080/metrics   # the lines that matter");
    for line in metrics
        .lines()
        .filter(|line| WATCHED.iter().any(|name| line.starts_with(name)) && !line.starts_with('#'))
    {
        println!("  {line}");
    }
    println!(
        "$ kubectl get qa   # BACKLOG and OLDEST come from the workers' reports (every 5 s)\n{}",
        env.plane.kubectl_ok(&["get", "qa"])?
    );
    ensure!(pod.is_running(), "{}", pod.log_tail());
    println!("done in {:.1?}", started.elapsed());
    Ok(())
}
