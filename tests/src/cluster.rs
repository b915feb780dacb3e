//! A real single-node Kubernetes cluster for the top test tier: containerd + runc run the pods,
//! with etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy,
//! every one a child process (`scripts/control-plane.sh cluster-bin-dir` builds them once).
//!
//! All of its networking lives in a network namespace of its own ([`net`]): the node address
//! [`NODE_IP`] on a bridge, the pods on it, the Service addresses, kube-proxy's rules. The host
//! reaches the API server through a loopback forward; pods reach the test's PostgreSQL and Redis
//! through [`Cluster::expose`]. The images are built by `scripts/cluster-image.sh` (buildah, no
//! registry) and imported into containerd. What the cluster changes on the host is recorded
//! before it starts and restored when it stops, or by the next start after a crash ([`host`]).
//! See docs/cluster.md.

pub mod env;
pub mod host;
pub mod net;

use std::fs::File;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::{Api, Client};
use nix::fcntl::Flock;
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::RwLock;

use self::host::{HostSnapshot, Record};
use self::net::{Forward, Netns};
use crate::control_plane::{self, client, log_tail, token, write_kubeconfig};
use crate::servers::{stop_child, workspace_path};
use crate::wait::wait_for;

/// The node's name.
pub const NODE_NAME: &str = "switchboard-node";
/// The node's address (inside the cluster's network namespace only): the API server, the
/// kubelet and the forwards to the host's servers listen here, and it is the pods' gateway.
pub const NODE_IP: &str = "10.89.0.1";
/// The kubelet's user (the Node authorizer's convention).
const NODE_USER: &str = "system:node:switchboard-node";
const NODE_CIDR: &str = "10.89.0.1/24";
const POD_SUBNET: &str = "10.89.0.0/24";
const SERVICE_CIDR: &str = "10.96.0.0/24";
/// The `kubernetes` Service's address (the first of [`SERVICE_CIDR`]).
const API_SERVICE_IP: &str = "10.96.0.1";
const BRIDGE: &str = "sbbr0";
const API_PORT: u16 = 6443;
/// The binaries of `scripts/control-plane.sh cluster-bin-dir`.
const BINARIES: [&str; 7] = [
    "etcd",
    "kube-apiserver",
    "kubectl",
    "kubelet",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
];
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a cluster start waits for another real cluster on this machine to stop.
const LOCK_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The folder holding the cluster's binaries.
pub fn bin_dir() -> Result<PathBuf> {
    control_plane::script_bin_dir(
        "cluster-bin-dir",
        &BINARIES,
        "run `make cluster-bins` (scripts/control-plane.sh cluster-bin-dir; needs Go, see \
         docs/cluster.md) or set KUBEBUILDER_ASSETS to a folder holding all of them",
    )
}

/// Fails naming the install command when a host prerequisite is missing.
fn check_prerequisites() -> Result<()> {
    ensure!(
        nix::unistd::Uid::effective().is_root(),
        "the real-cluster tests run containerd and the kubelet, which need root"
    );
    let on_path = |program: &str| {
        std::env::var_os("PATH")
            .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
    };
    let missing: Vec<&str> = [
        "containerd",
        "containerd-shim-runc-v2",
        "ctr",
        "runc",
        "buildah",
        "iptables",
        "gcc",
        "nsenter",
        "openssl",
    ]
    .into_iter()
    .filter(|program| !on_path(program))
    .chain((!Path::new("/usr/lib/cni/bridge").is_file()).then_some("/usr/lib/cni/bridge"))
    .collect();
    ensure!(
        missing.is_empty(),
        "missing for the real-cluster tests: {}; install them with `make deps` \
         (scripts/install-deps.sh: apt-get install -y containerd runc \
         containernetworking-plugins buildah iptables gcc)",
        missing.join(", ")
    );
    Ok(())
}

/// The images of `scripts/cluster-image.sh`: references and oci-archives.
#[derive(Debug, Clone)]
pub struct Images {
    pub switchboard: (String, PathBuf),
    pub pause: (String, PathBuf),
}

