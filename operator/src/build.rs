//! The pure middle of a reconcile: validate a QueueAdapter and build the objects its worker needs.
//! No client, no I/O: everything here is unit-tested from YAML fixtures.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, ObjectFieldSelector, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    SeccompProfile, SecretKeySelector, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};

use crate::autoscaling::{Autoscaled, autoscaling_objects};
use crate::database_ca::{self, DefaultCa};
use crate::mounted::{
    SECRETS_DIR, SECRETS_DIR_ENV, SECRETS_VOLUME, file_volume, mounted_files, secrets_volume,
};
use crate::pdb::disruption_budget;
use crate::pod_template::{self, PodDefaults};
use crate::worker_traces::WorkerTraces;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use sha2::{Digest, Sha256};
use switchboard_api::{
    Broker, InvalidSpec, MissingSecret, MountedFile, QueueAdapter, QueueAdapterSpec, SecretEnv,
    SecretKeyRef,
};

/// The one field manager every write of the operator uses.
pub const FIELD_MANAGER: &str = "switchboard-operator";
/// Pod-template annotation: a hash of the adapter's spec (its Secret references, not their
/// values: the operator cannot read Secrets), so that a change rolls the worker pods.
pub const CONFIG_HASH_ANNOTATION: &str = "switchboard.dev/config-hash";
/// Where the pod sees the ConfigMap holding the adapter's manifest.
pub const MANIFEST_DIR: &str = "/etc/switchboard";
/// The ConfigMap key (and file name) of the adapter's manifest.
pub const MANIFEST_KEY: &str = "adapter.yaml";
/// The worker's `/healthz`, `/readyz` and `/metrics` port.
pub const METRICS_PORT: i32 = 9090;
/// Above the worker's 25 s shutdown timeout, so a stopping worker finishes its batch.
pub const TERMINATION_GRACE_PERIOD_SECONDS: i64 = 40;
/// The worker binary in the image (which holds the operator binary too).
pub const WORKER_COMMAND: &str = "switchboard-worker";
/// The user and group the worker runs as (the image's non-root user).
pub const WORKER_UID: i64 = 65532;

const MANAGED_BY: &str = "switchboard-operator";

/// What the operator's configuration contributes to every worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSettings {
    /// Image used when the spec names none.
    pub image: String,
    pub image_pull_policy: String,
    /// Prefixes of the other images a spec may name (`spec.workload.image`); empty: none.
    pub allowed_images: Vec<String>,
    /// Database Secret used when the spec has no `database`.
    pub default_database_secret: SecretKeyRef,
    /// Database CA used when the spec's `database` names none.
    pub default_database_ca: Option<DefaultCa>,
    /// Defaults of the pod template's placement, identity and resources.
    pub pod: PodDefaults,
    /// Where workers export traces (none by default).
    pub traces: WorkerTraces,
}

/// Why a QueueAdapter cannot be turned into a worker (it waits for a spec change).
#[derive(Debug, thiserror::Error)]
pub enum InvalidAdapter {
    #[error(transparent)]
    Spec(#[from] InvalidSpec),
    #[error(transparent)]
    MissingSecret(#[from] MissingSecret),
    #[error("metadata.name and metadata.namespace are required")]
    MissingMetadata,
    #[error(
        "spec.workload.image {image:?} is not allowed: the operator runs {default:?} and, besides it, only images starting with one of {allowed:?} (its --allowed-worker-images setting, Helm value worker.allowedImages)"
    )]
    ImageNotAllowed {
        image: String,
        default: String,
        allowed: Vec<String>,
    },
}

impl InvalidAdapter {
    /// The reason of the status condition and the Event.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ImageNotAllowed { .. } => "ImageNotAllowed",
            Self::Spec(_) | Self::MissingSecret(_) | Self::MissingMetadata => "InvalidSpec",
        }
    }
}

/// Whether `image` is the default or starts with an allowed prefix at a name boundary:
/// `registry.example/switchboard` allows `registry.example/switchboard:1.2`, `…@sha256:…` and
/// `…/nightly:1`, not `registry.example/switchboard-evil`; a prefix ending with `/` allows
/// everything below it. A `:` or `@` after the prefix starts a tag or digest only if no `/`
/// follows (`registry.example:5000/x` is another registry, not a tag of `registry.example`).
pub fn image_allowed(image: &str, settings: &WorkerSettings) -> bool {
    const TAG_OR_DIGEST: [char; 2] = [':', '@'];
    image == settings.image
        || settings.allowed_images.iter().any(|prefix| {
            image.strip_prefix(prefix.as_str()).is_some_and(|rest| {
                rest.is_empty()
                    || prefix.ends_with('/')
                    || rest.starts_with('/')
                    || ((prefix.ends_with(TAG_OR_DIGEST) || rest.starts_with(TAG_OR_DIGEST))
                        && !rest.contains('/'))
            })
        })
}

/// A QueueAdapter that passed validation, with its defaults resolved.
#[derive(Debug, Clone)]
pub struct ValidAdapter<'a> {
    pub adapter: &'a QueueAdapter,
    pub name: &'a str,
    pub namespace: &'a str,
    pub broker: &'a dyn Broker,
    /// The broker's Secret keys, each with the environment variable it becomes.
    pub broker_secrets: Vec<SecretEnv<'a>>,
    pub database_secret: &'a SecretKeyRef,
    /// The database CA mounted for `sslrootcert`, if any.
    pub database_ca: Option<MountedFile<'a>>,
}

