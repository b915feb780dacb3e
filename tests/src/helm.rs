//! The Helm chart (`charts/switchboard`) rendered by the real helm: `scripts/helm.sh` builds it
//! once from the Go module proxy (cached) or takes `HELM`.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use serde_json::Value;

use crate::servers::workspace_path;

pub const CHART: &str = "charts/switchboard";
/// The QueueAdapter CRD the chart templates (`templates/crds.yaml`); `crds/` links to it.
pub const CHART_CRD: &str = "charts/switchboard/files/queueadapters.switchboard.dev.yaml";
pub const RELEASE: &str = "switchboard";
/// The release namespace of every render (the kind path's too).
pub const NAMESPACE: &str = "switchboard";

/// The helm binary from `scripts/helm.sh` (which honours `HELM` and otherwise builds it once).
pub fn helm_binary() -> Result<PathBuf> {
    let script = workspace_path("scripts/helm.sh");
    let output = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !output.status.success() || !path.is_file() {
        bail!(
            "helm is missing and could not be built; run `scripts/helm.sh` (or `make helm`; needs \
             Go, see docs/kubernetes.md) or set HELM=/path/to/helm.\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(path)
}

/// Runs helm in the workspace root.
pub fn helm(args: &[&str]) -> Result<Output> {
    Ok(Command::new(helm_binary()?)
        .current_dir(workspace_path(""))
        .args(args)
        .stdin(Stdio::null())
        .output()?)
}

/// `helm template` of the release with `values` (a file; `None`: defaults) and `extra` args:
/// every rendered object.
pub fn render(values: Option<&str>, extra: &[&str]) -> Result<Vec<Value>> {
    let mut args = vec!["template", RELEASE, CHART, "--namespace", NAMESPACE];
    args.extend(values.iter().flat_map(|file| ["--values", *file]));
    args.extend(extra);
    let output = helm(&args)?;
    ensure!(
        output.status.success(),
        "helm {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    yaml_documents(&String::from_utf8(output.stdout)?)
}

/// The non-empty documents of a multi-document YAML stream.
pub fn yaml_documents(yaml: &str) -> Result<Vec<Value>> {
    let mut documents = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(yaml) {
        let value = Value::deserialize(document)?;
        if !value.is_null() {
            documents.push(value);
        }
    }
    Ok(documents)
}

pub fn kind_of(object: &Value) -> &str {
    object["kind"].as_str().unwrap_or_default()
}

/// The one rendered object of `kind`, typed.
pub fn the<K: serde::de::DeserializeOwned>(objects: &[Value], kind: &str) -> Result<K> {
    let mut found = objects.iter().filter(|o| kind_of(o) == kind);
    let object = found
        .next()
        .with_context(|| format!("no {kind} rendered"))?;
    ensure!(found.next().is_none(), "more than one {kind} rendered");
    Ok(serde_json::from_value(object.clone())?)
}
