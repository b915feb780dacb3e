//! The worker refuses a manifest the API server would refuse, before it touches a broker or the
//! database: the real worker binary against real PostgreSQL and Redis.

use std::time::Duration;

use anyhow::{Result, ensure};
use switchboard_tests::Fixture;

/// Line 8 holds `bachSize`, a misspelling of `batchSize`.
const MISSPELLED_MANIFEST: &str = "\
apiVersion: switchboard.dev/v1alpha1
kind: QueueAdapter
metadata: {name: orders, namespace: test}
spec:
  source: {redis: {mode: stream, stream: orders}}
  target: {queue: orders}
  delivery:
    bachSize: 1
";

#[tokio::test]
async fn misspelled_field_stops_the_worker_naming_the_field_and_its_line() -> Result<()> {
    let fx = Fixture::start().await?;
    fx.produce("orders", [br#"{"order":1}"#.to_vec()])?;
    let manifest = fx.manifest("orders.yaml", MISSPELLED_MANIFEST)?;
    let mut worker = fx.worker(&manifest, "worker-a")?;

    let status = worker.wait_exit(Duration::from_secs(30))?;
    let log = worker.log();
    ensure!(!status.success(), "worker exited {status}:\n{log}");
    ensure!(
        log.contains("line 8: spec.delivery.bachSize: unknown field"),
        "the error names the field and its line:\n{log}"
    );
    // It did not run on defaults meanwhile: nothing stored, no consumer group created.
    ensure!(fx.todo_count("orders").await? == 0, "a todo was stored");
    let mut conn = fx.redis.connection()?;
    let groups: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg("orders")
        .query(&mut conn)?;
    ensure!(
        groups.is_empty(),
        "a consumer group was created: {groups:?}"
    );
    Ok(())
}

/// A manifest whose spec is `spec` (a YAML block, indented by two spaces).
fn manifest_with(metadata: &str, spec: &str) -> String {
    format!(
        "apiVersion: switchboard.dev/v1alpha1\nkind: QueueAdapter\nmetadata: {metadata}\nspec:\n{spec}"
    )
}

#[tokio::test]
async fn every_misspelling_type_error_and_bad_name_stops_the_worker_naming_field_and_line()
-> Result<()> {
    let fx = Fixture::start().await?;
    let valid_spec =
        "  source: {redis: {mode: stream, stream: orders}}\n  target: {queue: orders}\n";
    let metadata = "{name: orders, namespace: test}";
    let cases = [
        (
            manifest_with(
                metadata,
                &format!("{valid_spec}  payload: {{maxByte: 10}}\n"),
            ),
            "line 7: spec.payload.maxByte: unknown field",
        ),
        (
            manifest_with(
                metadata,
                &format!("{valid_spec}  delivery: {{deadLeter: {{stream: x}}}}\n"),
            ),
            "line 7: spec.delivery.deadLeter: unknown field",
        ),
        (
            manifest_with(
                metadata,
                "  source: {redis: {mode: stream, stream: orders, bodyFeild: b}}\n  target: {queue: orders}\n",
            ),
            "line 5: spec.source.redis.bodyFeild: unknown field",
        ),
        (
            manifest_with(
                metadata,
                &format!("{valid_spec}  delivery: {{batchSize: -5}}\n"),
            ),
            "line 7: spec.delivery.batchSize: invalid type",
        ),
        (
            manifest_with("{name: ordérs, namespace: test}", valid_spec),
            "metadata.name",
        ),
        (
            manifest_with("{name: Orders_X, namespace: test}", valid_spec),
            "metadata.name",
        ),
        (
            manifest_with("{name: orders, namespace: déf}", valid_spec),
            "metadata.namespace",
        ),
    ];
    for (index, (yaml, expected)) in cases.iter().enumerate() {
        let manifest = fx.manifest(&format!("case-{index}.yaml"), yaml)?;
        let mut worker = fx.worker(&manifest, &format!("worker-{index}"))?;
        let status = worker.wait_exit(Duration::from_secs(30))?;
        let log = worker.log();
        ensure!(!status.success(), "case {index} exited {status}:\n{log}");
        ensure!(
            log.contains(expected),
            "case {index}: the error names {expected:?}:\n{yaml}\n{log}"
        );
    }
    ensure!(fx.todo_count("orders").await? == 0, "a todo was stored");
    Ok(())
}

/// `switchboard-worker lint` gives `run`'s verdict on a manifest with no environment and no
/// server: every example is valid (one line each, naming what it runs), and a misspelled field
/// is refused naming the field and its line, with exit code 1 and the valid file still listed.
#[test]
fn lint_passes_every_example_and_refuses_a_misspelling_naming_its_line() -> Result<()> {
    let worker = switchboard_tests::worker::worker_binary()?;
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&examples)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            files.push(path);
        }
    }
    ensure!(files.len() >= 8, "{} examples", files.len());
    let lint = |files: &[std::path::PathBuf]| {
        let mut command = std::process::Command::new(&worker);
        command.env_clear().arg("lint");
        for file in files {
            command.arg("--file").arg(file);
        }
        command.output()
    };
    let out = lint(&files)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        stdout
            .lines()
            .filter(|line| line.contains(": valid: "))
            .count()
            == files.len(),
        "{stdout}"
    );
    ensure!(
        stdout.contains("default/orders: kafka group, at-least-once"),
        "{stdout}"
    );

    let dir = tempfile::tempdir()?;
    let misspelled = dir.path().join("misspelled.yaml");
    std::fs::write(&misspelled, MISSPELLED_MANIFEST)?;
    let out = lint(&[misspelled, files[0].clone()])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(1),
        "exit {}: {stderr}",
        out.status
    );
    ensure!(
        stderr.contains("line 8: spec.delivery.bachSize: unknown field"),
        "{stderr}"
    );
    ensure!(String::from_utf8_lossy(&out.stdout).contains(": valid: "));
    Ok(())
}
