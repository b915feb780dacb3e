//! The host state a real cluster touches, recorded before it starts and restored after it stops —
//! also after its owner died: the record is kept in a state file until the restore is done, and
//! the next cluster start (or [`cleanup_leftovers`]) restores from it first.
//!
//! What the kubelet, containerd, runc, the CNI plugins, kube-proxy and `ip netns` change outside
//! the cluster's own folder: the sysctls below; `/var/log/containers` links;
//! `/var/lib/kubelet/device-plugins`; containerd's shim sockets in `/run/containerd/s`; libcni's
//! cache in `/var/lib/cni`; the cgroups `/kubepods` and `/k8s.io` of every v1 hierarchy; the mounts
//! below the cluster's folder and `/run/netns`. iptables rules, links and addresses only ever
//! exist in the cluster's network namespace, which is deleted; [`HostSnapshot`] records the
//! host's to prove it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::servers::processes;
use crate::wait::wait_until;

/// The kernel settings the kubelet sets (`setupKernelTunables`), restored to their old values.
pub const SYSCTLS: [&str; 6] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Host folders a cluster writes into: whatever appears in them is removed again (the folder
/// itself when it did not exist).
pub const WATCHED_PATHS: [&str; 8] = [
    "/var/log/containers",
    "/var/log/pods",
    "/var/lib/kubelet",
    "/run/containerd",
    "/var/lib/cni",
    "/etc/cni",
    "/var/lib/containers",
    "/run/netns",
];

/// The cgroups of the pods (kubelet, cgroupfs driver) and of containerd's namespace.
pub const CGROUPS: [&str; 2] = ["kubepods", "k8s.io"];

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// What a cluster could change on the host, as comparable text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostSnapshot {
    pub sysctls: BTreeMap<String, String>,
    /// `ip -o addr` of the host's network namespace (lifetimes stripped).
    pub addresses: Vec<String>,
    /// `ip -o link` of the host's network namespace.
    pub links: Vec<String>,
    /// `iptables-save` and `ip6tables-save` of the host's network namespace, without counters.
    pub iptables: Vec<String>,
    pub mounts: BTreeSet<String>,
    /// Top-level cgroups of every hierarchy (`<hierarchy>/<name>`).
    pub cgroups: BTreeSet<String>,
    /// Every file below each of [`WATCHED_PATHS`]; a missing folder has no entry.
    pub paths: BTreeMap<String, BTreeSet<String>>,
}

fn lines(program: &str, args: &[&str]) -> Result<Vec<String>> {
    let output = super::run(Command::new(program).args(args))?;
    Ok(String::from_utf8(output.stdout)?
        .lines()
        .map(str::to_owned)
        .collect())
}

/// Every file and folder below `dir` (relative paths), or `None` when `dir` does not exist.
fn tree(dir: &Path) -> Option<BTreeSet<String>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if let Ok(relative) = path.strip_prefix(root) {
                out.insert(relative.display().to_string());
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                walk(root, &path, out);
            }
        }
    }
    dir.is_dir().then(|| {
        let mut out = BTreeSet::new();
        walk(dir, dir, &mut out);
        out
    })
}

/// Mount points (`/proc/self/mountinfo`, field 5).
fn mount_points() -> Result<BTreeSet<String>> {
    Ok(std::fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .filter_map(|line| line.split(' ').nth(4).map(str::to_owned))
        .collect())
}

fn hierarchies() -> Vec<PathBuf> {
    std::fs::read_dir(CGROUP_ROOT)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.join("cgroup.procs").is_file())
        .collect()
}

