//! The top tier: the chart, the operator and the workers as real pods on a real single-node
//! cluster (containerd + runc + kubelet + kube-proxy + the control plane; `tests/src/cluster.rs`),
//! with the image built from the workspace's binaries. One cluster is shared by the tests that
//! run at the same time, each in a namespace of its own.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use switchboard_tests::cluster::env::{ClusterEnv, shared};
use switchboard_tests::cluster::{Cluster, exclusive, host};
use switchboard_tests::helm::NAMESPACE as RELEASE_NAMESPACE;
use switchboard_tests::servers::workspace_path;
use switchboard_tests::wait::wait_for;

const TODO_TIMEOUT: Duration = Duration::from_secs(90);
const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=switchboard";

/// The uid of the first process of `pod`'s first container, read from /proc on the node.
fn container_uid(env: &ClusterEnv, pod: &Pod) -> Result<String> {
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.container_id.as_deref())
        .and_then(|id| id.strip_prefix("containerd://"))
        .context("the pod has a running container")?;
    let tasks = env.cluster.ctr(&["tasks", "ls"])?;
    let pid = tasks
        .lines()
        .find(|line| line.starts_with(id))
        .and_then(|line| line.split_whitespace().nth(1))
        .with_context(|| format!("container {id} is not among the tasks:\n{tasks}"))?;
    let status = std::fs::read_to_string(Path::new("/proc").join(pid).join("status"))?;
    let uid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .context("a Uid line")?;
    Ok(uid.split_whitespace().collect::<Vec<_>>().join(" "))
}

async fn wait_todos(env: &ClusterEnv, queue: &str, stream: &str, expected: i64) -> Result<()> {
    wait_for(
        TODO_TIMEOUT,
        &format!("{expected} todos in {queue}"),
        || async {
            Ok(env.fixture.todo_count(queue).await? == expected
                && env.fixture.pending(stream, "switchboard")? == 0)
        },
    )
    .await?;
    env.fixture.assert_exactly_once(queue, expected).await
}

fn produce(env: &ClusterEnv, stream: &str, range: std::ops::Range<usize>) -> Result<()> {
    env.fixture.produce(
        stream,
        range.map(|i| format!(r#"{{"order":{i}}}"#).into_bytes()),
    )?;
    Ok(())
}

#[tokio::test]
async fn helm_install_runs_the_operator_and_an_applied_adapter_runs_a_worker_pod_that_stores_todos()
-> Result<()> {
    let env = shared().await?;
    // The operator: the chart's Deployment, Ready under its restricted security context.
    let operators = env
        .wait_ready_pods(RELEASE_NAMESPACE, OPERATOR_SELECTOR, 1, |_| true)
        .await?;
    let operator = &operators[0];
    let container = operator
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .context("a container")?;
    ensure!(container.image.as_deref() == Some(env.cluster.images.switchboard.0.as_str()));
    ensure!(container.image_pull_policy.as_deref() == Some("Never"));
    let security = container
        .security_context
        .as_ref()
        .context("a securityContext")?;
    ensure!(security.read_only_root_filesystem == Some(true));
    ensure!(security.allow_privilege_escalation == Some(false));
    ensure!(container_uid(&env, operator)? == "65532 65532 65532 65532");

    // examples/orders-stream.yaml as a user applies it (namespace default).
    env.namespace("default").await?;
    let example = workspace_path("examples/orders-stream.yaml");
    env.cluster
        .kubectl_ok(&["apply", "-f", &example.display().to_string()])?;
    let workers = env
        .wait_ready_pods("default", "app.kubernetes.io/instance=orders", 1, |_| true)
        .await?;
    let worker = &workers[0];
    let image = worker
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.clone());
    ensure!(image.as_deref() == Some(env.cluster.images.switchboard.0.as_str()));
    ensure!(container_uid(&env, worker)? == "65532 65532 65532 65532");

    produce(&env, "orders", 0..500)?;
    wait_todos(&env, "orders", "orders", 500)
        .await
        .with_context(|| env.describe("default"))?;
    wait_for(TODO_TIMEOUT, "kubectl get qa shows Ready=True", || async {
        let ready = env.cluster.kubectl_ok(&[
            "get",
            "qa",
            "orders",
            "-n",
            "default",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
        ])?;
        Ok(ready == "True")
    })
    .await
    .with_context(|| env.describe("default"))?;
    println!("{}", env.cluster.kubectl_ok(&["get", "pods,qa", "-A"])?);
    Ok(())
}

/// Acceptance 2 and 3: a cluster's host changes are undone after its owner is SIGKILLed half-way
/// (by the leftover cleanup), and no non-loopback address ever appears on the host.
#[tokio::test]
async fn the_host_is_as_before_after_a_cluster_whose_owner_was_killed() -> Result<()> {
    let _exclusive = exclusive().await;
    let before = host::HostSnapshot::take()?;
    let cluster = Cluster::start().await?;
    let during = host::HostSnapshot::take()?;
    let new = during.new_addresses(&before);
    ensure!(new.is_empty(), "addresses on the host: {new:?}");
    // Nothing of the cluster's network on the host.
    ensure!(during.iptables == before.iptables, "iptables changed");
    ensure!(during.links == before.links, "links changed");
    // It did change the host elsewhere (else the restore below proves nothing).
    ensure!(
        !during.differences(&before).is_empty(),
        "the running cluster changed nothing on the host"
    );
    drop(cluster);
    let after = host::HostSnapshot::take()?;
    let differences = after.differences(&before);
    ensure!(
        differences.is_empty(),
        "after a clean stop: {differences:#?}"
    );
    Ok(())
}
