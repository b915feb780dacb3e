//! SQS dead letters beyond the contract suite (issue 29, SQS (a) and (b)): a FIFO letter
//! redriven, dead-lettered again and redriven again within SQS's five-minute deduplication
//! interval arrives; a letter SQS's own `RedrivePolicy` moved is not aged by its send time; a
//! redrive killed between `SendMessage` and `DeleteMessage` and run again doubles nothing.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use aws_sdk_sqs::types::QueueAttributeName;
use switchboard_tests::brokers::sqs::{SqsProxy, sqs_error};
use switchboard_tests::source_manifest;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::WorkerProcess;

use super::{
    Case, LONG, SqsCase, dead_lettered_at, dlq_command, dlq_ok, list_json, manifest_settings,
    now_ms, path_text,
};

/// A case over the FIFO queue `{name}.fifo` and its default dead-letter queue
/// `{name}-dlq.fifo` (both deduplicating by content unless a send names its own id). The
/// source hides a received message for 5 s only: a worker stopped while its long poll is still
/// open at ElasticMQ may be handed a message it never sees, which then blocks its group that long.
async fn fifo_case(name: &str) -> Result<SqsCase> {
    let mut case = SqsCase::start(name).await?;
    case.queue_url = case
        .mq
        .create_queue(
            &format!("{name}.fifo"),
            &[
                (QueueAttributeName::FifoQueue, "true"),
                (QueueAttributeName::ContentBasedDeduplication, "true"),
                (QueueAttributeName::VisibilityTimeout, "5"),
            ],
        )
        .await?;
    case.dlq_url = case
        .mq
        .create_fifo_queue(&format!("{name}-dlq.fifo"))
        .await?;
    Ok(case)
}

/// The ids of the dead letters, as `dlq list -o json` shows them.
fn letter_ids(case: &SqsCase, file: &str) -> Result<Vec<String>> {
    list_json(case, file)?
        .iter()
        .map(|letter| letter["id"].as_str().map(str::to_owned).context("an id"))
        .collect()
}

/// `dlq redrive --all`, which must say it redrove one letter.
fn redrive_one(case: &SqsCase, file: &str) -> Result<()> {
    let summary = String::from_utf8(dlq_ok(case, &["redrive", "--file", file, "--all"])?)?;
    ensure!(summary.contains("redrive: 1 redriven "), "{summary}");
    Ok(())
}

/// Runs the worker with `manifest` until the dead-letter queue holds `letters`, then stops it.
async fn dead_letter(case: &SqsCase, manifest: &Path, consumer: &str, letters: u64) -> Result<()> {
    let worker = case.fx().worker(manifest, consumer)?;
    let written = wait_for(LONG, "the dead letters", || async {
        Ok(case.dead_letters().await? == letters)
    })
    .await;
    written.with_context(|| worker.log_tail())
}

/// Waits until the running worker `worker` made `todos` todos and left the source queue
/// empty (nothing more can become a todo then).
async fn stored(case: &SqsCase, todos: i64, worker: &WorkerProcess) -> Result<()> {
    let made = wait_for(LONG, "the todos", || async {
        Ok(case.fx().todo_count(case.queue()).await? == todos)
    })
    .await;
    made.with_context(|| worker.log_tail())?;
    wait_for(LONG, "the source queue is empty", || async {
        let counts = case.mq.count(&case.queue_url).await?;
        Ok(counts.visible + counts.in_flight == 0)
    })
    .await
}

/// Issue 29 SQS (a): every copy of a FIFO letter used to carry the same
/// `MessageDeduplicationId`, so the second redrive within five minutes was dropped by SQS and
/// the letter then deleted: lost. Redriven, it is dead-lettered again by the poison manifest
/// (a new letter); redriven again at once under the fixed one it makes one todo, with its
/// original key, and leaves no letter.
#[tokio::test]
async fn a_fifo_letter_redriven_dead_lettered_again_and_redriven_again_arrives_once() -> Result<()>
{
    let case = fifo_case("fifo-again").await?;
    let strict = case.manifest(false)?;
    let file = path_text(&strict)?.to_owned();
    let sent = case
        .mq
        .send_fifo(&case.queue_url, "g1", "not json, dead-lettered twice")
        .await?;
    dead_letter(&case, &strict, "strict", 1).await?;
    let first = letter_ids(&case, &file)?;
    // Redriven while no worker runs (a redrive --all chases the letters a running poison
    // manifest dead-letters again), then dead-lettered again by the poison manifest.
    redrive_one(&case, &file)?;
    let worker = case.fx().worker(&strict, "strict-again")?;
    wait_for(
        LONG,
        "the copy dead-lettered again, as a new letter",
        || async {
            let ids = letter_ids(&case, &file)?;
            Ok(ids.len() == 1 && ids != first)
        },
    )
    .await
    .with_context(|| worker.log_tail())?;
    drop(worker);
    let fixed = case.fx().worker(&case.manifest(true)?, "fixed")?;
    redrive_one(&case, &file)?;
    stored(&case, 1, &fixed).await?;
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM todos WHERE queue = $1")
            .bind(case.queue())
            .fetch_all(case.fx().pool())
            .await?;
    ensure!(
        keys == [format!("sqs:test/fifo-again:{sent}")],
        "one todo, with the original's key: {keys:?}"
    );
    ensure!(case.dead_letters().await? == 0, "no letter is left");
    Ok(())
}

/// How long the message waits in the source queue before SQS moves it (its send time is
/// then this much older than its move).
const AGED: Duration = Duration::from_secs(6);

