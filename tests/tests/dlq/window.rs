//! Issue 29 acceptance 1: a redrive killed in the window between the copy and the removal, for
//! every broker (SQS's own test is in `sqs.rs`). Only the `dlq` command reaches the broker
//! through a holding proxy ([`CuttingProxy::holding`]), which lets through everything up to the
//! removal of the first letter and holds that request: the copy was confirmed by the broker,
//! the letter is still dead-lettered. The command is SIGKILLed there; run again, the redrive
//! leaves one todo per letter and no letter.
//!
//! What copy and removal are on the wire:
//! - Redis stream: `MULTI`, `XADD` to the stream, `XDEL` from the dead-letter stream, `EXEC`;
//!   Redis list: `MULTI`, `LPUSH`, `LREM`, `EXEC`. One transaction: no window. The proxy holds
//!   the second letter's `EXEC` (the first letter's went through): a kill there leaves the
//!   first letter both copied and removed, the second neither.
//! - NATS JetStream: a publish to the source subject, its PubAck, then a request to
//!   `$JS.API.STREAM.MSG.DELETE.<stream>_DLQ`: held.
//! - RabbitMQ: `basic.publish` on a confirm channel, its `basic.ack` from the broker, then the
//!   `basic.ack` (class 60, method 80) of the letter's `basic.get` delivery: held (RabbitMQ
//!   puts the letter back when the connection closes).
//! - Kafka: a produce to the source topic, acknowledged by every replica, then
//!   `DeleteRecords` (API key 21) of the dead-letter topic up to the letter: held.
//! - Gateway: `POST /` of the copy to the source queue, answered 200, then `DELETE /` of the
//!   letter's receipt in the dead-letter queue: held.

use std::path::Path;
use std::process::Stdio;

use anyhow::{Context, Result, ensure};
use switchboard_tests::proxy::{CuttingProxy, Hold, Request};
use switchboard_tests::wait::wait_for;
use switchboard_worker::transport::IDEMPOTENCY_KEY_HEADER;

use super::amqp_case::AmqpCase;
use super::gateway_case::GatewayCase;
use super::kafka_case::KafkaCase;
use super::{
    Case, LONG, ListCase, NatsCase, OVERDUE, POISON, StreamCase, dead_letter_fifteen, dlq_command,
    dlq_ok, path_text,
};

/// Letters in each test.
const LETTERS: u64 = (POISON + OVERDUE) as u64;

/// A broker whose `dlq` command can be put behind a holding proxy.
trait Window: Case {
    /// The broker's `host:port`, as the command's environment or manifest names it (Kafka:
    /// routes the proxy started for it through the listener that advertises the proxy).
    fn upstream(&self) -> Result<String>;
    /// The request the proxy holds: the first letter's removal, or where copy and removal are
    /// one transaction, the second letter's.
    fn removal() -> Hold;
}

/// `host:port` in a URL such as `amqp://user:password@127.0.0.1:5672/%2f`.
fn address_in(url: &str) -> Result<String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
    let address = rest.split('/').next().context("an address")?;
    Ok(address.to_owned())
}

/// The first `request`.
fn first(request: Request) -> Hold {
    Hold {
        request,
        occurrence: 1,
    }
}

/// The second transaction's `EXEC` (RESP), the first one done.
fn second_exec() -> Hold {
    Hold {
        request: Request::Bytes(b"$4\r\nEXEC\r\n".to_vec()),
        occurrence: 2,
    }
}

impl Window for StreamCase {
    fn upstream(&self) -> Result<String> {
        Ok(self.fx.redis.address())
    }

    fn removal() -> Hold {
        second_exec()
    }
}

impl Window for ListCase {
    fn upstream(&self) -> Result<String> {
        Ok(self.fx.redis.address())
    }

    fn removal() -> Hold {
        second_exec()
    }
}

impl Window for NatsCase {
    fn upstream(&self) -> Result<String> {
        address_in(&self.server.url())
    }

    fn removal() -> Hold {
        first(Request::Bytes(b"$JS.API.STREAM.MSG.DELETE.".to_vec()))
    }
}

impl Window for AmqpCase {
    fn upstream(&self) -> Result<String> {
        address_in(&self.server.url())
    }

    /// `basic.ack`: class 60, method 80, in a method frame's payload.
    fn removal() -> Hold {
        first(Request::Bytes(vec![0x00, 0x3c, 0x00, 0x50]))
    }
}

impl Window for KafkaCase {
    fn upstream(&self) -> Result<String> {
        self.server.route_proxy();
        Ok(self.server.bootstrap())
    }

    /// `DeleteRecords`.
    fn removal() -> Hold {
        first(Request::Kafka(21))
    }
}

impl Window for GatewayCase {
    fn upstream(&self) -> Result<String> {
        address_in(&self.broker.gateway.url())
    }

    fn removal() -> Hold {
        first(Request::Bytes(b"DELETE /".to_vec()))
    }
}

