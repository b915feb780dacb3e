//! The files a worker reads from ConfigMap or Secret keys (CA bundles), as read-only volumes.

use k8s_openapi::api::core::v1::{ConfigMapVolumeSource, KeyToPath, SecretVolumeSource, Volume};
use switchboard_api::{FileSource, MountedFile};

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
