//! Real PostgreSQL and Redis servers as child processes on random loopback ports, in temporary
//! directories, stopped and restartable mid-test, killed on drop.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, Uid, User};
use tempfile::TempDir;

use crate::wait::wait_until;

/// A free TCP port on 127.0.0.1 for a server to listen on, reserved for the rest of this process.
pub fn free_port() -> Result<u16> {
    Ok(free_ports::<1>()?[0])
}

/// `N` distinct free TCP ports on 127.0.0.1 for servers to listen on (and to listen on again after
/// a crash), each reserved for the rest of this process.
///
/// A port the kernel picks for `bind(0)` is only free until someone else binds it: two tests
/// could be handed the same port, and a server's port could be taken by another test's server
/// while it is down for a restart (CI once ran migrations against a RabbitMQ that had taken
/// PostgreSQL's port). So the ports come from below the kernel's ephemeral range, which neither
/// `bind(0)` nor outgoing connections use; each is handed out once per process and held across
/// processes by a lock file that lives until this process exits.
pub fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let mut ports = [0; N];
    for port in &mut ports {
        *port = PORTS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .reserve()?;
    }
    Ok(ports)
}

static PORTS: Mutex<PortReservations> = Mutex::new(PortReservations {
    next: None,
    locks: Vec::new(),
});

/// The ports this process has handed out, as the lock files that reserve them.
struct PortReservations {
    next: Option<u16>,
    locks: Vec<std::fs::File>,
}

/// Servers' ports are taken from `FIRST_PORT` up to the start of the ephemeral range.
const FIRST_PORT: u16 = 10_000;

impl PortReservations {
    fn reserve(&mut self) -> Result<u16> {
        let end = ephemeral_range_start();
        let span = end - FIRST_PORT;
        let start = *self.next.get_or_insert_with(|| {
            // Spread concurrent processes apart so they seldom meet each other's lock files.
            FIRST_PORT + u16::try_from(std::process::id() % u32::from(span)).unwrap_or(0)
        });
        let dir = std::env::temp_dir().join("switchboard-ports");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for step in 0..span {
            let port = FIRST_PORT + (start - FIRST_PORT + step) % span;
            let path = dir.join(format!("{port}.lock"));
            let lock = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            if lock.try_lock().is_err() || TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            self.next = Some(FIRST_PORT + (port - FIRST_PORT + 1) % span);
            self.locks.push(lock);
            return Ok(port);
        }
        bail!("no free port in 127.0.0.1:{FIRST_PORT}..{end} (all bound or reserved)")
    }
}

/// The first port of the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), 32768 if
/// it cannot be read or leaves no room below it.
fn ephemeral_range_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .filter(|&start: &u16| start > FIRST_PORT + 1_000)
        .unwrap_or(32_768)
}

fn signal_child(child: &Child, signal: Signal) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

/// Status code and body of `GET path` on 127.0.0.1:`port` (HTTP/1.0: the server closes the
/// connection after the body).
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    http_exchange(
        port,
        &format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n"),
    )
}

/// Status and body of `POST path` with a JSON `body` on 127.0.0.1:`port` (HTTP/1.0).
pub fn http_post_json(port: u16, path: &str, body: &str) -> Result<(u16, String)> {
    http_exchange(
        port,
        &format!(
            "POST {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
}

/// Status and body of one raw HTTP/1.0 `request` to 127.0.0.1:`port`.
fn http_exchange(port: u16, request: &str) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("malformed HTTP response")?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Sends `signal` and waits for the process to exit, up to `timeout`; then SIGKILL.
pub(crate) fn stop_child(child: &mut Child, signal: Signal, timeout: Duration) {
    signal_child(child, signal);
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Every process as its id and `/proc/<id>` folder.
pub fn processes() -> impl Iterator<Item = (i32, PathBuf)> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| Some((entry.file_name().to_str()?.parse().ok()?, entry.path())))
}

/// Processes whose parent is `parent`, from `/proc`.
pub fn children_of(parent: i32) -> Vec<i32> {
    processes()
        .filter_map(|(pid, dir)| {
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            // Fields after the parenthesised command name: state, ppid, …
            let ppid: i32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == parent).then_some(pid)
        })
        .collect()
}

/// A line `Name: value kB` of `/proc/PID/{file}` (`status`, `smaps_rollup`), in KiB.
pub fn proc_kib(pid: u32, file: &str, name: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
}

