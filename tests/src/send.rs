//! `switchboard-worker send` end to end, for every broker it supports: the real worker binary
//! sends one message with attributes into a queue of the real broker, a worker stores it.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Result, ensure};

use crate::brokers::BrokerFixture;
use crate::wait::wait_for;
use crate::worker::worker_binary;
use crate::{Fixture, source_manifest};

const LONG: Duration = Duration::from_secs(120);

/// `switchboard-worker send --file manifest --attr k=v… < body` with the fixture's extra
/// environment; the message id it prints.
pub fn send(
    fx: &Fixture,
    manifest: &std::path::Path,
    attributes: &[&str],
    body: &[u8],
) -> Result<String> {
    let mut send = Command::new(worker_binary()?);
    send.args(["send", "--file"]).arg(manifest);
    for attribute in attributes {
        send.args(["--attr", attribute]);
    }
    send.envs(fx.extra_env.iter().map(|(name, value)| (name, value)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = send.spawn()?;
    child.stdin.take().expect("piped").write_all(body)?;
    let output = child.wait_with_output()?;
    ensure!(
        output.status.success(),
        "send failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let message_id = String::from_utf8(output.stdout)?.trim().to_owned();
    ensure!(!message_id.is_empty(), "send prints the message id");
    Ok(message_id)
}

/// A message sent with `switchboard-worker send` to a queue of broker `B` ends in one todo of
/// key `{source}:test/sent:{messageId}` whose event carries the body and the attributes
/// (`chunk_id` added).
pub async fn round_trip<B: BrokerFixture>(source: &str) -> Result<()> {
    const NAME: &str = "sent";
    let mut fx = Fixture::start().await?;
    let (broker, env) = B::start(&fx).await?;
    fx.extra_env = env;
    let spec = broker.create(&fx, NAME).await?;
    let manifest = fx.manifest(
        "sent.yaml",
        &source_manifest(NAME, &spec, broker.delivery(), ""),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    let message_id = send(
        &fx,
        &manifest,
        &["source=obsidian", "level=L0"],
        br#"{"content":"hello world"}"#,
    )?;
    wait_for(LONG, "1 todo, nothing un-acknowledged", || async {
        Ok(fx.todo_count(NAME).await? >= 1 && broker.unacknowledged(&fx, NAME).await? == 0)
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    fx.assert_exactly_once(NAME, 1).await?;
    let (key, payload, headers): (String, serde_json::Value, serde_json::Value) = sqlx::query_as(
        "SELECT t.idempotency_key, e.payload, e.headers FROM todos t JOIN events e ON e.id = t.event_id WHERE t.queue = $1",
    )
    .bind(NAME)
    .fetch_one(fx.pool())
    .await?;
    ensure!(
        key == format!("{source}:test/{NAME}:{message_id}"),
        "key {key} of the message sent as {message_id}"
    );
    ensure!(
        payload == serde_json::json!({"content": "hello world"}),
        "{payload}"
    );
    let text = headers.to_string();
    ensure!(
        text.contains("obsidian") && text.contains("L0") && text.contains("chunk_id"),
        "the attributes are the event's headers: {text}"
    );
    Ok(())
}
