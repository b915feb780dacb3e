//! A real Kubernetes control plane for tests: etcd + kube-apiserver as child processes on random
//! loopback ports (no kubelet, no controllers), in a temporary directory, killed on drop. Two
//! tokens: an admin (`system:masters`) and the operator's user, bound only by the ClusterRole
//! built from `charts/switchboard/files/operator-rules.yaml` (and, in the namespaces
//! [`OperatorEnv`] creates, the Role from `leader-election-rules.yaml`). Also the operator binary
//! as a child process, and a kubelet stand-in that runs a rendered pod template locally.

pub mod keda;
pub mod pod;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, ResourceRequirements, Secret,
};
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use serde::de::DeserializeOwned;
use switchboard_api::QueueAdapter;
use tempfile::TempDir;

use crate::Fixture;
use crate::servers::{free_port, free_ports, workspace_path};
use crate::wait::wait_for;

/// The operator's default `--lease-name`.
pub const OPERATOR_LEASE: &str = "switchboard-operator";
/// The user the operator's token authenticates as.
pub const OPERATOR_USER: &str = "switchboard-operator";
/// The operator's cluster-wide RBAC rules, shared with the Helm chart.
pub const OPERATOR_RULES: &str = "charts/switchboard/files/operator-rules.yaml";
/// The operator's rules in its own namespace (leader election), shared with the Helm chart.
pub const LEADER_ELECTION_RULES: &str = "charts/switchboard/files/leader-election-rules.yaml";
/// The committed CRD.
pub const CRD_FILE: &str = "crds/queueadapters.switchboard.dev.yaml";

const START_TIMEOUT: Duration = Duration::from_secs(90);
const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

/// A list of PolicyRules from a YAML file of the repository.
fn rules_file(path: &str) -> Result<Vec<PolicyRule>> {
    let path = workspace_path(path);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_yaml_ng::from_str(&text)?)
}

/// The folder holding `etcd`, `kube-apiserver` and `kubectl`: `scripts/control-plane.sh bin-dir`
/// (which honours `KUBEBUILDER_ASSETS` and otherwise builds them once into a cache).
pub fn bin_dir() -> Result<PathBuf> {
    script_bin_dir(
        "bin-dir",
        &["etcd", "kube-apiserver", "kubectl"],
        "run `scripts/control-plane.sh bin-dir` (needs Go; see docs/control-plane.md) or set \
         KUBEBUILDER_ASSETS to a folder holding etcd and kube-apiserver",
    )
}

/// The folder `scripts/control-plane.sh <command>` prints, which must hold `binaries`; else an
/// error naming them and `how` to get them.
pub(crate) fn script_bin_dir(command: &str, binaries: &[&str], how: &str) -> Result<PathBuf> {
    let script = workspace_path("scripts/control-plane.sh");
    let output = Command::new("bash")
        .arg(&script)
        .arg(command)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !output.status.success() || binaries.iter().any(|b| !dir.join(b).is_file()) {
        bail!(
            "the binaries {} are missing and could not be built; {how}.\n{}",
            binaries.join(", "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(dir)
}

pub(crate) fn token() -> String {
    (0..32).map(|_| fastrand::alphanumeric()).collect()
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<Child> {
    let file = std::fs::File::create(log)?;
    cmd.stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))
}

/// Runs `openssl` with `args`; fails with its stderr.
fn openssl<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Result<()> {
    let output = Command::new("openssl")
        .args(args)
        .output()
        .context("running openssl (install it with `apt-get install -y openssl`)")?;
    ensure!(
        output.status.success(),
        "openssl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// The last `lines` lines of a log file.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    format!(
        "{} (last lines):\n{}",
        path.display(),
        all[all.len().saturating_sub(lines)..].join("\n")
    )
}

/// A kubeconfig file for one token.
pub(crate) fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca: &Path,
    user: &str,
    token: &str,
) -> Result<()> {
    let yaml = format!(
        "apiVersion: v1\nkind: Config\n\
         clusters:\n- name: local\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
         users:\n- name: {user}\n  user:\n    token: {token}\n\
         contexts:\n- name: local\n  context:\n    cluster: local\n    user: {user}\n\
         current-context: local\n",
        ca = ca.display()
    );
    std::fs::write(path, yaml)?;
    Ok(())
}

/// A client from a kubeconfig file.
pub async fn client(kubeconfig: &Path) -> Result<Client> {
    // This crate links rustls with two providers (kube's ring, the AWS SDK's aws-lc-rs), so
    // rustls cannot pick one itself; an error only means one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = kube::Config::from_custom_kubeconfig(
        Kubeconfig::read_from(kubeconfig)?,
        &KubeConfigOptions::default(),
    )
    .await?;
    Ok(Client::try_from(config)?)
}