/// Where PostgreSQL's server binaries are: `$PG_BIN`, else the newest `/usr/lib/postgresql/*/bin`.
fn postgres_bin_dir() -> Result<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut candidates: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    candidates.sort();
    match candidates.pop() {
        Some((_, bin)) => Ok(bin),
        None => bail!(
            "PostgreSQL server binaries (initdb, postgres) not found under /usr/lib/postgresql; \
             install them with `apt-get install -y postgresql` (or set PG_BIN)"
        ),
    }
}

/// PostgreSQL refuses to run as root: when we are root, run it as the `postgres` user.
fn postgres_user() -> Result<Option<User>> {
    if !Uid::effective().is_root() {
        return Ok(None);
    }
    match User::from_name("postgres")? {
        Some(user) => Ok(Some(user)),
        None => bail!(
            "running as root but there is no `postgres` user to run PostgreSQL as; \
             install the server with `apt-get install -y postgresql`"
        ),
    }
}

/// A PostgreSQL cluster of our own.
#[derive(Debug)]
pub struct Postgres {
    dir: TempDir,
    bin: PathBuf,
    user: Option<User>,
    port: u16,
    settings: Vec<(String, String)>,
    child: Option<Child>,
}

impl Postgres {
    /// Starts a cluster tuned for tests (no fsync: process crashes are what the tests inject).
    pub fn start() -> Result<Self> {
        Self::start_with(&[
            ("fsync", "off"),
            ("synchronous_commit", "off"),
            ("full_page_writes", "off"),
        ])
    }

    /// Starts a cluster with extra `-c name=value` settings.
    pub fn start_with(settings: &[(&str, &str)]) -> Result<Self> {
        let mut pg = Self::init(settings)?;
        pg.start_server()?;
        Ok(pg)
    }

    /// Starts a cluster that also accepts TLS, with a certificate for `localhost` issued by
    /// `ca` (plain connections stay allowed: the test's own pool uses them).
    pub fn start_tls(ca: &crate::brokers::gateway::TestCa) -> Result<Self> {
        let mut pg = Self::init(&[("ssl", "on")])?;
        for (file, pem) in [("server.crt", &ca.cert_pem), ("server.key", &ca.key_pem)] {
            let path = pg.data_dir().join(file);
            std::fs::write(&path, pem)?;
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            if let Some(user) = &pg.user {
                chown(&path, Some(user.uid.as_raw()), Some(user.gid.as_raw()))?;
            }
        }
        pg.start_server()?;
        Ok(pg)
    }

    /// initdb, not started yet.
    fn init(settings: &[(&str, &str)]) -> Result<Self> {
        let bin = postgres_bin_dir()?;
        let user = postgres_user()?;
        let dir = tempfile::Builder::new()
            .prefix("switchboard-pg-")
            .tempdir()?;
        if let Some(user) = &user {
            chown(dir.path(), Some(user.uid.as_raw()), Some(user.gid.as_raw()))?;
        }
        let pg = Self {
            dir,
            bin,
            user,
            port: free_port()?,
            settings: settings
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            child: None,
        };
        let output = pg
            .command("initdb")
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "-D",
            ])
            .arg(pg.data_dir())
            .output()
            .context("running initdb")?;
        if !output.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&output.stderr));
        }
        Ok(pg)
    }

    /// Where the cluster keeps its data.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin.join(program));
        if let Some(user) = &self.user {
            cmd.uid(user.uid.as_raw()).gid(user.gid.as_raw());
        }
        cmd.current_dir(self.dir.path());
        cmd
    }

    fn start_server(&mut self) -> Result<()> {
        let log = std::fs::File::create(self.dir.path().join("postgres.log"))?;
        if let Some(user) = &self.user {
            chown(
                self.dir.path().join("postgres.log"),
                Some(user.uid.as_raw()),
                Some(user.gid.as_raw()),
            )?;
        }
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(self.data_dir())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args([
                "-c",
                &format!("unix_socket_directories={}", self.dir.path().display()),
            ])
            .args(["-c", "max_connections=200"]);
        for (name, value) in &self.settings {
            cmd.args(["-c", &format!("{name}={value}")]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting postgres")?;
        self.child = Some(child);
        let port = self.port;
        wait_until(
            Duration::from_secs(30),
            "PostgreSQL accepts connections",
            || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        )
        .with_context(|| self.log_tail())?;
        // What accepted may be another server on this port if postgres could not bind it.
        if let Some(status) = self
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
        {
            bail!("postgres exited ({status}): {}", self.log_tail());
        }
        Ok(())
    }

    /// `postgres://…` for the `postgres` database.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// `postgres://…` for `database`.
    pub fn url_for(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory the cluster lives in (data, socket and log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's process id, for CPU accounting.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Fast shutdown (SIGINT): clients are disconnected.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGINT, Duration::from_secs(20));
        }
    }

    /// SIGSTOP (`false`) or SIGCONT (`true`) the postmaster: a hung, not a dead, database.
    pub fn set_running(&self, running: bool) -> Result<()> {
        let child = self.child.as_ref().context("postgres is not running")?;
        let signal = if running {
            Signal::SIGCONT
        } else {
            Signal::SIGSTOP
        };
        // Backends are their own session leaders: signal the postmaster, then each child. The
        // postmaster first: once it is stopped it forks no backend that the list would miss.
        let postmaster = i32::try_from(child.id())?;
        kill(Pid::from_raw(postmaster), signal)
            .with_context(|| format!("sending {signal} to the postmaster {postmaster}"))?;
        for pid in children_of(postmaster) {
            match kill(Pid::from_raw(pid), signal) {
                // A backend that ended between the listing and the signal has nothing to stop.
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(err) => return Err(err).with_context(|| format!("sending {signal} to {pid}")),
            }
        }
        Ok(())
    }

    /// Starts the same cluster again on the same port.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.start_server()
    }

    /// The server's log so far (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    fn log_tail(&self) -> String {
        let log = self.log();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        format!(
            "postgres log (last lines, newest first):\n{}",
            tail.join("\n")
        )
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Immediate shutdown: the postmaster takes its backends down with it.
            stop_child(&mut child, Signal::SIGQUIT, Duration::from_secs(10));
        }
    }
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

