//! The Helm chart (`charts/switchboard`), the Dockerfile and the kind path.
//!
//! helm comes from `scripts/helm.sh` (built once from the Go module proxy, cached); the chart is
//! rendered by the real helm and its objects are applied to the real kube-apiserver of the test
//! harness. There is no Docker engine here: the Dockerfile and the kind scripts are checked
//! statically (and the scripts in their `KIND_DRY_RUN=1` mode).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Container, EnvVar, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::config::Kubeconfig;
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use kube::{Api, Client};
use serde_json::Value;
use switchboard_api::{ConfigMapKeyRef, SecretKeyRef};
use switchboard_operator::DEFAULT_WORKER_IMAGE;
use switchboard_operator::build::{WORKER_COMMAND, WORKER_UID, worker_name};
use switchboard_operator::database_ca::DefaultCa;
use switchboard_operator::pod_template::PodDefaults;
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{
    CRD_FILE, ControlPlane, OPERATOR_TIMEOUT, OperatorEnv, condition, pairs, quantities,
    wait_object,
};
use switchboard_tests::helm::{
    CHART, CHART_CRD, NAMESPACE, RELEASE, helm, kind_of, render, the, yaml_documents,
};
use switchboard_tests::servers::workspace_path;
use switchboard_tests::wait::wait_for;

/// Two replicas, ServiceMonitor, NetworkPolicy, PodMonitor, PrometheusRule and the dashboard on,
/// an existing database Secret.
const HA_VALUES: &str = "charts/switchboard/ci/ha-values.yaml";
/// The chart creates the database Secret from `database.url`; names overridden.
const CREATED_SECRET_VALUES: &str = "charts/switchboard/ci/created-secret-values.yaml";
/// `None`: the chart's defaults.
const VALUE_SETS: [Option<&str>; 3] = [None, Some(HA_VALUES), Some(CREATED_SECRET_VALUES)];

const ADAPTER: &str = "\
apiVersion: switchboard.dev/v1alpha1
kind: QueueAdapter
metadata: {name: orders, namespace: shop}
spec:
  source:
    redis: {mode: stream, stream: orders, urlSecretRef: {name: redis, key: url}}
  target: {queue: orders}
";

/// A minimal `monitoring.coreos.com/v1` ServiceMonitor CRD: only the fields the chart sets, typed
/// as in the Prometheus Operator's CRD, so that strict field validation rejects anything else.
const SERVICE_MONITOR_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: servicemonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: ServiceMonitor, listKind: ServiceMonitorList, plural: servicemonitors, singular: servicemonitor}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          required: [spec]
          properties:
            spec:
              type: object
              required: [selector]
              properties:
                selector:
                  type: object
                  properties:
                    matchLabels: {type: object, additionalProperties: {type: string}}
                namespaceSelector:
                  type: object
                  properties:
                    any: {type: boolean}
                    matchNames: {type: array, items: {type: string}}
                endpoints:
                  type: array
                  items:
                    type: object
                    properties:
                      port: {type: string}
                      path: {type: string}
                      interval: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
                      scrapeTimeout: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
"#;

fn kinds(objects: &[Value]) -> BTreeSet<&str> {
    objects.iter().map(kind_of).collect()
}

fn operator_container(deployment: &Deployment) -> Result<&Container> {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.first())
        .context("the Deployment has a container")
}

fn env<'a>(container: &'a Container, name: &str) -> Option<&'a EnvVar> {
    container.env.iter().flatten().find(|var| var.name == name)
}

fn env_value<'a>(container: &'a Container, name: &str) -> Option<&'a str> {
    env(container, name)?.value.as_deref()
}

/// Minimal PodMonitor and PrometheusRule CRDs (`monitoring.coreos.com/v1`), like
/// [`SERVICE_MONITOR_CRD`]: the fields the chart sets, typed as in the Prometheus Operator's CRDs.
const MONITORING_CRDS: [&str; 3] = [
    SERVICE_MONITOR_CRD,
    r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: podmonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PodMonitor, listKind: PodMonitorList, plural: podmonitors, singular: podmonitor}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          required: [spec]
          properties:
            spec:
              type: object
              required: [selector]
              properties:
                jobLabel: {type: string}
                selector:
                  type: object
                  properties:
                    matchLabels: {type: object, additionalProperties: {type: string}}
                namespaceSelector:
                  type: object
                  properties:
                    any: {type: boolean}
                    matchNames: {type: array, items: {type: string}}
                podMetricsEndpoints:
                  type: array
                  items:
                    type: object
                    properties:
                      port: {type: string}
                      path: {type: string}
                      interval: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
                      scrapeTimeout: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
"#,
    r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: prometheusrules.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PrometheusRule, listKind: PrometheusRuleList, plural: prometheusrules, singular: prometheusrule}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          required: [spec]
          properties:
            spec:
              type: object
              properties:
                groups:
                  type: array
                  items:
                    type: object
                    required: [name]
                    properties:
                      name: {type: string, minLength: 1}
                      rules:
                        type: array
                        items:
                          type: object
                          required: [expr]
                          properties:
                            alert: {type: string}
                            expr: {anyOf: [{type: integer}, {type: string}], x-kubernetes-int-or-string: true}
                            for: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
                            labels: {type: object, additionalProperties: {type: string}}
                            annotations: {type: object, additionalProperties: {type: string}}
"#,
];

// ---------------------------------------------------------------------------------------------
// Acceptance 1: lint and schema

#[test]
fn helm_lint_strict_passes_with_every_values_set() -> Result<()> {
    for values in VALUE_SETS {
        let mut args = vec!["lint", "--strict", CHART];
        args.extend(values.iter().flat_map(|file| ["--values", *file]));
        let output = helm(&args)?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        ensure!(
            output.status.success() && text.contains("1 chart(s) linted, 0 chart(s) failed"),
            "helm {args:?}:\n{text}"
        );
    }
    Ok(())
}

#[test]
fn schema_rejects_values_of_the_wrong_type_and_unknown_keys() -> Result<()> {
    // (helm arguments, what the schema error must name)
    let cases: [(&[&str], &str); 14] = [
        (&["--set", "replicaCount=two"], "/replicaCount"),
        (
            &["--set-string", "serviceMonitor.enabled=yes"],
            "/serviceMonitor/enabled",
        ),
        (&["--set", "metrics.port=70000"], "/metrics/port"),
        (
            &["--set", "image.pullPolicy=Sometimes"],
            "/image/pullPolicy",
        ),
        (
            &["--set", "leaderElection.leaseDuration=soon"],
            "/leaderElection/leaseDuration",
        ),
        (
            &["--set", "database.existingSecret.name=Not_A_Name"],
            "/database/existingSecret/name",
        ),
        (&["--set", "replicas=2"], "'replicas' not allowed"),
        (&["--set", "image.tga=latest"], "'tga' not allowed"),
        (
            &[
                "--set",
                "networkPolicy.metricsFrom.podSelecter.app=prometheus",
            ],
            "'podSelecter' not allowed",
        ),
        (
            &["--set", "worker.defaultDatabaseSecret.url=postgres://x"],
            "'url' not allowed",
        ),
        (
            &["--set-string", "prometheusRule.enabled=yes"],
            "/prometheusRule/enabled",
        ),
        (
            &["--set", "prometheusRule.runbookBaseUrl=README.md"],
            "/prometheusRule/runbookBaseUrl",
        ),
        (
            &["--set", "podMonitor.namespaces[0]=Not_A_Namespace"],
            "/podMonitor/namespaces/0",
        ),
        (&["--set", "dashboard.lables.a=b"], "'lables' not allowed"),
    ];
    for (values, needle) in cases {
        ensure_schema_refuses(values, needle)?;
    }
    Ok(())
}

