//! `make demo-cluster`: the Kubernetes path on a real single-node cluster, without Docker.
//! containerd + runc + kubelet + kube-proxy + the control plane as child processes, all of their
//! networking in a network namespace of their own; the image built from this workspace's
//! binaries with buildah; `helm install` of `charts/switchboard`; `kubectl apply -f
//! examples/orders-stream.yaml`; a real worker pod turns Redis messages into todos. Everything is
//! stopped and the host restored at the end (docs/cluster.md).

use std::time::Instant;

use anyhow::{Context, Result};
use switchboard_tests::cluster::env::shared;
use switchboard_tests::helm::NAMESPACE;
use switchboard_tests::servers::workspace_path;
use switchboard_tests::wait::wait_for;

const MESSAGES: usize = 2_000;
const EXAMPLE: &str = "examples/orders-stream.yaml";

#[tokio::main]
async fn main() -> Result<()> {
    println!(
        "== Switchboard demo, a real cluster: helm install → operator pod → worker pod → todos =="
    );
    let started = Instant::now();
    let env = shared().await?;
    println!(
        "cluster up in {:.1?} (node Ready; logs in {}); images {} and {} imported into containerd",
        env.cluster.started_in,
        env.cluster.root().display(),
        env.cluster.images.switchboard.0,
        env.cluster.images.pause.0,
    );
    println!(
        "PostgreSQL and Redis on the host's loopback, reached by the pods at {} and {}",
        env.pod_database_url, env.pod_redis_url
    );
    print!(
        "$ helm install switchboard charts/switchboard -n {NAMESPACE} --set image.pullPolicy=Never …\n{}",
        env.installed.split("NOTES:").next().unwrap_or_default()
    );
    env.namespace("default").await?;
    let applied = env.cluster.kubectl_ok(&[
        "apply",
        "-f",
        &workspace_path(EXAMPLE).display().to_string(),
    ])?;
    print!("$ kubectl apply -f {EXAMPLE}\n{applied}");
    env.wait_ready_pods("default", "app.kubernetes.io/instance=orders", 1, |_| true)
        .await?;
    env.fixture.produce(
        "orders",
        (0..MESSAGES).map(|i| format!(r#"{{"order":{i}}}"#).into_bytes()),
    )?;
    println!("{MESSAGES} messages XADDed to the stream orders");
    wait_for(
        std::time::Duration::from_secs(120),
        "every message is a todo",
        || async {
            Ok(env.fixture.todo_count("orders").await? == MESSAGES as i64
                && env.fixture.pending("orders", "switchboard")? == 0)
        },
    )
    .await
    .with_context(|| env.describe("default"))?;
    env.fixture
        .assert_exactly_once("orders", MESSAGES as i64)
        .await?;
    println!("{MESSAGES} todos in queue orders, each exactly once, nothing pending");
    wait_for(
        std::time::Duration::from_secs(60),
        "the adapter reports Ready",
        || async { env.adapter_ready("default", "orders").await },
    )
    .await?;
    println!(
        "$ kubectl get pods,qa -A\n{}",
        env.cluster.kubectl_ok(&["get", "pods,qa", "-A"])?
    );
    drop(env);
    println!(
        "cluster stopped, host restored; the whole demo took {:.1?}",
        started.elapsed()
    );
    Ok(())
}