/// Issue 29 SQS (b): a letter's age was taken from `SentTimestamp`, which SQS keeps from the
/// original send, so `purge --older-than` deleted a letter moved a moment before. A letter
/// SQS's `RedrivePolicy` (maxReceiveCount 1) moved just now is kept by `purge --older-than`
/// shorter than its time in the source, and its listed time is not its send time.
#[tokio::test]
async fn a_letter_moved_by_a_redrive_policy_has_no_age_and_is_not_purged_by_age() -> Result<()> {
    let case = SqsCase::start("moved").await?;
    let target = case.mq.queue_arn(&case.dlq_url).await?;
    let client = case.mq.client();
    client
        .set_queue_attributes()
        .queue_url(&case.queue_url)
        .attributes(
            QueueAttributeName::RedrivePolicy,
            format!(r#"{{"maxReceiveCount":"1","deadLetterTargetArn":"{target}"}}"#),
        )
        .send()
        .await
        .map_err(|err| sqs_error("SetQueueAttributes", err))?;
    let manifest = case.manifest(false)?;
    let file = path_text(&manifest)?.to_owned();
    case.send(&[br#"{"moved": 1}"#.to_vec()]).await?;
    // Not synchronisation: the message must be older than `--older-than` when it moves.
    tokio::time::sleep(AGED).await;
    let before_move_ms = now_ms();
    // Received by a consumer that dies (visibility 0); the receive after that moves it.
    wait_for(LONG, "SQS moves the message", || async {
        client
            .receive_message()
            .queue_url(&case.queue_url)
            .visibility_timeout(0)
            .wait_time_seconds(0)
            .send()
            .await
            .map_err(|err| sqs_error("ReceiveMessage", err))?;
        Ok(case.dead_letters().await? == 1)
    })
    .await?;
    let older_than = format!("{}s", AGED.as_secs() - 1);
    let purged = String::from_utf8(dlq_ok(
        &case,
        &[
            "purge",
            "--file",
            &file,
            "--older-than",
            &older_than,
            "--yes",
        ],
    )?)?;
    case.settle().await?;
    ensure!(
        case.dead_letters().await? == 1,
        "a letter moved just now is not purged --older-than {older_than}: {purged}"
    );
    let letters = list_json(&case, &file)?;
    let [letter] = letters.as_slice() else {
        anyhow::bail!("one letter: {letters:?}");
    };
    ensure!(
        letter["reason"] == "redrive_policy",
        "moved by SQS: {letter}"
    );
    ensure!(
        dead_lettered_at(letter).is_none_or(|at| at >= before_move_ms),
        "its time is not its send time, {} ms before the move: {letter}",
        AGED.as_millis()
    );
    Ok(())
}

/// Letters in the kill-window test.
const WINDOW: usize = 3;

/// The fixed manifest of `case`'s adapter, reaching SQS through `proxy`.
fn proxied_manifest(case: &SqsCase, proxy: &SqsProxy) -> Result<PathBuf> {
    let (delivery, payload) = manifest_settings(true);
    let source = format!(
        "sqs: {{queueUrl: \"{}\", endpoint: \"{}\", waitTimeSeconds: 1}}",
        case.queue_url,
        proxy.endpoint()
    );
    case.fx().manifest(
        &format!("{}-proxied.yaml", case.queue()),
        &source_manifest(case.queue(), &source, &delivery, payload),
    )
}

/// Issue 29: the redrive window between `SendMessage` and `DeleteMessage` under a kill. The
/// proxy holds the first letter's `DeleteMessage` (its copy is on the source queue, the letter
/// still in the dead-letter queue) and the command is SIGKILLed there; run again, it redrives
/// every letter (the first one a second time): one todo each, no letter left.
#[tokio::test]
async fn redrive_killed_between_send_and_delete_then_run_again_leaves_one_todo_each() -> Result<()>
{
    let case = SqsCase::start("window").await?;
    let strict = case.manifest(false)?;
    let file = path_text(&strict)?.to_owned();
    let bodies: Vec<Vec<u8>> = (0..WINDOW)
        .map(|n| format!("not json, window #{n}").into_bytes())
        .collect();
    case.send(&bodies).await?;
    dead_letter(&case, &strict, "strict", WINDOW as u64).await?;
    let fixed = case.fx().worker(&case.manifest(true)?, "fixed")?;
    let proxy = SqsProxy::start(case.mq.port())?;
    proxy.hang_deletes(true);
    let proxied = proxied_manifest(&case, &proxy)?;
    let mut redrive = dlq_command(&case, &["redrive", "--file", path_text(&proxied)?, "--all"])?
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    wait_for(LONG, "a letter sent and its delete held", || async {
        Ok(proxy.hung_deletes() == 1)
    })
    .await?;
    redrive.kill()?;
    redrive.wait()?;
    wait_for(LONG, "the copy sent before the kill is stored", || async {
        Ok(case.fx().todo_count(case.queue()).await? == 1)
    })
    .await
    .with_context(|| fixed.log_tail())?;
    ensure!(
        case.dead_letters().await? == WINDOW as u64,
        "the kill came before any delete"
    );
    case.settle().await?;
    let summary = String::from_utf8(dlq_ok(&case, &["redrive", "--file", &file, "--all"])?)?;
    ensure!(
        summary.contains(&format!("redrive: {WINDOW} redriven ")),
        "{summary}"
    );
    stored(&case, WINDOW as i64, &fixed).await?;
    ensure!(
        case.fx().todo_count(case.queue()).await? == WINDOW as i64,
        "the first letter's second copy made no second todo"
    );
    ensure!(case.dead_letters().await? == 0, "no letter is left");
    Ok(())
}
