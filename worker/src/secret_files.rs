//! Restarting onto rotated Secrets. In Kubernetes the operator mounts every Secret key the worker
//! reads from its environment under one directory, as `<secret>/<environment variable>`; kubelet
//! refreshes those files when a Secret changes, while the environment keeps the values the
//! container started with. Every [`POLL_INTERVAL`] the worker compares each file with the
//! variable it names; once one differs it stops as on SIGTERM (the batch in hand is stored and
//! acknowledged, or left un-acknowledged) and exits 0, so that kubelet starts the container
//! again with the new values. A file that is missing or empty (a Secret kubelet has not projected
//! yet, or one deleted) is no change. Values are compared, never kept or logged.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio_util::sync::CancellationToken;

/// How often the mounted files are compared with the environment.
pub const POLL_INTERVAL: Duration = Duration::from_secs(10);

/// Where the Secrets of this worker's environment are mounted.
#[derive(Debug)]
pub struct SecretFiles {
    dir: PathBuf,
}

impl SecretFiles {
    pub fn new(dir: PathBuf) -> Self {
        tracing::info!(dir = %dir.display(), "restarting when a mounted Secret differs from the environment");
        Self { dir }
    }

    /// Compares the files with the environment every [`POLL_INTERVAL`] until a Secret changed
    /// (then counts it in `restarts` and cancels `cancel`) or `cancel` fires.
    pub fn stop_on_change(self, cancel: CancellationToken, restarts: Counter) {
        crate::task::spawn(async move {
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(POLL_INTERVAL) => {}
                }
                let changed = changed_secrets(&self.dir, |name| std::env::var_os(name));
                if changed.is_empty() {
                    continue;
                }
                for secret in &changed {
                    tracing::info!(secret = %secret, "mounted Secret changed; finishing the batch in hand and exiting to restart onto its new value");
                }
                restarts.inc();
                cancel.cancel();
                return;
            }
        });
    }
}

/// The visible entries of `dir`, sorted (kubelet's own start with `..`).
fn entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut entries: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            (!name.starts_with("..")).then(|| (name, entry.path()))
        })
        .collect();
    entries.sort();
    entries
}

/// The Secrets under `dir` with a file (named for a variable) whose content differs from that
/// variable in `env`.
fn changed_secrets(dir: &Path, env: impl Fn(&str) -> Option<OsString>) -> Vec<String> {
    entries(dir)
        .into_iter()
        .filter(|(_, path)| path.is_dir())
        .filter(|(_, path)| {
            entries(path).into_iter().any(|(variable, file)| {
                let mounted = std::fs::read(&file).unwrap_or_default();
                let started_with = env(&variable).unwrap_or_default();
                !mounted.is_empty() && mounted != started_with.as_bytes()
            })
        })
        .map(|(secret, _)| secret)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn write(dir: &Path, secret: &str, variable: &str, value: &str) {
        std::fs::create_dir_all(dir.join(secret)).expect("mkdir");
        std::fs::write(dir.join(secret).join(variable), value).expect("write");
    }

    #[test]
    fn a_secret_whose_file_differs_from_the_environment_is_named_and_missing_files_are_no_change() {
        let dir =
            std::env::temp_dir().join(format!("switchboard-secret-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let env = BTreeMap::from([("REDIS_URL", "redis://a"), ("DATABASE_URL", "postgres://a")]);
        let lookup = |name: &str| env.get(name).map(OsString::from);
        write(&dir, "redis", "REDIS_URL", "redis://a");
        write(&dir, "db", "DATABASE_URL", "postgres://a");
        write(&dir, "..2026_12_04", "REDIS_URL", "ignored");
        assert!(changed_secrets(&dir, lookup).is_empty());

        // Not projected yet (or deleted): an empty or missing file is no change.
        write(&dir, "db", "DATABASE_URL", "");
        assert!(changed_secrets(&dir, lookup).is_empty());

        write(&dir, "redis", "REDIS_URL", "redis://b");
        assert_eq!(changed_secrets(&dir, lookup), ["redis"]);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn a_missing_directory_has_no_changes() {
        let none = |_: &str| None;
        assert!(changed_secrets(Path::new("/nonexistent/switchboard-secrets"), none).is_empty());
    }
}
