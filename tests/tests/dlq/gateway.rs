//! `switchboard-worker dlq` for a gateway adapter: [`GatewayCase`] runs the contract suite
//! against the test gateway (seed 004's protocol in front of a real ElasticMQ, tokens from a
//! real Hydra), the dead-letter queue named by `spec.source.gateway.deadLetter.queue`. Without
//! that field the command says what to set and reads the letters kept in PostgreSQL; a token
//! the gateway refuses the dead-letter queue (403) ends the command, naming the setting.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Result, ensure};
use axum::http::StatusCode;
use switchboard_tests::brokers::BrokerFixture;
use switchboard_tests::brokers::gateway::{GatewayBroker, encode_body};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::worker_binary;
use switchboard_tests::{Fixture, source_manifest};

use super::{
    Case, LONG, case_manifest, deliver_repeatedly, dlq, path_text, ten_attributes_redriven,
};

/// An SQS queue and its dead-letter queue `{name}-dlq` behind the test gateway.
pub(crate) struct GatewayCase {
    fx: Fixture,
    pub(crate) broker: GatewayBroker,
    name: String,
}

impl GatewayCase {
    fn dead_letter_url(&self) -> String {
        self.broker.sqs.url(&format!("{}-dlq", self.name))
    }

    /// The adapter's `spec.source`, with `more` gateway fields.
    fn source(&self, more: &str) -> String {
        self.broker.source(&self.name, more)
    }
}

impl Case for GatewayCase {
    async fn start(name: &str) -> Result<Self> {
        let mut fx = Fixture::start().await?;
        let (broker, env) = GatewayBroker::start(&fx).await?;
        fx.extra_env.extend(env);
        broker.create_queues(name).await?;
        Ok(Self {
            fx,
            broker,
            name: name.to_owned(),
        })
    }

    fn fx(&self) -> &Fixture {
        &self.fx
    }

    fn manifest(&self, fixed: bool) -> Result<PathBuf> {
        let source = self.source(&format!(
            "visibilityTimeoutSeconds: 2, deadLetter: {{queue: {}-dlq}}",
            self.name
        ));
        case_manifest(&self.fx, &self.name, &source, fixed)
    }

    async fn send(&self, bodies: &[Vec<u8>]) -> Result<()> {
        self.broker
            .produce(&self.fx, &self.name, bodies.to_vec())
            .await
    }

    async fn send_overdue(&self, bodies: &[Vec<u8>]) -> Result<()> {
        self.send(bodies).await?;
        let client = self.broker.sqs.server.client();
        deliver_repeatedly(&client, &self.broker.sqs.url(&self.name), bodies.len()).await
    }

    async fn dead_letters(&self) -> Result<u64> {
        let counts = self
            .broker
            .sqs
            .server
            .count(&self.dead_letter_url())
            .await?;
        Ok(counts.visible + counts.in_flight)
    }

    async fn settle(&self) -> Result<()> {
        wait_for(LONG, "every dead letter is visible again", || async {
            Ok(self
                .broker
                .sqs
                .server
                .count(&self.dead_letter_url())
                .await?
                .in_flight
                == 0)
        })
        .await
    }

    fn queue(&self) -> &str {
        &self.name
    }
}

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

/// What the command must tell the user of a gateway adapter without a dead-letter queue: the
/// field to set, where the letters are and how they are counted.
fn says_what_to_set(stderr: &str) -> bool {
    stderr.contains("spec.source.gateway.deadLetter.queue is not set")
        && stderr.contains("deadLetterMessages")
        && stderr.contains("list, show, redrive and purge")
}

/// A gateway manifest without `deadLetter`: the command reads no further than the file (no
/// gateway, no token).
const UNSET: &str = "gateway: {url: \"https://gateway.invalid\", queue: orders, auth: \
                     {oauth2: {tokenUrl: \"https://auth.invalid/token\", clientId: dlq}}}";

