//! The chart's alerts: the PrometheusRule (`prometheusRule.enabled`) holds the rules of
//! `charts/switchboard/files/prometheus-rules.yaml`, each with a runbook in `docs/alerts.md`
//! (linked by a `runbook_url` annotation when `prometheusRule.runbookBaseUrl` is set), and the
//! real promtool (`scripts/prometheus.sh`) checks them and runs one test file per alert
//! (`tests/alerts/<alert>.yaml`: synthetic series, a firing and a not-firing case) on the rules
//! as `helm template` renders them.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use switchboard_tests::helm::{render, the};
use switchboard_tests::prometheus::promtool;
use switchboard_tests::servers::workspace_path;
use tempfile::TempDir;

const RULES_FILE: &str = "charts/switchboard/files/prometheus-rules.yaml";
const TESTS_DIR: &str = "tests/alerts";
/// The seed's SLOs, one alert each, then the operator's (which fire with no worker series).
const ALERTS: [&str; 10] = [
    "SwitchboardDeadLetterRate",
    "SwitchboardOldestMessageTooOld",
    "SwitchboardBacklogGrowing",
    "SwitchboardBacklogStuck",
    "SwitchboardWorkerNotReady",
    "SwitchboardDependencyDown",
    "SwitchboardWorkersUnavailable",
    "SwitchboardAdapterNotReady",
    "SwitchboardOperatorReconcileFailing",
    "SwitchboardEventsMaintenanceStale",
];
/// The runbooks, one `### <alert>` section each.
const RUNBOOKS: &str = "docs/alerts.md";

/// The rendered PrometheusRule's `spec` (`{groups: […]}`), rendered with `extra` helm arguments.
fn rendered_rules(extra: &[&str]) -> Result<Value> {
    let mut args = vec!["--set", "prometheusRule.enabled=true"];
    args.extend(extra);
    let rule: Value = the(&render(None, &args)?, "PrometheusRule")?;
    Ok(rule["spec"].clone())
}

/// Every rule of every group.
fn rules(spec: &Value) -> Vec<&Value> {
    spec["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|group| group["rules"].as_array().into_iter().flatten())
        .collect()
}

fn alert_name(rule: &Value) -> &str {
    rule["alert"].as_str().unwrap_or_default()
}

/// A scratch directory holding `rules.yaml` (`spec`) and a copy of every alert's test file.
fn promtool_dir(spec: &Value) -> Result<TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("switchboard-alerts-")
        .tempdir()?;
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_yaml_ng::to_string(spec)?,
    )?;
    for alert in ALERTS {
        let file = format!("{alert}.yaml");
        std::fs::copy(
            workspace_path(&format!("{TESTS_DIR}/{file}")),
            dir.path().join(&file),
        )
        .with_context(|| format!("{TESTS_DIR}/{file}: every alert has its test file"))?;
    }
    Ok(dir)
}

fn output_text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn prometheus_rule_renders_the_rules_file_with_a_documented_runbook_per_alert() -> Result<()> {
    let defaults = render(None, &[])?;
    ensure!(
        !defaults.iter().any(|o| o["kind"] == "PrometheusRule"),
        "no PrometheusRule unless prometheusRule.enabled"
    );
    let base = "https://docs.example/switchboard/docs/alerts.md";
    let runbooks = format!("prometheusRule.runbookBaseUrl={base}");
    let rule: Value = the(
        &render(
            None,
            &[
                "--set",
                "prometheusRule.enabled=true",
                "--set",
                &runbooks,
                "--set",
                "prometheusRule.labels.release=monitoring",
            ],
        )?,
        "PrometheusRule",
    )?;
    ensure!(
        rule["metadata"]["labels"]["release"] == "monitoring",
        "prometheusRule.labels: {}",
        rule["metadata"]
    );
    let mut spec = rule["spec"].clone();
    let runbooks = std::fs::read_to_string(workspace_path(RUNBOOKS))?;
    let mut names = Vec::new();
    for group in spec["groups"].as_array_mut().into_iter().flatten() {
        for rule in group["rules"].as_array_mut().into_iter().flatten() {
            let name = alert_name(rule).to_owned();
            let runbook = rule["annotations"]
                .as_object_mut()
                .and_then(|annotations| annotations.remove("runbook_url"));
            let expected = format!("{base}#{}", name.to_lowercase());
            ensure!(
                runbook.as_ref().and_then(Value::as_str) == Some(expected.as_str()),
                "{name}: runbook_url {runbook:?}, expected {expected}"
            );
            ensure!(
                runbooks.lines().any(|line| line == format!("### {name}")),
                "{RUNBOOKS} has no runbook `### {name}`"
            );
            names.push(name);
        }
    }
    ensure!(names == ALERTS, "the alerts are {ALERTS:?}: {names:?}");
    let file: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(workspace_path(RULES_FILE))?)?;
    ensure!(
        spec == file,
        "without runbook_url the rendered rules are {RULES_FILE} as it is"
    );
    Ok(())
}