/// etcd + kube-apiserver of our own.
#[derive(Debug)]
pub struct ControlPlane {
    dir: TempDir,
    bin: PathBuf,
    etcd: Child,
    apiserver: Child,
    /// Kubeconfig of the admin (`system:masters`).
    pub admin_kubeconfig: PathBuf,
    /// Kubeconfig of the operator's least-privilege user.
    pub operator_kubeconfig: PathBuf,
    /// From launch to `/readyz` = 200.
    pub started_in: Duration,
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver, waits until ready, and binds the operator user's
    /// ClusterRole from the chart's rules.
    pub async fn start() -> Result<Self> {
        let bin = bin_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("switchboard-k8s-")
            .tempdir()?;
        let d = dir.path();
        std::fs::create_dir_all(d.join("certs"))?;
        let (admin_token, operator_token) = (token(), token());
        std::fs::write(
            d.join("tokens.csv"),
            format!(
                "{admin_token},admin,admin,system:masters\n{operator_token},{OPERATOR_USER},{OPERATOR_USER}\n"
            ),
        )?;
        let key = d.join("sa.key");
        for args in [
            vec![
                "genrsa".into(),
                "-out".into(),
                key.clone().into_os_string(),
                "2048".into(),
            ],
            vec![
                "rsa".into(),
                "-in".into(),
                key.clone().into_os_string(),
                "-pubout".into(),
                "-out".into(),
                d.join("sa.pub").into_os_string(),
            ],
        ] {
            openssl(&args)?;
        }
        let [client_port, peer_port, secure_port] = free_ports()?;
        let started = Instant::now();
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let etcd = spawn_logged(
            Command::new(bin.join("etcd"))
                .arg("--data-dir")
                .arg(d.join("etcd"))
                .args(["--listen-client-urls", &etcd_url])
                .args(["--advertise-client-urls", &etcd_url])
                .args([
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer_port}"),
                ])
                .arg("--unsafe-no-fsync"),
            &d.join("etcd.log"),
        )?;
        let server = format!("https://127.0.0.1:{secure_port}");
        let mut apiserver_cmd = Command::new(bin.join("kube-apiserver"));
        apiserver_cmd
            .arg(format!("--etcd-servers={etcd_url}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={secure_port}"))
            .arg(format!("--cert-dir={}", d.join("certs").display()))
            .arg("--service-cluster-ip-range=10.0.0.0/24")
            .arg(format!("--service-account-issuer={server}"))
            .arg(format!(
                "--service-account-key-file={}",
                d.join("sa.pub").display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                key.display()
            ))
            .arg(format!(
                "--token-auth-file={}",
                d.join("tokens.csv").display()
            ))
            .arg("--authorization-mode=RBAC")
            .arg("--disable-admission-plugins=ServiceAccount")
            .arg("--allow-privileged=true");
        let apiserver = spawn_logged(&mut apiserver_cmd, &d.join("kube-apiserver.log"))?;
        let ca = d.join("certs").join("apiserver.crt");
        let admin_kubeconfig = d.join("admin.kubeconfig");
        let operator_kubeconfig = d.join("operator.kubeconfig");
        let mut plane = Self {
            admin_kubeconfig,
            operator_kubeconfig,
            dir,
            bin,
            etcd,
            apiserver,
            started_in: Duration::ZERO,
        };
        let apiserver_log = plane.dir.path().join("kube-apiserver.log");
        wait_for(
            START_TIMEOUT,
            "kube-apiserver wrote its certificate",
            || {
                let ready = ca.is_file();
                async move { Ok(ready) }
            },
        )
        .await
        .with_context(|| log_tail(&apiserver_log, 30))?;
        write_kubeconfig(&plane.admin_kubeconfig, &server, &ca, "admin", &admin_token)?;
        write_kubeconfig(
            &plane.operator_kubeconfig,
            &server,
            &ca,
            OPERATOR_USER,
            &operator_token,
        )?;
        // A fresh client per attempt: the certificate file may still be being written.
        wait_for(START_TIMEOUT, "kube-apiserver /readyz is 200", || async {
            let request = http::Request::get("/readyz").body(Vec::new())?;
            Ok(plane.admin().await?.request_text(request).await?.trim() == "ok")
        })
        .await
        .with_context(|| log_tail(&apiserver_log, 30))?;
        plane.started_in = started.elapsed();
        plane.grant_operator(None, Self::operator_rules()?).await?;
        Ok(plane)
    }

    /// A client with the admin token.
    pub async fn admin(&self) -> Result<Client> {
        client(&self.admin_kubeconfig).await
    }

    /// A client with the operator's least-privilege token.
    pub async fn operator_client(&self) -> Result<Client> {
        client(&self.operator_kubeconfig).await
    }

    /// The operator's cluster-wide rules from the chart's file.
    pub fn operator_rules() -> Result<Vec<PolicyRule>> {
        rules_file(OPERATOR_RULES)
    }

    /// The operator's leader-election rules from the chart's file, for the Lease `lease`.
    pub fn leader_election_rules(lease: &str) -> Result<Vec<PolicyRule>> {
        let mut rules = rules_file(LEADER_ELECTION_RULES)?;
        for name in rules
            .iter_mut()
            .flat_map(|rule| rule.resource_names.iter_mut().flatten())
        {
            if name == "LEASE_NAME" {
                lease.clone_into(name);
            }
        }
        Ok(rules)
    }

    /// Grants the operator's user `rules`: cluster-wide (ClusterRole + ClusterRoleBinding) when
    /// `namespace` is `None`, else in that namespace (Role + RoleBinding).
    pub async fn grant_operator(
        &self,
        namespace: Option<&str>,
        rules: Vec<PolicyRule>,
    ) -> Result<()> {
        let admin = self.admin().await?;
        let (role, binding) = match namespace {
            None => ("ClusterRole", "ClusterRoleBinding"),
            Some(_) => ("Role", "RoleBinding"),
        };
        let metadata = serde_json::json!({"name": OPERATOR_USER, "namespace": namespace});
        let objects = [
            (role, serde_json::json!({"rules": rules})),
            (
                binding,
                serde_json::json!({
                    "roleRef": {"apiGroup": RBAC_GROUP, "kind": role, "name": OPERATOR_USER},
                    "subjects": [{"apiGroup": RBAC_GROUP, "kind": "User", "name": OPERATOR_USER}],
                }),
            ),
        ];
        for (kind, mut object) in objects {
            object["apiVersion"] = format!("{RBAC_GROUP}/v1").into();
            object["kind"] = kind.into();
            object["metadata"] = metadata.clone();
            let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(RBAC_GROUP, "v1", kind));
            let api: Api<DynamicObject> = match namespace {
                Some(namespace) => Api::namespaced_with(admin.clone(), namespace, &resource),
                None => Api::all_with(admin.clone(), &resource),
            };
            api.create(&PostParams::default(), &serde_json::from_value(object)?)
                .await
                .with_context(|| format!("creating the operator's {kind}"))?;
        }
        Ok(())
    }

    /// `kubectl` with the admin kubeconfig.
    pub fn kubectl(&self, args: &[&str]) -> Result<Output> {
        kubectl(&self.bin, &self.admin_kubeconfig, args)
    }

    /// `kubectl` that must succeed; returns its stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String> {
        kubectl_ok(&self.bin, &self.admin_kubeconfig, args)
    }

    /// Creates the committed CRD and waits until it is Established.
    pub async fn install_crd(&self) -> Result<()> {
        self.install_crd_file(&workspace_path(CRD_FILE)).await
    }

    /// Creates KEDA's CRDs (its own files, from `scripts/keda-crds.sh`: ScaledObject,
    /// TriggerAuthentication and the ones KEDA's operator watches besides) and waits until they
    /// are Established.
    pub async fn install_keda_crds(&self) -> Result<()> {
        let script = workspace_path("scripts/keda-crds.sh");
        let output = Command::new(&script).output()?;
        ensure!(
            output.status.success(),
            "{} failed (it downloads KEDA's CRDs from the Go module proxy): {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        let dir = PathBuf::from(String::from_utf8(output.stdout)?.trim());
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
            .map(|entry| Ok(entry?.path()))
            .collect::<Result<_>>()?;
        files.retain(|path| path.extension().is_some_and(|e| e == "yaml"));
        files.sort();
        ensure!(
            files
                .iter()
                .any(|f| f.ends_with("keda.sh_scaledobjects.yaml")),
            "no ScaledObject CRD in {}",
            dir.display()
        );
        for file in files {
            self.install_crd_file(&file).await?;
        }
        Ok(())
    }

    /// Creates the CRD in `path` and waits until it is Established.
    async fn install_crd_file(&self, path: &Path) -> Result<()> {
        let crd: CustomResourceDefinition =
            serde_yaml_ng::from_str(&std::fs::read_to_string(path)?)?;
        let name = crd.metadata.name.clone().context("CRD has a name")?;
        let api = Api::<CustomResourceDefinition>::all(self.admin().await?);
        api.create(&PostParams::default(), &crd).await?;
        wait_for(
            START_TIMEOUT,
            &format!("the CRD {name} is Established"),
            || {
                let (api, name) = (api.clone(), name.clone());
                async move {
                    let crd = api.get(&name).await?;
                    Ok(crd
                        .status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Established" && c.status == "True"))
                }
            },
        )
        .await
    }

    /// Creates namespace `name`.
    pub async fn create_namespace(&self, name: &str) -> Result<()> {
        create_namespace(&self.admin().await?, name).await
    }

    /// Creates or replaces Secret `namespace/name` with one `key`.
    pub async fn put_secret(
        &self,
        namespace: &str,
        name: &str,
        key: &str,
        value: &str,
    ) -> Result<()> {
        apply_secret(&self.admin().await?, namespace, name, key, value).await
    }

    /// Kills both processes now (apiserver first).
    pub fn stop(&mut self) {
        kill(&mut self.apiserver);
        kill(&mut self.etcd);
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `<bin>/kubectl --kubeconfig <kubeconfig> args…`.
pub fn kubectl(bin: &Path, kubeconfig: &Path, args: &[&str]) -> Result<Output> {
    Ok(Command::new(bin.join("kubectl"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::null())
        .output()?)
}

/// [`kubectl`] that must succeed; returns its stdout.
pub fn kubectl_ok(bin: &Path, kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let output = kubectl(bin, kubeconfig, args)?;
    ensure!(
        output.status.success(),
        "kubectl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// Creates namespace `name`.
pub async fn create_namespace(client: &Client, name: &str) -> Result<()> {
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(name.to_owned()),
                    ..ObjectMeta::default()
                },
                ..Namespace::default()
            },
        )
        .await?;
    Ok(())
}

/// Creates or replaces (server-side apply) Secret `namespace/name` with one `key`.
pub async fn apply_secret(
    client: &Client,
    namespace: &str,
    name: &str,
    key: &str,
    value: &str,
) -> Result<()> {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some([(key.to_owned(), ByteString(value.as_bytes().to_vec()))].into()),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(client.clone(), namespace)
        .patch(
            name,
            &PatchParams::apply("switchboard-tests").force(),
            &Patch::Apply(&secret),
        )
        .await?;
    Ok(())
}

/// Status code and body of an HTTP/1.0 `GET path` to `addr`.
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("malformed HTTP response")?;
    Ok((code, body.to_owned()))
}

/// `target/<profile>/switchboard-operator`, built by `cargo build --workspace --bins`.
pub fn operator_binary() -> Result<PathBuf> {
    crate::worker::workspace_binary("switchboard-operator")
}

/// A running `switchboard-operator run`.
#[derive(Debug)]
pub struct OperatorProcess {
    child: Child,
    pub identity: String,
    pub metrics_addr: SocketAddr,
    log: PathBuf,
}

impl OperatorProcess {
    /// Starts the operator with `kubeconfig`, the database at `database_url`, a fast lease and
    /// `extra_args`.
    pub fn start(
        kubeconfig: &Path,
        database_url: &str,
        log_dir: &Path,
        identity: &str,
        extra_args: &[&str],
    ) -> Result<Self> {
        Self::start_with_env(kubeconfig, database_url, log_dir, identity, extra_args, &[])
    }

    /// [`OperatorProcess::start`] with the environment variables `extra_env` besides.
    pub fn start_with_env(
        kubeconfig: &Path,
        database_url: &str,
        log_dir: &Path,
        identity: &str,
        extra_args: &[&str],
        extra_env: &[(&str, &str)],
    ) -> Result<Self> {
        let metrics_addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let log = log_dir.join(format!("operator-{identity}.log"));
        let child = spawn_logged(
            Command::new(operator_binary()?)
                .arg("run")
                .args(["--metrics-addr", &metrics_addr.to_string()])
                .args(["--worker-image", "switchboard:test"])
                .args(extra_args)
                .env("KUBECONFIG", kubeconfig)
                .env("DATABASE_URL", database_url)
                .env("HOSTNAME", identity)
                .env("RUST_LOG", "info")
                .envs(extra_env.iter().copied()),
            &log,
        )?;
        Ok(Self {
            child,
            identity: identity.to_owned(),
            metrics_addr,
            log,
        })
    }

    /// Status code and body of `GET path` on the operator's metrics server.
    pub async fn http_get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.metrics_addr, path).await
    }

    /// The sum of every sample of metric `name` (all label sets); 0 when absent.
    pub async fn metric_sum(&self, name: &str) -> Result<f64> {
        let (_, body) = self.http_get("/metrics").await?;
        Ok(body
            .lines()
            .filter(|line| {
                line.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(['{', ' ']))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum())
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(&mut self, timeout: Duration) -> Result<()> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id())?);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                ensure!(
                    status.success(),
                    "operator exited with {status}\n{}",
                    self.log_tail()
                );
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "operator did not exit within {timeout:?}\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        log_tail(&self.log, 40)
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        kill(&mut self.child);
    }
}