impl Images {
    /// Builds (or takes from the cache) the images of the binaries next to the tests.
    pub fn build() -> Result<Self> {
        let operator = crate::control_plane::operator_binary()?;
        crate::worker::workspace_binary("switchboard-worker")?;
        let dir = operator.parent().context("the binaries have a folder")?;
        let output = run(Command::new("bash")
            .arg(workspace_path("scripts/cluster-image.sh"))
            .arg(dir))?;
        let text = String::from_utf8(output.stdout)?;
        let mut images = text.lines().map(|line| -> Result<(String, PathBuf)> {
            let (reference, archive) = line.split_once(' ').context("`<ref> <archive>`")?;
            Ok((reference.to_owned(), PathBuf::from(archive)))
        });
        let mut next = || images.next().context("two images")?;
        Ok(Self {
            switchboard: next()?,
            pause: next()?,
        })
    }
}

/// Runs `cmd`, which must succeed.
fn run(cmd: &mut Command) -> Result<Output> {
    let output = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        output.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(output)
}

/// On SIGINT (Ctrl-C) or SIGTERM, stops the cluster and restores the host from the record before
/// the process ends (a panic unwinds into [`Cluster`]'s `Drop`; a SIGKILL leaves the record for
/// the next start). Installed once per process.
fn trap_signals() {
    static TRAP: std::sync::Once = std::sync::Once::new();
    TRAP.call_once(|| {
        std::thread::spawn(|| {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            let signalled = runtime.block_on(async {
                let mut terminate = signal(SignalKind::terminate())?;
                tokio::select! {
                    result = tokio::signal::ctrl_c() => result,
                    _ = terminate.recv() => Ok(()),
                }
            });
            if signalled.is_ok() {
                eprintln!("interrupted: stopping the cluster and restoring the host");
                if let Err(err) = host::cleanup_leftovers() {
                    eprintln!("restoring the host failed: {err:#}");
                }
                std::process::exit(130);
            }
        });
    });
}

/// A CA and the certificates signed by it, made with openssl.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn create(dir: PathBuf) -> Result<Self> {
        std::fs::create_dir_all(&dir)?;
        let pki = Self { dir };
        pki.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=switchboard-cluster-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ])?;
        pki.openssl(&["genrsa", "-out", "sa.key", "2048"])?;
        pki.openssl(&["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
        Ok(pki)
    }

    fn openssl(&self, args: &[&str]) -> Result<()> {
        run(Command::new("openssl").current_dir(&self.dir).args(args))?;
        Ok(())
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// `<name>.crt` and `<name>.key` for `subject`, with `alt_names` (`IP:…`, `DNS:…`) if any.
    fn issue(&self, name: &str, subject: &str, alt_names: &[&str]) -> Result<()> {
        let (key, csr, crt) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
        );
        self.openssl(&[
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", &key, "-out", &csr,
        ])?;
        let ext = format!("{name}.ext");
        let mut extensions = String::from("basicConstraints=CA:FALSE\n");
        if !alt_names.is_empty() {
            extensions.push_str(&format!("subjectAltName={}\n", alt_names.join(",")));
        }
        std::fs::write(self.path(&ext), extensions)?;
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &crt,
        ])
    }
}

/// A running cluster. Dropping it stops everything and restores the host.
#[derive(Debug)]
pub struct Cluster {
    record: Record,
    bin: PathBuf,
    netns: Option<Netns>,
    children: Mutex<Vec<(&'static str, Child)>>,
    forwards: Mutex<Vec<Forward>>,
    /// Kubeconfig of the admin (`system:masters`), through the host's loopback forward.
    pub admin_kubeconfig: PathBuf,
    pub images: Images,
    /// From the first daemon's launch to the node being Ready.
    pub started_in: Duration,
    /// Released after the restore (fields drop after `Drop::drop`).
    _lock: Flock<File>,
}

impl Cluster {
    /// The cluster's folder (its logs are there).
    pub fn root(&self) -> &Path {
        &self.record.root
    }

