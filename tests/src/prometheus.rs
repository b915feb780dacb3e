//! Prometheus and promtool (`scripts/prometheus.sh` builds them once from the Go module proxy,
//! cached, or takes `PROMETHEUS_BIN_DIR`), and a real Prometheus server as a child process on a
//! random loopback port, scraping given targets every second.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use nix::sys::signal::Signal;
use serde_json::Value;
use tempfile::TempDir;

use crate::control_plane::log_tail;
use crate::servers::{free_port, http_get, stop_child, workspace_path};
use crate::wait::wait_until;

/// The directory holding `prometheus` and `promtool`.
pub fn bin_dir() -> Result<PathBuf> {
    let script = workspace_path("scripts/prometheus.sh");
    let output = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !output.status.success() || !dir.join("promtool").is_file() {
        bail!(
            "prometheus and promtool are missing and could not be built; run \
             `scripts/prometheus.sh` (or `make prometheus`; needs Go, see docs/kubernetes.md) or \
             set PROMETHEUS_BIN_DIR=/path/to/a/dir/with/both.\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(dir)
}

/// Runs `promtool args…` in `dir`.
pub fn promtool(dir: &Path, args: &[&str]) -> Result<Output> {
    Ok(Command::new(bin_dir()?.join("promtool"))
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .output()?)
}

/// A Prometheus server of our own (TSDB in a temporary directory).
#[derive(Debug)]
pub struct Prometheus {
    dir: TempDir,
    port: u16,
    child: Child,
}

impl Prometheus {
    /// Starts a server scraping `targets` (`127.0.0.1:<port>`) as job `job` every second.
    pub fn start(job: &str, targets: &[u16]) -> Result<Self> {
        let binary = bin_dir()?.join("prometheus");
        let dir = tempfile::Builder::new()
            .prefix("switchboard-prometheus-")
            .tempdir()?;
        let targets: Vec<String> = targets.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let config = serde_json::json!({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
        });
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config.to_string())?;
        let port = free_port()?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting prometheus")?;
        let prometheus = Self { dir, port, child };
        wait_until(Duration::from_secs(60), "prometheus is ready", || {
            matches!(http_get(port, "/-/ready"), Ok((200, _)))
        })
        .with_context(|| prometheus.log_tail())?;
        Ok(prometheus)
    }

    /// `GET /api/v1/<path>` with `query` (name, value) parameters: the answer's `data`.
    pub fn api(&self, path: &str, query: &[(&str, &str)]) -> Result<Value> {
        let query: Vec<String> = query
            .iter()
            .map(|(name, value)| format!("{name}={}", url_encode(value)))
            .collect();
        let (status, body) = http_get(self.port, &format!("/api/v1/{path}?{}", query.join("&")))?;
        let answer: Value = serde_json::from_str(&body)
            .with_context(|| format!("prometheus answered {status}: {body}"))?;
        ensure!(
            status == 200 && answer["status"] == "success",
            "prometheus answered {status}: {body}"
        );
        Ok(answer["data"].clone())
    }

    /// The samples of the instant query `promql` (evaluated now).
    pub fn query(&self, promql: &str) -> Result<Vec<Value>> {
        let data = self.api("query", &[("query", promql)])?;
        data["result"]
            .as_array()
            .cloned()
            .with_context(|| format!("no result vector in {data}"))
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        log_tail(&self.dir.path().join("prometheus.log"), 30)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        stop_child(&mut self.child, Signal::SIGTERM, Duration::from_secs(10));
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn url_encode(value: &str) -> String {
    value
        .bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}