/// Checks the spec the way the API server does, plus what only Kubernetes needs.
pub fn validate<'a>(
    adapter: &'a QueueAdapter,
    settings: &'a WorkerSettings,
) -> Result<ValidAdapter<'a>, InvalidAdapter> {
    let (Some(name), Some(namespace)) = (
        adapter.metadata.name.as_deref(),
        adapter.metadata.namespace.as_deref(),
    ) else {
        return Err(InvalidAdapter::MissingMetadata);
    };
    adapter.spec.validate()?;
    // A valid spec has exactly one broker.
    let broker = adapter
        .spec
        .source
        .broker()
        .ok_or(InvalidAdapter::MissingMetadata)?;
    let broker_secrets = broker.secret_env()?;
    // A disabled adapter runs nothing, so its image does not matter until it is enabled.
    if adapter.spec.enabled
        && let Some(image) = spec_image(&adapter.spec)
        && !image_allowed(image, settings)
    {
        return Err(InvalidAdapter::ImageNotAllowed {
            image: image.to_owned(),
            default: settings.image.clone(),
            allowed: settings.allowed_images.clone(),
        });
    }
    Ok(ValidAdapter {
        adapter,
        name,
        namespace,
        broker,
        broker_secrets,
        database_secret: database_secret(&adapter.spec, settings),
        database_ca: database_ca::mounted_file(
            &adapter.spec,
            settings.default_database_ca.as_ref(),
        ),
    })
}

/// The image `spec` names, if any (an empty string names none).
fn spec_image(spec: &QueueAdapterSpec) -> Option<&str> {
    spec.workload
        .image
        .as_deref()
        .filter(|image| !image.is_empty())
}

/// The database Secret of `spec`: its own, else the operator's default.
fn database_secret<'a>(
    spec: &'a QueueAdapterSpec,
    settings: &'a WorkerSettings,
) -> &'a SecretKeyRef {
    spec.database
        .as_ref()
        .map_or(&settings.default_database_secret, |db| &db.url_secret_ref)
}

/// Everything the worker needs, ready for server-side apply.
#[derive(Debug, Clone)]
pub struct WorkerObjects {
    pub config_map: ConfigMap,
    pub deployment: Deployment,
    /// KEDA's objects, when the adapter is autoscaled (then the Deployment leaves `replicas`
    /// to the ScaledObject).
    pub autoscaled: Option<Autoscaled>,
    /// The worker's PodDisruptionBudget, when it can run more than one pod.
    pub disruption_budget: Option<PodDisruptionBudget>,
}

/// Why building failed (a bug, not a user error).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot render the adapter manifest")]
    Manifest(#[source] serde_yaml_ng::Error),
    #[error("the QueueAdapter has no uid yet")]
    NoUid,
}

/// `<name>-worker`: the Deployment and the ConfigMap.
pub fn worker_name(adapter_name: &str) -> String {
    format!("{adapter_name}-worker")
}

/// The label naming the adapter of a worker object (its pods included).
pub const INSTANCE_LABEL: &str = "app.kubernetes.io/instance";

/// Labels that select the worker pods of one adapter.
pub fn selector_labels(adapter_name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_owned(),
            "switchboard-worker".to_owned(),
        ),
        (INSTANCE_LABEL.to_owned(), adapter_name.to_owned()),
    ])
}

/// The standard `app.kubernetes.io/*` labels of every object the operator writes.
pub fn labels(adapter_name: &str) -> BTreeMap<String, String> {
    let mut labels = selector_labels(adapter_name);
    labels.extend([
        (
            "app.kubernetes.io/component".to_owned(),
            "queue-adapter".to_owned(),
        ),
        (
            "app.kubernetes.io/part-of".to_owned(),
            "switchboard".to_owned(),
        ),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            MANAGED_BY.to_owned(),
        ),
    ]);
    labels
}

/// Label selector for watching the objects the operator manages.
pub fn managed_selector() -> String {
    format!("app.kubernetes.io/managed-by={MANAGED_BY}")
}

/// The manifest the worker runs: the QueueAdapter's name, namespace and spec (with defaults).
pub fn worker_manifest(valid: &ValidAdapter<'_>) -> Result<String, BuildError> {
    let manifest = QueueAdapter {
        metadata: ObjectMeta {
            name: Some(valid.name.to_owned()),
            namespace: Some(valid.namespace.to_owned()),
            ..ObjectMeta::default()
        },
        spec: valid.adapter.spec.clone(),
        status: None,
    };
    let yaml = serde_yaml_ng::to_string(&manifest).map_err(BuildError::Manifest)?;
    Ok(format!(
        "# Rendered by switchboard-operator from QueueAdapter {}/{}; edits are overwritten.\n{yaml}",
        valid.namespace, valid.name
    ))
}

/// sha256 over the manifest and the database CA's source (the operator's default is not in the
/// manifest), each part length-prefixed.
pub fn config_hash(manifest: &str, database_ca: Option<&MountedFile<'_>>) -> String {
    let mut hasher = Sha256::new();
    let ca = format!("{:?}", database_ca.map(|file| file.source));
    for part in [manifest.as_bytes(), ca.as_bytes()] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hex::encode(hasher.finalize())
}

