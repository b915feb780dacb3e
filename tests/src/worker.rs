//! The real `switchboard-worker` binary as a child process.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::servers::{free_port, http_get};

/// What the worker says at start when the broker keeps messages longer than the dedup window.
pub const RETENTION_WARNING: &str = "longer than the dedup window";

/// The worker binary: [`workspace_binary`]`("switchboard-worker")`.
pub fn worker_binary() -> Result<PathBuf> {
    workspace_binary("switchboard-worker")
}

/// A binary of this workspace in the target directory this executable was built into
/// (`target/<profile>/` or its `deps/` folder), checked to be newer than every source it is
/// built from: `cargo test` does not rebuild other packages' binaries, and a test must not pass
/// or fail on yesterday's code.
/// `$SWITCHBOARD_WORKER_BIN`, when set, is taken as the worker binary as it is.
pub fn workspace_binary(name: &str) -> Result<PathBuf> {
    if name == "switchboard-worker"
        && let Some(path) = std::env::var_os("SWITCHBOARD_WORKER_BIN")
    {
        return Ok(PathBuf::from(path));
    }
    let own_crate = match name {
        "switchboard-worker" => "worker/src",
        "switchboard-operator" => "operator/src",
        other => bail!("{other} is not a binary of this workspace"),
    };
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    let candidates = [Some(dir), dir.parent()];
    let binary = candidates
        .into_iter()
        .flatten()
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .with_context(|| {
            format!(
                "{name} is not built next to {}: build it first with `cargo build --workspace --bins` (make test does)",
                exe.display()
            )
        })?;
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the tests crate lives in the workspace")?;
    let mut latest = None;
    for dir in [
        "api/src",
        "store/src",
        "telemetry/src",
        "migrations",
        own_crate,
    ] {
        newest_file(&workspace.join(dir), &mut latest)?;
    }
    if let Some((modified, path)) = latest
        && modified > binary.metadata()?.modified()?
    {
        bail!(
            "{} is older than {}: rebuild it with `cargo build --workspace --bins` (make test does)",
            binary.display(),
            path.display()
        );
    }
    Ok(binary)
}

/// Updates `found` with the most recently modified source (`.rs`, `.sql`) below `dir`; other
/// files (an editor's swap file) do not make cargo relink, so they must not count.
fn newest_file(dir: &Path, found: &mut Option<(SystemTime, PathBuf)>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            newest_file(&path, found)?;
        } else if path
            .extension()
            .is_some_and(|extension| extension == "rs" || extension == "sql")
        {
            let modified = entry.metadata()?.modified()?;
            if found.as_ref().is_none_or(|(time, _)| modified > *time) {
                *found = Some((modified, path));
            }
        }
    }
    Ok(())
}

/// Connection settings every worker process gets.
#[derive(Debug, Clone)]
pub struct WorkerEnv {
    pub database_url: String,
    pub redis_url: String,
    pub log_dir: PathBuf,
}

/// A running worker process.
#[derive(Debug)]
pub struct WorkerProcess {
    child: Child,
    pub consumer: String,
    pub metrics_port: u16,
    log: PathBuf,
}

/// Runs `switchboard-worker migrate`.
pub fn migrate(env: &WorkerEnv) -> Result<std::process::Output> {
    Ok(Command::new(worker_binary()?)
        .arg("migrate")
        .env("DATABASE_URL", &env.database_url)
        .output()?)
}

impl WorkerProcess {
    /// Starts `switchboard-worker run --file manifest --consumer consumer`.
    pub fn start(
        env: &WorkerEnv,
        manifest: &Path,
        consumer: &str,
        extra_env: &[(&str, &str)],
    ) -> Result<Self> {
        Self::start_binary(&worker_binary()?, env, manifest, consumer, extra_env)
    }

    /// [`WorkerProcess::start`] with a given worker binary (e.g. a release build).
    pub fn start_binary(
        binary: &Path,
        env: &WorkerEnv,
        manifest: &Path,
        consumer: &str,
        extra_env: &[(&str, &str)],
    ) -> Result<Self> {
        let metrics_port = free_port()?;
        let log = env
            .log_dir
            .join(format!("worker-{consumer}-{metrics_port}.log"));
        let file = std::fs::File::create(&log)?;
        let mut cmd = Command::new(binary);
        cmd.arg("run")
            .arg("--file")
            .arg(manifest)
            .args(["--consumer", consumer])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--shutdown-timeout", "10s"])
            .env("DATABASE_URL", &env.database_url)
            .env("REDIS_URL", &env.redis_url)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        for (name, value) in extra_env {
            cmd.env(name, value);
        }
        let child = cmd.spawn().context("starting switchboard-worker")?;
        Ok(Self {
            child,
            consumer: consumer.to_owned(),
            metrics_port,
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, signal: Signal) -> Result<()> {
        kill(Pid::from_raw(i32::try_from(self.child.id())?), signal)?;
        Ok(())
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// The exit status, if the process has exited.
    pub fn try_exit(&mut self) -> Result<Option<ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Waits for the process to exit, up to `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!(
                    "worker did not exit within {timeout:?}\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits up to `within` for `/readyz` to answer 200; the error carries the log's tail.
    pub async fn wait_ready(&self, within: Duration) -> Result<()> {
        crate::wait::wait_for(within, "the worker is ready", || async {
            Ok(self.http_get("/readyz")?.0 == 200)
        })
        .await
        .with_context(|| self.log_tail())
    }

    /// Status code and body of `GET path` on the worker's metrics server.
    pub fn http_get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.metrics_port, path)
    }

    /// The value of a metric sample line starting with `prefix` (e.g. `name{labels}`).
    pub fn metric(&self, prefix: &str) -> Result<f64> {
        let (_, body) = self.http_get("/metrics")?;
        body.lines()
            .find(|line| line.starts_with(prefix))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse().ok())
            .with_context(|| format!("metric {prefix} not found"))
    }

    /// The worker's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Issue 30: the worker's warning at start that the broker keeps messages for `retention`
    /// (as `setting` says), longer than the dedup window of one day.
    pub fn assert_retention_warned(&self, retention: &str, setting: &str) -> Result<()> {
        let log = self.log();
        let warning = log
            .lines()
            .find(|line| line.contains(RETENTION_WARNING))
            .with_context(|| format!("no warning about the retention:\n{}", self.log_tail()))?;
        anyhow::ensure!(
            warning.contains("WARN")
                && warning.contains(&format!("retention={retention} "))
                && warning.contains(setting)
                && warning.contains("dedup_window=1d")
                && warning.contains("spec.delivery.dedupWindowDays"),
            "the warning names the retention, its setting, the window and what to raise: {warning}"
        );
        Ok(())
    }

    pub fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let start = lines.len().saturating_sub(30);
        format!(
            "worker {} log tail:\n{}",
            self.consumer,
            lines[start..].join("\n")
        )
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether the process behind `status` was ended by `signal`.
pub fn killed_by(status: ExitStatus, signal: Signal) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(signal as i32)
}
