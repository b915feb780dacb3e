//! Traces of the worker pods: the OpenTelemetry environment the operator gives every worker
//! when it is configured with an OTLP endpoint (`--worker-otlp-endpoint`, Helm value
//! `telemetry.otlp.endpoint`). Without one, workers get none and export nothing.

use k8s_openapi::api::core::v1::EnvVar;

/// Where and how workers export their spans.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerTraces {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` of every worker (OTLP/HTTP, e.g.
    /// `http://otel-collector.observability:4318`); `None`: no traces.
    pub endpoint: Option<String>,
    /// `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG` (the SDK's default when `None`:
    /// `parentbased_always_on`).
    pub sampler: Option<String>,
    pub sampler_arg: Option<String>,
}

impl WorkerTraces {
    /// The environment of the worker of adapter `name` in `namespace`: the endpoint, the
    /// service name `switchboard-worker`, the adapter and pod as resource attributes (the pod
    /// name from `HOSTNAME`, set before), the sampler.
    pub fn env(&self, namespace: &str, name: &str) -> Vec<EnvVar> {
        let Some(endpoint) = &self.endpoint else {
            return Vec::new();
        };
        let value = |name: &str, value: String| EnvVar {
            name: name.to_owned(),
            value: Some(value),
            ..EnvVar::default()
        };
        let mut env = vec![
            value("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
            value("OTEL_SERVICE_NAME", "switchboard-worker".to_owned()),
            value(
                "OTEL_RESOURCE_ATTRIBUTES",
                format!(
                    "k8s.namespace.name={namespace},k8s.pod.name=$(HOSTNAME),\
                     switchboard.adapter={namespace}/{name}"
                ),
            ),
        ];
        if let Some(sampler) = &self.sampler {
            env.push(value("OTEL_TRACES_SAMPLER", sampler.clone()));
        }
        if let Some(arg) = &self.sampler_arg {
            env.push(value("OTEL_TRACES_SAMPLER_ARG", arg.clone()));
        }
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(env: &[EnvVar]) -> Vec<(&str, &str)> {
        env.iter()
            .map(|e| (e.name.as_str(), e.value.as_deref().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn without_an_endpoint_workers_get_no_tracing_environment() {
        assert!(WorkerTraces::default().env("shop", "orders").is_empty());
    }

    #[test]
    fn with_an_endpoint_workers_name_their_service_adapter_and_pod() {
        let traces = WorkerTraces {
            endpoint: Some("http://collector:4318".to_owned()),
            sampler: Some("parentbased_traceidratio".to_owned()),
            sampler_arg: Some("0.25".to_owned()),
        };
        assert_eq!(
            names(&traces.env("shop", "orders")),
            [
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
                ("OTEL_SERVICE_NAME", "switchboard-worker"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "k8s.namespace.name=shop,k8s.pod.name=$(HOSTNAME),switchboard.adapter=shop/orders"
                ),
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ]
        );
    }
}