impl HostSnapshot {
    pub fn take() -> Result<Self> {
        let sysctls = SYSCTLS
            .iter()
            .map(|name| {
                let value = std::fs::read_to_string(Path::new("/proc/sys").join(name))
                    .with_context(|| format!("reading sysctl {name}"))?;
                Ok(((*name).to_owned(), value.trim().to_owned()))
            })
            .collect::<Result<_>>()?;
        let addresses = lines("ip", &["-o", "addr"])?
            .into_iter()
            .map(|line| match line.find("valid_lft") {
                Some(at) => line[..at].trim_end().to_owned(),
                None => line,
            })
            .collect();
        let mut iptables = Vec::new();
        for program in ["iptables-save", "ip6tables-save"] {
            iptables.extend(
                lines(program, &[])?
                    .into_iter()
                    .filter(|line| !line.starts_with('#'))
                    .map(|line| match line.rsplit_once(" [") {
                        Some((chain, _counters)) if line.starts_with(':') => chain.to_owned(),
                        _ => line,
                    }),
            );
        }
        let cgroups = hierarchies()
            .iter()
            .flat_map(|hierarchy| {
                std::fs::read_dir(hierarchy)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|entry| entry.path().display().to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        Ok(Self {
            sysctls,
            addresses,
            links: lines("ip", &["-o", "link"])?,
            iptables,
            mounts: mount_points()?,
            cgroups,
            paths: WATCHED_PATHS
                .iter()
                .filter_map(|path| Some(((*path).to_owned(), tree(Path::new(path))?)))
                .collect(),
        })
    }

    /// Addresses outside 127.0.0.0/8 and ::1 that `self` has and `before` had not.
    pub fn new_addresses(&self, before: &Self) -> Vec<String> {
        self.addresses
            .iter()
            .filter(|line| !before.addresses.contains(line))
            .filter(|line| !line.contains(" inet 127.") && !line.contains(" inet6 ::1/"))
            .cloned()
            .collect()
    }

    /// One line per difference from `before`, empty when equal.
    pub fn differences(&self, before: &Self) -> Vec<String> {
        fn diff<T: Ord + std::fmt::Debug + Clone>(
            what: &str,
            before: impl IntoIterator<Item = T>,
            after: impl IntoIterator<Item = T>,
            out: &mut Vec<String>,
        ) {
            let (before, after): (BTreeSet<T>, BTreeSet<T>) =
                (before.into_iter().collect(), after.into_iter().collect());
            out.extend(
                after
                    .difference(&before)
                    .map(|x| format!("{what}: new {x:?}")),
            );
            out.extend(
                before
                    .difference(&after)
                    .map(|x| format!("{what}: gone {x:?}")),
            );
        }
        let mut out = Vec::new();
        diff("sysctl", &before.sysctls, &self.sysctls, &mut out);
        diff("address", &before.addresses, &self.addresses, &mut out);
        diff("link", &before.links, &self.links, &mut out);
        diff("iptables", &before.iptables, &self.iptables, &mut out);
        diff("mount", &before.mounts, &self.mounts, &mut out);
        diff("cgroup", &before.cgroups, &self.cgroups, &mut out);
        for path in WATCHED_PATHS {
            match (before.paths.get(path), self.paths.get(path)) {
                (None, Some(_)) => out.push(format!("{path}: created")),
                (Some(_), None) => out.push(format!("{path}: removed")),
                (Some(old), Some(new)) => diff(path, old, new, &mut out),
                (None, None) => {}
            }
        }
        out
    }
}

/// What a running cluster owns, written before anything is started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// The cluster's folder: every process of the cluster has it on its command line.
    pub root: PathBuf,
    /// The network namespace (`/run/netns/<name>`).
    pub netns: String,
    pub before: HostSnapshot,
}

/// `${SWITCHBOARD_CACHE:-~/.cache/switchboard}/cluster-state`.
pub fn state_dir() -> Result<PathBuf> {
    let cache = match std::env::var_os("SWITCHBOARD_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?)
            .join(".cache/switchboard"),
    };
    let dir = cache.join("cluster-state");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn record_file() -> Result<PathBuf> {
    Ok(state_dir()?.join("cluster.json"))
}

/// The machine-wide lock: one real cluster at a time (they share the host's cgroups and
/// `/var/log/containers`). Held as long as the returned value lives.
pub fn lock(timeout: Duration) -> Result<Flock<File>> {
    let path = state_dir()?.join("lock");
    let deadline = Instant::now() + timeout;
    let mut file = File::create(&path)?;
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((returned, nix::errno::Errno::EWOULDBLOCK)) => {
                ensure!(
                    Instant::now() < deadline,
                    "another real cluster held {} for {timeout:?}",
                    path.display()
                );
                file = returned;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err((_, err)) => return Err(err).context(format!("locking {}", path.display())),
        }
    }
}

impl Record {
    /// Writes the record (before anything of the cluster exists).
    pub fn save(&self) -> Result<()> {
        let path = record_file()?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// Stops every process of the cluster and restores the host; then forgets the record.
    pub fn restore(&self) -> Result<()> {
        stop_processes(&self.root);
        remove_cgroups()?;
        unmount_below(&self.root)?;
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.netns])
            .output();
        self.restore_paths()?;
        for (name, value) in &self.before.sysctls {
            std::fs::write(Path::new("/proc/sys").join(name), value)
                .with_context(|| format!("restoring sysctl {name}"))?;
        }
        if self.root.exists() {
            std::fs::remove_dir_all(&self.root)
                .with_context(|| format!("removing {}", self.root.display()))?;
        }
        let path = record_file()?;
        if path.exists() {
            std::fs::remove_file(path)?;
        }
        Ok(())
    }

