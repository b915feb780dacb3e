//! Restarting onto rotated Secrets. In Kubernetes the operator mounts every Secret key the worker
//! reads under one directory, as `<secret>/<key>`; kubelet refreshes those files when a Secret
//! changes, while the environment keeps the values the container started with. The worker
//! fingerprints the files at start and, once a Secret's files differ, stops as on SIGTERM (the
//! batch in hand is stored and acknowledged, or left un-acknowledged) and exits 0: kubelet starts
//! the container again, with the new values in its environment. Values are hashed, never kept
//! or logged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

/// How often the mounted files are compared with their fingerprint at start.
pub const POLL_INTERVAL: Duration = Duration::from_secs(10);

/// A digest of each Secret's mounted files, by Secret name.
type Fingerprint = BTreeMap<String, [u8; 32]>;

/// The mounted Secrets of this run, as they were when it started.
#[derive(Debug)]
pub struct SecretFiles {
    dir: PathBuf,
    at_start: Fingerprint,
}

impl SecretFiles {
    /// Fingerprints the Secrets mounted under `dir` now.
    pub fn at_start(dir: PathBuf) -> Self {
        let at_start = fingerprint(&dir);
        tracing::info!(dir = %dir.display(), secrets = at_start.len(), "restarting when a mounted Secret changes");
        Self { dir, at_start }
    }

    /// Compares the files with their fingerprint every [`POLL_INTERVAL`] until one Secret
    /// changed (then counts it in `restarts` and cancels `cancel`) or `cancel` fires.
    pub fn stop_on_change(self, cancel: CancellationToken, restarts: Counter) {
        crate::task::spawn(async move {
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(POLL_INTERVAL) => {}
                }
                let changed = changed_secrets(&self.at_start, &fingerprint(&self.dir));
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

/// The Secrets whose files differ between `before` and `now` (added or gone included).
fn changed_secrets(before: &Fingerprint, now: &Fingerprint) -> Vec<String> {
    let mut names: Vec<&String> = before.keys().chain(now.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|name| before.get(*name) != now.get(*name))
        .cloned()
        .collect()
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

/// Each Secret directory under `dir` with a digest of its files' names and contents. An
/// unreadable file counts as empty: its change is noticed when it can be read again.
fn fingerprint(dir: &Path) -> Fingerprint {
    entries(dir)
        .into_iter()
        .filter(|(_, path)| path.is_dir())
        .map(|(secret, path)| {
            let mut hasher = Sha256::new();
            for (key, file) in entries(&path) {
                let value = std::fs::read(&file).unwrap_or_default();
                for part in [key.as_bytes(), &value] {
                    hasher.update((part.len() as u64).to_be_bytes());
                    hasher.update(part);
                }
            }
            (secret, hasher.finalize().into())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, secret: &str, key: &str, value: &str) {
        std::fs::create_dir_all(dir.join(secret)).expect("mkdir");
        std::fs::write(dir.join(secret).join(key), value).expect("write");
    }

    #[test]
    fn a_changed_added_or_removed_secret_is_named_and_kubelet_entries_are_ignored() {
        let dir =
            std::env::temp_dir().join(format!("switchboard-secret-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write(dir.as_path(), "redis", "url", "redis://a");
        write(dir.as_path(), "db", "url", "postgres://a");
        std::fs::create_dir(dir.as_path().join("..2026_12_04")).expect("mkdir");
        let before = fingerprint(dir.as_path());
        assert_eq!(before.len(), 2);
        assert!(changed_secrets(&before, &fingerprint(dir.as_path())).is_empty());

        write(dir.as_path(), "redis", "url", "redis://b");
        write(dir.as_path(), "..2026_12_04", "url", "ignored");
        assert_eq!(
            changed_secrets(&before, &fingerprint(dir.as_path())),
            ["redis"]
        );

        std::fs::remove_dir_all(dir.as_path().join("db")).expect("rm");
        write(dir.as_path(), "amqp", "uri", "amqp://a");
        assert_eq!(
            changed_secrets(&before, &fingerprint(dir.as_path())),
            ["amqp", "db", "redis"]
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn a_missing_directory_has_no_secrets() {
        assert!(fingerprint(Path::new("/nonexistent/switchboard-secrets")).is_empty());
    }
}