/// Everything an operator test needs: the control plane with the CRD installed, PostgreSQL and
/// Redis, and a namespace with the Secrets `redis` and `switchboard-db` (key `url`) pointing at
/// them.
pub struct OperatorEnv {
    pub fixture: Fixture,
    pub plane: ControlPlane,
    pub admin: Client,
    pub namespace: String,
}

impl OperatorEnv {
    /// The namespace of [`OperatorEnv::start`].
    pub const NAMESPACE: &'static str = "shop";

    pub async fn start() -> Result<Self> {
        Self::start_in(Self::NAMESPACE).await
    }

    /// Like [`OperatorEnv::start`] with the adapters in `namespace`.
    pub async fn start_in(namespace: &str) -> Result<Self> {
        let plane = ControlPlane::start().await?;
        plane.install_crd().await?;
        if namespace != "default" {
            plane.create_namespace(namespace).await?;
        }
        // The operators started here keep their leader Lease in this namespace.
        plane
            .grant_operator(
                Some(namespace),
                ControlPlane::leader_election_rules(OPERATOR_LEASE)?,
            )
            .await?;
        let fixture = Fixture::start().await?;
        plane
            .put_secret(namespace, "redis", "url", &fixture.redis.url())
            .await?;
        plane
            .put_secret(namespace, "switchboard-db", "url", &fixture.postgres.url())
            .await?;
        let admin = plane.admin().await?;
        Ok(Self {
            fixture,
            plane,
            admin,
            namespace: namespace.to_owned(),
        })
    }

