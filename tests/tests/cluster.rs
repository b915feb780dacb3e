//! The top tier: the chart, the operator and the workers as real pods on a real single-node
//! cluster (containerd + runc + kubelet + kube-proxy + the control plane; `tests/src/cluster.rs`),
//! with the image built from the workspace's binaries. One cluster is shared by the tests that
//! run at the same time, each in a namespace of its own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use switchboard_api::QueueAdapter;
use switchboard_tests::cluster::env::{ClusterEnv, POD_TIMEOUT, shared};
use switchboard_tests::cluster::{Cluster, Images, exclusive, host};
use switchboard_tests::control_plane::{adapter_manifest_in, condition};
use switchboard_tests::helm::{CHART, NAMESPACE as RELEASE_NAMESPACE, RELEASE};
use switchboard_tests::servers::workspace_path;
use switchboard_tests::wait::{wait_for, wait_until};

const TODO_TIMEOUT: Duration = Duration::from_secs(90);
const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=switchboard";
/// The last chart that shipped the CRD in its `crds/` folder (which Helm installs once and never
/// upgrades): what the upgrade test upgrades from.
const PREVIOUS_CHART_COMMIT: &str = "67e96c101284b20440e624aab99d67834b717d43";
const CRD_NAME: &str = "queueadapters.switchboard.dev";
/// Set for the child process of the killed-owner test: where it reports that its cluster runs.
const OWNER_READY_ENV: &str = "SWITCHBOARD_CLUSTER_OWNER_READY";

/// The selector of adapter `name`'s worker pods.
fn workers_of(name: &str) -> String {
    format!("app.kubernetes.io/instance={name}")
}

fn pod_name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// Waits until the one Ready pod matching `selector` is another than `old`; returns it.
async fn wait_replaced(
    env: &ClusterEnv,
    namespace: &str,
    selector: &str,
    old: &Pod,
) -> Result<Pod> {
    let mut pods = env
        .wait_ready_pods(namespace, selector, 1, |pods| {
            pods.iter().all(|pod| pod_name(pod) != pod_name(old))
        })
        .await?;
    pods.pop().context("one pod")
}

/// Applies adapter `name` in its own namespace `name` (stream and queue `name` too) and waits
/// for its one worker pod to be Ready.
async fn start_adapter(env: &ClusterEnv, name: &str, spec_extra: &str) -> Result<Pod> {
    env.namespace(name).await?;
    env.apply(&adapter_manifest_in(name, name, spec_extra))?;
    let mut pods = env
        .wait_ready_pods(name, &workers_of(name), 1, |_| true)
        .await?;
    pods.pop().context("one pod")
}

/// Sets adapter `name`'s `spec.enabled: false` and waits until none of its pods is left.
async fn disable_and_wait_without_pods(env: &ClusterEnv, name: &str) -> Result<()> {
    env.cluster.kubectl_ok(&[
        "patch",
        "qa",
        name,
        "-n",
        name,
        "--type=merge",
        "-p",
        r#"{"spec":{"enabled":false}}"#,
    ])?;
    env.wait_ready_pods(name, &workers_of(name), 0, |_| true)
        .await?;
    Ok(())
}

/// Produces to `stream` from a thread until stopped: a steady flow of messages while pods come
/// and go.
struct Producer {
    stop: Arc<AtomicBool>,
    produced: Arc<AtomicUsize>,
    thread: std::thread::JoinHandle<Result<()>>,
}