/// Starts `redrive --all` of the `fixed` manifest, reaching the broker through a holding
/// proxy (its manifest and environment rewritten, nothing else), waits until the proxy holds,
/// and SIGKILLs it there; then the proxy goes.
async fn killed_where_held<C: Window>(case: &C, fixed: &Path) -> Result<()> {
    let upstream = case.upstream()?;
    let proxy = CuttingProxy::holding(&upstream, C::removal()).await?;
    let upstream = upstream.as_str();
    let through = proxy.address();
    let fixed = std::fs::read_to_string(fixed)?;
    let manifest = case.fx().manifest(
        &format!("{}-proxied.yaml", case.queue()),
        &fixed.replace(upstream, &through),
    )?;
    let mut command = dlq_command(case, &["redrive", "--file", path_text(&manifest)?, "--all"])?;
    let fx = case.fx();
    let environment = std::iter::once(("REDIS_URL", &fx.env.redis_url)).chain(
        fx.extra_env
            .iter()
            .map(|(key, value)| (key.as_str(), value)),
    );
    for (key, value) in environment {
        command.env(key, value.replace(upstream, &through));
    }
    let redrive = std::cell::RefCell::new(
        command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?,
    );
    let waited = wait_for(
        LONG,
        "the redrive held at the removal, or ended",
        || async { Ok(proxy.held() || redrive.borrow_mut().try_wait()?.is_some()) },
    )
    .await;
    let mut redrive = redrive.into_inner();
    let killed = redrive.kill();
    let output = redrive.wait_with_output()?;
    killed?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    waited.with_context(|| stderr.clone().into_owned())?;
    ensure!(
        proxy.held(),
        "the redrive ended ({:?}) before the proxy held: {stderr}",
        output.status
    );
    Ok(())
}

/// Runs the redrive again (the proxy gone): it redrives `left` letters, fails none; then one
/// todo per letter, with distinct keys, and no letter left.
async fn run_again_leaves_one_todo_each<C: Case>(case: &C, fixed: &Path, left: u64) -> Result<()> {
    case.settle().await?;
    ensure!(
        case.dead_letters().await? == left,
        "{left} letters left after the kill"
    );
    let summary = String::from_utf8(dlq_ok(
        case,
        &["redrive", "--file", path_text(fixed)?, "--all"],
    )?)?;
    ensure!(
        summary.starts_with(&format!("redrive: {left} redriven "))
            && summary.contains(", 0 left, 0 failed"),
        "{summary}"
    );
    wait_for(LONG, "a todo per letter", || async {
        Ok(case.fx().todo_count(case.queue()).await? == LETTERS as i64)
    })
    .await?;
    ensure!(case.dead_letters().await? == 0, "no letter is left");
    case.fx()
        .assert_exactly_once(case.queue(), LETTERS as i64)
        .await
}

/// A redrive killed after the first letter's copy was confirmed and before its removal: the
/// copy is stored once by the running fixed worker, every letter is still dead-lettered; run
/// again, one todo each (the first letter's second copy carries the same key).
async fn killed_between_copy_and_removal<C: Window>(name: &str) -> Result<()> {
    let case = C::start(name).await?;
    dead_letter_fifteen(&case, name).await?;
    // Written once: a worker reading the file while it is written again finds it empty.
    let manifest = case.manifest(true)?;
    let fixed = case.fx().worker(&manifest, "fixed")?;
    killed_where_held(&case, &manifest).await?;
    wait_for(
        LONG,
        "the copy confirmed before the kill is stored",
        || async { Ok(case.fx().todo_count(case.queue()).await? == 1) },
    )
    .await
    .with_context(|| fixed.log_tail())?;
    run_again_leaves_one_todo_each(&case, &manifest, LETTERS).await
}

/// Where copy and removal are one transaction: a redrive killed with the second letter's
/// transaction queued but not executed left the first letter copied (one copy in the source,
/// `copies`) and removed, the second neither; run again, one todo each.
async fn killed_around_one_transaction<C: Window>(
    name: &str,
    copies: impl Fn(&C) -> Result<u64>,
) -> Result<()> {
    let case = C::start(name).await?;
    dead_letter_fifteen(&case, name).await?;
    let manifest = case.manifest(true)?;
    killed_where_held(&case, &manifest).await?;
    ensure!(
        copies(&case)? == 1 && case.dead_letters().await? == LETTERS - 1,
        "the first letter moved whole, the second not at all: {} copies, {} letters",
        copies(&case)?,
        case.dead_letters().await?
    );
    let fixed = case.fx().worker(&manifest, "fixed")?;
    wait_for(LONG, "the first letter's copy is stored", || async {
        Ok(case.fx().todo_count(case.queue()).await? == 1)
    })
    .await
    .with_context(|| fixed.log_tail())?;
    run_again_leaves_one_todo_each(&case, &manifest, LETTERS - 1).await
}

#[tokio::test]
async fn redis_stream_redrive_killed_between_copy_and_removal_then_run_again_leaves_one_todo_each()
-> Result<()> {
    killed_around_one_transaction::<StreamCase>("window", |case| {
        let entries = case.fx.stream_entries(&case.name)?;
        let copies = entries
            .iter()
            .filter(|entry| entry.contains_key(IDEMPOTENCY_KEY_HEADER));
        Ok(copies.count() as u64)
    })
    .await
}

#[tokio::test]
async fn redis_list_redrive_killed_between_copy_and_removal_then_run_again_leaves_one_todo_each()
-> Result<()> {
    killed_around_one_transaction::<ListCase>("window", |case| case.fx.llen(&case.name)).await
}

#[tokio::test]
async fn nats_redrive_killed_between_copy_and_removal_then_run_again_leaves_one_todo_each()
-> Result<()> {
    killed_between_copy_and_removal::<NatsCase>("window").await
}

#[tokio::test]
async fn amqp_redrive_killed_between_copy_and_removal_then_run_again_leaves_one_todo_each()
-> Result<()> {
    killed_between_copy_and_removal::<AmqpCase>("window").await
}

#[tokio::test]
async fn kafka_redrive_killed_between_copy_and_removal_then_run_again_leaves_one_todo_each()
-> Result<()> {
    killed_between_copy_and_removal::<KafkaCase>("window").await
}

#[tokio::test]
async fn gateway_redrive_killed_between_copy_and_removal_then_run_again_leaves_one_todo_each()
-> Result<()> {
    killed_between_copy_and_removal::<GatewayCase>("window").await
}