    /// Starts an operator with the least-privilege token.
    pub fn start_operator(&self, identity: &str, extra_args: &[&str]) -> Result<OperatorProcess> {
        OperatorProcess::start(
            &self.plane.operator_kubeconfig,
            &self.fixture.postgres.url(),
            self.fixture.dir.path(),
            identity,
            extra_args,
        )
    }

    pub fn adapters(&self) -> Api<QueueAdapter> {
        Api::namespaced(self.admin.clone(), &self.namespace)
    }

    pub fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.admin.clone(), &self.namespace)
    }

    pub fn config_maps(&self) -> Api<ConfigMap> {
        Api::namespaced(self.admin.clone(), &self.namespace)
    }

    /// Server-side applies a QueueAdapter manifest as a user would (`kubectl apply`).
    pub async fn apply_adapter(&self, yaml: &str) -> Result<QueueAdapter> {
        let adapter: QueueAdapter = serde_yaml_ng::from_str(yaml)?;
        let name = adapter
            .metadata
            .name
            .clone()
            .context("manifest has a name")?;
        Ok(self
            .adapters()
            .patch(
                &name,
                &PatchParams::apply("kubectl").force(),
                &Patch::Apply(&adapter),
            )
            .await?)
    }

    /// Waits until QueueAdapter `name` satisfies `condition`; returns it.
    pub async fn wait_adapter(
        &self,
        name: &str,
        what: &str,
        condition: impl Fn(&QueueAdapter) -> bool,
    ) -> Result<QueueAdapter> {
        wait_object(&self.adapters(), name, what, condition).await
    }

    /// Waits until the Deployment `name` exists and satisfies `condition`; returns it.
    pub async fn wait_deployment(
        &self,
        name: &str,
        what: &str,
        condition: impl Fn(&Deployment) -> bool,
    ) -> Result<Deployment> {
        wait_object(&self.deployments(), name, what, condition).await
    }

    /// Plays the Deployment controller and kubelet: reports every desired replica available
    /// at the Deployment's current generation.
    pub async fn mark_deployment_available(&self, name: &str) -> Result<()> {
        let deployment = self.deployments().get(name).await?;
        let replicas = deployment
            .spec
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(1);
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = serde_json::json!({"status": {
            "observedGeneration": deployment.metadata.generation,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
            "conditions": [{
                "type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                "message": "Deployment has minimum availability.",
                "lastUpdateTime": now, "lastTransitionTime": now,
            }],
        }});
        self.deployments()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
        Ok(())
    }

    /// The `adapters` row of adapter `name` in this namespace.
    pub async fn adapter_row(&self, name: &str) -> Result<Option<AdapterRow>> {
        Ok(sqlx::query_as(
            "SELECT family, trust_mode, enabled, config, generation, updated_at::text \
             FROM adapters WHERE name = $1",
        )
        .bind(format!("{}/{name}", self.namespace))
        .fetch_optional(self.fixture.pool())
        .await?)
    }
}