/// The adapter's settings for the `adapters.config` column: the spec without Kubernetes-only
/// parts (database, workload) and without secret references.
pub fn adapter_config(spec: &QueueAdapterSpec) -> serde_json::Value {
    let mut source = spec.source.clone();
    if let Some(broker) = source.broker_mut() {
        broker.strip_secrets();
    }
    serde_json::json!({
        "source": source,
        "target": spec.target,
        "payload": spec.payload,
        "delivery": spec.delivery,
    })
}

fn secret_env(name: &str, secret: &SecretKeyRef) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.name.clone(),
                key: secret.key.clone(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn http_probe(path: &str, period_seconds: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("metrics".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period_seconds),
        timeout_seconds: Some(2),
        failure_threshold: Some(3),
        ..Probe::default()
    }
}

fn worker_container(valid: &ValidAdapter<'_>, settings: &WorkerSettings) -> Container {
    let workload = &valid.adapter.spec.workload;
    let files = mounted_files(valid.broker.mounted_files(), valid.database_ca);
    let mut env = worker_env(valid, &files);
    env.extend(settings.traces.env(valid.namespace, valid.name));
    Container {
        name: "worker".to_owned(),
        image: Some(
            spec_image(&valid.adapter.spec)
                .unwrap_or(&settings.image)
                .to_owned(),
        ),
        image_pull_policy: Some(settings.image_pull_policy.clone()),
        command: Some(vec![WORKER_COMMAND.to_owned()]),
        args: Some(vec![
            "run".to_owned(),
            "--file".to_owned(),
            format!("{MANIFEST_DIR}/{MANIFEST_KEY}"),
        ]),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some("metrics".to_owned()),
            container_port: METRICS_PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        liveness_probe: Some(http_probe("/healthz", 10)),
        readiness_probe: Some(http_probe("/readyz", 5)),
        resources: pod_template::resources(workload, &settings.pod),
        security_context: Some(restricted_security_context()),
        volume_mounts: Some(
            [("manifest", MANIFEST_DIR), (SECRETS_VOLUME, SECRETS_DIR)]
                .into_iter()
                .chain(files.iter().map(|file| (file.volume, file.dir)))
                .map(|(name, dir)| VolumeMount {
                    name: name.to_owned(),
                    mount_path: dir.to_owned(),
                    read_only: Some(true),
                    ..VolumeMount::default()
                })
                .collect(),
        ),
        ..Container::default()
    }
}

/// The worker's environment: its pod name, the broker's secrets and mounted files, the
/// database URL, where its Secrets are mounted for rotation, and JSON logs.
fn worker_env(valid: &ValidAdapter<'_>, files: &[MountedFile]) -> Vec<EnvVar> {
    let hostname = EnvVar {
        name: "HOSTNAME".to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "metadata.name".to_owned(),
                api_version: Some("v1".to_owned()),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    };
    let broker_env = valid
        .broker_secrets
        .iter()
        .map(|secret| secret_env(secret.env, secret.secret));
    let file_env = files.iter().map(|file| EnvVar {
        name: file.env.to_owned(),
        value: Some(format!("{}/{}", file.dir, file.file)),
        ..EnvVar::default()
    });
    std::iter::once(hostname)
        .chain(broker_env)
        .chain(file_env)
        .chain([
            secret_env("DATABASE_URL", valid.database_secret),
            EnvVar {
                name: SECRETS_DIR_ENV.to_owned(),
                value: Some(SECRETS_DIR.to_owned()),
                ..EnvVar::default()
            },
            EnvVar {
                name: "LOG_JSON".to_owned(),
                value: Some("true".to_owned()),
                ..EnvVar::default()
            },
        ])
        .collect()
}

/// No privilege escalation, a read-only root, a non-root user, no capabilities.
fn restricted_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        ..SecurityContext::default()
    }
}

/// A non-root user and group, the runtime's default seccomp profile.
fn restricted_pod_security_context() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(WORKER_UID),
        run_as_group: Some(WORKER_UID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            localhost_profile: None,
        }),
        ..PodSecurityContext::default()
    }
}