impl Producer {
    fn start(env: &ClusterEnv, stream: &str) -> Result<Self> {
        let (stop, produced) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
        );
        let mut redis = env.fixture.redis.connection()?;
        let stream = stream.to_owned();
        let thread = std::thread::spawn({
            let (stop, produced) = (Arc::clone(&stop), Arc::clone(&produced));
            move || -> Result<()> {
                while !stop.load(Ordering::SeqCst) {
                    let start = produced.load(Ordering::SeqCst);
                    let mut pipe = redis::pipe();
                    for i in start..start + 20 {
                        pipe.cmd("XADD")
                            .arg(&stream)
                            .arg("*")
                            .arg("body")
                            .arg(format!(r#"{{"order":{i}}}"#))
                            .ignore();
                    }
                    pipe.query::<()>(&mut redis)?;
                    produced.store(start + 20, Ordering::SeqCst);
                    // Pacing, not synchronisation: a flow of ~1,000 messages a second.
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(())
            }
        });
        Ok(Self {
            stop,
            produced,
            thread,
        })
    }

    fn produced(&self) -> usize {
        self.produced.load(Ordering::SeqCst)
    }

    /// Stops the flow; how many messages it produced.
    fn stop(self) -> Result<usize> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the producer panicked"))??;
        Ok(self.produced.load(Ordering::SeqCst))
    }
}

/// Fails unless the first container of `pod` really runs restricted, as the kernel sees its
/// process on the node: uid/gid 65532, no capabilities, no_new_privs, a seccomp filter
/// (RuntimeDefault) and a read-only root file system.
fn assert_restricted(env: &ClusterEnv, pod: &Pod) -> Result<()> {
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
    let proc = Path::new("/proc").join(pid);
    let status = std::fs::read_to_string(proc.join("status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .map(|value| value.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    for (name, expected) in [
        ("Uid:", "65532 65532 65532 65532"),
        ("Gid:", "65532 65532 65532 65532"),
        ("CapEff:", "0000000000000000"),
        ("CapPrm:", "0000000000000000"),
        ("NoNewPrivs:", "1"),
        ("Seccomp:", "2"),
    ] {
        ensure!(
            field(name) == expected,
            "{name} of pod {} is {:?}, not {expected:?}",
            pod_name(pod),
            field(name)
        );
    }
    let mounts = std::fs::read_to_string(proc.join("mounts"))?;
    let root = mounts
        .lines()
        .find(|line| line.split(' ').nth(1) == Some("/"))
        .context("a root mount")?;
    ensure!(
        root.split(' ')
            .nth(3)
            .is_some_and(|o| o.split(',').any(|o| o == "ro")),
        "the root of pod {} is writable: {root}",
        pod_name(pod)
    );
    Ok(())
}

async fn wait_todos(env: &ClusterEnv, queue: &str, stream: &str, expected: i64) -> Result<()> {
    wait_for(
        TODO_TIMEOUT,
        &format!("{expected} todos in {queue}"),
        || async {
            Ok(env.todos(queue).await?.0 == expected
                && env.fixture.pending(stream, "switchboard")? == 0)
        },
    )
    .await?;
    assert_exactly_once(env, queue, expected).await
}

/// `expected` todos in `queue`, each with its own idempotency key.
async fn assert_exactly_once(env: &ClusterEnv, queue: &str, expected: i64) -> Result<()> {
    let (todos, distinct) = env.todos(queue).await?;
    ensure!(
        todos == expected && distinct == expected,
        "expected {expected} todos with distinct keys, found {todos} todos / {distinct} keys"
    );
    Ok(())
}

/// Waits until queue `name` holds at least `count` todos.
async fn wait_stored(env: &ClusterEnv, name: &str, count: usize) -> Result<()> {
    wait_for(
        TODO_TIMEOUT,
        &format!("{count} todos in {name}"),
        || async { Ok(env.todos(name).await?.0 >= count as i64) },
    )
    .await
    .with_context(|| env.describe(name))
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
    // The operator test running alongside replaces this pod: check whichever is the current one.
    wait_for(
        TODO_TIMEOUT,
        "the operator's container runs restricted",
        || async {
            let operators = env
                .wait_ready_pods(RELEASE_NAMESPACE, OPERATOR_SELECTOR, 1, |_| true)
                .await?;
            assert_restricted(&env, &operators[0])?;
            Ok(true)
        },
    )
    .await?;

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
    assert_restricted(&env, worker)?;

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

#[tokio::test]
async fn deleting_a_worker_pod_mid_flow_and_a_rollout_restart_store_every_message_exactly_once()
-> Result<()> {
    let env = shared().await?;
    let name = "restarts";
    let first = start_adapter(&env, name, "").await?;
    let producer = Producer::start(&env, name)?;
    wait_stored(&env, name, 200).await?;
    // A real SIGTERM and grace period, mid-flow.
    env.cluster.kubectl_ok(&[
        "delete",
        "pod",
        "-n",
        name,
        &pod_name(&first),
        "--wait=true",
    ])?;
    let second = wait_replaced(&env, name, &workers_of(name), &first).await?;
    let before_restart = producer.produced();
    wait_stored(&env, name, before_restart).await?;
    env.cluster.kubectl_ok(&[
        "rollout",
        "restart",
        "-n",
        name,
        &format!("deployment/{name}-worker"),
    ])?;
    wait_replaced(&env, name, &workers_of(name), &second).await?;
    let produced = producer.stop()?;
    wait_todos(&env, name, name, produced as i64)
        .await
        .with_context(|| env.describe(name))?;
    Ok(())
}

/// How often the worker container of `pod` has been restarted.
fn restarts(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|statuses| statuses.first())
        .map_or(0, |status| status.restart_count)
}

/// Points Secret `redis` of adapter `name` at `url` and waits until its one worker pod, the same
/// as `pod`, is Ready again after one more container restart: kubelet refreshes the mounted
/// Secret, the worker stops cleanly and kubelet starts it anew.
async fn rotate_redis_secret(env: &ClusterEnv, name: &str, url: &str, pod: &Pod) -> Result<Pod> {
    let current = env.pods(name, &workers_of(name)).await?;
    ensure!(
        current.len() == 1 && pod_name(&current[0]) == pod_name(pod),
        "one worker pod, {}",
        pod_name(pod)
    );
    let restarts_at_least = restarts(&current[0]) + 1;
    env.put_secret(name, "redis", url).await?;
    let mut pods = env
        .wait_ready_pods(name, &workers_of(name), 1, |pods| {
            pods.iter()
                .all(|p| pod_name(p) == pod_name(pod) && restarts(p) >= restarts_at_least)
        })
        .await?;
    pods.pop().context("one pod")
}

#[tokio::test]
async fn changing_the_referenced_secret_restarts_the_worker_onto_the_new_value_losing_nothing()
-> Result<()> {
    let env = shared().await?;
    let name = "rotation";
    let pod = start_adapter(&env, name, "").await?;
    // Messages flow into database 0 while its Secret is switched to database 1 and back.
    let producer = Producer::start(&env, name)?;
    wait_stored(&env, name, 200).await?;
    let db1 = env.pod_redis_url.replace("/0", "/1");
    let pod = rotate_redis_secret(&env, name, &db1, &pod).await?;
    // Only a worker that reads the new value connects to database 1.
    wait_for(
        TODO_TIMEOUT,
        "the restarted worker connects to database 1",
        || async {
            let mut redis = env.fixture.redis.connection()?;
            let clients: String = redis::cmd("CLIENT").arg("LIST").query(&mut redis)?;
            Ok(clients.lines().any(|client| client.contains(" db=1 ")))
        },
    )
    .await
    .with_context(|| env.describe(name))?;
    // Back to database 0: every message produced there, before, during and after the two
    // restarts, is stored exactly once.
    rotate_redis_secret(&env, name, &env.pod_redis_url, &pod).await?;
    let produced = producer.stop()?;
    wait_todos(&env, name, name, produced as i64)
        .await
        .with_context(|| env.describe(name))?;
    let log = env
        .cluster
        .kubectl_ok(&["logs", "-n", name, &pod_name(&pod), "--previous"])?;
    ensure!(
        log.contains("mounted Secret changed") && !log.contains(&db1),
        "the stopped worker's last log names the Secret, never its value:\n{log}"
    );
    Ok(())
}

/// Waits until QueueAdapter `namespace/name` satisfies `check`; returns it.
async fn wait_condition(
    env: &ClusterEnv,
    namespace: &str,
    name: &str,
    what: &str,
    check: impl Fn(&QueueAdapter) -> bool,
) -> Result<QueueAdapter> {
    let adapters = Api::<QueueAdapter>::namespaced(env.admin().await?, namespace);
    wait_for(POD_TIMEOUT, what, || async {
        Ok(check(&adapters.get(name).await?))
    })
    .await
    .with_context(|| env.describe(namespace))?;
    Ok(adapters.get(name).await?)
}

fn has(adapter: &QueueAdapter, type_: &str, status: &str, reason: &str) -> bool {
    condition(adapter, type_).is_some_and(|c| c.status == status && c.reason == reason)
}

#[tokio::test]
async fn a_missing_secret_is_reported_from_the_waiting_pod_and_cleared_when_it_starts() -> Result<()>
{
    let env = shared().await?;
    let name = "late-secret";
    env.namespace(name).await?;
    let manifest = adapter_manifest_in(name, name, "")
        .replace("name: redis, key: url", "name: redis-later, key: url");
    env.apply(&manifest)?;
    // The operator cannot read Secrets: the kubelet's CreateContainerConfigError tells it.
    let adapter = wait_condition(&env, name, name, "Degraded=True SecretNotFound", |a| {
        has(a, "Degraded", "True", "SecretNotFound")
    })
    .await?;
    let message = &condition(&adapter, "Degraded").context("Degraded")?.message;
    ensure!(
        message.contains("redis-later"),
        "names the Secret: {message}"
    );

    // Disabled, it is scaled to zero whatever its Secrets.
    env.apply(&manifest.replace("spec:\n", "spec:\n  enabled: false\n"))?;
    wait_condition(&env, name, name, "Ready=False Disabled", |a| {
        has(a, "Ready", "False", "Disabled") && !has(a, "Degraded", "True", "SecretNotFound")
    })
    .await?;
    wait_for(POD_TIMEOUT, "no worker pod", || async {
        Ok(env.pods(name, &workers_of(name)).await?.is_empty())
    })
    .await
    .with_context(|| env.describe(name))?;

    // Enabled again with the Secret created: the pod starts and the report clears.
    env.put_secret(name, "redis-later", &env.pod_redis_url)
        .await?;
    env.apply(&manifest)?;
    env.wait_ready_pods(name, &workers_of(name), 1, |_| true)
        .await?;
    wait_condition(&env, name, name, "Ready=True, Degraded=False", |a| {
        condition(a, "Ready").is_some_and(|c| c.status == "True")
            && condition(a, "Degraded").is_some_and(|c| c.status == "False")
    })
    .await?;
    produce(&env, name, 0..50)?;
    wait_todos(&env, name, name, 50).await
}

#[tokio::test]
async fn disabling_an_adapter_stops_its_pods_and_deleting_it_collects_its_deployment() -> Result<()>
{
    let env = shared().await?;
    let name = "retired";
    start_adapter(&env, name, "").await?;
    produce(&env, name, 0..50)?;
    wait_todos(&env, name, name, 50).await?;
    disable_and_wait_without_pods(&env, name).await?;
    wait_for(TODO_TIMEOUT, "the adapters row exists", || async {
        env.adapter_row_exists(name, name).await
    })
    .await?;
    env.cluster
        .kubectl_ok(&["delete", "qa", name, "-n", name, "--wait=true"])?;
    let deployments = Api::<Deployment>::namespaced(env.admin().await?, name);
    wait_for(
        TODO_TIMEOUT,
        "the garbage collector deletes the Deployment",
        || async {
            Ok(deployments
                .get_opt(&format!("{name}-worker"))
                .await?
                .is_none())
        },
    )
    .await
    .with_context(|| env.describe(name))?;
    wait_for(TODO_TIMEOUT, "the adapters row is removed", || async {
        Ok(!env.adapter_row_exists(name, name).await?)
    })
    .await
    .with_context(|| env.describe(name))?;
    Ok(())
}

#[tokio::test]
async fn a_killed_operator_pod_is_replaced_and_the_replacement_takes_the_lease_and_reconciles()
-> Result<()> {
    let env = shared().await?;
    let leases = Api::<Lease>::namespaced(env.admin().await?, RELEASE_NAMESPACE);
    // The holder is the pod's name, `_` and a random suffix (two replicas never share one).
    let held_by = |lease: Option<Lease>, pod: &str| {
        lease
            .and_then(|l| l.spec?.holder_identity)
            .and_then(|holder| holder.strip_prefix(pod)?.strip_prefix('_').map(str::len))
            == Some(16)
    };
    let old = env
        .wait_ready_pods(RELEASE_NAMESPACE, OPERATOR_SELECTOR, 1, |_| true)
        .await?
        .remove(0);
    wait_for(TODO_TIMEOUT, "the operator holds the Lease", || async {
        Ok(held_by(leases.get_opt(RELEASE).await?, &pod_name(&old)))
    })
    .await?;
    env.cluster.kubectl_ok(&[
        "delete",
        "pod",
        "-n",
        RELEASE_NAMESPACE,
        &pod_name(&old),
        "--grace-period=0",
        "--force",
    ])?;
    let new = wait_replaced(&env, RELEASE_NAMESPACE, OPERATOR_SELECTOR, &old).await?;
    wait_for(TODO_TIMEOUT, "the replacement takes the Lease", || async {
        Ok(held_by(leases.get_opt(RELEASE).await?, &pod_name(&new)))
    })
    .await
    .with_context(|| env.describe(RELEASE_NAMESPACE))?;
    let name = "takeover";
    start_adapter(&env, name, "").await?;
    produce(&env, name, 0..20)?;
    wait_todos(&env, name, name, 20).await
}

/// `charts/switchboard` as it was at `commit`, extracted into `dir` with `git archive`.
fn chart_at(commit: &str, dir: &Path) -> Result<PathBuf> {
    let archive = dir.join("chart.tar");
    let mut git = Command::new("git");
    git.current_dir(workspace_path(""))
        .arg("archive")
        .arg("--output")
        .arg(&archive)
        .args([commit, CHART]);
    let mut tar = Command::new("tar");
    tar.arg("-xf").arg(&archive).arg("-C").arg(dir);
    for command in [&mut git, &mut tar] {
        let output = command.output()?;
        ensure!(
            output.status.success(),
            "{command:?} (the chart at {commit}; a shallow clone needs `git fetch --unshallow`): {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(dir.join(CHART))
}

/// The QueueAdapter CRD as the API server serves it.
async fn served_crd(env: &ClusterEnv) -> Result<CustomResourceDefinition> {
    Ok(Api::<CustomResourceDefinition>::all(env.admin().await?)
        .get(CRD_NAME)
        .await?)
}

/// (`helm.sh/resource-policy` annotation, `meta.helm.sh/release-name` annotation) of a CRD.
fn helm_ownership(crd: &CustomResourceDefinition) -> (Option<&str>, Option<&str>) {
    let annotation = |key: &str| {
        crd.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .map(String::as_str)
    };
    (
        annotation("helm.sh/resource-policy"),
        annotation("meta.helm.sh/release-name"),
    )
}

/// The memory limit of the pod's first container.
fn memory_limit(pod: &Pod) -> Option<String> {
    let container = pod.spec.as_ref()?.containers.first()?;
    let limits = container.resources.as_ref()?.limits.as_ref()?;
    Some(limits.get("memory")?.0.clone())
}

/// The bodies stored in queue `name` are exactly the `produced` ones the [`Producer`] wrote:
/// none missing, none twice.
async fn assert_stored_bodies(env: &ClusterEnv, name: &str, produced: usize) -> Result<()> {
    let stored = env.stored_orders(name).await?;
    let expected: Vec<i64> = (0..i64::try_from(produced)?).collect();
    ensure!(
        stored == expected,
        "{produced} bodies produced, {} stored; the first missing or doubled: {:?}",
        stored.len(),
        stored
            .iter()
            .zip(&expected)
            .find(|(stored, expected)| stored != expected)
    );
    Ok(())
}

/// `helm uninstall` leaves the CRD (keep policy) and adapter `name`; `helm install` under the
/// same name takes the CRD back and its operator reconciles the adapter again.
async fn uninstall_keeps_the_crd_and_the_adapter_and_install_takes_them_back(
    env: &ClusterEnv,
    name: &str,
) -> Result<()> {
    let uninstalled = env.cluster.helm(&[
        "uninstall",
        RELEASE,
        "--namespace",
        RELEASE_NAMESPACE,
        "--wait",
    ])?;
    env.wait_ready_pods(RELEASE_NAMESPACE, OPERATOR_SELECTOR, 0, |_| true)
        .await?;
    ensure!(
        helm_ownership(&served_crd(env).await?).0 == Some("keep"),
        "helm uninstall kept the CRD: {uninstalled}"
    );
    env.cluster.kubectl_ok(&["get", "qa", name, "-n", name])?;
    // Installed again under the same name: the release takes the kept CRD back (Helm refuses
    // an object that is not its own), and its operator reconciles the kept adapter again.
    env.release("install", &workspace_path(CHART), &[])?;
    disable_and_wait_without_pods(env, name).await?;
    Ok(())
}

/// The release installed from the previous chart (its CRD from `crds/`), an adapter storing a
/// steady flow; `helm upgrade` to this chart, which changes the workers' defaults, so the
/// operator and then the workers roll while messages flow. Every produced body is stored exactly
/// once, the CRD served is the release's (with the keep policy), the adapter is Ready; and
/// `helm uninstall` leaves the CRD and the QueueAdapter in place.
#[tokio::test]
async fn helm_upgrade_from_the_previous_chart_while_workers_roll_stores_every_body_once_and_serves_the_new_crd()
-> Result<()> {
    let _exclusive = exclusive().await;
    let scratch = tempfile::tempdir()?;
    let previous = chart_at(PREVIOUS_CHART_COMMIT, scratch.path())?;
    ensure!(
        previous.join("crds").is_dir() && !previous.join("templates/crds.yaml").exists(),
        "the chart at {PREVIOUS_CHART_COMMIT} ships its CRD in crds/"
    );
    let env = ClusterEnv::start(&previous).await?;
    let before = served_crd(&env).await?;
    ensure!(
        helm_ownership(&before) == (None, None),
        "the previous chart's CRD (from crds/) is neither the release's nor kept: {:?}",
        before.metadata.annotations
    );
    let name = "upgrade";
    let first = start_adapter(&env, name, "").await?;
    ensure!(memory_limit(&first).as_deref() == Some("512Mi"));
    let producer = Producer::start(&env, name)?;
    wait_stored(&env, name, 200).await?;

    let produced_before = producer.produced();
    let upgrade = ["--set", "worker.resources.limits.memory=640Mi"];
    // The CRD that crds/ installed is not the release's: Helm refuses to take it over unless
    // told to, once, on the first upgrade from such a chart (README, Upgrading).
    let refused = env.release("upgrade", &workspace_path(CHART), &upgrade);
    ensure!(
        refused
            .as_ref()
            .is_err_and(|err| format!("{err:#}").contains("invalid ownership metadata")),
        "helm upgrade without --take-ownership: {refused:?}"
    );
    let started = std::time::Instant::now();
    env.release(
        "upgrade",
        &workspace_path(CHART),
        &[&["--take-ownership"][..], &upgrade].concat(),
    )
    .with_context(|| env.describe(name))?;
    let upgraded_in = started.elapsed();
    let rolled = wait_replaced(&env, name, &workers_of(name), &first).await?;
    ensure!(
        memory_limit(&rolled).as_deref() == Some("640Mi"),
        "the rolled worker runs with the upgraded defaults: {:?}",
        memory_limit(&rolled)
    );
    wait_stored(&env, name, producer.produced()).await?;
    let produced = producer.stop()?;
    ensure!(
        produced > produced_before,
        "messages flowed through the upgrade"
    );
    wait_todos(&env, name, name, produced as i64)
        .await
        .with_context(|| env.describe(name))?;
    assert_stored_bodies(&env, name, produced).await?;
    let after = served_crd(&env).await?;
    ensure!(
        helm_ownership(&after) == (Some("keep"), Some(RELEASE)),
        "the CRD served is the release's, with the keep policy: {:?}",
        after.metadata.annotations
    );
    wait_for(TODO_TIMEOUT, "the adapter is Ready", || async {
        env.adapter_ready(name, name).await
    })
    .await
    .with_context(|| env.describe(name))?;
    println!(
        "{produced} messages ({produced_before} before the upgrade) stored once each through \
         `helm upgrade` (which took {upgraded_in:.1?} with --wait)"
    );

    uninstall_keeps_the_crd_and_the_adapter_and_install_takes_them_back(&env, name).await
}

/// Not a test of its own: the cluster owner that
/// [`the_host_is_as_before_after_a_cluster_whose_owner_was_killed`] runs as a child process and
/// SIGKILLs. Without its environment variable it does nothing.
#[tokio::test]
#[ignore = "run by the_host_is_as_before_after_a_cluster_whose_owner_was_killed"]
async fn cluster_owner() -> Result<()> {
    let Some(ready) = std::env::var_os(OWNER_READY_ENV) else {
        return Ok(());
    };
    let env = shared().await?;
    start_adapter(&env, "owner", "").await?;
    // What its killer must stop and remove: this process cannot drop its fixture.
    let fixture = &env.fixture;
    let servers = [
        ("postgres", fixture.postgres.pid(), fixture.postgres.dir()),
        ("redis", fixture.redis.pid(), fixture.redis.dir()),
    ];
    let mut left = format!("dir - {}\n", fixture.dir.path().display());
    for (server, pid, dir) in servers {
        let pid = pid.with_context(|| format!("{server} is not running"))?;
        left += &format!("{server} {pid} {}\n", dir.display());
    }
    std::fs::write(ready, left)?;
    std::future::pending::<()>().await;
    Ok(())
}

/// Stops the PostgreSQL and Redis a SIGKILLed [`cluster_owner`] left running (listed in its
/// ready file) and removes their directories and its scratch directory.
fn stop_what_the_owner_left(ready: &Path) -> Result<()> {
    for line in std::fs::read_to_string(ready)?.lines() {
        let mut fields = line.splitn(3, ' ');
        let (Some(kind), Some(pid), Some(dir)) = (fields.next(), fields.next(), fields.next())
        else {
            bail!("the owner's ready file: {line:?}");
        };
        let dir = Path::new(dir);
        match kind {
            // Immediate shutdown: the postmaster stops its children, then removes its pid file.
            "postgres" => {
                kill(Pid::from_raw(pid.parse()?), Signal::SIGQUIT)?;
                let pid_file = dir.join("data/postmaster.pid");
                wait_until(
                    Duration::from_secs(30),
                    "the owner's PostgreSQL stops",
                    || !pid_file.exists(),
                )?;
            }
            "redis" => kill(Pid::from_raw(pid.parse()?), Signal::SIGKILL)?,
            "dir" => {}
            _ => bail!("the owner's ready file: {line:?}"),
        }
        std::fs::remove_dir_all(dir)?;
    }
    Ok(())
}

/// `tar -xOf archive member`.
fn archive_member(archive: &Path, member: &str) -> Result<Vec<u8>> {
    let output = std::process::Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg(member)
        .output()?;
    ensure!(
        output.status.success(),
        "tar: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(output.stdout)
}

/// The Dockerfile's instruction `keyword`'s argument (the first such line).
fn dockerfile(keyword: &str) -> Result<String> {
    let text = std::fs::read_to_string(workspace_path("Dockerfile"))?;
    text.lines()
        .find_map(|line| line.strip_prefix(keyword)?.strip_prefix(' '))
        .map(str::to_owned)
        .with_context(|| format!("the Dockerfile has no {keyword}"))
}

#[test]
fn the_buildah_image_has_the_dockerfiles_user_entrypoint_and_binaries_and_nothing_but_their_libraries()
-> Result<()> {
    let images = Images::build()?;
    let archive = &images.switchboard.1;
    let blob = |digest: &serde_json::Value| -> Result<Vec<u8>> {
        let digest = digest.as_str().context("a digest")?;
        let hex = digest.strip_prefix("sha256:").context("a sha256 digest")?;
        archive_member(archive, &format!("blobs/sha256/{hex}"))
    };
    let index: serde_json::Value = serde_json::from_slice(&archive_member(archive, "index.json")?)?;
    let manifest: serde_json::Value =
        serde_json::from_slice(&blob(&index["manifests"][0]["digest"])?)?;
    let config: serde_json::Value = serde_json::from_slice(&blob(&manifest["config"]["digest"])?)?;
    ensure!(config["config"]["User"].as_str() == Some(dockerfile("USER")?.as_str()));
    let entrypoint: Vec<String> = serde_json::from_str(&dockerfile("ENTRYPOINT")?)?;
    ensure!(config["config"]["Entrypoint"] == serde_json::json!(entrypoint));
    let copy = dockerfile("COPY --from=build")?;
    let destination = copy.rsplit(' ').next().context("a COPY destination")?;

    let mut files = Vec::new();
    let layers = tempfile::tempdir()?;
    for (i, layer) in manifest["layers"]
        .as_array()
        .context("layers")?
        .iter()
        .enumerate()
    {
        let path = layers.path().join(format!("layer-{i}"));
        std::fs::write(&path, blob(&layer["digest"])?)?;
        let output = std::process::Command::new("tar")
            .arg("-tf")
            .arg(&path)
            .output()?;
        ensure!(
            output.status.success(),
            "tar: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        files.extend(
            String::from_utf8(output.stdout)?
                .lines()
                .map(|f| format!("/{}", f.trim_start_matches("./"))),
        );
    }
    for binary in ["switchboard-operator", "switchboard-worker"] {
        let path = format!("{destination}{binary}");
        ensure!(
            files.contains(&path),
            "{path} is not in the image: {files:?}"
        );
    }
    let others: Vec<&String> = files
        .iter()
        .filter(|f| !f.ends_with('/') && !f.starts_with(destination))
        .filter(|f| !f.contains(".so"))
        .collect();
    ensure!(
        others.is_empty(),
        "files besides the binaries and their libraries: {others:?}"
    );
    Ok(())
}

/// Acceptance 2 and 3: a cluster's host changes are undone after its owner is SIGKILLed half-way
/// (by the leftover cleanup), and no non-loopback address ever appears on the host.
#[tokio::test]
async fn the_host_is_as_before_after_a_cluster_whose_owner_was_killed() -> Result<()> {
    let _exclusive = exclusive().await;
    {
        // Whatever an earlier crashed run left is not part of "before".
        let _lock = host::lock(Duration::from_secs(60))?;
        host::cleanup_leftovers()?;
    }
    let before = host::HostSnapshot::take()?;
    let cluster = Cluster::start().await?;
    println!(
        "a bare cluster's node was Ready in {:.1?}",
        cluster.started_in
    );
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

    // A cluster with the operator and a worker pod, whose owner is SIGKILLed.
    let ready = tempfile::NamedTempFile::new()?.into_temp_path();
    std::fs::remove_file(&ready)?;
    let mut owner = std::process::Command::new(std::env::current_exe()?)
        .args(["--exact", "cluster_owner", "--ignored", "--nocapture"])
        .env(OWNER_READY_ENV, &ready)
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let started = wait_until(Duration::from_secs(300), "the owner's cluster runs", || {
        ready.exists() || matches!(owner.try_wait(), Ok(Some(_)))
    });
    ensure!(
        ready.exists(),
        "the cluster owner exited early: {started:?}"
    );
    let during = host::HostSnapshot::take()?;
    let new = during.new_addresses(&before);
    ensure!(new.is_empty(), "addresses on the host: {new:?}");
    ensure!(during.iptables == before.iptables && during.links == before.links);
    let changed = during.differences(&before);
    ensure!(
        changed.iter().any(|d| d.contains("kubepods"))
            && changed.iter().any(|d| d.contains("/var/log/containers")),
        "a cluster with pods changes cgroups and /var/log/containers: {changed:#?}"
    );
    kill(Pid::from_raw(i32::try_from(owner.id())?), Signal::SIGKILL)?;
    owner.wait()?;
    stop_what_the_owner_left(&ready)?;
    let _lock = host::lock(Duration::from_secs(60))?;
    host::cleanup_leftovers()?;
    let after = host::HostSnapshot::take()?;
    let differences = after.differences(&before);
    ensure!(
        differences.is_empty(),
        "after the owner was killed and the leftovers cleaned: {differences:#?}"
    );
    Ok(())
}
