//! A kubelet stand-in: runs the first container of a Deployment's pod template as a local process,
//! the way a kubelet would start it — ConfigMap, Secret and projected Secret volumes (all keys,
//! or their `items`) written to a folder and the container's mount paths in its arguments and
//! `env` values pointed there, `env` resolved from literal values, Secrets, ConfigMaps and the
//! downward API, and nothing else from the test's environment.
//!
//! Two deliberate differences, because the process shares the host's network and file system:
//! the metrics port is remapped to a free loopback port (`--metrics-addr`), and the container's
//! `command` is looked up among the workspace's binaries instead of the image.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, EnvVar, KeyToPath, PodSpec, Probe, Secret, Volume,
};
use kube::{Api, Client};
use tempfile::TempDir;

use super::{http_get, log_tail, pod_template, spawn_logged};
use crate::servers::free_port;
use crate::worker::workspace_binary;

/// The pod's one container, running.
#[derive(Debug)]
pub struct LocalPod {
    child: Child,
    _volumes: TempDir,
    pub container: Container,
    pub metrics_addr: SocketAddr,
    /// What the container's environment was resolved to (names only are safe to print).
    pub env: BTreeMap<String, String>,
    pub args: Vec<String>,
    log: PathBuf,
}

async fn secret_data(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<BTreeMap<String, Vec<u8>>> {
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("Secret {namespace}/{name}"))?;
    Ok(secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(key, value)| (key, value.0))
        .collect())
}

async fn secret_value(client: &Client, namespace: &str, name: &str, key: &str) -> Result<String> {
    let value = secret_data(client, namespace, name)
        .await?
        .remove(key)
        .with_context(|| format!("Secret {namespace}/{name} has no key {key}"))?;
    Ok(String::from_utf8(value)?)
}

async fn config_map(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<BTreeMap<String, String>> {
    let map = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("ConfigMap {namespace}/{name}"))?;
    Ok(map.data.unwrap_or_default())
}

async fn resolve_env(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    var: &EnvVar,
) -> Result<String> {
    if let Some(value) = &var.value {
        return Ok(value.clone());
    }
    let source = var
        .value_from
        .as_ref()
        .with_context(|| format!("env {} has neither value nor valueFrom", var.name))?;
    if let Some(secret) = &source.secret_key_ref {
        return secret_value(client, namespace, &secret.name, &secret.key).await;
    }
    if let Some(map_ref) = &source.config_map_key_ref {
        return config_map(client, namespace, &map_ref.name)
            .await?
            .remove(&map_ref.key)
            .with_context(|| format!("ConfigMap {} has no key {}", map_ref.name, map_ref.key));
    }
    match source.field_ref.as_ref().map(|f| f.field_path.as_str()) {
        Some("metadata.name") => Ok(pod_name.to_owned()),
        Some("metadata.namespace") => Ok(namespace.to_owned()),
        other => bail!("env {}: unsupported valueFrom {other:?}", var.name),
    }
}

/// `data`'s files as `items` name them (all keys without `items`); a key `items` names that
/// `data` lacks is an error unless `optional`.
fn pick_files(
    volume: &str,
    data: BTreeMap<String, Vec<u8>>,
    items: Option<&Vec<KeyToPath>>,
    optional: bool,
) -> Result<Vec<(String, Vec<u8>)>> {
    let Some(items) = items else {
        return Ok(data.into_iter().collect());
    };
    let mut files = Vec::new();
    for item in items {
        match data.get(&item.key) {
            Some(value) => files.push((item.path.clone(), value.clone())),
            None if optional => {}
            None => bail!("volume {volume}: no key {}", item.key),
        }
    }
    Ok(files)
}

