//! The database CA (`sslrootcert`): the adapter's `spec.database` CA, else the operator's
//! default (Helm value `database.ca`), mounted read-only with `PGSSLROOTCERT` naming its path.

use switchboard_api::{
    ConfigMapKeyRef, DATABASE_CA_ENV, Database, FileSource, MountedFile, QueueAdapterSpec,
    SecretKeyRef,
};

/// Where the CA volume is mounted in the worker container.
pub const DIR: &str = "/etc/switchboard-database-ca";

/// The operator's default database CA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DefaultCa {
    ConfigMap(ConfigMapKeyRef),
    Secret(SecretKeyRef),
}

impl DefaultCa {
    /// Parses `configMap:NAME/KEY` or `secret:NAME/KEY`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let usage = || format!("{text:?}: expected configMap:NAME/KEY or secret:NAME/KEY");
        let (kind, reference) = text.split_once(':').ok_or_else(usage)?;
        let (name, key) = reference
            .split_once('/')
            .filter(|(name, key)| !name.is_empty() && !key.is_empty())
            .ok_or_else(usage)?;
        let (name, key) = (name.to_owned(), key.to_owned());
        match kind {
            "configMap" => Ok(Self::ConfigMap(ConfigMapKeyRef { name, key })),
            "secret" => Ok(Self::Secret(SecretKeyRef { name, key })),
            _ => Err(usage()),
        }
    }

    fn source(&self) -> FileSource<'_> {
        match self {
            Self::ConfigMap(map) => FileSource::ConfigMap {
                name: &map.name,
                key: &map.key,
            },
            Self::Secret(secret) => FileSource::Secret(secret),
        }
    }
}

/// The CA file of `spec`'s database: its own, else `default`; `None`: no CA is mounted.
pub fn mounted_file<'a>(
    spec: &'a QueueAdapterSpec,
    default: Option<&'a DefaultCa>,
) -> Option<MountedFile<'a>> {
    spec.database
        .as_ref()
        .and_then(Database::ca)
        .or_else(|| default.map(DefaultCa::source))
        .map(|source| MountedFile {
            env: DATABASE_CA_ENV,
            volume: "database-ca",
            dir: DIR,
            file: "ca.crt",
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ca_parses_config_maps_and_secrets_and_refuses_the_rest() {
        assert_eq!(
            DefaultCa::parse("secret:pg-ca/ca.crt"),
            Ok(DefaultCa::Secret(SecretKeyRef {
                name: "pg-ca".to_owned(),
                key: "ca.crt".to_owned()
            }))
        );
        assert!(matches!(
            DefaultCa::parse("configMap:bundle/ca.pem"),
            Ok(DefaultCa::ConfigMap(map)) if map.name == "bundle" && map.key == "ca.pem"
        ));
        for bad in ["secret:pg-ca", "pg-ca/ca.crt", "file:a/b", "secret:/ca.crt"] {
            assert!(DefaultCa::parse(bad).is_err(), "{bad}");
        }
    }
}
