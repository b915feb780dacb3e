//! The files a worker reads from ConfigMap or Secret keys (CA bundles), and the Secret keys of
//! its environment as files it watches for rotation, as read-only volumes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, KeyToPath, ProjectedVolumeSource, SecretProjection, SecretVolumeSource,
    Volume, VolumeProjection,
};
use switchboard_api::{FileSource, MountedFile, SecretKeyRef};

/// The volume, and where the worker sees it, holding every Secret key of its environment as
/// `<secret>/<environment variable>`: kubelet refreshes these files when a Secret changes, and
/// the worker, finding one that differs from its environment, restarts to take the new value.
pub const SECRETS_VOLUME: &str = "watched-secrets";
pub const SECRETS_DIR: &str = "/var/run/switchboard/secrets";
/// The worker's setting naming [`SECRETS_DIR`].
pub const SECRETS_DIR_ENV: &str = "SWITCHBOARD_SECRETS_DIR";

/// The [`SECRETS_VOLUME`] of `secrets` (environment variable, Secret key), read-only. Each
/// Secret is optional here: a missing one stops the container at its environment
/// (`CreateContainerConfigError` in the pod's status, which the operator reports) rather than
/// at a mount, which only an Event would tell.
pub fn secrets_volume<'a>(
    secrets: impl IntoIterator<Item = (&'a str, &'a SecretKeyRef)>,
) -> Volume {
    let mut items: BTreeMap<&str, Vec<KeyToPath>> = BTreeMap::new();
    for (env, secret) in secrets {
        items.entry(&secret.name).or_default().push(KeyToPath {
            key: secret.key.clone(),
            path: format!("{}/{env}", secret.name),
            mode: None,
        });
    }
    let sources = items
        .into_iter()
        .map(|(name, items)| VolumeProjection {
            secret: Some(SecretProjection {
                name: name.to_owned(),
                items: Some(items),
                optional: Some(true),
            }),
            ..VolumeProjection::default()
        })
        .collect();
    Volume {
        name: SECRETS_VOLUME.to_owned(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(sources),
            default_mode: Some(0o444),
        }),
        ..Volume::default()
    }
}

/// The files the worker reads: the broker's and the database CA.
pub fn mounted_files<'a>(
    broker: Vec<MountedFile<'a>>,
    database_ca: Option<MountedFile<'a>>,
) -> Vec<MountedFile<'a>> {
    let mut files = broker;
    files.extend(database_ca);
    files
}

/// The volume of a file the worker reads: only its key, as the file's name, read-only.
pub fn file_volume(file: &MountedFile<'_>) -> Volume {
    let items = |key: &str| {
        Some(vec![KeyToPath {
            key: key.to_owned(),
            path: file.file.to_owned(),
            mode: None,
        }])
    };
    let (config_map, secret) = match file.source {
        FileSource::ConfigMap { name, key } => (
            Some(ConfigMapVolumeSource {
                name: name.to_owned(),
                items: items(key),
                default_mode: Some(0o444),
                optional: Some(false),
            }),
            None,
        ),
        FileSource::Secret(secret) => (
            None,
            Some(SecretVolumeSource {
                secret_name: Some(secret.name.clone()),
                items: items(&secret.key),
                default_mode: Some(0o444),
                optional: Some(false),
            }),
        ),
    };
    Volume {
        name: file.volume.to_owned(),
        config_map,
        secret,
        ..Volume::default()
    }
}