/// The files of a ConfigMap, Secret or projected (Secrets only) volume, by path.
async fn volume_files(
    client: &Client,
    namespace: &str,
    volume: &Volume,
) -> Result<Vec<(String, Vec<u8>)>> {
    let name = &volume.name;
    if let Some(source) = &volume.config_map {
        let data = config_map(client, namespace, &source.name).await?;
        let data = data.into_iter().map(|(k, v)| (k, v.into_bytes())).collect();
        return pick_files(name, data, source.items.as_ref(), false);
    }
    if let Some(source) = &volume.secret {
        let secret = source
            .secret_name
            .as_deref()
            .context("a Secret volume without name")?;
        let data = secret_data(client, namespace, secret).await?;
        return pick_files(name, data, source.items.as_ref(), false);
    }
    let Some(projected) = &volume.projected else {
        bail!("volume {name}: only ConfigMap, Secret and projected Secret volumes are supported");
    };
    let mut files = Vec::new();
    for source in projected.sources.iter().flatten() {
        let secret = source.secret.as_ref().with_context(|| {
            format!("volume {name}: only Secrets are supported in a projection")
        })?;
        let optional = secret.optional == Some(true);
        let data = match secret_data(client, namespace, &secret.name).await {
            Ok(data) => data,
            Err(_) if optional => continue,
            Err(err) => return Err(err),
        };
        files.extend(pick_files(name, data, secret.items.as_ref(), optional)?);
    }
    Ok(files)
}

/// Writes each volume the container mounts to a folder; returns mount path → local folder.
async fn mount_volumes(
    client: &Client,
    namespace: &str,
    pod: &PodSpec,
    container: &Container,
    root: &Path,
) -> Result<Vec<(String, PathBuf)>> {
    let mut mounts = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .with_context(|| format!("volume {} is not defined", mount.name))?;
        let local = root.join(&volume.name);
        std::fs::create_dir_all(&local)?;
        for (path, value) in volume_files(client, namespace, volume).await? {
            let file = local.join(path);
            if let Some(dir) = file.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(file, value)?;
        }
        mounts.push((mount.mount_path.clone(), local));
    }
    Ok(mounts)
}

/// `text` with a mount path at its start (a whole path: `/etc/a` is not the start of
/// `/etc/ab`) pointed at the mount's local folder.
fn local_path(mounts: &[(String, PathBuf)], text: &str) -> String {
    mounts
        .iter()
        .find_map(|(path, local)| {
            text.strip_prefix(path.as_str())
                .filter(|rest| rest.is_empty() || rest.starts_with('/'))
                .map(|rest| format!("{}{rest}", local.display()))
        })
        .unwrap_or_else(|| text.to_owned())
}

impl LocalPod {
    /// Starts the first container of `deployment`'s pod template as pod `pod_name`.
    pub async fn start(
        client: &Client,
        deployment: &Deployment,
        pod_name: &str,
        log_dir: &Path,
    ) -> Result<Self> {
        let namespace = deployment
            .metadata
            .namespace
            .as_deref()
            .context("the Deployment has no namespace")?;
        let (pod, container) = pod_template(deployment)?;
        let volumes = tempfile::Builder::new()
            .prefix("switchboard-pod-")
            .tempdir()?;
        let mounts = mount_volumes(client, namespace, pod, container, volumes.path()).await?;
        let program = match container.command.as_deref() {
            Some([program]) => workspace_binary(program)?,
            other => bail!("expected a one-word command, found {other:?}"),
        };
        let mut args: Vec<String> = container
            .args
            .iter()
            .flatten()
            .map(|arg| local_path(&mounts, arg))
            .collect();
        let metrics_addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        args.extend(["--metrics-addr".to_owned(), metrics_addr.to_string()]);
        let mut env = BTreeMap::new();
        for var in container.env.iter().flatten() {
            let value = resolve_env(client, namespace, pod_name, var).await?;
            env.insert(var.name.clone(), local_path(&mounts, &value));
        }
        let log = log_dir.join(format!("pod-{pod_name}.log"));
        let child = spawn_logged(
            Command::new(&program)
                .args(&args)
                .env_clear()
                .env("PATH", "/usr/local/bin:/usr/bin:/bin")
                .envs(&env),
            &log,
        )?;
        Ok(Self {
            child,
            _volumes: volumes,
            container: container.clone(),
            metrics_addr,
            env,
            args,
            log,
        })
    }

    /// Runs an HTTP probe of the container against the process: the status code.
    pub async fn probe(&self, probe: Option<&Probe>) -> Result<u16> {
        let path = probe
            .and_then(|p| p.http_get.as_ref())
            .and_then(|get| get.path.as_deref())
            .context("not an HTTP probe")?;
        Ok(http_get(self.metrics_addr, path).await?.0)
    }

    /// SIGKILL: the pod dies without a word.
    pub fn kill(&mut self) {
        super::kill(&mut self.child);
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn log_tail(&self) -> String {
        log_tail(&self.log, 30)
    }
}

impl Drop for LocalPod {
    fn drop(&mut self) {
        super::kill(&mut self.child);
    }
}