/// A redis-server of our own, with an append-only file in its own directory.
#[derive(Debug)]
pub struct Redis {
    dir: TempDir,
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Redis {
    pub fn start() -> Result<Self> {
        let Some(bin) = find_on_path("redis-server") else {
            bail!("redis-server not found; install it with `apt-get install -y redis-server`");
        };
        let mut redis = Self {
            dir: tempfile::Builder::new()
                .prefix("switchboard-redis-")
                .tempdir()?,
            bin,
            port: free_port()?,
            child: None,
        };
        redis.start_server()?;
        Ok(redis)
    }

    fn start_server(&mut self) -> Result<()> {
        let log = std::fs::File::create(self.dir.path().join("redis.log"))?;
        let child = Command::new(&self.bin)
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            // The append-only file is written before each reply (fsync left to the kernel), so a
            // SIGKILLed server ([`Redis::crash`]) keeps every write it confirmed.
            .args(["--appendonly", "yes"])
            .args(["--appendfsync", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting redis-server")?;
        self.child = Some(child);
        let url = self.url();
        wait_until(Duration::from_secs(20), "redis-server answers PING", || {
            redis::Client::open(url.as_str())
                .and_then(|client| client.get_connection())
                .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn))
                .is_ok()
        })
    }

    pub fn url(&self) -> String {
        format!("redis://{}/0", self.address())
    }

    /// `127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The directory the server keeps its append-only file and log in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's process id, for CPU accounting.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server and starts an empty one on the same port (its data deleted, as a
    /// server without persistence comes back).
    pub fn restart_empty(&mut self) -> Result<()> {
        self.kill();
        let aof = self.dir.path().join("appendonlydir");
        if aof.exists() {
            std::fs::remove_dir_all(&aof).context("deleting the append-only file")?;
        }
        self.start_server()
    }

    /// SIGKILLs the server, whatever it is doing, and starts it again on the same port and
    /// append-only file: every write it confirmed survives.
    pub fn crash(&mut self) -> Result<()> {
        self.kill();
        self.start_server()
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGKILL, Duration::from_secs(10));
        }
    }

    /// A blocking connection for test setup and assertions.
    pub fn connection(&self) -> Result<redis::Connection> {
        Ok(redis::Client::open(self.url().as_str())?.get_connection()?)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGKILL, Duration::from_secs(10));
        }
    }
}

/// Reads a path relative to the workspace root.
/// Whether the broker JVMs (Kafka, ElasticMQ) run with the full JIT, as production servers do
/// ([`jvm_full_jit`]); otherwise with C1 only, which starts them faster for the tests.
static FULL_JIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the broker JVMs started from now on run with the full JIT (the bench: their CPU per
/// message is measured).
pub fn jvm_full_jit() {
    FULL_JIT.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The JIT arguments of a broker JVM (see [`jvm_full_jit`]).
pub fn jvm_jit_args() -> &'static [&'static str] {
    if FULL_JIT.load(std::sync::atomic::Ordering::Relaxed) {
        &[]
    } else {
        &["-XX:TieredStopAtLevel=1"]
    }
}

pub fn workspace_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative)
}