#[test]
fn promtool_check_rules_accepts_the_rendered_rules() -> Result<()> {
    let dir = promtool_dir(&rendered_rules(&[])?)?;
    let output = promtool(dir.path(), &["check", "rules", "rules.yaml"])?;
    let text = output_text(&output);
    ensure!(
        output.status.success() && text.contains(&format!("SUCCESS: {} rules found", ALERTS.len())),
        "promtool check rules:\n{text}"
    );
    Ok(())
}

/// The alerts a test file tests: (alert name, whether some case expects it to fire, whether some
/// case expects it not to).
fn tested_alerts(file: &Path) -> Result<Vec<(String, bool, bool)>> {
    let tests: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(file)?)?;
    let mut alerts: Vec<(String, bool, bool)> = Vec::new();
    for case in tests["tests"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|test| test["alert_rule_test"].as_array().into_iter().flatten())
    {
        let name = case["alertname"].as_str().unwrap_or_default().to_owned();
        let fires = case["exp_alerts"]
            .as_array()
            .is_some_and(|alerts| !alerts.is_empty());
        match alerts.iter_mut().find(|(n, _, _)| *n == name) {
            Some(entry) => {
                entry.1 |= fires;
                entry.2 |= !fires;
            }
            None => alerts.push((name, fires, !fires)),
        }
    }
    Ok(alerts)
}

#[test]
fn promtool_test_rules_fire_and_do_not_fire_for_every_alert() -> Result<()> {
    // One file per alert, testing that alert only, firing and not firing.
    let files: BTreeSet<String> = std::fs::read_dir(workspace_path(TESTS_DIR))?
        .map(|entry| Ok(entry?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    let expected: BTreeSet<String> = ALERTS.iter().map(|a| format!("{a}.yaml")).collect();
    ensure!(files == expected, "{TESTS_DIR} holds {files:?}");
    for alert in ALERTS {
        let tested = tested_alerts(&workspace_path(&format!("{TESTS_DIR}/{alert}.yaml")))?;
        ensure!(
            tested == [(alert.to_owned(), true, true)],
            "{alert}.yaml must test {alert} only, firing and not firing: {tested:?}"
        );
    }
    let spec = rendered_rules(&[])?;
    let files: Vec<String> = ALERTS.iter().map(|a| format!("{a}.yaml")).collect();
    let mut args = vec!["test", "rules"];
    args.extend(files.iter().map(String::as_str));

    let dir = promtool_dir(&spec)?;
    let output = promtool(dir.path(), &args)?;
    let text = output_text(&output);
    ensure!(output.status.success(), "promtool test rules:\n{text}");
    for file in &files {
        ensure!(
            text.contains(&format!("Processing test file: {file}\n  SUCCESS")),
            "{file} passed:\n{text}"
        );
    }
    // The same tests fail on rules that never fire (each file's firing case is checked) and on
    // rules that always fire at once (its not-firing case is).
    for (expr, what) in [
        ("vector(1) == 0", "never fire"),
        ("vector(1)", "always fire"),
    ] {
        let mut mutant = spec.clone();
        for group in mutant["groups"].as_array_mut().into_iter().flatten() {
            for rule in group["rules"].as_array_mut().into_iter().flatten() {
                rule["expr"] = Value::from(expr);
                rule.as_object_mut().map(|rule| rule.remove("for"));
            }
        }
        let dir = promtool_dir(&mutant)?;
        for file in &files {
            let output = promtool(dir.path(), &["test", "rules", file])?;
            let text = output_text(&output);
            ensure!(
                !output.status.success() && text.contains("FAILED:"),
                "{file} passes on rules that {what}:\n{text}"
            );
        }
    }
    // And by default (no runbookBaseUrl) no alert has a runbook_url, as the files expect.
    ensure!(
        rules(&spec)
            .iter()
            .all(|rule| rule["annotations"].get("runbook_url").is_none()),
        "runbook_url without prometheusRule.runbookBaseUrl"
    );
    Ok(())
}