/// Waits until object `name` exists and satisfies `condition`; returns it.
pub async fn wait_object<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    condition: impl Fn(&K) -> bool,
) -> Result<K>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    let seen = Mutex::new(None);
    wait_for(OPERATOR_TIMEOUT, what, || async {
        let Some(object) = api.get_opt(name).await? else {
            return Ok(false);
        };
        let done = condition(&object);
        *seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = Some(object);
        Ok(done)
    })
    .await?;
    seen.into_inner()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .with_context(|| format!("{name} not seen"))
}

/// A row of the `adapters` table.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AdapterRow {
    pub family: String,
    pub trust_mode: String,
    pub enabled: bool,
    pub config: serde_json::Value,
    pub generation: i64,
    pub updated_at: String,
}

/// The pod spec of `deployment` and its first container.
pub fn pod_template(deployment: &Deployment) -> Result<(&PodSpec, &Container)> {
    let pod = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("the Deployment has no pod template")?;
    let container = pod.containers.first().context("the pod has no container")?;
    Ok((pod, container))
}

/// The `requests` (or else `limits`) of `resources`, each quantity as text.
pub fn quantities(
    resources: Option<&ResourceRequirements>,
    which: &str,
) -> std::collections::BTreeMap<String, String> {
    let part = resources.and_then(|r| match which {
        "requests" => r.requests.as_ref(),
        _ => r.limits.as_ref(),
    });
    part.into_iter()
        .flatten()
        .map(|(name, quantity)| (name.clone(), quantity.0.clone()))
        .collect()
}