    /// Removes what appeared in [`WATCHED_PATHS`] (unmounting it first).
    fn restore_paths(&self) -> Result<()> {
        for path in WATCHED_PATHS {
            let dir = Path::new(path);
            let Some(now) = tree(dir) else { continue };
            match self.before.paths.get(path) {
                None => {
                    unmount_below(dir)?;
                    remove(dir)?;
                }
                Some(old) => {
                    // Deepest first, so that folders are empty when their turn comes.
                    let new: Vec<&String> = now.difference(old).collect();
                    for entry in new.into_iter().rev() {
                        let entry = dir.join(entry);
                        unmount_below(&entry)?;
                        remove(&entry)?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn remove(path: &Path) -> Result<()> {
    let result = if path.is_dir() && !path.is_symlink() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match result {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            Err(err).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Restores the host after a cluster whose owner died, if there was one. Call with [`lock`] held.
pub fn cleanup_leftovers() -> Result<()> {
    let path = record_file()?;
    if !path.exists() {
        return Ok(());
    }
    let record: Record = serde_json::from_slice(&std::fs::read(&path)?)
        .with_context(|| format!("reading {}", path.display()))?;
    record
        .restore()
        .with_context(|| format!("cleaning up the cluster of {}", path.display()))
}

/// Processes whose command line mentions `root`: the cluster's daemons and containerd's shims
/// (whose `-address` is the cluster's socket). Zombies have an empty command line.
fn processes_of(root: &Path) -> Vec<(i32, String)> {
    let root = root.display().to_string();
    processes()
        .filter_map(|(pid, dir)| {
            let cmdline = std::fs::read(dir.join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains(&root).then_some((pid, cmdline))
        })
        .filter(|(pid, _)| *pid != std::process::id() as i32)
        .collect()
}

fn signal_all(pids: impl IntoIterator<Item = i32>, signal: Signal) {
    for pid in pids {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

/// Stops the cluster's processes: the node's daemons first (so that nothing restarts
/// containers), then the containers, containerd and its shims, then kube-apiserver, then etcd.
fn stop_processes(root: &Path) {
    let program = |cmdline: &str| {
        let argv0 = cmdline.split(' ').next().unwrap_or_default();
        Path::new(argv0)
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let stages: [&[&str]; 3] = [
        &[
            "kube-proxy",
            "kubelet",
            "kube-scheduler",
            "kube-controller-manager",
        ],
        &["containerd"],
        &["kube-apiserver"],
    ];
    for stage in stages {
        let pids = || -> Vec<i32> {
            processes_of(root)
                .into_iter()
                .filter(|(_, cmdline)| stage.contains(&program(cmdline).as_str()))
                .map(|(pid, _)| pid)
                .collect()
        };
        signal_all(pids(), Signal::SIGTERM);
        if wait_until(STOP_TIMEOUT, "the cluster's daemons exit", || {
            pids().is_empty()
        })
        .is_err()
        {
            signal_all(pids(), Signal::SIGKILL);
        }
        if stage.contains(&"containerd") {
            kill_cgroup_processes();
            // The shims: they exit with their containers, or now.
            let shims = || -> Vec<i32> {
                processes_of(root)
                    .into_iter()
                    .filter(|(_, cmdline)| program(cmdline).starts_with("containerd-shim"))
                    .map(|(pid, _)| pid)
                    .collect()
            };
            signal_all(shims(), Signal::SIGKILL);
            let _ = wait_until(STOP_TIMEOUT, "containerd's shims exit", || {
                shims().is_empty()
            });
        }
    }
    // etcd and anything else left (stopped last: the apiserver hangs when etcd goes first).
    let rest = || -> Vec<i32> { processes_of(root).into_iter().map(|(pid, _)| pid).collect() };
    signal_all(rest(), Signal::SIGTERM);
    if wait_until(STOP_TIMEOUT, "etcd exits", || rest().is_empty()).is_err() {
        signal_all(rest(), Signal::SIGKILL);
        let _ = wait_until(STOP_TIMEOUT, "the cluster's processes die", || {
            rest().is_empty()
        });
    }
}

/// The [`CGROUPS`] folders of every hierarchy that exist.
fn cluster_cgroups() -> Vec<PathBuf> {
    hierarchies()
        .iter()
        .flat_map(|hierarchy| CGROUPS.iter().map(move |name| hierarchy.join(name)))
        .filter(|path| path.is_dir())
        .collect()
}

/// Every cgroup folder below `dir`, deepest first.
fn cgroup_tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(cgroup_tree(&entry.path()));
        }
    }
    out.push(dir.to_path_buf());
    out
}

fn cgroup_pids() -> Vec<i32> {
    cluster_cgroups()
        .iter()
        .flat_map(|dir| cgroup_tree(dir))
        .flat_map(|dir| {
            std::fs::read_to_string(dir.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .filter_map(|pid| pid.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// SIGKILLs every process in the pods' cgroups (the containers: nothing else runs there).
fn kill_cgroup_processes() {
    signal_all(cgroup_pids(), Signal::SIGKILL);
    let _ = wait_until(STOP_TIMEOUT, "the containers' processes die", || {
        cgroup_pids().is_empty()
    });
}

/// Removes the pods' cgroups in every hierarchy.
fn remove_cgroups() -> Result<()> {
    kill_cgroup_processes();
    for dir in cluster_cgroups().iter().flat_map(|dir| cgroup_tree(dir)) {
        // A cgroup is removed with rmdir once it has no process (its files are not real files).
        let mut result = std::fs::remove_dir(&dir);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while result.is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            result = std::fs::remove_dir(&dir);
        }
        result.with_context(|| format!("removing cgroup {}", dir.display()))?;
    }
    Ok(())
}

/// Lazily unmounts every mount at or below `dir`, deepest first.
fn unmount_below(dir: &Path) -> Result<()> {
    let prefix = dir.display().to_string();
    let mut points: Vec<String> = mount_points()?
        .into_iter()
        .filter(|point| {
            point == &prefix
                || point
                    .strip_prefix(&prefix)
                    .is_some_and(|rest| rest.starts_with('/'))
        })
        .collect();
    points.sort_by_key(|point| std::cmp::Reverse(point.len()));
    for point in points {
        let output = Command::new("umount").args(["-l", &point]).output()?;
        ensure!(
            output.status.success() || !mount_points()?.contains(&point),
            "umount {point}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}