/// `helm template` with `values` fails the chart's schema, naming `needle`.
fn ensure_schema_refuses(values: &[&str], needle: &str) -> Result<()> {
    let mut args = vec!["template", RELEASE, CHART];
    args.extend(values);
    let output = helm(&args)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success()
            && stderr.contains("don't meet the specifications of the schema")
            && stderr.contains(needle),
        "helm {args:?} should fail naming {needle:?}; status {}, stderr:\n{stderr}",
        output.status
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// What the templates render (no API server)

#[test]
fn roles_render_exactly_the_operator_rules_files() -> Result<()> {
    for values in VALUE_SETS {
        let objects = render(values, &[])?;
        let role: ClusterRole = the(&objects, "ClusterRole")?;
        let rendered: Vec<PolicyRule> = role.rules.unwrap_or_default();
        ensure!(
            rendered == ControlPlane::operator_rules()?,
            "the ClusterRole's rules differ from files/operator-rules.yaml: {rendered:#?}"
        );
        let binding: ClusterRoleBinding = the(&objects, "ClusterRoleBinding")?;
        let deployment: Deployment = the(&objects, "Deployment")?;
        let pod = deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .context("pod spec")?;
        let subject = binding.subjects.unwrap_or_default();
        ensure!(
            subject.len() == 1
                && subject[0].kind == "ServiceAccount"
                && subject[0].namespace.as_deref() == Some(NAMESPACE)
                && Some(&subject[0].name) == pod.service_account_name.as_ref()
                && binding.role_ref.name == role.metadata.name.unwrap_or_default(),
            "the binding must bind the ClusterRole to the pods' ServiceAccount: {subject:?}"
        );
        // Leader election: a Role in the release namespace, bound to the same ServiceAccount.
        let lease_role: Role = the(&objects, "Role")?;
        let operator = operator_container(&deployment)?;
        let lease = env(operator, "SWITCHBOARD_LEASE_NAME")
            .and_then(|var| var.value.clone())
            .context("the operator's Lease name")?;
        ensure!(
            lease_role.rules.unwrap_or_default() == ControlPlane::leader_election_rules(&lease)?
                && lease_role.metadata.namespace.as_deref() == Some(NAMESPACE),
            "the Role must be files/leader-election-rules.yaml for Lease {lease} in {NAMESPACE}"
        );
        let lease_binding: RoleBinding = the(&objects, "RoleBinding")?;
        ensure!(
            lease_binding.subjects.unwrap_or_default() == subject
                && lease_binding.role_ref.kind == "Role"
                && lease_binding.role_ref.name == lease_role.metadata.name.unwrap_or_default()
                && lease_binding.metadata.namespace.as_deref() == Some(NAMESPACE),
            "the RoleBinding must bind the Role to the pods' ServiceAccount"
        );
    }
    Ok(())
}

#[test]
fn operator_deployment_is_restricted_probed_and_elects_a_leader_with_replicas() -> Result<()> {
    for (values, replicas, leader_election) in [(None, 1, "false"), (Some(HA_VALUES), 2, "true")] {
        let objects = render(values, &[])?;
        let deployment: Deployment = the(&objects, "Deployment")?;
        let spec = deployment.spec.as_ref().context("spec")?;
        ensure!(
            spec.replicas == Some(replicas),
            "replicas {:?}",
            spec.replicas
        );
        let pod = spec.template.spec.as_ref().context("pod spec")?;
        let pod_security = pod
            .security_context
            .as_ref()
            .context("pod securityContext")?;
        ensure!(pod_security.run_as_non_root == Some(true));
        ensure!(pod_security.run_as_user == Some(WORKER_UID));
        ensure!(
            pod_security
                .seccomp_profile
                .as_ref()
                .map(|p| p.type_.as_str())
                == Some("RuntimeDefault")
        );
        let container = operator_container(&deployment)?;
        let security = container
            .security_context
            .as_ref()
            .context("securityContext")?;
        ensure!(security.allow_privilege_escalation == Some(false));
        ensure!(security.read_only_root_filesystem == Some(true));
        ensure!(security.run_as_non_root == Some(true));
        ensure!(
            security.capabilities.as_ref().and_then(|c| c.drop.clone())
                == Some(vec!["ALL".to_owned()])
        );
        for (probe, path) in [
            (&container.liveness_probe, "/healthz"),
            (&container.readiness_probe, "/readyz"),
        ] {
            let get = probe.as_ref().and_then(|p| p.http_get.as_ref());
            ensure!(
                get.and_then(|g| g.path.as_deref()) == Some(path),
                "probe {path}: {probe:?}"
            );
        }
        let resources = container.resources.as_ref().context("resources")?;
        ensure!(resources.requests.is_some() && resources.limits.is_some());
        ensure!(
            env_value(container, "SWITCHBOARD_LEADER_ELECTION") == Some(leader_election),
            "leader election with {replicas} replica(s)"
        );
        let namespace = env(container, "POD_NAMESPACE")
            .and_then(|v| v.value_from.as_ref()?.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        ensure!(namespace == Some("metadata.namespace"), "POD_NAMESPACE");
    }
    Ok(())
}

/// The OTLP environment the chart gives the operator (for its own spans and, through the
/// `SWITCHBOARD_WORKER_*` settings, for every worker it builds).
const TELEMETRY_ENV: [&str; 7] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "SWITCHBOARD_WORKER_OTLP_ENDPOINT",
    "OTEL_TRACES_SAMPLER",
    "SWITCHBOARD_WORKER_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "SWITCHBOARD_WORKER_TRACES_SAMPLER_ARG",
];

/// The TCP ports the operator's NetworkPolicy lets it reach.
fn egress_ports(objects: &[Value]) -> Result<BTreeSet<i32>> {
    let policy: NetworkPolicy = the(objects, "NetworkPolicy")?;
    let egress = policy.spec.and_then(|s| s.egress).context("egress rules")?;
    Ok(egress
        .iter()
        .flat_map(|rule| rule.ports.iter().flatten())
        .filter(|port| port.protocol.as_deref() == Some("TCP"))
        .filter_map(|port| match port.port {
            Some(IntOrString::Int(number)) => Some(number),
            _ => None,
        })
        .collect())
}

#[test]
fn telemetry_values_give_the_operator_and_its_workers_the_otlp_endpoint_and_sampler() -> Result<()>
{
    let policy = ["--set", "networkPolicy.enabled=true"];
    let telemetry = [
        "--set",
        "telemetry.otlp.endpoint=http://collector.obs:4318",
        "--set",
        "telemetry.tracesSampler=parentbased_traceidratio",
        "--set-string",
        "telemetry.tracesSamplerArg=0.25",
        "--set",
        "networkPolicy.otlpPort=4319",
    ];
    let objects = render(None, &[&policy[..], &telemetry[..]].concat())?;
    let deployment: Deployment = the(&objects, "Deployment")?;
    let container = operator_container(&deployment)?;
    let rendered: Vec<_> = TELEMETRY_ENV
        .iter()
        .map(|name| (*name, env_value(container, name)))
        .collect();
    ensure!(
        rendered
            == [
                (
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    Some("http://collector.obs:4318")
                ),
                ("OTEL_SERVICE_NAME", Some("switchboard-operator")),
                (
                    "SWITCHBOARD_WORKER_OTLP_ENDPOINT",
                    Some("http://collector.obs:4318")
                ),
                ("OTEL_TRACES_SAMPLER", Some("parentbased_traceidratio")),
                (
                    "SWITCHBOARD_WORKER_TRACES_SAMPLER",
                    Some("parentbased_traceidratio")
                ),
                ("OTEL_TRACES_SAMPLER_ARG", Some("0.25")),
                ("SWITCHBOARD_WORKER_TRACES_SAMPLER_ARG", Some("0.25")),
            ],
        "{rendered:?}"
    );
    let ports = egress_ports(&objects)?;
    ensure!(ports.contains(&4319), "the OTLP port is allowed: {ports:?}");

    // Without an endpoint: no tracing environment at all, and no OTLP port.
    let objects = render(None, &policy)?;
    let deployment: Deployment = the(&objects, "Deployment")?;
    let container = operator_container(&deployment)?;
    let set: Vec<_> = TELEMETRY_ENV
        .iter()
        .filter(|name| env(container, name).is_some())
        .collect();
    ensure!(set.is_empty(), "without an endpoint: {set:?}");
    let ports = egress_ports(&objects)?;
    ensure!(!ports.contains(&4318), "no OTLP port: {ports:?}");

    // The schema refuses a sampler the SDK does not know and an endpoint without its scheme.
    ensure_schema_refuses(
        &["--set", "telemetry.tracesSampler=sometimes"],
        "/telemetry/tracesSampler",
    )?;
    ensure_schema_refuses(
        &["--set", "telemetry.otlp.endpoint=collector.obs:4318"],
        "'collector.obs:4318' does not match",
    )?;
    Ok(())
}

/// The operator's `--worker-pod-defaults` as the chart renders them with `values` and `extra`.
fn worker_pod_defaults(values: Option<&str>, extra: &[&str]) -> Result<PodDefaults> {
    let deployment: Deployment = the(&render(values, extra)?, "Deployment")?;
    let json = env_value(
        operator_container(&deployment)?,
        "SWITCHBOARD_WORKER_POD_DEFAULTS",
    )
    .context("SWITCHBOARD_WORKER_POD_DEFAULTS")?;
    PodDefaults::from_json(json).with_context(|| format!("the operator refuses {json}"))
}

#[test]
fn chart_renders_worker_pod_defaults_with_resources_and_the_charts_pull_secrets() -> Result<()> {
    // Defaults: requests and a memory limit (Burstable, never BestEffort), nothing else.
    let defaults = worker_pod_defaults(None, &[])?;
    ensure!(
        quantities(Some(&defaults.resources), "requests")
            == pairs(&[("cpu", "100m"), ("memory", "128Mi")])
            && quantities(Some(&defaults.resources), "limits") == pairs(&[("memory", "512Mi")]),
        "default worker resources {:?}",
        defaults.resources
    );
    let empty = PodDefaults {
        resources: defaults.resources.clone(),
        ..PodDefaults::default()
    };
    ensure!(defaults == empty, "only resources by default: {defaults:?}");
    // The chart's imagePullSecrets reach the workers unless worker.imagePullSecrets is set.
    let names = |defaults: &PodDefaults| -> Vec<String> {
        defaults
            .image_pull_secrets
            .iter()
            .map(|s| s.name.clone())
            .collect()
    };
    let inherited = worker_pod_defaults(None, &["--set", "imagePullSecrets[0].name=regcred"])?;
    ensure!(names(&inherited) == ["regcred"], "{inherited:?}");
    let own = worker_pod_defaults(
        None,
        &[
            "--set",
            "imagePullSecrets[0].name=regcred",
            "--set",
            "worker.imagePullSecrets[0].name=worker-regcred",
        ],
    )?;
    ensure!(names(&own) == ["worker-regcred"], "{own:?}");
    // Every default of ci/ha-values.yaml reaches the operator.
    let ha = worker_pod_defaults(Some(HA_VALUES), &[])?;
    ensure!(names(&ha) == ["worker-regcred"], "{ha:?}");
    ensure!(ha.service_account_name == "queue-workers", "{ha:?}");
    ensure!(ha.node_selector == pairs(&[("pool", "queues")]), "{ha:?}");
    ensure!(
        ha.tolerations.len() == 1 && ha.tolerations[0].key.as_deref() == Some("dedicated"),
        "{ha:?}"
    );
    ensure!(ha.priority_class_name == "queue-workers", "{ha:?}");
    ensure!(
        quantities(Some(&ha.resources), "limits") == pairs(&[("memory", "1Gi")]),
        "{ha:?}"
    );
    ensure!(
        ha.pod_annotations == pairs(&[("team", "platform")])
            && ha.pod_labels == pairs(&[("team", "platform")]),
        "{ha:?}"
    );
    Ok(())
}

/// The operator's `SWITCHBOARD_DEFAULT_DATABASE_CA` as the chart renders it with `extra`,
/// parsed as the operator parses it.
fn default_database_ca(extra: &[&str]) -> Result<Option<DefaultCa>> {
    let deployment: Deployment = the(&render(None, extra)?, "Deployment")?;
    env_value(
        operator_container(&deployment)?,
        "SWITCHBOARD_DEFAULT_DATABASE_CA",
    )
    .map(|text| DefaultCa::parse(text).map_err(anyhow::Error::msg))
    .transpose()
}

#[test]
fn chart_default_database_ca_reaches_the_operator_as_a_reference_it_parses() -> Result<()> {
    ensure!(
        default_database_ca(&[])?.is_none(),
        "no worker.defaultDatabaseCa, no default CA"
    );
    let secret = default_database_ca(&[
        "--set",
        "worker.defaultDatabaseCa.caSecretRef.name=pg-ca",
        "--set",
        "worker.defaultDatabaseCa.caSecretRef.key=ca.crt",
    ])?;
    ensure!(
        secret
            == Some(DefaultCa::Secret(SecretKeyRef {
                name: "pg-ca".into(),
                key: "ca.crt".into(),
            })),
        "{secret:?}"
    );
    let config_map = default_database_ca(&[
        "--set",
        "worker.defaultDatabaseCa.caConfigMapRef.name=pg-cluster-ca",
        "--set",
        "worker.defaultDatabaseCa.caConfigMapRef.key=ca.crt",
    ])?;
    ensure!(
        config_map
            == Some(DefaultCa::ConfigMap(ConfigMapKeyRef {
                name: "pg-cluster-ca".into(),
                key: "ca.crt".into(),
            })),
        "{config_map:?}"
    );
    // Both: the values schema refuses them, naming the value.
    let both = render(
        None,
        &[
            "--set",
            "worker.defaultDatabaseCa.caSecretRef.name=pg-ca",
            "--set",
            "worker.defaultDatabaseCa.caSecretRef.key=ca.crt",
            "--set",
            "worker.defaultDatabaseCa.caConfigMapRef.name=pg-cluster-ca",
            "--set",
            "worker.defaultDatabaseCa.caConfigMapRef.key=ca.crt",
        ],
    )
    .err()
    .context("both CA references render")?;
    ensure!(
        format!("{both:#}").contains("/worker/defaultDatabaseCa"),
        "{both:#}"
    );
    Ok(())
}

#[test]
fn operator_disruption_budget_comes_with_more_than_one_replica_and_never_blocks_a_drain()
-> Result<()> {
    ensure!(
        !kinds(&render(None, &[])?).contains("PodDisruptionBudget"),
        "one replica: no budget"
    );
    let objects = render(Some(HA_VALUES), &[])?;
    let budget: PodDisruptionBudget = the(&objects, "PodDisruptionBudget")?;
    let deployment: Deployment = the(&objects, "Deployment")?;
    let spec = budget.spec.context("budget spec")?;
    ensure!(
        spec.max_unavailable == Some(IntOrString::Int(1)) && spec.min_available.is_none(),
        "maxUnavailable 1, no minAvailable: {spec:?}"
    );
    let selected = spec.selector.and_then(|s| s.match_labels);
    let operator = deployment.spec.context("spec")?.selector.match_labels;
    ensure!(
        selected.is_some() && selected == operator,
        "the budget selects the operator pods: {selected:?} vs {operator:?}"
    );
    ensure!(
        !kinds(&render(
            Some(HA_VALUES),
            &["--set", "podDisruptionBudget.enabled=false"]
        )?)
        .contains("PodDisruptionBudget"),
        "podDisruptionBudget.enabled=false turns it off"
    );
    Ok(())
}

#[test]
fn database_url_is_only_referenced_from_a_secret_the_user_or_the_chart_owns() -> Result<()> {
    // (values, the Secret and key the operator reads, whether the chart creates it)
    let cases = [
        (None, "switchboard-db", "url", false),
        (Some(HA_VALUES), "operator-db", "dsn", false),
        (Some(CREATED_SECRET_VALUES), "sb-database", "url", true),
    ];
    for (values, name, key, created) in cases {
        let objects = render(values, &[])?;
        let deployment: Deployment = the(&objects, "Deployment")?;
        let container = operator_container(&deployment)?;
        let reference = env(container, "DATABASE_URL")
            .and_then(|v| v.value_from.as_ref()?.secret_key_ref.as_ref())
            .context("DATABASE_URL comes from a Secret")?;
        ensure!(
            reference.name == name && reference.key == key,
            "{values:?}: {reference:?}"
        );
        let secrets: Vec<&Value> = objects.iter().filter(|o| kind_of(o) == "Secret").collect();
        ensure!(
            secrets.len() == usize::from(created),
            "{values:?}: {} Secrets",
            secrets.len()
        );
        if created {
            ensure!(secrets[0]["metadata"]["name"] == name);
            ensure!(secrets[0]["stringData"][key].as_str() == Some(DATABASE_URL_IN_VALUES));
        }
        ensure!(
            objects
                .iter()
                .filter(|o| kind_of(o) == "ConfigMap")
                .all(|o| o["metadata"]["labels"]["grafana_dashboard"] == "1"),
            "no ConfigMap but the dashboard's"
        );
        // The URL appears in the Secret only: never in an env value, annotation or label.
        for object in objects.iter().filter(|o| kind_of(o) != "Secret") {
            let text = object.to_string();
            ensure!(
                !text.contains("postgres://"),
                "{values:?}: a database URL outside a Secret in {object}"
            );
        }
    }
    Ok(())
}

#[test]
fn dashboard_config_map_carries_the_dashboard_file_for_the_grafana_sidecar() -> Result<()> {
    let file = std::fs::read_to_string(workspace_path("charts/switchboard/files/dashboard.json"))?;
    serde_json::from_str::<Value>(&file).context("files/dashboard.json is JSON")?;
    let config_map: Value = the(&render(Some(HA_VALUES), &[])?, "ConfigMap")?;
    let metadata = &config_map["metadata"];
    ensure!(
        config_map["data"]["dashboard.json"].as_str() == Some(file.as_str())
            && metadata["labels"]["grafana_dashboard"] == "1"
            && metadata["annotations"]["grafana_folder"] == "Switchboard"
            && metadata["namespace"] == NAMESPACE,
        "the dashboard ConfigMap: {metadata}"
    );
    let elsewhere: Value = the(
        &render(
            None,
            &[
                "--set",
                "dashboard.enabled=true",
                "--set",
                "dashboard.namespace=monitoring",
            ],
        )?,
        "ConfigMap",
    )?;
    ensure!(elsewhere["metadata"]["namespace"] == "monitoring");
    Ok(())
}

/// The URL of `ci/created-secret-values.yaml`.
const DATABASE_URL_IN_VALUES: &str =
    "postgres://switchboard:not-a-real-password@postgres.switchboard-dev.svc:5432/switchboard";

#[test]
fn names_and_labels_follow_helm_conventions() -> Result<()> {
    let objects = render(Some(CREATED_SECRET_VALUES), &[])?;
    for object in &objects {
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        // The CRD's name is its group's, whatever the release.
        ensure!(
            name.starts_with("sb") || kind_of(object) == "CustomResourceDefinition",
            "fullnameOverride: {name}"
        );
        let labels = &object["metadata"]["labels"];
        for label in [
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/managed-by",
            "helm.sh/chart",
        ] {
            ensure!(labels[label].is_string(), "{name} lacks label {label}");
        }
    }
    let renamed = render(None, &["--set", "nameOverride=queues"])?;
    let deployment: Deployment = the(&renamed, "Deployment")?;
    ensure!(deployment.metadata.name.as_deref() == Some("switchboard-queues"));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Acceptance 2: the real API server accepts every rendered object

/// Server-side applies `object` as helm's field manager with strict field validation (unknown or
/// duplicate fields are errors); `dry_run`: dryRun=All, nothing is stored.
async fn server_side_apply(client: &Client, object: &Value, dry_run: bool) -> Result<()> {
    let object: DynamicObject = serde_json::from_value(object.clone())?;
    let types = object.types.as_ref().context("apiVersion and kind")?;
    let gvk = GroupVersionKind::try_from(types)?;
    let (resource, capabilities) = kube::discovery::pinned_kind(client, &gvk).await?;
    let api: Api<DynamicObject> = match capabilities.scope {
        Scope::Namespaced => Api::namespaced_with(
            client.clone(),
            object.metadata.namespace.as_deref().unwrap_or(NAMESPACE),
            &resource,
        ),
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    };
    let mut params = PatchParams::apply("helm").force().validation_strict();
    if dry_run {
        params = params.dry_run();
    }
    let name = object.metadata.name.clone().context("a name")?;
    api.patch(&name, &params, &Patch::Apply(&object))
        .await
        .with_context(|| format!("applying {} {name}", gvk.kind))?;
    Ok(())
}

async fn create_crd(client: &Client, yaml: &str) -> Result<()> {
    let crd: CustomResourceDefinition = serde_yaml_ng::from_str(yaml)?;
    let name = crd.metadata.name.clone().context("CRD name")?;
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    api.create(&PostParams::default(), &crd).await?;
    wait_object(&api, &name, "the CRD is Established", |crd| {
        crd.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            })
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn every_rendered_object_is_accepted_by_the_api_server_with_every_values_set() -> Result<()> {
    let plane = ControlPlane::start().await?;
    let admin = plane.admin().await?;
    plane.create_namespace(NAMESPACE).await?;
    for crd in MONITORING_CRDS {
        create_crd(&admin, crd).await?;
    }
    let mut applied = 0;
    for values in VALUE_SETS {
        let objects = render(values, &[])?;
        let rendered = kinds(&objects);
        for kind in [
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Service",
            "Deployment",
        ] {
            ensure!(rendered.contains(kind), "{values:?}: no {kind}");
        }
        let optional = [
            "ServiceMonitor",
            "NetworkPolicy",
            "PodMonitor",
            "PrometheusRule",
            "ConfigMap",
        ]
        .map(|k| rendered.contains(k));
        ensure!(
            optional == [values == Some(HA_VALUES); 5],
            "{values:?}: ServiceMonitor, NetworkPolicy, PodMonitor, PrometheusRule and the \
             dashboard's ConfigMap only when enabled"
        );
        for object in &objects {
            server_side_apply(&admin, object, true)
                .await
                .with_context(|| format!("values {values:?}"))?;
            applied += 1;
        }
    }
    // The kind path's dev manifests too (their namespaces for real, the rest dry-run).
    for file in ["namespaces", "postgres", "redis", "secrets"] {
        let path = workspace_path(&format!("examples/dev/{file}.yaml"));
        for object in yaml_documents(&std::fs::read_to_string(&path)?)? {
            let dry_run = file != "namespaces";
            server_side_apply(&admin, &object, dry_run)
                .await
                .with_context(|| path.display().to_string())?;
            applied += 1;
        }
    }
    println!("{applied} objects accepted");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Acceptance 3: the chart's RBAC suffices for the operator, and each part of it is needed

/// The chart installed for real (the database URL in an existing Secret), its ServiceAccount's
/// token from the TokenRequest API, and the chart's operator container running locally with it.
struct ChartOperator {
    env: OperatorEnv,
    pod: LocalPod,
}

impl ChartOperator {
    /// `values`: helm arguments (the database URL must come from Secret `operator-db`, key
    /// `dsn`). `drop_rule`: leave out the rendered ClusterRole's and Role's rules matching it.
    async fn start(values: &[&str], drop_rule: impl Fn(&PolicyRule) -> bool) -> Result<Self> {
        let env = OperatorEnv::start().await?;
        let plane = &env.plane;
        plane.create_namespace(NAMESPACE).await?;
        for crd in MONITORING_CRDS {
            create_crd(&env.admin, crd).await?;
        }
        plane
            .put_secret(NAMESPACE, "operator-db", "dsn", &env.fixture.postgres.url())
            .await?;
        for mut object in render(None, values)? {
            if matches!(kind_of(&object), "ClusterRole" | "Role") {
                let rules: Vec<PolicyRule> = serde_json::from_value(object["rules"].clone())?;
                let kept: Vec<PolicyRule> = rules.into_iter().filter(|r| !drop_rule(r)).collect();
                object["rules"] = serde_json::to_value(kept)?;
            }
            server_side_apply(&env.admin, &object, false).await?;
        }
        let account = "switchboard";
        let token = plane.kubectl_ok(&[
            "create",
            "token",
            account,
            "--namespace",
            NAMESPACE,
            "--duration",
            "1h",
        ])?;
        let mut kubeconfig = Kubeconfig::read_from(&plane.admin_kubeconfig)?;
        for user in &mut kubeconfig.auth_infos {
            if let Some(auth) = user.auth_info.as_mut() {
                auth.token = Some(token.trim().to_owned().into());
            }
        }
        let kubeconfig_path = env.fixture.dir.path().join("service-account.kubeconfig");
        std::fs::write(&kubeconfig_path, serde_yaml_ng::to_string(&kubeconfig)?)?;

        // What the kubelet would do with the in-cluster config, done with a kubeconfig: the
        // process runs outside the cluster.
        let mut deployment = Api::<Deployment>::namespaced(env.admin.clone(), NAMESPACE)
            .get(RELEASE)
            .await?;
        let container = deployment
            .spec
            .as_mut()
            .and_then(|s| s.template.spec.as_mut())
            .and_then(|p| p.containers.first_mut())
            .context("the chart's Deployment has a container")?;
        container.env.get_or_insert_with(Vec::new).push(EnvVar {
            name: "KUBECONFIG".to_owned(),
            value: Some(kubeconfig_path.display().to_string()),
            ..EnvVar::default()
        });
        let pod = LocalPod::start(
            &env.admin,
            &deployment,
            "switchboard-5d8f9c7b4-x2k9q",
            env.fixture.dir.path(),
        )
        .await?;
        let probe = pod.container.readiness_probe.clone();
        wait_for(
            OPERATOR_TIMEOUT,
            "the operator's readiness probe passes",
            || {
                let probe = probe.clone();
                let pod = &pod;
                async move { Ok(pod.probe(probe.as_ref()).await? == 200) }
            },
        )
        .await
        .with_context(|| pod.log_tail())?;
        Ok(Self { env, pod })
    }
}

#[tokio::test]
async fn operator_with_the_charts_service_account_reconciles_an_adapter_end_to_end() -> Result<()> {
    // Two replicas: leader election on, so the Lease rule is exercised too.
    let mut chart = ChartOperator::start(&["--values", HA_VALUES], |_| false).await?;
    let env = &chart.env;
    // Two workers: the operator writes their PodDisruptionBudget with the chart's RBAC.
    env.apply_adapter(&format!("{ADAPTER}  workload: {{replicas: 2}}\n"))
        .await?;
    let worker_deployment = worker_name("orders");
    let deployment = env
        .wait_deployment(&worker_deployment, "the worker Deployment exists", |_| true)
        .await
        .with_context(|| chart.pod.log_tail())?;
    // The chart's worker settings (ci/ha-values.yaml) reach the worker Deployment.
    let worker = operator_container(&deployment)?;
    ensure!(
        worker.image.as_deref() == Some("registry.example/switchboard-worker:0.1.0-rc.1")
            && worker.image_pull_policy.as_deref() == Some("Always"),
        "worker image {:?}, pull policy {:?}",
        worker.image,
        worker.image_pull_policy
    );
    // So do the worker pod defaults.
    let pod = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("pod spec")?;
    ensure!(
        pod.service_account_name.as_deref() == Some("queue-workers")
            && pod.priority_class_name.as_deref() == Some("queue-workers")
            && pod
                .node_selector
                .as_ref()
                .is_some_and(|n| n["pool"] == "queues")
            && pod.tolerations.as_ref().is_some_and(|t| t.len() == 1)
            && pod
                .image_pull_secrets
                .as_ref()
                .is_some_and(|s| s[0].name == "worker-regcred"),
        "the chart's worker pod defaults: {pod:?}"
    );
    ensure!(
        quantities(worker.resources.as_ref(), "limits") == pairs(&[("memory", "1Gi")]),
        "the chart's worker resources: {:?}",
        worker.resources
    );
    let budgets = Api::<PodDisruptionBudget>::namespaced(env.admin.clone(), "shop");
    wait_object(
        &budgets,
        &worker_deployment,
        "the worker PodDisruptionBudget",
        |_| true,
    )
    .await
    .with_context(|| chart.pod.log_tail())?;
    // The chart's PodMonitor (ci/ha-values.yaml) selects the pods of the worker Deployment the
    // operator wrote, on their metrics port, as job `switchboard-worker` (the alerts' job).
    let monitor: Value = the(&render(Some(HA_VALUES), &[])?, "PodMonitor")?;
    let pod_template = &deployment.spec.as_ref().context("spec")?.template;
    let pod_labels = pod_template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    let selector = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("PodMonitor matchLabels")?;
    ensure!(
        !selector.is_empty()
            && selector
                .iter()
                .all(|(key, value)| pod_labels.get(key).map(String::as_str) == value.as_str()),
        "PodMonitor selector {selector:?} vs worker pod labels {pod_labels:?}"
    );
    let job_label = monitor["spec"]["jobLabel"].as_str().unwrap_or_default();
    ensure!(
        pod_labels.get(job_label).map(String::as_str) == Some("switchboard-worker"),
        "jobLabel {job_label}: the job is switchboard-worker"
    );
    let ports: Vec<String> = worker
        .ports
        .iter()
        .flatten()
        .filter_map(|port| port.name.clone())
        .collect();
    let endpoints = monitor["spec"]["podMetricsEndpoints"]
        .as_array()
        .context("podMetricsEndpoints")?;
    ensure!(
        !endpoints.is_empty()
            && endpoints.iter().all(|e| {
                e["port"]
                    .as_str()
                    .is_some_and(|p| ports.iter().any(|n| n == p))
                    && e["path"] == "/metrics"
            }),
        "PodMonitor endpoints {endpoints:?} vs the worker's ports {ports:?}"
    );
    ensure!(
        monitor["spec"]["namespaceSelector"]["matchNames"]
            .as_array()
            .is_some_and(|names| names.iter().any(|n| n == "shop")),
        "the PodMonitor watches the adapter's namespace: {}",
        monitor["spec"]["namespaceSelector"]
    );
    env.mark_deployment_available(&worker_deployment).await?;
    let adapter = env
        .wait_adapter("orders", "the adapter is Ready", |adapter| {
            condition(adapter, "Ready").is_some_and(|c| c.status == "True")
                && adapter.status.as_ref().and_then(|s| s.observed_generation)
                    == adapter.metadata.generation
        })
        .await
        .with_context(|| chart.pod.log_tail())?;
    let row = env
        .adapter_row("orders")
        .await?
        .context("the adapters row exists")?;
    ensure!(row.family == "queue" && row.enabled, "{row:?}");
    ensure!(
        chart.pod.is_running(),
        "the operator keeps running\n{}",
        chart.pod.log_tail()
    );
    let lease = Api::<Lease>::namespaced(env.admin.clone(), NAMESPACE)
        .get(RELEASE)
        .await
        .context("the chart's leader Lease")?;
    let holder = lease.spec.and_then(|s| s.holder_identity);
    ensure!(
        holder.is_some_and(|h| !h.is_empty()),
        "the operator holds the Lease"
    );

    // The chart's worker.allowedImages (ci/ha-values.yaml) reach the operator: an allowed
    // custom image runs, any other is refused before a pod could receive the Secrets.
    let with_image = |name: &str, image: &str| {
        ADAPTER
            .replace("name: orders,", &format!("name: {name},"))
            .replace(
                "  target:",
                &format!("  workload: {{image: {image}}}\n  target:"),
            )
    };
    let allowed = "mirror.example/switchboard:0.1.0";
    env.apply_adapter(&with_image("mirrored", allowed)).await?;
    let mirrored = env
        .wait_deployment(
            &worker_name("mirrored"),
            "the allowed image's Deployment",
            |_| true,
        )
        .await
        .with_context(|| chart.pod.log_tail())?;
    let image = operator_container(&mirrored)?.image.clone();
    ensure!(image.as_deref() == Some(allowed), "worker image {image:?}");
    env.apply_adapter(&with_image(
        "foreign",
        "elsewhere.example/switchboard:0.1.0",
    ))
    .await?;
    env.wait_adapter("foreign", "Reconciled=False ImageNotAllowed", |adapter| {
        condition(adapter, "Reconciled")
            .is_some_and(|c| c.status == "False" && c.reason == "ImageNotAllowed")
    })
    .await
    .with_context(|| chart.pod.log_tail())?;
    ensure!(
        env.deployments()
            .get_opt(&worker_name("foreign"))
            .await?
            .is_none(),
        "a refused image gets no Deployment"
    );
    println!(
        "reconciled with the chart's ServiceAccount: {:?}",
        condition(&adapter, "Reconciled")
    );

    // …and reads no Secret: a real GET with its token is refused, and `kubectl auth can-i` as
    // the ServiceAccount says no, for one nobody references, the adapter's own and the
    // operator's database Secret.
    env.plane
        .put_secret("shop", "unreferenced", "password", "hunter2")
        .await?;
    let kubeconfig = env.fixture.dir.path().join("service-account.kubeconfig");
    let chart_identity = switchboard_tests::control_plane::client(&kubeconfig).await?;
    let account = format!("system:serviceaccount:{NAMESPACE}:switchboard");
    for (namespace, name) in [
        ("shop", "unreferenced"),
        ("shop", "redis"),
        (NAMESPACE, "operator-db"),
    ] {
        let got = Api::<Secret>::namespaced(chart_identity.clone(), namespace)
            .get(name)
            .await;
        ensure!(
            matches!(got, Err(kube::Error::Api(status)) if status.code == 403),
            "GET Secret {namespace}/{name} with the chart's token is not 403"
        );
        let secret = format!("secret/{name}");
        let args = [
            "auth", "can-i", "get", &secret, "-n", namespace, "--as", &account,
        ];
        let output = env.plane.kubectl(&args)?;
        let answer = String::from_utf8_lossy(&output.stdout);
        ensure!(answer.trim() == "no", "kubectl {args:?}: {answer}");
    }
    Ok(())
}

#[tokio::test]
async fn operator_without_the_charts_deployments_rule_cannot_reconcile() -> Result<()> {
    let values = [
        "--set",
        "database.existingSecret.name=operator-db,database.existingSecret.key=dsn",
    ];
    let chart = ChartOperator::start(&values, |rule| {
        rule.resources
            .as_ref()
            .is_some_and(|r| r.iter().any(|r| r == "deployments"))
    })
    .await?;
    let env = &chart.env;
    env.apply_adapter(ADAPTER).await?;
    let adapter = env
        .wait_adapter(
            "orders",
            "the adapter reports the forbidden Deployment",
            |adapter| {
                condition(adapter, "Reconciled").is_some_and(|c| {
                    c.status == "False" && c.message.to_lowercase().contains("forbidden")
                })
            },
        )
        .await
        .with_context(|| chart.pod.log_tail())?;
    let message = &condition(&adapter, "Reconciled")
        .context("Reconciled")?
        .message;
    ensure!(
        message.contains("system:serviceaccount:switchboard:switchboard"),
        "the operator must act as the chart's ServiceAccount: {message}"
    );
    ensure!(
        env.deployments()
            .get_opt(&worker_name("orders"))
            .await?
            .is_none(),
        "no worker Deployment without the rule"
    );
    // One replica: the chart turns leader election off, so there is no Lease.
    ensure!(
        Api::<Lease>::namespaced(env.admin.clone(), NAMESPACE)
            .get_opt(RELEASE)
            .await?
            .is_none(),
        "leader election is off with one replica"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Acceptance 4: the chart's CRD and versions

/// The CRDs `helm template` renders with `extra` arguments.
fn rendered_crds(extra: &[&str]) -> Result<Vec<Value>> {
    Ok(render(None, extra)?
        .into_iter()
        .filter(|object| kind_of(object) == "CustomResourceDefinition")
        .collect())
}

/// `value` with every number a float: helm's `fromYaml`/`toYaml` write `604800.0` as `604800`.
fn numbers_as_floats(value: Value) -> Value {
    match value {
        Value::Number(n) => n.as_f64().map_or(Value::Number(n), Value::from),
        Value::Array(items) => Value::Array(items.into_iter().map(numbers_as_floats).collect()),
        Value::Object(fields) => Value::Object(
            fields
                .into_iter()
                .map(|(key, value)| (key, numbers_as_floats(value)))
                .collect(),
        ),
        other => other,
    }
}

#[test]
fn chart_renders_the_generated_crd_from_its_only_copy_with_the_releases_labels() -> Result<()> {
    // One copy: crds/ links to the file in the chart that `switchboard-operator crd` writes
    // (checked against the API types by the operator's `committed_crd_matches_the_api_types`).
    let (repository_copy, chart_copy) = (workspace_path(CRD_FILE), workspace_path(CHART_CRD));
    ensure!(
        repository_copy.canonicalize()? == chart_copy.canonicalize()?,
        "{CRD_FILE} must be a link to {CHART_CRD}: `ln -sf ../{CHART_CRD} {CRD_FILE}`"
    );
    let generated: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&chart_copy)?)?;
    let [mut rendered] = <[Value; 1]>::try_from(rendered_crds(&[])?)
        .map_err(|crds| anyhow::anyhow!("{} CRDs rendered, not one", crds.len()))?;
    let metadata = rendered["metadata"]
        .as_object_mut()
        .context("the CRD's metadata")?;
    let labels = metadata.remove("labels").unwrap_or_default();
    metadata.remove("annotations");
    ensure!(
        numbers_as_floats(rendered) == numbers_as_floats(generated),
        "the rendered CRD differs from {CHART_CRD} (beyond its labels and annotations)"
    );
    ensure!(
        labels["app.kubernetes.io/managed-by"] == "Helm"
            && labels["app.kubernetes.io/instance"] == RELEASE,
        "the CRD carries the release's labels: {labels}"
    );
    Ok(())
}

#[test]
fn crd_is_kept_on_uninstall_unless_keep_is_false_and_absent_unless_install_is_true() -> Result<()> {
    let keep_annotation = |crds: &[Value]| -> Vec<Value> {
        crds.iter()
            .map(|crd| crd["metadata"]["annotations"]["helm.sh/resource-policy"].clone())
            .collect()
    };
    ensure!(
        keep_annotation(&rendered_crds(&[])?) == [Value::from("keep")],
        "by default the one CRD is annotated helm.sh/resource-policy: keep"
    );
    ensure!(
        keep_annotation(&rendered_crds(&["--set", "crds.keep=false"])?) == [Value::Null],
        "with crds.keep=false the one CRD has no resource policy"
    );
    ensure!(
        rendered_crds(&["--set", "crds.install=false"])?.is_empty(),
        "with crds.install=false no CRD is rendered"
    );
    Ok(())
}

#[test]
fn chart_versions_are_the_crates_and_description_names_every_broker() -> Result<()> {
    let chart: serde_yaml_ng::Value = serde_yaml_ng::from_str(&std::fs::read_to_string(
        workspace_path("charts/switchboard/Chart.yaml"),
    )?)?;
    let description = chart["description"].as_str().context("description")?;
    for broker in switchboard_api::BROKERS {
        // Every broker by the name its users know it by.
        let name = match *broker {
            "amqp" => "rabbitmq",
            other => other,
        };
        ensure!(
            description.to_lowercase().contains(name),
            "Chart.yaml's description leaves out {name}: {description}"
        );
    }
    for file in ["Chart.yaml", "values.yaml"] {
        ensure!(
            !std::fs::read_to_string(workspace_path(&format!("charts/switchboard/{file}")))?
                .contains("example.invalid"),
            "{file} points at placeholder addresses"
        );
    }
    let crate_version = env!("CARGO_PKG_VERSION");
    for key in ["version", "appVersion"] {
        ensure!(
            chart[key].as_str() == Some(crate_version),
            "Chart.yaml {key} is {:?}, the crates are {crate_version}",
            chart[key]
        );
    }
    let metadata = cargo_metadata()?;
    for package in metadata["packages"].as_array().context("packages")? {
        ensure!(
            package["version"] == crate_version,
            "{} has version {}",
            package["name"],
            package["version"]
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Acceptance 5: Dockerfile and kind scripts, statically

fn cargo_metadata() -> Result<Value> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(workspace_path(""))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .stdin(Stdio::null())
        .output()?;
    ensure!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// Dockerfile instructions with continuation lines joined, comments dropped: (INSTRUCTION, rest).
fn dockerfile_instructions(text: &str) -> Vec<(String, String)> {
    let mut joined = Vec::new();
    let mut current = String::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                joined.push(std::mem::take(&mut current));
            }
        }
    }
    joined
        .into_iter()
        .filter_map(|line| {
            let (instruction, rest) = line.split_once(char::is_whitespace)?;
            Some((instruction.to_uppercase(), rest.trim().to_owned()))
        })
        .collect()
}

#[test]
fn dockerfile_copies_existing_sources_and_installs_the_binaries_cargo_builds() -> Result<()> {
    let text = std::fs::read_to_string(workspace_path("Dockerfile"))?;
    let instructions = dockerfile_instructions(&text);
    let ignored: Vec<String> = std::fs::read_to_string(workspace_path(".dockerignore"))?
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    let metadata = cargo_metadata()?;
    let root = workspace_path("").canonicalize()?;

    // Every source copied from the context exists and is not excluded by .dockerignore; every
    // workspace member and the migrations are copied.
    let mut copied = BTreeSet::new();
    for (_, rest) in instructions
        .iter()
        .filter(|(i, rest)| i == "COPY" && !rest.starts_with("--from"))
    {
        let words: Vec<&str> = rest.split_whitespace().collect();
        for source in &words[..words.len() - 1] {
            ensure!(
                root.join(source).exists(),
                "Dockerfile copies missing {source}"
            );
            ensure!(
                !ignored.iter().any(|pattern| pattern == source),
                ".dockerignore excludes {source}, which the Dockerfile copies"
            );
            copied.insert((*source).to_owned());
        }
    }
    let mut needed = vec![
        "Cargo.toml".to_owned(),
        "Cargo.lock".to_owned(),
        "migrations".to_owned(),
    ];
    for package in metadata["packages"].as_array().context("packages")? {
        let manifest = PathBuf::from(package["manifest_path"].as_str().context("manifest")?);
        let dir = manifest.parent().context("package dir")?.canonicalize()?;
        needed.push(dir.strip_prefix(&root)?.display().to_string());
    }
    for path in needed {
        ensure!(
            copied.contains(&path),
            "the Dockerfile does not copy {path}"
        );
    }

    // The binaries the runtime stage installs are bin targets of the packages the build builds,
    // and they are the two the chart and the operator run.
    let bins: BTreeSet<(String, String)> = metadata["packages"]
        .as_array()
        .context("packages")?
        .iter()
        .flat_map(|package| {
            let name = package["name"].as_str().unwrap_or_default().to_owned();
            package["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| {
                    t["kind"]
                        .as_array()
                        .is_some_and(|k| k.iter().any(|k| k == "bin"))
                })
                .map(move |t| {
                    (
                        name.clone(),
                        t["name"].as_str().unwrap_or_default().to_owned(),
                    )
                })
        })
        .collect();
    let build = instructions
        .iter()
        .find(|(i, rest)| i == "RUN" && rest.contains("cargo build"))
        .context("a RUN cargo build")?;
    // The words of the `cargo build …` command, up to the next `&&`.
    let words: Vec<&str> = build
        .1
        .split_whitespace()
        .skip_while(|w| *w != "cargo")
        .take_while(|w| *w != "&&")
        .collect();
    let built_packages: BTreeSet<&str> = words
        .windows(2)
        .filter(|w| w[0] == "-p" || w[0] == "--package")
        .map(|w| w[1])
        .collect();
    // Where cargo puts what it built: the profile's folder (`--profile dist` → target/dist).
    let profile = if words.contains(&"--release") {
        "release"
    } else {
        words
            .windows(2)
            .find(|w| w[0] == "--profile")
            .map_or("debug", |w| w[1])
    };
    let installed: BTreeSet<String> = instructions
        .iter()
        .filter(|(i, rest)| i == "COPY" && rest.starts_with("--from"))
        .flat_map(|(_, rest)| {
            let words: Vec<&str> = rest.split_whitespace().skip(1).collect();
            words[..words.len().saturating_sub(1)]
                .iter()
                .filter_map(|path| path.rsplit('/').next().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect();
    for binary in &installed {
        ensure!(
            bins.iter()
                .any(|(package, bin)| bin == binary && built_packages.contains(package.as_str())),
            "the image installs {binary}, which is no bin target of the packages built \
             ({built_packages:?}); cargo's bins: {bins:?}"
        );
        ensure!(
            build.1.contains(&format!("target/{profile}/{binary}")),
            "the build stage does not copy out {binary}"
        );
    }
    let objects = render(None, &[])?;
    let deployment: Deployment = the(&objects, "Deployment")?;
    let chart_command = operator_container(&deployment)?
        .command
        .clone()
        .unwrap_or_default();
    let expected: BTreeSet<String> = [chart_command.join(" "), WORKER_COMMAND.to_owned()].into();
    ensure!(
        installed == expected,
        "the image must hold exactly the chart's and the operator's commands {expected:?}, it \
         holds {installed:?}"
    );
    let user = instructions
        .iter()
        .rfind(|(i, _)| i == "USER")
        .context("a USER")?;
    ensure!(
        user.1 == format!("{WORKER_UID}:{WORKER_UID}"),
        "USER {} is not the uid the pods run as ({WORKER_UID})",
        user.1
    );
    Ok(())
}

/// Runs a kind script with `KIND_DRY_RUN=1`: the commands it would run.
fn kind_dry_run(script: &str) -> Result<Vec<Vec<String>>> {
    let output = Command::new("bash")
        .arg(workspace_path(&format!("scripts/{script}")))
        .env("KIND_DRY_RUN", "1")
        .env_remove("IMAGE")
        .env_remove("KIND_CLUSTER")
        .env_remove("HELM")
        .stdin(Stdio::null())
        .output()?;
    ensure!(
        output.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?
        .lines()
        .filter_map(|line| line.strip_prefix("+ "))
        .map(|command| command.split(' ').map(str::to_owned).collect())
        .collect())
}

/// The value after `flag` in `command`.
fn flag<'a>(command: &'a [String], flag: &str) -> Option<&'a str> {
    command
        .windows(2)
        .find(|w| w[0] == flag)
        .map(|w| w[1].as_str())
}

#[test]
fn kind_scripts_build_and_load_the_image_the_chart_deploys_by_default() -> Result<()> {
    let up = kind_dry_run("kind-up.sh")?;
    let demo = kind_dry_run("kind-demo.sh")?;
    let down = kind_dry_run("kind-down.sh")?;
    let starts = |command: &[String], prefix: &[&str]| {
        command.len() >= prefix.len() && command.iter().zip(prefix).all(|(a, b)| a == b)
    };
    let find = |commands: &[Vec<String>], prefix: &[&str]| -> Result<Vec<String>> {
        commands
            .iter()
            .find(|c| starts(c, prefix))
            .cloned()
            .with_context(|| format!("no `{}` in {commands:?}", prefix.join(" ")))
    };

    // The image: built, loaded, and the one the chart's defaults deploy for both binaries.
    let build = find(&up, &["docker", "build"])?;
    let built = flag(&build, "--tag").context("docker build --tag")?;
    let load = find(&up, &["kind", "load", "docker-image"])?;
    ensure!(
        load[3] == built,
        "kind loads {} but docker builds {built}",
        load[3]
    );
    ensure!(flag(&build, "--file") == Some("Dockerfile"));
    let objects = render(None, &[])?;
    let deployment: Deployment = the(&objects, "Deployment")?;
    let container = operator_container(&deployment)?;
    ensure!(
        container.image.as_deref() == Some(built),
        "the chart deploys {:?}, the kind scripts load {built}",
        container.image
    );
    ensure!(
        env_value(container, "SWITCHBOARD_WORKER_IMAGE") == Some(built)
            && DEFAULT_WORKER_IMAGE == built,
        "the workers' image must be the loaded {built} too (operator default \
         {DEFAULT_WORKER_IMAGE})"
    );
    ensure!(
        container.image_pull_policy.as_deref() == Some("IfNotPresent"),
        "a kind-loaded image needs imagePullPolicy IfNotPresent"
    );
    // helm installs the chart with its defaults, so the image is the one above.
    let install = find(&up, &["helm", "upgrade", "--install"])?;
    ensure!(
        !install
            .iter()
            .any(|w| w.starts_with("--set") || w == "--values" || w == "-f"),
        "kind-up must install the chart's defaults: {install:?}"
    );
    ensure!(install[4] == CHART && flag(&install, "--namespace") == Some(NAMESPACE));

    // Every file the scripts pass exists; the cluster is created from kind-config.yaml and the
    // same cluster is deleted.
    let root = workspace_path("");
    let mut files = vec![install[4].clone()];
    for command in up.iter().chain(&demo).chain(&down) {
        for option in ["-f", "--file", "--config"] {
            files.extend(
                command
                    .windows(2)
                    .filter(|w| w[0] == option)
                    .map(|w| w[1].clone()),
            );
        }
    }
    for file in &files {
        ensure!(
            root.join(file).exists(),
            "the kind scripts use missing {file}"
        );
    }
    let create = find(&up, &["kind", "create", "cluster"])?;
    ensure!(flag(&create, "--config") == Some("kind-config.yaml"));
    let delete = find(&down, &["kind", "delete", "cluster"])?;
    ensure!(flag(&create, "--name") == flag(&delete, "--name"));
    ensure!(flag(&load, "--name") == flag(&create, "--name"));
    find(
        &demo,
        &[
            "kubectl",
            "apply",
            "--server-side",
            "-f",
            "examples/orders-stream.yaml",
        ],
    )?;

    // The Makefile targets run the scripts.
    let makefile = std::fs::read_to_string(root.join("Makefile"))?;
    for target in ["kind-up", "kind-demo", "kind-down"] {
        ensure!(
            makefile.contains(&format!("{target}:"))
                && makefile.contains(&format!("scripts/{target}.sh")),
            "Makefile target {target} runs scripts/{target}.sh"
        );
    }
    Ok(())
}

#[test]
fn dev_manifests_provide_every_secret_the_chart_and_the_example_reference() -> Result<()> {
    let secrets: BTreeSet<(String, String, String)> = yaml_documents(&std::fs::read_to_string(
        workspace_path("examples/dev/secrets.yaml"),
    )?)?
    .iter()
    .flat_map(|secret| {
        let namespace = secret["metadata"]["namespace"].as_str().unwrap_or_default();
        let name = secret["metadata"]["name"].as_str().unwrap_or_default();
        secret["stringData"]
            .as_object()
            .into_iter()
            .flat_map(|data| data.keys())
            .map(move |key| (namespace.to_owned(), name.to_owned(), key.clone()))
    })
    .collect();
    let objects = render(None, &[])?;
    let deployment: Deployment = the(&objects, "Deployment")?;
    let container = operator_container(&deployment)?;
    let operator_db = env(container, "DATABASE_URL")
        .and_then(|v| v.value_from.as_ref()?.secret_key_ref.as_ref())
        .context("DATABASE_URL")?;
    let example: switchboard_api::QueueAdapter = serde_yaml_ng::from_str(
        &std::fs::read_to_string(workspace_path("examples/orders-stream.yaml"))?,
    )?;
    let example_namespace = example.metadata.namespace.clone().unwrap_or_default();
    let redis = example
        .spec
        .source
        .redis
        .as_ref()
        .and_then(|r| r.url_secret_ref.as_ref())
        .context("the example's Redis Secret")?;
    let worker_db = (
        env_value(container, "SWITCHBOARD_DEFAULT_DATABASE_SECRET_NAME").context("worker db")?,
        env_value(container, "SWITCHBOARD_DEFAULT_DATABASE_SECRET_KEY").context("worker key")?,
    );
    for needed in [
        (
            NAMESPACE,
            operator_db.name.as_str(),
            operator_db.key.as_str(),
        ),
        (example_namespace.as_str(), worker_db.0, worker_db.1),
        (
            example_namespace.as_str(),
            redis.name.as_str(),
            redis.key.as_str(),
        ),
    ] {
        let needed = (
            needed.0.to_owned(),
            needed.1.to_owned(),
            needed.2.to_owned(),
        );
        ensure!(
            secrets.contains(&needed),
            "examples/dev/secrets.yaml lacks {needed:?}; it has {secrets:?}"
        );
    }
    Ok(())
}
