//! What the real-cluster tests share: one [`Cluster`], PostgreSQL and Redis on the host (reached
//! by the pods through forwards on the node), and the Helm release of `charts/switchboard` with
//! the locally built image — one operator for the whole cluster, as users run it. Each test
//! works in a namespace of its own ([`ClusterEnv::namespace`]).

use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::ListParams;
use kube::{Api, Client};
use sqlx::{Connection as _, PgConnection};
use tokio::sync::OwnedRwLockReadGuard;

use super::{Cluster, SLOT};
use crate::Fixture;
use crate::control_plane::{condition, create_namespace};
use crate::helm::{CHART, NAMESPACE, RELEASE};
use crate::servers::workspace_path;
use crate::wait::wait_for;

/// How long pods get to start, roll or stop.
pub const POD_TIMEOUT: Duration = Duration::from_secs(120);
/// The release's leader Lease is held this long without renewal.
pub const LEASE_DURATION: &str = "10s";

/// The shared cluster with the operator installed.
#[derive(Debug)]
pub struct ClusterEnv {
    pub cluster: Cluster,
    pub fixture: Fixture,
    /// PostgreSQL's URL as the pods see it.
    pub pod_database_url: String,
    /// Redis's URL as the pods see it.
    pub pod_redis_url: String,
    /// `helm install`'s output.
    pub installed: String,
}

/// The port of a `scheme://host:port/…` URL.
fn url_port(url: &str) -> Result<u16> {
    let (_, rest) = url.rsplit_once(':').context("URL has a port")?;
    Ok(rest.split(['/', '?']).next().unwrap_or_default().parse()?)
}

impl ClusterEnv {
    /// A cluster of its own with `chart` installed (the shared one: [`shared`]).
    pub async fn start(chart: &Path) -> Result<Self> {
        let cluster = Cluster::start().await?;
        let fixture = Fixture::start().await?;
        let database = cluster.expose(fixture.postgres.port())?;
        let redis = cluster.expose(url_port(&fixture.redis.url())?)?;
        let mut env = Self {
            pod_database_url: format!("postgres://postgres@{database}/postgres"),
            pod_redis_url: format!("redis://{redis}/0"),
            cluster,
            fixture,
            installed: String::new(),
        };
        env.namespace(NAMESPACE).await?;
        env.installed = env.release("install", chart, &[])?;
        Ok(env)
    }

    /// `helm <command>` (install, upgrade) of the release from `chart` with the locally built
    /// image and a fast leader lease, waiting for the operator, and `extra` arguments: its output.
    pub fn release(&self, command: &str, chart: &Path, extra: &[&str]) -> Result<String> {
        let (repository, tag) = self
            .cluster
            .images
            .switchboard
            .0
            .rsplit_once(':')
            .context("the image has a tag")?;
        let values = [
            format!("image.repository={repository}"),
            format!("image.tag={tag}"),
            "image.pullPolicy=Never".to_owned(),
            "worker.image.pullPolicy=Never".to_owned(),
            "leaderElection.enabled=true".to_owned(),
            format!("leaderElection.leaseDuration={LEASE_DURATION}"),
        ];
        let chart = chart.display().to_string();
        let mut args = vec![
            command,
            RELEASE,
            &chart,
            "--namespace",
            NAMESPACE,
            "--wait",
            "--timeout",
            "180s",
        ];
        for value in &values {
            args.extend(["--set", value]);
        }
        args.extend(extra);
        self.cluster
            .helm(&args)
            .with_context(|| self.cluster.log_tail("kubelet"))
    }

    pub async fn admin(&self) -> Result<Client> {
        self.cluster.admin().await
    }

    /// Creates namespace `name` (unless it exists) with the Secrets `redis` and
    /// `switchboard-db` (key `url`) pointing at the host's servers as the pods reach them.
    pub async fn namespace(&self, name: &str) -> Result<()> {
        let client = self.admin().await?;
        if Api::<Namespace>::all(client.clone())
            .get_opt(name)
            .await?
            .is_none()
        {
            create_namespace(&client, name).await?;
        }
        for (secret, url) in [
            ("redis", &self.pod_redis_url),
            ("switchboard-db", &self.pod_database_url),
        ] {
            self.put_secret(name, secret, url).await?;
        }
        Ok(())
    }

    /// Creates or replaces Secret `namespace/name` with key `url`.
    pub async fn put_secret(&self, namespace: &str, name: &str, url: &str) -> Result<()> {
        crate::control_plane::apply_secret(&self.admin().await?, namespace, name, "url", url).await
    }

    /// `kubectl apply -f` of a manifest: its output.
    pub fn apply(&self, yaml: &str) -> Result<String> {
        let file = self
            .fixture
            .manifest(&format!("apply-{}.yaml", fastrand::u64(..)), yaml)?;
        self.cluster
            .kubectl_ok(&["apply", "-f", &file.display().to_string()])
    }

