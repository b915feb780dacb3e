//! `switchboard-worker dlq` for a gateway adapter. The gateway's API has no call that reads its
//! dead-letter queue (it writes letters and counts them), so there is no `GatewayCase` for the
//! contract suite: the command says so and what to do instead, and reads the letters the
//! gateway refused, kept in PostgreSQL.

use std::process::{Command, Output, Stdio};

use anyhow::{Result, ensure};
use switchboard_tests::worker::worker_binary;
use switchboard_tests::{Fixture, source_manifest};

/// A gateway manifest: the command reads no further than the file (no gateway, no token).
const GATEWAY: &str = "gateway: {url: \"https://gateway.invalid\", queue: orders, auth: \
                       {oauth2: {tokenUrl: \"https://auth.invalid/token\", clientId: dlq}}}";

/// `dlq list` of `file` as JSON, with `DATABASE_URL` when `database` is given.
fn list(file: &str, database: Option<&str>) -> Result<Output> {
    let mut cmd = Command::new(worker_binary()?);
    cmd.args(["dlq", "list", "--file", file, "-o", "json"])
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null());
    if let Some(url) = database {
        cmd.env("DATABASE_URL", url);
    }
    Ok(cmd.output()?)
}

/// What the command must tell the user of a gateway adapter: that the gateway cannot be read,
/// where the letters are and how they are counted.
fn says_what_to_do(stderr: &str) -> bool {
    stderr.contains("no call that reads its dead-letter queue")
        && stderr.contains("deadLetterMessages")
        && stderr.contains("SQS dead-letter queue behind the gateway")
}

/// Without `DATABASE_URL` the command fails (exit 1) saying why the gateway's letters cannot
/// be read and what to do; with it, it lists the letters the gateway refused, kept in
/// PostgreSQL, and says the same.
#[tokio::test]
async fn gateway_dlq_says_its_queue_cannot_be_read_and_lists_the_letters_kept_in_postgresql()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.manifest(
        "gateway-dlq.yaml",
        &source_manifest("refused", GATEWAY, "", ""),
    )?;
    let file = manifest.to_str().unwrap_or_default();

    let alone = list(file, None)?;
    let stderr = String::from_utf8_lossy(&alone.stderr);
    ensure!(
        alone.status.code() == Some(1),
        "{:?}: {stderr}",
        alone.status
    );
    ensure!(
        says_what_to_do(&stderr) && stderr.contains("DATABASE_URL"),
        "{stderr}"
    );

    fx.store
        .keep_dead_letters(
            "gateway:test/refused",
            &[switchboard_store::KeptLetter {
                idempotency_key: "gateway:test/refused:m-1",
                external_id: "m-1",
                body: b"{\"broken\"",
                headers: "{}",
                reason: "invalid_json",
                error: "body is not valid JSON",
                delivery_count: 1,
                attempts: r#"{"total":1,"recent":[]}"#,
                refused_because: "gateway send to DLQ: 413 MessageTooLong",
            }],
        )
        .await?;
    let kept = list(file, Some(&fx.env.database_url))?;
    let stderr = String::from_utf8_lossy(&kept.stderr);
    ensure!(kept.status.success(), "{stderr}");
    ensure!(says_what_to_do(&stderr), "{stderr}");
    let stdout = String::from_utf8(kept.stdout)?;
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    ensure!(
        lines.len() == 2
            && lines[0]["reason"] == "invalid_json"
            && lines[0]["body"] == "{\"broken\""
            && lines[1]["summary"]["listed"] == 1,
        "the kept letter, then the summary: {stdout}"
    );
    Ok(())
}