    /// Builds the images, takes the machine's cluster lock, restores the host after a crashed
    /// earlier run, records the host's state and starts the cluster.
    pub async fn start() -> Result<Self> {
        check_prerequisites()?;
        let bin = bin_dir()?;
        let images = Images::build()?;
        let lock = tokio::task::spawn_blocking(|| host::lock(LOCK_TIMEOUT)).await??;
        host::cleanup_leftovers()?;
        let root = std::env::temp_dir().join(format!(
            "switchboard-cluster-{}-{}",
            std::process::id(),
            token()[..6].to_lowercase()
        ));
        std::fs::create_dir_all(&root)?;
        // Tokens, keys and kubeconfigs live here: only for root.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))?;
        let record = Record {
            netns: format!("sb-{}", std::process::id()),
            root: root.clone(),
            before: HostSnapshot::take()?,
        };
        record.save()?;
        trap_signals();
        let mut cluster = Self {
            admin_kubeconfig: root.join("admin.kubeconfig"),
            record,
            bin,
            netns: None,
            children: Mutex::new(Vec::new()),
            forwards: Mutex::new(Vec::new()),
            images,
            started_in: Duration::ZERO,
            _lock: lock,
        };
        let started = Instant::now();
        if let Err(err) = cluster.boot().await {
            // The restore deletes the cluster's folder: keep its logs.
            let kept = cluster.keep_logs();
            return Err(err.context(format!("starting the cluster (its logs: {kept})")));
        }
        cluster.started_in = started.elapsed();
        Ok(cluster)
    }

    /// Copies the daemons' logs to `cluster-state/failed-run/`; says where (or why not).
    fn keep_logs(&self) -> String {
        let copy = || -> Result<PathBuf> {
            let dir = host::state_dir()?.join("failed-run");
            if dir.exists() {
                std::fs::remove_dir_all(&dir)?;
            }
            std::fs::create_dir_all(&dir)?;
            for entry in std::fs::read_dir(self.root())? {
                let path = entry?.path();
                if path.extension().is_some_and(|e| e == "log") {
                    std::fs::copy(&path, dir.join(path.file_name().unwrap_or_default()))?;
                }
            }
            Ok(dir)
        };
        match copy() {
            Ok(dir) => dir.display().to_string(),
            Err(err) => format!("not kept: {err:#}"),
        }
    }

    fn netns(&self) -> Result<&Netns> {
        self.netns.as_ref().context("the network namespace is gone")
    }

    /// Starts `program` of the cluster's binaries (or on the PATH) in the network namespace,
    /// its output in `<root>/<name>.log`.
    fn spawn(&self, name: &'static str, program: &Path, args: &[String]) -> Result<()> {
        let log = File::create(self.root().join(format!("{name}.log")))?;
        let child = self
            .netns()?
            .command(program)
            .args(args)
            .current_dir(self.root())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.children
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .push((name, child));
        Ok(())
    }