    /// The pods of `namespace` matching `selector`.
    pub async fn pods(&self, namespace: &str, selector: &str) -> Result<Vec<Pod>> {
        Ok(Api::<Pod>::namespaced(self.admin().await?, namespace)
            .list(&ListParams::default().labels(selector))
            .await?
            .items)
    }

    /// Waits until `namespace` has exactly `count` pods matching `selector`, all Ready and none
    /// terminating, and `check` holds for them; returns them.
    pub async fn wait_ready_pods(
        &self,
        namespace: &str,
        selector: &str,
        count: usize,
        check: impl Fn(&[Pod]) -> bool,
    ) -> Result<Vec<Pod>> {
        let seen = Mutex::new(Vec::new());
        wait_for(
            POD_TIMEOUT,
            &format!("{count} Ready pods {selector} in {namespace}"),
            || async {
                let pods = self.pods(namespace, selector).await?;
                let done = pods.len() == count
                    && pods
                        .iter()
                        .all(|pod| pod.metadata.deletion_timestamp.is_none() && pod_ready(pod))
                    && check(&pods);
                *seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = pods;
                Ok(done)
            },
        )
        .await
        .with_context(|| self.describe(namespace))?;
        seen.into_inner().map_err(|_| anyhow::anyhow!("poisoned"))
    }

    /// `kubectl get pods,deploy,qa,events` of `namespace` and the operator's log, for failures.
    pub fn describe(&self, namespace: &str) -> String {
        let get = |args: &[&str]| match self.cluster.kubectl(args) {
            Ok(output) => format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
            Err(err) => format!("{err:#}"),
        };
        format!(
            "{}\n{}\noperator log:\n{}",
            get(&["get", "pods,deploy,qa", "-o", "wide", "-n", namespace]),
            get(&["get", "events", "-n", namespace]),
            get(&[
                "logs",
                "-n",
                NAMESPACE,
                "-l",
                "app.kubernetes.io/name=switchboard",
                "--tail=30"
            ]),
        )
    }

    /// Whether QueueAdapter `namespace/name` reports Ready=True.
    pub async fn adapter_ready(&self, namespace: &str, name: &str) -> Result<bool> {
        let adapter =
            Api::<switchboard_api::QueueAdapter>::namespaced(self.admin().await?, namespace)
                .get(name)
                .await?;
        Ok(condition(&adapter, "Ready").is_some_and(|c| c.status == "True"))
    }

    /// The `adapters` row of `namespace/name` exists.
    pub async fn adapter_row_exists(&self, namespace: &str, name: &str) -> Result<bool> {
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM adapters WHERE name = $1")
            .bind(format!("{namespace}/{name}"))
            .fetch_one(&mut self.connection().await?)
            .await?;
        Ok(count > 0)
    }

    /// A database connection of the calling test's own. The tests sharing the environment each
    /// run on a runtime of their own, and the fixture's pool may hand out a connection opened
    /// on the runtime of a test that has ended ("a Tokio context … is being shutdown").
    async fn connection(&self) -> Result<PgConnection> {
        Ok(PgConnection::connect(&self.fixture.postgres.url()).await?)
    }

    /// The todos of `queue`, and their distinct idempotency keys.
    pub async fn todos(&self, queue: &str) -> Result<(i64, i64)> {
        Ok(sqlx::query_as(
            "SELECT count(*), count(DISTINCT idempotency_key) FROM todos WHERE queue = $1",
        )
        .bind(queue)
        .fetch_one(&mut self.connection().await?)
        .await?)
    }

    /// The `order` field of every todo's body in `queue`, in order (a body stored twice is
    /// there twice).
    pub async fn stored_orders(&self, queue: &str) -> Result<Vec<i64>> {
        Ok(sqlx::query_scalar(
            "SELECT (payload->>'order')::bigint FROM todos WHERE queue = $1 ORDER BY 1",
        )
        .bind(queue)
        .fetch_all(&mut self.connection().await?)
        .await?)
    }
}

/// Whether the pod's Ready condition is True.
pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

static SHARED: Mutex<Weak<ClusterEnv>> = Mutex::new(Weak::new());
static STARTING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The shared [`ClusterEnv`] of a test: the first test starts it, the last one to let go stops
/// it (the environment is dropped before the slot is released).
#[derive(Debug)]
pub struct SharedEnv {
    pub env: Arc<ClusterEnv>,
    _slot: OwnedRwLockReadGuard<()>,
}

impl std::ops::Deref for SharedEnv {
    type Target = ClusterEnv;
    fn deref(&self) -> &ClusterEnv {
        &self.env
    }
}

/// The running shared environment, or a new one.
pub async fn shared() -> Result<SharedEnv> {
    let slot = Arc::clone(&SLOT).read_owned().await;
    let _starting = STARTING.lock().await;
    let existing = SHARED
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .upgrade();
    let env = match existing {
        Some(env) => env,
        None => {
            let env = Arc::new(ClusterEnv::start(&workspace_path(CHART)).await?);
            *SHARED.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = Arc::downgrade(&env);
            env
        }
    };
    Ok(SharedEnv { env, _slot: slot })
}