fn object_meta(valid: &ValidAdapter<'_>, owner: &OwnerReference) -> ObjectMeta {
    ObjectMeta {
        name: Some(worker_name(valid.name)),
        namespace: Some(valid.namespace.to_owned()),
        labels: Some(labels(valid.name)),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}

/// The worker pod's volumes: the manifest's ConfigMap `config_map`, the Secrets it watches, and
/// the files it reads.
fn worker_volumes(valid: &ValidAdapter<'_>, config_map: &str) -> Vec<Volume> {
    let manifest = Volume {
        name: "manifest".to_owned(),
        config_map: Some(ConfigMapVolumeSource {
            name: config_map.to_owned(),
            default_mode: Some(0o444),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    };
    let secrets = valid.broker_secrets.iter().map(|s| (s.env, s.secret));
    let watched = secrets_volume(secrets.chain([("DATABASE_URL", valid.database_secret)]));
    let files = mounted_files(valid.broker.mounted_files(), valid.database_ca);
    [manifest, watched]
        .into_iter()
        .chain(files.iter().map(file_volume))
        .collect()
}

/// The ConfigMap with the worker's manifest and the worker Deployment, owned by the adapter.
pub fn build(
    valid: &ValidAdapter<'_>,
    settings: &WorkerSettings,
) -> Result<WorkerObjects, BuildError> {
    let owner = valid
        .adapter
        .controller_owner_ref(&())
        .ok_or(BuildError::NoUid)?;
    let manifest = worker_manifest(valid)?;
    let hash = config_hash(&manifest, valid.database_ca.as_ref());
    let autoscaled = autoscaling_objects(valid.adapter, valid.broker, &object_meta(valid, &owner));
    let name = worker_name(valid.name);
    let spec = &valid.adapter.spec;
    let config_map = ConfigMap {
        metadata: object_meta(valid, &owner),
        data: Some(BTreeMap::from([(MANIFEST_KEY.to_owned(), manifest)])),
        ..ConfigMap::default()
    };
    let pod = PodSpec {
        containers: vec![worker_container(valid, settings)],
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        termination_grace_period_seconds: Some(TERMINATION_GRACE_PERIOD_SECONDS),
        security_context: Some(restricted_pod_security_context()),
        volumes: Some(worker_volumes(valid, &name)),
        ..pod_template::placement(&spec.workload, &settings.pod)
    };
    let deployment = Deployment {
        metadata: object_meta(valid, &owner),
        spec: Some(DeploymentSpec {
            replicas: match (spec.enabled, &autoscaled) {
                (false, _) => Some(0),
                (true, Some(_)) => None,
                (true, None) => Some(spec.workload.replicas),
            },
            revision_history_limit: Some(3),
            selector: LabelSelector {
                match_labels: Some(selector_labels(valid.name)),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(pod_template::metadata(
                    &spec.workload,
                    &settings.pod,
                    labels(valid.name),
                    (CONFIG_HASH_ANNOTATION.to_owned(), hash),
                )),
                spec: Some(pod),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    };
    Ok(WorkerObjects {
        config_map,
        deployment,
        autoscaled,
        disruption_budget: disruption_budget(
            spec,
            selector_labels(valid.name),
            object_meta(valid, &owner),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{KeyToPath, ProjectedVolumeSource, ResourceRequirements};

    const ORDERS: &str = include_str!("../fixtures/orders-stream.yaml");
    const DISABLED_WITH_DATABASE: &str = include_str!("../fixtures/disabled-with-database.yaml");
    const NO_REDIS_SECRET: &str = include_str!("../fixtures/no-redis-secret.yaml");

    fn settings() -> WorkerSettings {
        WorkerSettings {
            image: "registry.example/switchboard:9.9.9".to_owned(),
            image_pull_policy: "IfNotPresent".to_owned(),
            allowed_images: vec![
                "example/worker".to_owned(),
                "mirror.example/".to_owned(),
                "other.example".to_owned(),
                "tags.example/only:".to_owned(),
            ],
            default_database_secret: SecretKeyRef {
                name: "switchboard-db".to_owned(),
                key: "url".to_owned(),
            },
            default_database_ca: None,
            pod: PodDefaults::from_json(POD_DEFAULTS).expect("pod defaults parse"),
            traces: WorkerTraces::default(),
        }
    }

    /// The operator's worker pod defaults, as the chart renders them.
    const POD_DEFAULTS: &str = include_str!("../fixtures/pod-defaults.json");

    /// ORDERS with `workload` lines (indented by four spaces) added.
    fn orders_with(workload: &str) -> WorkerObjects {
        build_fixture(&format!(
            "{}{workload}",
            ORDERS.replace(
                "    resources:\n      requests: {cpu: 50m, memory: 64Mi}\n",
                ""
            )
        ))
    }

    fn fixture(yaml: &str) -> QueueAdapter {
        serde_yaml_ng::from_str(yaml).expect("fixture parses")
    }

    fn build_fixture(yaml: &str) -> WorkerObjects {
        let adapter = fixture(yaml);
        let settings = settings();
        let valid = validate(&adapter, &settings).expect("valid");
        build(&valid, &settings).expect("builds")
    }

    fn pod_spec(objects: &WorkerObjects) -> &PodSpec {
        objects
            .deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec")
    }

    fn env_secret<'a>(container: &'a Container, name: &str) -> &'a SecretKeySelector {
        container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.secret_key_ref.as_ref())
            .unwrap_or_else(|| panic!("{name} from a secret"))
    }

    fn hash_of(objects: &WorkerObjects) -> String {
        objects
            .deployment
            .spec
            .as_ref()
            .expect("spec")
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(CONFIG_HASH_ANNOTATION))
            .cloned()
            .expect("hash annotation")
    }

    #[test]
    fn worker_deployment_runs_the_rendered_manifest_with_secrets_from_secret_refs() {
        let objects = build_fixture(ORDERS);
        let deployment = &objects.deployment;
        assert_eq!(deployment.metadata.name.as_deref(), Some("orders-worker"));
        assert_eq!(deployment.metadata.namespace.as_deref(), Some("shop"));
        let owner = &deployment
            .metadata
            .owner_references
            .as_ref()
            .expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.controller),
            ("QueueAdapter", "orders", Some(true))
        );
        assert_eq!(deployment.spec.as_ref().and_then(|s| s.replicas), Some(2));
        let pod = pod_spec(&objects);
        let container = &pod.containers[0];
        assert_eq!(
            container.image.as_deref(),
            Some("registry.example/switchboard:9.9.9")
        );
        assert_eq!(container.image_pull_policy.as_deref(), Some("IfNotPresent"));
        assert_eq!(
            container.command,
            Some(vec!["switchboard-worker".to_owned()])
        );
        assert_eq!(
            container.args.as_deref(),
            Some(
                &[
                    "run".to_owned(),
                    "--file".to_owned(),
                    "/etc/switchboard/adapter.yaml".to_owned()
                ][..]
            )
        );
        let redis = env_secret(container, "REDIS_URL");
        assert_eq!((redis.name.as_str(), redis.key.as_str()), ("redis", "url"));
        let database = env_secret(container, "DATABASE_URL");
        assert_eq!(
            (database.name.as_str(), database.key.as_str()),
            ("switchboard-db", "url")
        );
        let hostname = container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "HOSTNAME")
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.field_ref.as_ref())
            .expect("HOSTNAME from the downward API");
        assert_eq!(hostname.field_path, "metadata.name");
        let rendered = objects.config_map.data.as_ref().expect("data")[MANIFEST_KEY].clone();
        let manifest = switchboard_api::load_manifest(&rendered).expect("worker accepts it");
        assert_eq!(manifest.adapter_name(), "shop/orders");
        assert_eq!(manifest.spec, fixture(ORDERS).spec);
    }

    #[test]
    fn worker_pod_is_restricted_probed_and_outlives_the_shutdown_timeout() {
        let objects = build_fixture(ORDERS);
        let pod = pod_spec(&objects);
        let container = &pod.containers[0];
        let pod_security = pod.security_context.as_ref().expect("pod security");
        assert_eq!(pod_security.run_as_non_root, Some(true));
        assert_eq!(
            pod_security
                .seccomp_profile
                .as_ref()
                .map(|p| p.type_.as_str()),
            Some("RuntimeDefault")
        );
        let security = container
            .security_context
            .as_ref()
            .expect("container security");
        assert_eq!(security.allow_privilege_escalation, Some(false));
        assert_eq!(security.read_only_root_filesystem, Some(true));
        assert_eq!(security.run_as_non_root, Some(true));
        assert_eq!(
            security.capabilities.as_ref().and_then(|c| c.drop.clone()),
            Some(vec!["ALL".to_owned()])
        );
        assert!(pod.termination_grace_period_seconds.expect("grace") > 25);
        let port = &container.ports.as_ref().expect("ports")[0];
        assert_eq!(
            (port.name.as_deref(), port.container_port),
            (Some("metrics"), 9090)
        );
        for (probe, path) in [
            (&container.liveness_probe, "/healthz"),
            (&container.readiness_probe, "/readyz"),
        ] {
            let get = probe
                .as_ref()
                .and_then(|p| p.http_get.as_ref())
                .expect("probe");
            assert_eq!(get.path.as_deref(), Some(path));
            assert_eq!(get.port, IntOrString::String("metrics".to_owned()));
        }
        let requests = container
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .expect("requests from the spec");
        assert_eq!(requests["memory"].0, "64Mi");
        let labels = objects.deployment.metadata.labels.as_ref().expect("labels");
        for key in [
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/component",
            "app.kubernetes.io/part-of",
            "app.kubernetes.io/managed-by",
        ] {
            assert!(labels.contains_key(key), "missing label {key}");
        }
    }

    #[test]
    fn disabled_adapter_scales_to_zero_and_uses_its_own_database_and_image() {
        let objects = build_fixture(DISABLED_WITH_DATABASE);
        assert_eq!(
            objects.deployment.spec.as_ref().and_then(|s| s.replicas),
            Some(0)
        );
        let container = &pod_spec(&objects).containers[0];
        assert_eq!(container.image.as_deref(), Some("example/worker:dev"));
        let database = env_secret(container, "DATABASE_URL");
        assert_eq!(
            (database.name.as_str(), database.key.as_str()),
            ("billing-db", "dsn")
        );
    }

    #[test]
    fn hash_changes_with_the_spec_and_its_secret_references() {
        let hash = hash_of(&build_fixture(ORDERS));
        for changed in [
            ORDERS.replace("batchSize: 200", "batchSize: 300"),
            ORDERS.replace("name: redis, key: url", "name: redis-2, key: url"),
        ] {
            assert_ne!(hash_of(&build_fixture(&changed)), hash);
        }
        assert_eq!(hash_of(&build_fixture(ORDERS)), hash, "deterministic");
    }

    #[test]
    fn every_secret_key_of_the_environment_is_mounted_under_its_secret_and_optional() {
        let objects = build_fixture(ORDERS);
        let pod = pod_spec(&objects);
        let container = &pod.containers[0];
        let env = |name: &str| {
            container
                .env
                .iter()
                .flatten()
                .find(|e| e.name == name)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(
            env("SWITCHBOARD_SECRETS_DIR").as_deref(),
            Some("/var/run/switchboard/secrets")
        );
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "watched-secrets")
            .expect("mounted");
        assert_eq!(
            (mount.mount_path.as_str(), mount.read_only),
            ("/var/run/switchboard/secrets", Some(true))
        );
        let volume = watched_secrets(&objects);
        let sources: Vec<(String, Vec<String>, Option<bool>)> = volume
            .sources
            .iter()
            .flatten()
            .filter_map(|source| source.secret.as_ref())
            .map(|secret| {
                let paths = secret.items.iter().flatten().map(|i| i.path.clone());
                (secret.name.clone(), paths.collect(), secret.optional)
            })
            .collect();
        assert_eq!(
            sources,
            [
                (
                    "redis".to_owned(),
                    vec!["redis/REDIS_URL".to_owned()],
                    Some(true)
                ),
                (
                    "switchboard-db".to_owned(),
                    vec!["switchboard-db/DATABASE_URL".to_owned()],
                    Some(true)
                ),
            ]
        );
        // Two references to one key: a file for each variable, under one Secret.
        let shared = build_fixture(&format!(
            "{ORDERS}  database:\n    urlSecretRef: {{name: redis, key: url}}\n"
        ));
        let sources = watched_secrets(&shared).sources.clone().unwrap_or_default();
        let paths: Vec<String> = sources
            .iter()
            .flat_map(|source| source.secret.iter().flat_map(|s| s.items.iter().flatten()))
            .map(|item| format!("{}→{}", item.key, item.path))
            .collect();
        assert_eq!(paths, ["url→redis/REDIS_URL", "url→redis/DATABASE_URL"]);
    }

    /// The projected volume of the Secrets the worker watches.
    fn watched_secrets(objects: &WorkerObjects) -> &ProjectedVolumeSource {
        pod_spec(objects)
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "watched-secrets")
            .and_then(|v| v.projected.as_ref())
            .expect("projected volume")
    }

    #[test]
    fn only_the_default_image_and_allowed_prefixes_run() {
        let settings = settings();
        for (image, allowed) in [
            ("registry.example/switchboard:9.9.9", true),
            ("example/worker", true),
            ("example/worker:dev", true),
            ("example/worker@sha256:0123", true),
            ("example/worker/nightly:1", true),
            ("mirror.example/anything:1", true),
            ("example/worker-evil:dev", false),
            ("example/worker:5000/evil", false),
            ("example/workers:1", false),
            ("mirror.example", false),
            ("other.example:5000/anything:1", false),
            ("other.example/anything:1", true),
            ("tags.example/only:1.2", true),
            ("tags.example/only:1.2/evil", false),
            ("registry.example/switchboard:9.9.8", false),
            ("evil.example/steal:1", false),
        ] {
            assert_eq!(image_allowed(image, &settings), allowed, "{image}");
        }
        let strict = WorkerSettings {
            allowed_images: Vec::new(),
            ..settings.clone()
        };
        assert!(!image_allowed("example/worker:dev", &strict));
        assert!(image_allowed("registry.example/switchboard:9.9.9", &strict));

        let evil = DISABLED_WITH_DATABASE.replace("example/worker:dev", "evil.example/steal:1");
        // Disabled, it runs nothing: its image does not matter until it is enabled.
        let disabled = fixture(&evil);
        assert!(validate(&disabled, &settings).is_ok());
        let adapter = fixture(&evil.replace("enabled: false", "enabled: true"));
        let refused = validate(&adapter, &settings).expect_err("the image is refused");
        assert_eq!(refused.reason(), "ImageNotAllowed");
        let message = refused.to_string();
        assert!(
            message.contains(r#"spec.workload.image "evil.example/steal:1""#)
                && message.contains("--allowed-worker-images"),
            "{message}"
        );
    }

    #[test]
    fn adapter_config_has_no_secret_references() {
        let adapter = fixture(ORDERS);
        let config = adapter_config(&adapter.spec);
        let text = config.to_string();
        assert!(
            !text.contains("urlSecretRef") && !text.contains("database"),
            "{text}"
        );
        assert_eq!(config["target"]["queue"], "orders");
        assert_eq!(config["source"]["redis"]["stream"], "orders");
        assert_eq!(config["delivery"]["batchSize"], 200);
    }

    #[test]
    fn adapter_without_a_redis_secret_is_invalid_naming_the_field() {
        let adapter = fixture(NO_REDIS_SECRET);
        let err = validate(&adapter, &settings()).expect_err("invalid");
        assert!(
            err.to_string().contains("spec.source.redis.urlSecretRef"),
            "{err}"
        );
    }

    /// Builds ORDERS (with `database` lines added) under `default_ca`.
    fn orders_with_database(database: &str, default_ca: Option<&str>) -> WorkerObjects {
        let adapter = fixture(&format!("{ORDERS}{database}"));
        let settings = WorkerSettings {
            default_database_ca: default_ca.map(|ca| DefaultCa::parse(ca).expect("parses")),
            ..settings()
        };
        let valid = validate(&adapter, &settings).expect("valid");
        build(&valid, &settings).expect("builds")
    }

    /// The database CA volume's (kind, name, key) and the container's mount and PGSSLROOTCERT.
    fn database_ca_of(objects: &WorkerObjects) -> Option<(String, String, String)> {
        let pod = pod_spec(objects);
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "database-ca")?;
        let container = &pod.containers[0];
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "database-ca");
        assert_eq!(
            mount.map(|m| (m.mount_path.as_str(), m.read_only)),
            Some((database_ca::DIR, Some(true))),
            "mounted read-only"
        );
        let env = container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "PGSSLROOTCERT");
        assert_eq!(
            env.and_then(|e| e.value.as_deref()),
            Some("/etc/switchboard-database-ca/ca.crt")
        );
        let item = |items: &Option<Vec<KeyToPath>>| {
            let items = items.as_deref().expect("one item");
            assert_eq!(items.len(), 1);
            assert_eq!(items[0].path, "ca.crt");
            items[0].key.clone()
        };
        Some(match (&volume.config_map, &volume.secret) {
            (Some(map), None) => ("configMap".into(), map.name.clone(), item(&map.items)),
            (None, Some(secret)) => (
                "secret".into(),
                secret.secret_name.clone().expect("named"),
                item(&secret.items),
            ),
            other => panic!("one source: {other:?}"),
        })
    }

    #[test]
    fn database_ca_is_mounted_read_only_as_pgsslrootcert_and_the_adapters_wins() {
        let none = orders_with_database("", None);
        assert_eq!(database_ca_of(&none), None);
        let default = orders_with_database("", Some("configMap:pg-bundle/ca.pem"));
        let expected = |kind: &str, name: &str, key: &str| {
            Some((kind.to_owned(), name.to_owned(), key.to_owned()))
        };
        assert_eq!(
            database_ca_of(&default),
            expected("configMap", "pg-bundle", "ca.pem")
        );
        let own = orders_with_database(
            "  database:\n    urlSecretRef: {name: db, key: url}\n    \
             caSecretRef: {name: cluster-ca, key: ca.crt}\n",
            Some("configMap:pg-bundle/ca.pem"),
        );
        assert_eq!(
            database_ca_of(&own),
            expected("secret", "cluster-ca", "ca.crt")
        );
        let hashes = [&none, &default, &own].map(hash_of);
        assert_ne!(hashes[0], hashes[1], "the default CA rolls the pods");
        assert_ne!(hashes[1], hashes[2]);
    }

    #[test]
    fn database_with_both_ca_refs_is_invalid_naming_the_field() {
        let adapter = fixture(&format!(
            "{ORDERS}  database:\n    urlSecretRef: {{name: db, key: url}}\n    \
             caSecretRef: {{name: a, key: b}}\n    caConfigMapRef: {{name: a, key: b}}\n"
        ));
        let err = validate(&adapter, &settings()).expect_err("invalid");
        assert!(err.to_string().contains("spec.database"), "{err}");
        assert!(
            err.to_string().contains("caConfigMapRef and caSecretRef"),
            "{err}"
        );
    }

    #[test]
    fn gateway_ca_config_map_is_mounted_read_only_and_named_by_its_env() {
        let objects = build_fixture(
            "apiVersion: switchboard.dev/v1alpha1\n\
             kind: QueueAdapter\n\
             metadata: {name: orders, namespace: shop, uid: 1b4e28ba}\n\
             spec:\n\
             \x20 source:\n\
             \x20   gateway:\n\
             \x20     url: https://gw.example\n\
             \x20     queue: orders\n\
             \x20     auth: {tokenSecretRef: {name: gw, key: token}}\n\
             \x20     tls: {caConfigMapRef: {name: gateway-ca, key: ca-bundle.pem}}\n\
             \x20 target: {queue: orders}\n",
        );
        let pod = pod_spec(&objects);
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "gateway-ca")
            .expect("the CA volume");
        let map = volume.config_map.as_ref().expect("from the ConfigMap");
        assert_eq!(map.name, "gateway-ca");
        assert_eq!(map.default_mode, Some(0o444));
        let items: Vec<(&str, &str)> = map
            .items
            .iter()
            .flatten()
            .map(|item| (item.key.as_str(), item.path.as_str()))
            .collect();
        assert_eq!(items, [("ca-bundle.pem", "ca.crt")]);
        let container = &pod.containers[0];
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "gateway-ca")
            .expect("mounted");
        assert_eq!(
            (mount.mount_path.as_str(), mount.read_only),
            ("/etc/switchboard-gateway-ca", Some(true))
        );
        let env = container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "GATEWAY_CA_FILE")
            .expect("GATEWAY_CA_FILE");
        assert_eq!(
            env.value.as_deref(),
            Some("/etc/switchboard-gateway-ca/ca.crt")
        );
        assert_eq!(env_secret(container, "GATEWAY_TOKEN").name, "gw");
    }

    fn placement_of(objects: &WorkerObjects) -> (&PodSpec, &ObjectMeta) {
        let template = &objects.deployment.spec.as_ref().expect("spec").template;
        (
            template.spec.as_ref().expect("pod spec"),
            template.metadata.as_ref().expect("pod metadata"),
        )
    }

    fn quantity(resources: Option<&ResourceRequirements>, which: &str, name: &str) -> String {
        let part = resources.and_then(|r| match which {
            "requests" => r.requests.as_ref(),
            _ => r.limits.as_ref(),
        });
        part.and_then(|p| p.get(name))
            .map(|q| q.0.clone())
            .unwrap_or_default()
    }

    #[test]
    fn worker_pod_takes_the_operators_defaults_when_the_adapter_sets_none() {
        let objects = orders_with("");
        let (pod, metadata) = placement_of(&objects);
        let secrets: Vec<&str> = pod
            .image_pull_secrets
            .iter()
            .flatten()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(secrets, ["regcred"]);
        assert_eq!(pod.service_account_name.as_deref(), Some("queue-workers"));
        assert_eq!(
            pod.node_selector.as_ref().expect("nodeSelector")["pool"],
            "queues"
        );
        let toleration = &pod.tolerations.as_ref().expect("tolerations")[0];
        assert_eq!(toleration.key.as_deref(), Some("dedicated"));
        assert_eq!(pod.priority_class_name.as_deref(), Some("queue-workers"));
        // Empty defaults render nothing.
        assert_eq!(pod.affinity, None);
        assert_eq!(pod.topology_spread_constraints, None);
        // Not BestEffort: the default requests and memory limit.
        let resources = pod.containers[0].resources.as_ref();
        assert_eq!(quantity(resources, "requests", "cpu"), "100m");
        assert_eq!(quantity(resources, "requests", "memory"), "128Mi");
        assert_eq!(quantity(resources, "limits", "memory"), "512Mi");
        // The API token stays unmounted whatever account the pod runs as.
        assert_eq!(pod.automount_service_account_token, Some(false));
        // The default pod labels and annotations, under the selector labels and the hash.
        let labels = metadata.labels.as_ref().expect("labels");
        assert_eq!(
            (&labels["team"], &labels["tier"]),
            (&"platform".to_owned(), &"queues".to_owned())
        );
        for (key, value) in super::labels("orders") {
            assert_eq!(labels[&key], value, "{key} is the operator's");
        }
        let annotations = metadata.annotations.as_ref().expect("annotations");
        assert_eq!(annotations["cost-center"], "queues");
        assert_eq!(annotations[CONFIG_HASH_ANNOTATION], hash_of(&objects));
    }

    #[test]
    fn adapters_pod_template_replaces_the_defaults_and_cannot_touch_selector_labels_or_security() {
        let objects = orders_with(
            "    imagePullSecrets: []\n\
             \x20   serviceAccountName: orders-irsa\n\
             \x20   nodeSelector: {zone: a}\n\
             \x20   tolerations: []\n\
             \x20   affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: arch, operator: In, values: [arm64]}]}]}}}\n\
             \x20   topologySpreadConstraints: [{maxSkew: 1, topologyKey: zone, whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {app.kubernetes.io/instance: orders}}}]\n\
             \x20   priorityClassName: queue-critical\n\
             \x20   resources: {requests: {cpu: '1'}}\n\
             \x20   podAnnotations: {team: shop, switchboard.dev/config-hash: forged}\n\
             \x20   podLabels: {team: shop, app.kubernetes.io/instance: other, app.kubernetes.io/managed-by: me}\n",
        );
        let (pod, metadata) = placement_of(&objects);
        assert_eq!(pod.image_pull_secrets, Some(Vec::new()));
        assert_eq!(pod.service_account_name.as_deref(), Some("orders-irsa"));
        assert_eq!(
            pod.node_selector,
            Some(BTreeMap::from([("zone".to_owned(), "a".to_owned())]))
        );
        assert_eq!(pod.tolerations, Some(Vec::new()));
        assert!(
            pod.affinity
                .as_ref()
                .and_then(|a| a.node_affinity.as_ref())
                .is_some()
        );
        assert_eq!(
            pod.topology_spread_constraints.as_ref().map(Vec::len),
            Some(1)
        );
        assert_eq!(pod.priority_class_name.as_deref(), Some("queue-critical"));
        let resources = pod.containers[0].resources.as_ref();
        assert_eq!(quantity(resources, "requests", "cpu"), "1");
        assert_eq!(
            quantity(resources, "limits", "memory"),
            "",
            "replaced as a whole"
        );
        // Pod labels and annotations merge: the adapter's keys win, the defaults' others stay.
        let labels = metadata.labels.as_ref().expect("labels");
        assert_eq!(labels["team"], "shop");
        assert_eq!(labels["tier"], "queues");
        for (key, value) in super::labels("orders") {
            assert_eq!(labels[&key], value, "{key} is the operator's");
        }
        let annotations = metadata.annotations.as_ref().expect("annotations");
        assert_eq!(annotations["team"], "shop");
        assert_eq!(annotations["cost-center"], "queues");
        assert_ne!(annotations[CONFIG_HASH_ANNOTATION], "forged");
        assert_eq!(annotations[CONFIG_HASH_ANNOTATION], hash_of(&objects));
        let restricted = build_fixture(ORDERS);
        let (restricted_pod, _) = placement_of(&restricted);
        assert_eq!(pod.security_context, restricted_pod.security_context);
        assert_eq!(
            pod.containers[0].security_context,
            restricted_pod.containers[0].security_context
        );
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_ne!(
            hash_of(&objects),
            hash_of(&restricted),
            "a template change rolls the pods"
        );
    }

    #[test]
    fn disruption_budget_only_while_more_than_one_worker_can_run() {
        let budget = build_fixture(ORDERS)
            .disruption_budget
            .expect("2 replicas: a budget");
        assert_eq!(budget.metadata.name.as_deref(), Some("orders-worker"));
        let owner = &budget.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("QueueAdapter", Some(true))
        );
        let spec = budget.spec.expect("spec");
        assert_eq!(spec.max_unavailable, Some(IntOrString::Int(1)));
        assert_eq!(spec.min_available, None);
        assert_eq!(
            spec.selector.and_then(|s| s.match_labels),
            Some(selector_labels("orders"))
        );
        for (workload, budgeted) in [
            ("    replicas: 1\n", false),
            (
                "    replicas: 1\n    autoscaling: {maxReplicas: 3, triggerAuthenticationRef: redis-auth}\n",
                true,
            ),
            (
                "    replicas: 3\n    autoscaling: {maxReplicas: 1, triggerAuthenticationRef: redis-auth}\n",
                false,
            ),
        ] {
            let one = ORDERS.replace("    replicas: 2\n", workload);
            assert_eq!(
                build_fixture(&one).disruption_budget.is_some(),
                budgeted,
                "{workload}"
            );
        }
        assert!(
            build_fixture(DISABLED_WITH_DATABASE)
                .disruption_budget
                .is_none()
        );
    }
}