    /// Fails with the log of `name` when it has exited.
    fn check_alive(&self) -> Result<()> {
        let mut children = self
            .children
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?;
        for (name, child) in children.iter_mut() {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "{name} exited with {status}\n{}",
                    log_tail(&self.root().join(format!("{name}.log")), 30)
                );
            }
        }
        Ok(())
    }

    /// Waits for `what`, failing early when a daemon died.
    async fn wait<F, Fut>(&self, what: &str, mut condition: F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool>>,
    {
        wait_for(START_TIMEOUT, what, || {
            let alive = self.check_alive();
            let check = condition();
            async move {
                alive?;
                check.await
            }
        })
        .await
    }

    async fn boot(&mut self) -> Result<()> {
        let root = self.root().to_path_buf();
        let p = |rel: &str| root.join(rel).display().to_string();
        self.netns = Some(Netns::create(&self.record.netns, BRIDGE, NODE_CIDR)?);

        let pki = Pki::create(root.join("pki"))?;
        pki.issue(
            "apiserver",
            "/CN=kube-apiserver",
            &[
                "IP:127.0.0.1",
                &format!("IP:{NODE_IP}"),
                &format!("IP:{API_SERVICE_IP}"),
                "DNS:kubernetes",
                "DNS:kubernetes.default",
                "DNS:kubernetes.default.svc",
            ],
        )?;
        pki.issue(
            "kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
            &[],
        )?;
        let tokens = [
            ("admin", "admin", "system:masters"),
            ("node", NODE_USER, "system:nodes"),
            ("kcm", "system:kube-controller-manager", ""),
            ("scheduler", "system:kube-scheduler", ""),
            ("proxy", "system:kube-proxy", ""),
        ]
        .map(|(name, user, group)| (name, user, group, token()));
        let csv: String = tokens
            .iter()
            .map(|(_, user, group, token)| match *group {
                "" => format!("{token},{user},{user}\n"),
                group => format!("{token},{user},{user},\"{group}\"\n"),
            })
            .collect();
        std::fs::write(root.join("tokens.csv"), csv)?;
        let inside = format!("https://{NODE_IP}:{API_PORT}");
        for (name, _, _, token) in &tokens {
            write_kubeconfig(
                &root.join(format!("{name}.kubeconfig")),
                &inside,
                &pki.path("ca.crt"),
                name,
                token,
            )?;
        }

        // containerd, then the images.
        let pause = &self.images.pause.0;
        std::fs::create_dir_all(root.join("cni/net.d"))?;
        std::fs::write(
            root.join("containerd.toml"),
            format!(
                r#"version = 2
root = "{root_dir}"
state = "{state_dir}"
[grpc]
  address = "{socket}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  tolerate_missing_hugetlb_controller = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    snapshotter = "overlayfs"
    disable_snapshot_annotations = true
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{runc}"
"#,
                root_dir = p("containerd/root"),
                state_dir = p("containerd/state"),
                socket = self.containerd_socket().display(),
                opt = p("containerd/opt"),
                cni = p("cni/net.d"),
                runc = p("runc"),
            ),
        )?;
        std::fs::write(
            root.join("cni/net.d/10-switchboard.conflist"),
            serde_json::to_string_pretty(&serde_json::json!({
                "cniVersion": "0.4.0",
                "name": "switchboard",
                "plugins": [
                    {
                        "type": "bridge", "bridge": BRIDGE, "isGateway": true, "ipMasq": false,
                        "hairpinMode": true,
                        "ipam": {
                            "type": "host-local", "dataDir": p("cni/ipam"),
                            "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP,
                                         "rangeStart": "10.89.0.10"}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                        },
                    },
                    {"type": "portmap", "capabilities": {"portMappings": true}},
                ],
            }))?,
        )?;
        self.spawn(
            "containerd",
            Path::new("containerd"),
            &["--config".into(), p("containerd.toml")],
        )?;

        // etcd and the API server (stopped in the other order).
        self.spawn(
            "etcd",
            &self.bin.join("etcd"),
            &[
                format!("--data-dir={}", p("etcd")),
                "--listen-client-urls=http://127.0.0.1:2379".into(),
                "--advertise-client-urls=http://127.0.0.1:2379".into(),
                "--listen-peer-urls=http://127.0.0.1:2380".into(),
                "--unsafe-no-fsync".into(),
            ],
        )?;
        let pki_arg = |flag: &str, file: &str| format!("--{flag}={}", pki.path(file).display());
        self.spawn(
            "kube-apiserver",
            &self.bin.join("kube-apiserver"),
            &[
                "--etcd-servers=http://127.0.0.1:2379".into(),
                format!("--bind-address={NODE_IP}"),
                format!("--advertise-address={NODE_IP}"),
                format!("--secure-port={API_PORT}"),
                pki_arg("tls-cert-file", "apiserver.crt"),
                pki_arg("tls-private-key-file", "apiserver.key"),
                pki_arg("client-ca-file", "ca.crt"),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--service-account-issuer=https://kubernetes.default.svc".into(),
                pki_arg("service-account-key-file", "sa.pub"),
                pki_arg("service-account-signing-key-file", "sa.key"),
                format!("--token-auth-file={}", p("tokens.csv")),
                "--authorization-mode=Node,RBAC".into(),
                "--allow-privileged=true".into(),
                pki_arg("kubelet-client-certificate", "kubelet-client.crt"),
                pki_arg("kubelet-client-key", "kubelet-client.key"),
                "--kubelet-preferred-address-types=InternalIP".into(),
            ],
        )?;
        let api = Forward::into_netns(self.netns()?, format!("{NODE_IP}:{API_PORT}").parse()?)?;
        write_kubeconfig(
            &self.admin_kubeconfig,
            &format!("https://{}", api.listen),
            &pki.path("ca.crt"),
            "admin",
            &tokens[0].3,
        )?;
        self.forwards
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .push(api);

        let socket = self.containerd_socket();
        self.wait("containerd's socket exists", || {
            let exists = socket.exists();
            async move { Ok(exists) }
        })
        .await?;
        for (_, archive) in [&self.images.switchboard, &self.images.pause] {
            self.ctr(&["images", "import", &archive.display().to_string()])?;
        }
        self.wait("kube-apiserver /readyz is 200", || async {
            let request = http::Request::get("/readyz").body(Vec::new())?;
            Ok(self.admin().await?.request_text(request).await?.trim() == "ok")
        })
        .await?;

        // The controllers, the node and its Service proxy.
        let kubeconfig_arg = |flag: &str, name: &str| format!("--{flag}={}", p(name));
        let component = |name: &str, port: u16| {
            let config = format!("{name}.kubeconfig");
            vec![
                kubeconfig_arg("kubeconfig", &config),
                kubeconfig_arg("authentication-kubeconfig", &config),
                kubeconfig_arg("authorization-kubeconfig", &config),
                "--leader-elect=false".into(),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={port}"),
                format!("--cert-dir={}", p(&format!("{name}-certs"))),
            ]
        };
        let mut kcm = component("kcm", 10257);
        kcm.extend([
            pki_arg("root-ca-file", "ca.crt"),
            pki_arg("service-account-private-key-file", "sa.key"),
            "--use-service-account-credentials=true".into(),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
        ]);
        self.spawn(
            "kube-controller-manager",
            &self.bin.join("kube-controller-manager"),
            &kcm,
        )?;
        self.spawn(
            "kube-scheduler",
            &self.bin.join("kube-scheduler"),
            &component("scheduler", 10259),
        )?;
        std::fs::write(
            root.join("kubelet.yaml"),
            format!(
                "apiVersion: kubelet.config.k8s.io/v1beta1\n\
                 kind: KubeletConfiguration\n\
                 address: {NODE_IP}\n\
                 port: 10250\n\
                 readOnlyPort: 0\n\
                 healthzBindAddress: 127.0.0.1\n\
                 healthzPort: 10248\n\
                 authentication:\n  anonymous: {{enabled: false}}\n  webhook: {{enabled: true}}\n  x509: {{clientCAFile: {ca}}}\n\
                 authorization: {{mode: Webhook}}\n\
                 cgroupDriver: cgroupfs\n\
                 failSwapOn: false\n\
                 failCgroupV1: false\n\
                 containerRuntimeEndpoint: unix://{socket}\n\
                 imageServiceEndpoint: unix://{socket}\n\
                 podLogsDir: {logs}\n\
                 resolvConf: /etc/resolv.conf\n\
                 imageGCHighThresholdPercent: 100\n\
                 imageGCLowThresholdPercent: 99\n\
                 evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}\n\
                 maxPods: 50\n\
                 serializeImagePulls: false\n",
                ca = pki.path("ca.crt").display(),
                socket = socket.display(),
                logs = p("pods"),
            ),
        )?;
        self.spawn(
            "kubelet",
            &self.bin.join("kubelet"),
            &[
                kubeconfig_arg("config", "kubelet.yaml"),
                kubeconfig_arg("kubeconfig", "node.kubeconfig"),
                kubeconfig_arg("root-dir", "kubelet"),
                kubeconfig_arg("cert-dir", "kubelet-certs"),
                format!("--hostname-override={NODE_NAME}"),
                format!("--node-ip={NODE_IP}"),
                "--v=1".into(),
            ],
        )?;
        self.spawn(
            "kube-proxy",
            &self.bin.join("kube-proxy"),
            &[
                kubeconfig_arg("kubeconfig", "proxy.kubeconfig"),
                format!("--hostname-override={NODE_NAME}"),
                "--proxy-mode=iptables".into(),
                format!("--cluster-cidr={POD_SUBNET}"),
                "--conntrack-max-per-core=0".into(),
                "--conntrack-tcp-timeout-established=0".into(),
                "--conntrack-tcp-timeout-close-wait=0".into(),
                "--metrics-bind-address=127.0.0.1:10249".into(),
                "--healthz-bind-address=127.0.0.1:10256".into(),
            ],
        )?;
        self.wait("the node is Ready", || async {
            let node = Api::<Node>::all(self.admin().await?)
                .get_opt(NODE_NAME)
                .await?;
            Ok(node
                .and_then(|n| n.status?.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .await?;
        self.wait("the default ServiceAccount exists", || async {
            Ok(
                Api::<ServiceAccount>::namespaced(self.admin().await?, "default")
                    .get_opt("default")
                    .await?
                    .is_some(),
            )
        })
        .await
    }

    fn containerd_socket(&self) -> PathBuf {
        self.root().join("containerd/containerd.sock")
    }

    /// `ctr` against the cluster's containerd, namespace `k8s.io`; its stdout.
    pub fn ctr(&self, args: &[&str]) -> Result<String> {
        let output = run(Command::new("ctr")
            .arg("--address")
            .arg(self.containerd_socket())
            .args(["--namespace", "k8s.io"])
            .args(args))?;
        Ok(String::from_utf8(output.stdout)?)
    }

    /// A client with the admin token.
    pub async fn admin(&self) -> Result<Client> {
        client(&self.admin_kubeconfig).await
    }

    /// `kubectl` with the admin kubeconfig.
    pub fn kubectl(&self, args: &[&str]) -> Result<Output> {
        control_plane::kubectl(&self.bin, &self.admin_kubeconfig, args)
    }

    /// `kubectl` that must succeed; returns its stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String> {
        control_plane::kubectl_ok(&self.bin, &self.admin_kubeconfig, args)
    }

    /// `helm` with the admin kubeconfig and a scratch home, in the workspace root.
    pub fn helm(&self, args: &[&str]) -> Result<String> {
        let home = self.root().join("helm");
        let output = Command::new(crate::helm::helm_binary()?)
            .current_dir(workspace_path(""))
            .arg("--kubeconfig")
            .arg(&self.admin_kubeconfig)
            .args(args)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            .stdin(Stdio::null())
            .output()?;
        ensure!(
            output.status.success(),
            "helm {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8(output.stdout)?)
    }

    /// Makes the host's `127.0.0.1:port` reachable from the pods; returns the address they use
    /// (on the node).
    pub fn expose(&self, port: u16) -> Result<SocketAddr> {
        let forward = Forward::out_of_netns(
            self.netns()?,
            format!("{NODE_IP}:0").parse()?,
            SocketAddr::from(([127, 0, 0, 1], port)),
        )?;
        let address = forward.listen;
        self.forwards
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .push(forward);
        Ok(address)
    }

    /// The last lines of a daemon's log.
    pub fn log_tail(&self, name: &str) -> String {
        log_tail(&self.root().join(format!("{name}.log")), 40)
    }

    /// Stops everything (gently first) and restores the host.
    pub fn stop(&mut self) -> Result<()> {
        if let Ok(mut forwards) = self.forwards.lock() {
            forwards.clear();
        }
        if let Ok(mut children) = self.children.lock() {
            // The restore below signals them in order; here only the first SIGTERM for the
            // daemons whose order does not matter, then reaping.
            for (name, child) in children.iter_mut() {
                if matches!(*name, "kube-proxy" | "kubelet" | "kube-scheduler") {
                    stop_child(child, Signal::SIGTERM, Duration::from_secs(10));
                }
            }
        }
        let restored = self.record.restore();
        if let Ok(mut children) = self.children.lock() {
            for (_, child) in children.iter_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
            children.clear();
        }
        // Already deleted by the restore: this only forgets it.
        self.netns = None;
        restored
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Err(err) = self.stop() {
            eprintln!("restoring the host after the cluster failed: {err:#}");
        }
    }
}

/// Held shared by the users of [`env::SharedEnv`] and exclusively by a test that needs the
/// machine without a shared cluster ([`exclusive`]).
static SLOT: std::sync::LazyLock<Arc<RwLock<()>>> =
    std::sync::LazyLock::new(|| Arc::new(RwLock::new(())));

/// Waits until no shared cluster runs in this process and keeps new ones from starting while
/// the guard lives.
pub async fn exclusive() -> tokio::sync::OwnedRwLockWriteGuard<()> {
    Arc::clone(&SLOT).write_owned().await
}