/// A map of `items`, to compare with label maps and [`quantities`].
pub fn pairs(items: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    items
        .iter()
        .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
        .collect()
}

/// A stream-mode QueueAdapter `name` in [`OperatorEnv::NAMESPACE`] reading stream `name` into
/// queue `name`, the Redis URL from Secret `redis`, plus `spec_extra` (spec lines, indented by
/// two spaces).
pub fn adapter_manifest(name: &str, spec_extra: &str) -> String {
    adapter_manifest_in(OperatorEnv::NAMESPACE, name, spec_extra)
}

/// QueueAdapter `orders` in [`OperatorEnv::NAMESPACE`] reading `source` (the YAML under
/// `spec.source`, indented by four spaces) into queue `orders`, 50 messages a batch.
pub fn orders_adapter(source: &str) -> String {
    format!(
        "apiVersion: switchboard.dev/v1alpha1\n\
         kind: QueueAdapter\n\
         metadata: {{name: orders, namespace: {namespace}}}\n\
         spec:\n\
         \x20 source:\n\
         {source}\
         \x20 target: {{queue: orders}}\n\
         \x20 delivery: {{batchSize: 50}}\n",
        namespace = OperatorEnv::NAMESPACE
    )
}

/// [`adapter_manifest`] in `namespace`.
pub fn adapter_manifest_in(namespace: &str, name: &str, spec_extra: &str) -> String {
    format!(
        "apiVersion: switchboard.dev/v1alpha1\n\
         kind: QueueAdapter\n\
         metadata: {{name: {name}, namespace: {namespace}}}\n\
         spec:\n\
         \x20 source:\n\
         \x20   redis: {{mode: stream, stream: {name}, urlSecretRef: {{name: redis, key: url}}}}\n\
         \x20 target: {{queue: {name}}}\n\
         {spec_extra}"
    )
}

/// How long the operator gets to react to a change.
pub const OPERATOR_TIMEOUT: Duration = Duration::from_secs(60);

/// The QueueAdapter's status condition of type `type_`, if it has one.
pub fn condition<'a>(adapter: &'a QueueAdapter, type_: &str) -> Option<&'a Condition> {
    adapter
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}