/// Without `spec.source.gateway.deadLetter.queue` and without `DATABASE_URL` the command fails
/// (exit 1) saying which field to set; with `DATABASE_URL`, it lists the letters the gateway
/// refused, kept in PostgreSQL, and says the same.
#[tokio::test]
async fn gateway_dlq_without_a_dead_letter_queue_says_what_to_set_and_lists_the_letters_kept_in_postgresql()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.manifest(
        "gateway-dlq.yaml",
        &source_manifest("refused", UNSET, "", ""),
    )?;
    let file = path_text(&manifest)?;

    let alone = list(file, None)?;
    let stderr = String::from_utf8_lossy(&alone.stderr);
    ensure!(
        alone.status.code() == Some(1),
        "{:?}: {stderr}",
        alone.status
    );
    ensure!(
        says_what_to_set(&stderr) && stderr.contains("DATABASE_URL"),
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
    ensure!(says_what_to_set(&stderr), "{stderr}");
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

/// A gateway that refuses the token the dead-letter queue (403), refuses the token itself
/// (401, a new one too) or whose calls hang: `dlq list` exits 1 at once naming
/// `spec.source.gateway.deadLetter.queue` or `spec.source.gateway.auth`, or within its call's
/// deadline.
#[tokio::test]
async fn gateway_dlq_refused_names_the_setting_and_a_hung_gateway_meets_the_deadline() -> Result<()>
{
    let case = GatewayCase::start("refusing").await?;
    let manifest = case.manifest(true)?;
    let file = path_text(&manifest)?;
    let hooks = case.broker.gateway.hooks();

    hooks.fail_for(StatusCode::FORBIDDEN, Duration::from_secs(300));
    let refused = dlq(&case, &["list", "--file", file])?;
    hooks.stop_failing();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        refused.status.code() == Some(1),
        "{:?}: {stderr}",
        refused.status
    );
    ensure!(
        stderr.contains("spec.source.gateway.deadLetter.queue") && stderr.contains("403"),
        "{stderr}"
    );

    hooks.fail_for(StatusCode::UNAUTHORIZED, Duration::from_secs(300));
    let unauthorized = dlq(&case, &["list", "--file", file])?;
    hooks.stop_failing();
    let stderr = String::from_utf8_lossy(&unauthorized.stderr);
    ensure!(
        unauthorized.status.code() == Some(1) && stderr.contains("spec.source.gateway.auth"),
        "{:?}: {stderr}",
        unauthorized.status
    );

    hooks.hang_receives(true);
    let started = std::time::Instant::now();
    let hung = dlq(&case, &["list", "--file", file])?;
    let took = started.elapsed();
    hooks.hang_receives(false);
    let stderr = String::from_utf8_lossy(&hung.stderr);
    ensure!(
        hung.status.code() == Some(1) && stderr.contains("gateway receive"),
        "{:?}: {stderr}",
        hung.status
    );
    ensure!(
        took < Duration::from_secs(30),
        "a hung receive ends at its deadline, not {took:?}: {stderr}"
    );
    Ok(())
}

/// A gateway letter whose original had SQS's maximum of 10 attributes is redriven through the
/// gateway (the key packed with the last attribute, unpacked by the gateway transport): stored
/// with all ten and its original key.
#[tokio::test]
async fn gateway_letter_with_ten_attributes_is_redriven_with_all_of_them_and_its_key() -> Result<()>
{
    let case = GatewayCase::start("tenattrs").await?;
    let manifest = case.manifest(false)?;
    let file = path_text(&manifest)?.to_owned();
    let attributes: Vec<(String, Vec<u8>)> = (0..10)
        .map(|n| (format!("attr{n}"), format!("value {n}").into_bytes()))
        .collect();
    let id = case
        .broker
        .sqs
        .server
        .send_with_attributes(
            &case.broker.sqs.url(&case.name),
            encode_body(b"not json, ten attributes").into_bytes(),
            attributes
                .iter()
                .map(|(name, value)| (name.as_str(), "String", value.clone()))
                .collect(),
        )
        .await?;
    let key = format!("gateway:test/tenattrs:{id}");
    ten_attributes_redriven(&case, &file, &key, &attributes).await
}
