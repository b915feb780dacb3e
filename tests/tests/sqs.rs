//! Amazon SQS beyond the contract suite, end to end: the real worker binary against real
//! PostgreSQL and a real SQS-compatible server (ElasticMQ; moto where credentials and regions
//! must be checked, which ElasticMQ does not do).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{Message, QueueAttributeName};
use nix::sys::signal::Signal;
use switchboard_tests::brokers::SqsBroker;
use switchboard_tests::brokers::moto::Moto;
use switchboard_tests::brokers::sqs::{ElasticMq, SqsProxy, odd_attributes, sqs_error};
use switchboard_tests::send::round_trip;
use switchboard_tests::todos_lock::{TodosLock, wait_blocked_on_lock};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{RETENTION_WARNING, WorkerProcess};
use switchboard_tests::{Fixture, source_manifest};

const LONG: Duration = Duration::from_secs(120);
/// Acceptance 4: a misconfigured worker exits within this.
const FATAL_EXIT: Duration = Duration::from_secs(30);
/// ElasticMQ and moto accept any credentials unless told otherwise; the region is fixed.
const AWS_ENV: [(&str, &str); 3] = [
    ("AWS_ACCESS_KEY_ID", "x"),
    ("AWS_SECRET_ACCESS_KEY", "x"),
    ("AWS_REGION", "us-east-1"),
];
/// Adapter `test/{name}` reading `queue_url` on `endpoint` into todo queue `name`, strict JSON.
/// `sqs_extra` and `delivery` are extra flow-mapping entries (`visibilityTimeoutSeconds: 4`).
fn sqs_manifest(
    name: &str,
    queue_url: &str,
    endpoint: &str,
    sqs_extra: &str,
    delivery: &str,
) -> String {
    source_manifest(
        name,
        &format!(
            "sqs: {{queueUrl: \"{queue_url}\", endpoint: \"{endpoint}\", waitTimeSeconds: 1{sqs_extra}}}"
        ),
        &format!("batchSize: 10, maxDeliveries: 3{delivery}"),
        "format: json",
    )
}

fn start_worker(fx: &Fixture, manifest: &Path, consumer: &str) -> Result<WorkerProcess> {
    WorkerProcess::start(&fx.env, manifest, consumer, &AWS_ENV)
}

/// Creates `{name}` and its default dead-letter queue `{name}-dlq`; returns both URLs.
async fn queue_pair(mq: &ElasticMq, name: &str) -> Result<(String, String)> {
    let queue = mq.create_queue(name, &[]).await?;
    let dlq = mq.create_queue(&format!("{name}-dlq"), &[]).await?;
    Ok((queue, dlq))
}

fn bodies(name: &str, count: usize) -> impl Iterator<Item = Vec<u8>> + use<> {
    let name = name.to_owned();
    (0..count).map(move |i| format!(r#"{{"{name}":{i}}}"#).into_bytes())
}

/// Waits until `queue` holds `expected` todos and the SQS queue is empty (nothing visible, in
/// flight or delayed).
async fn wait_drained(
    fx: &Fixture,
    mq: &ElasticMq,
    queue: &str,
    queue_url: &str,
    expected: i64,
    worker: &WorkerProcess,
) -> Result<()> {
    wait_for(
        LONG,
        &format!("{expected} todos in {queue} and its SQS queue empty"),
        || async {
            let counts = mq.count(queue_url).await?;
            Ok(fx.todo_count(queue).await? == expected
                && counts.visible + counts.in_flight + counts.delayed == 0)
        },
    )
    .await
    .with_context(|| worker.log_tail())
}

/// A counter of adapter `test/{name}`.
fn counter(worker: &WorkerProcess, family: &str, name: &str) -> Result<f64> {
    worker.metric(&format!(
        r#"switchboard_{family}_total{{adapter="test/{name}"}}"#
    ))
}

/// Receives up to ten visible messages as another consumer would, hiding them for `hide`.
async fn receive_as_other_consumer(
    client: &Client,
    queue_url: &str,
    hide: Duration,
) -> Result<Vec<Message>> {
    let output = client
        .receive_message()
        .queue_url(queue_url)
        .max_number_of_messages(10)
        .wait_time_seconds(1)
        .visibility_timeout(i32::try_from(hide.as_secs())?)
        .send()
        .await
        .map_err(|err| sqs_error("ReceiveMessage", err))?;
    Ok(output.messages.unwrap_or_default())
}

/// Waits for the worker to exit; fails unless it exited non-zero within [`FATAL_EXIT`] with
/// every one of `needles` in its log. Returns the log.
fn assert_fatal_exit(worker: &mut WorkerProcess, needles: &[&str]) -> Result<String> {
    let started = Instant::now();
    let status = worker.wait_exit(FATAL_EXIT)?;
    let log = worker.log();
    ensure!(
        !status.success() && status.code().is_some(),
        "expected a non-zero exit, got {status:?} after {:?}\n{log}",
        started.elapsed()
    );
    for needle in needles {
        ensure!(
            log.contains(needle),
            "the log does not name {needle}:\n{log}"
        );
    }
    Ok(log)
}

#[tokio::test]
async fn fifo_groups_keep_their_order_and_a_poison_message_does_not_break_it() -> Result<()> {
    const PER_GROUP: usize = 30;
    const POISON_SEQ: usize = 11;
    let fx = Fixture::start().await?;
    let mq = ElasticMq::start()?;
    let queue = mq.create_fifo_queue("orders.fifo").await?;
    let dlq = mq.create_fifo_queue("orders-dlq.fifo").await?;
    let poison = r#"{"group":"a","seq":11,"#;
    for seq in 0..PER_GROUP {
        for group in ["a", "b"] {
            let body = if group == "a" && seq == POISON_SEQ {
                poison.to_owned()
            } else {
                format!(r#"{{"group":"{group}","seq":{seq}}}"#)
            };
            mq.send_fifo(&queue, group, &body).await?;
        }
    }
    let manifest = fx.manifest(
        "orders.yaml",
        &sqs_manifest(
            "orders",
            &queue,
            &mq.endpoint(),
            ", visibilityTimeoutSeconds: 4",
            "",
        ),
    )?;
    let worker = start_worker(&fx, &manifest, "worker-a")?;
    let stored = (2 * PER_GROUP - 1) as i64;
    wait_drained(&fx, &mq, "orders", &queue, stored, &worker).await?;
    fx.assert_exactly_once("orders", stored).await?;

    for group in ["a", "b"] {
        let seqs: Vec<i64> = sqlx::query_scalar(
            "SELECT (payload->>'seq')::bigint FROM todos WHERE queue = 'orders' \
             AND payload->>'group' = $1 ORDER BY id",
        )
        .bind(group)
        .fetch_all(fx.pool())
        .await?;
        let expected: Vec<i64> = (0..PER_GROUP as i64)
            .filter(|&seq| group == "b" || seq != POISON_SEQ as i64)
            .collect();
        ensure!(
            seqs == expected,
            "group {group} stored out of order: {seqs:?}"
        );
    }

    let letters = mq.receive_all(&dlq).await?;
    ensure!(
        letters.len() == 1,
        "expected the poison alone in the DLQ: {letters:?}"
    );
    let letter = &letters[0];
    ensure!(
        letter.body() == Some(poison),
        "the dead letter's body changed: {letter:?}"
    );
    let reason = letter
        .message_attributes()
        .and_then(|attributes| attributes.get("x-dlq-reason"))
        .and_then(|value| value.string_value())
        .with_context(|| format!("the dead letter has no x-dlq-reason: {letter:?}"))?;
    ensure!(!reason.is_empty());
    // One sample per reason: the poison is the only dead letter, whatever its reason.
    let (_, metrics) = worker.http_get("/metrics")?;
    let dead_lettered: f64 = metrics
        .lines()
        .filter(|line| {
            line.starts_with(r#"switchboard_messages_dead_lettered_total{adapter="test/orders""#)
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    ensure!(
        dead_lettered == 1.0,
        "{dead_lettered} dead letters:\n{metrics}"
    );
    Ok(())
}

/// A worker of adapter `test/{name}` (visibility 2 s) whose first batch of ten messages waits
/// on a lock of the todos table.
struct Held {
    fx: Fixture,
    mq: ElasticMq,
    queue: String,
    worker: WorkerProcess,
    lock: TodosLock,
}

async fn held_batch(name: &str) -> Result<Held> {
    let fx = Fixture::start().await?;
    let mq = ElasticMq::start()?;
    let (queue, _dlq) = queue_pair(&mq, name).await?;
    let manifest = fx.manifest(
        &format!("{name}.yaml"),
        &sqs_manifest(
            name,
            &queue,
            &mq.endpoint(),
            ", visibilityTimeoutSeconds: 2",
            "",
        ),
    )?;
    let worker = start_worker(&fx, &manifest, "worker-a")?;
    worker.wait_ready(LONG).await?;
    let lock = TodosLock::take(&fx.postgres.url()).await?;
    mq.send_bodies(&queue, bodies(name, 10)).await?;
    wait_blocked_on_lock(&fx, &worker).await?;
    Ok(Held {
        fx,
        mq,
        queue,
        worker,
        lock,
    })
}

#[tokio::test]
async fn batch_whose_commit_outlasts_the_visibility_timeout_is_not_redelivered() -> Result<()> {
    const VISIBILITY: Duration = Duration::from_secs(2);
    let Held {
        fx,
        mq,
        queue,
        worker,
        lock,
    } = held_batch("slow").await?;
    // Three visibility timeouts pass while the batch waits; the lock is the condition, the
    // hold only has to outlast the timeout (and stay under the worker's database timeout).
    tokio::time::sleep(3 * VISIBILITY).await;
    let hidden = mq.count(&queue).await?;
    lock.release().await?;
    ensure!(
        hidden.visible == 0,
        "messages of the held batch became visible again: {hidden:?}"
    );

    wait_drained(&fx, &mq, "slow", &queue, 10, &worker).await?;
    fx.assert_exactly_once("slow", 10).await?;
    ensure!(
        counter(&worker, "messages_redelivered", "slow")? == 0.0,
        "{}",
        worker.log_tail()
    );
    let extended = counter(&worker, "leases_extended", "slow")?;
    ensure!(extended > 0.0, "no lease was extended");
    Ok(())
}

#[tokio::test]
async fn delete_of_an_expired_receipt_counts_as_stale_and_never_blocks_the_loop() -> Result<()> {
    let Held {
        fx,
        mq,
        queue,
        worker,
        lock,
    } = held_batch("stale").await?;
    // A pause of the whole process (as a long GC or CPU starvation would): the lease is not
    // extended, the visibility expires and another consumer receives the held messages, which
    // makes the worker's receipt handles stale (SQS and ElasticMQ accept only the latest).
    worker.signal(Signal::SIGSTOP)?;
    let client = mq.client();
    let mut taken = Vec::new();
    let deadline = Instant::now() + LONG;
    while taken.is_empty() {
        ensure!(
            Instant::now() < deadline,
            "the held messages never became visible again"
        );
        taken = receive_as_other_consumer(&client, &queue, Duration::from_secs(60)).await?;
    }
    worker.signal(Signal::SIGCONT)?;
    lock.release().await?;

    wait_for(LONG, "the worker counts a stale receipt", || async {
        Ok(counter(&worker, "stale_receipts", "stale")? > 0.0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    // The loop goes on: new messages are stored...
    mq.send_bodies(&queue, bodies("fresh", 5)).await?;
    wait_for(LONG, "the new messages are stored", || async {
        Ok(fx.todo_count("stale").await? == 15)
    })
    .await
    .with_context(|| worker.log_tail())?;
    // ...and the messages the other consumer gave back come again and are deduplicated.
    for message in &taken {
        client
            .change_message_visibility()
            .queue_url(&queue)
            .receipt_handle(message.receipt_handle().context("no receipt handle")?)
            .visibility_timeout(0)
            .send()
            .await
            .map_err(|err| sqs_error("ChangeMessageVisibility", err))?;
    }
    wait_drained(&fx, &mq, "stale", &queue, 15, &worker).await?;
    fx.assert_exactly_once("stale", 15).await?;
    ensure!(
        counter(&worker, "messages_duplicate", "stale")? >= taken.len() as f64,
        "{}",
        worker.log_tail()
    );
    Ok(())
}

/// `switchboard-worker send --file MANIFEST --attr k=v < body` into a real ElasticMQ queue,
/// through the SQS transport's own client, into a todo whose event carries the body and the
/// attributes.
#[tokio::test]
async fn send_round_trip_through_sqs_ends_in_one_todo() -> Result<()> {
    round_trip::<SqsBroker>("sqs").await
}

#[tokio::test]
async fn missing_queue_exits_non_zero_naming_the_setting_within_30_seconds() -> Result<()> {
    let fx = Fixture::start().await?;
    let mq = ElasticMq::start()?;
    let missing = format!("{}/000000000000/nowhere", mq.endpoint());
    let manifest = fx.manifest(
        "nowhere.yaml",
        &sqs_manifest("nowhere", &missing, &mq.endpoint(), "", ""),
    )?;
    let mut worker = start_worker(&fx, &manifest, "worker-a")?;
    assert_fatal_exit(&mut worker, &["spec.source.sqs.queueUrl"])?;
    Ok(())
}

#[tokio::test]
async fn missing_dead_letter_queue_exits_naming_the_setting() -> Result<()> {
    let fx = Fixture::start().await?;
    let mq = ElasticMq::start()?;
    let queue = mq.create_queue("lonely", &[]).await?;
    let manifest = fx.manifest(
        "lonely.yaml",
        &sqs_manifest("lonely", &queue, &mq.endpoint(), "", ""),
    )?;
    let mut worker = start_worker(&fx, &manifest, "worker-a")?;
    assert_fatal_exit(
        &mut worker,
        &["spec.delivery.deadLetter.queueUrl", "lonely-dlq"],
    )?;
    Ok(())
}

#[tokio::test]
async fn sql_statement_error_exits_non_zero_with_the_statement_error() -> Result<()> {
    let fx = Fixture::start().await?;
    let mq = ElasticMq::start()?;
    let (queue, _dlq) = queue_pair(&mq, "broken").await?;
    sqlx::query("ALTER TABLE todos RENAME COLUMN payload TO payload_x")
        .execute(fx.pool())
        .await?;
    mq.send_bodies(&queue, bodies("broken", 3)).await?;
    let manifest = fx.manifest(
        "broken.yaml",
        &sqs_manifest("broken", &queue, &mq.endpoint(), "", ""),
    )?;
    let mut worker = start_worker(&fx, &manifest, "worker-a")?;
    // PostgreSQL's own message for SQLSTATE 42703 (undefined_column).
    assert_fatal_exit(
        &mut worker,
        &[
            "SQLSTATE 42703",
            r#"column "payload" of relation "todos" does not exist"#,
        ],
    )?;
    // Nothing was acknowledged that was not stored.
    let counts = mq.count(&queue).await?;
    ensure!(
        counts.visible + counts.in_flight == 3,
        "messages were deleted without being stored: {counts:?}"
    );
    Ok(())
}

#[tokio::test]
async fn denied_credentials_exit_non_zero_naming_the_setting() -> Result<()> {
    let fx = Fixture::start().await?;
    let moto = Moto::start(true, &fx.dir.path().join("moto.log"))?;
    let queue = format!("{}/123456789012/orders", moto.endpoint());
    let manifest = fx.manifest(
        "denied.yaml",
        &sqs_manifest("denied", &queue, &moto.endpoint(), "", ""),
    )?;
    // Credentials that look like real ones: neither may reach the log or the error line.
    const KEY_ID: &str = "AKIAIOSFODNN7EXAMPLE";
    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    let mut worker = WorkerProcess::start(
        &fx.env,
        &manifest,
        "worker-a",
        &[
            ("AWS_ACCESS_KEY_ID", KEY_ID),
            ("AWS_SECRET_ACCESS_KEY", SECRET),
            ("AWS_REGION", "us-east-1"),
        ],
    )?;
    let log = assert_fatal_exit(&mut worker, &["AWS_ACCESS_KEY_ID", "accessKeyIdSecretRef"])?;
    ensure!(
        !log.contains(SECRET) && !log.contains(KEY_ID),
        "a credential in the log:\n{log}"
    );
    Ok(())
}

#[tokio::test]
async fn queue_name_in_another_region_exits_naming_the_setting() -> Result<()> {
    let fx = Fixture::start().await?;
    let moto = Moto::start(false, &fx.dir.path().join("moto.log"))?;
    let elsewhere = moto.client("eu-west-1");
    for name in ["orders", "orders-dlq"] {
        elsewhere
            .create_queue()
            .queue_name(name)
            .send()
            .await
            .map_err(|err| sqs_error("CreateQueue", err))?;
    }
    let manifest = fx.manifest(
        "orders.yaml",
        &format!(
            "apiVersion: switchboard.dev/v1alpha1\n\
             kind: QueueAdapter\n\
             metadata: {{name: orders, namespace: test}}\n\
             spec:\n\
             \x20 source: {{sqs: {{queueName: orders, region: us-east-1, endpoint: \"{}\", waitTimeSeconds: 1}}}}\n\
             \x20 target: {{queue: orders}}\n",
            moto.endpoint()
        ),
    )?;
    let mut worker = start_worker(&fx, &manifest, "worker-a")?;
    assert_fatal_exit(&mut worker, &["spec.source.sqs.queueName", "us-east-1"])?;
    Ok(())
}

#[test]
fn orders_sqs_example_is_a_valid_manifest() -> Result<()> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/orders-sqs.yaml");
    let yaml = std::fs::read_to_string(&path)?;
    let adapter = switchboard_api::load_manifest(&yaml)
        .map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))?;
    let sqs = adapter
        .spec
        .source
        .sqs
        .as_ref()
        .context("the example's source is not sqs")?;
    ensure!(sqs.queue_url.is_some() && sqs.region.is_some());
    ensure!(sqs.access_key_id_secret_ref.is_some() && sqs.secret_access_key_secret_ref.is_some());
    ensure!(sqs.visibility_timeout_seconds.is_some());
    ensure!(adapter.spec.delivery.dead_letter.queue_url.is_some());
    Ok(())
}

/// Issue 27: a dead letter SQS refuses for good (moto enforces the dead-letter queue's
/// `MaximumMessageSize`, 1024 bytes, and refuses the whole `SendMessageBatch` for one letter
/// over it) is kept in PostgreSQL, and the batch around it is stored and deleted: no wedge.
#[tokio::test]
async fn dead_letter_over_the_dead_letter_queues_size_limit_is_kept_in_postgresql() -> Result<()> {
    let fx = Fixture::start().await?;
    let moto = Moto::start(false, &fx.dir.path().join("moto.log"))?;
    let client = moto.client("us-east-1");
    let mut urls = Vec::new();
    for (name, attributes) in [
        ("limited", vec![]),
        (
            "limited-dlq",
            vec![(QueueAttributeName::MaximumMessageSize, "1024")],
        ),
    ] {
        let output = client
            .create_queue()
            .queue_name(name)
            .set_attributes(Some(
                attributes
                    .into_iter()
                    .map(|(n, v)| (n, v.to_owned()))
                    .collect(),
            ))
            .send()
            .await
            .map_err(|err| sqs_error("CreateQueue", err))?;
        urls.push(output.queue_url.context("no QueueUrl")?);
    }
    let poison = format!("{{\"broken\": \"{}\"", "x".repeat(2_000)).into_bytes();
    let good: Vec<Vec<u8>> = bodies("limited", 9).collect();
    for body in good.iter().chain([&poison]) {
        client
            .send_message()
            .queue_url(&urls[0])
            .message_body(String::from_utf8(body.clone())?)
            .send()
            .await
            .map_err(|err| sqs_error("SendMessage", err))?;
    }
    let manifest = fx.manifest(
        "limited.yaml",
        &sqs_manifest("limited", &urls[0], &moto.endpoint(), "", ""),
    )?;
    let worker = start_worker(&fx, &manifest, "worker-a")?;
    wait_for(
        LONG,
        "9 todos, one kept letter, the queue empty",
        || async {
            let left = client
                .get_queue_attributes()
                .queue_url(&urls[0])
                .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
                .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
                .send()
                .await
                .map_err(|err| sqs_error("GetQueueAttributes", err))?
                .attributes
                .unwrap_or_default()
                .values()
                .map(|count| count.parse::<u64>().unwrap_or(1))
                .sum::<u64>();
            Ok(fx.todo_count("limited").await? == 9
                && !fx.database_dead_letters("limited").await?.is_empty()
                && left == 0)
        },
    )
    .await
    .with_context(|| worker.log_tail())?;
    fx.assert_stored_exactly("limited", &good).await?;
    let kept = fx.database_dead_letters("limited").await?;
    ensure!(
        kept == vec![(poison, "invalid_json".to_owned())],
        "one letter kept, byte-identical: {kept:?}"
    );
    Ok(())
}

/// Issue 27: message attributes the worker cannot take as text (a `Binary` value holding NUL,
/// a `Binary.gif` value that is not UTF-8, a custom `Number.float` type) are encoded into the
/// stored headers: the message and its neighbours are stored, nothing is dead-lettered or
/// received twice.
#[tokio::test]
async fn attributes_that_are_not_text_are_encoded_into_the_stored_headers() -> Result<()> {
    let fx = Fixture::start().await?;
    let mq = ElasticMq::start()?;
    let (url, dlq) = queue_pair(&mq, "odd").await?;
    let good: Vec<Vec<u8>> = bodies("odd", 9).collect();
    mq.send_bodies(&url, good[..5].to_vec()).await?;
    let odd = br#"{"odd":true}"#.to_vec();
    mq.send_with_attributes(&url, odd.clone(), odd_attributes())
        .await?;
    mq.send_bodies(&url, good[5..].to_vec()).await?;
    let manifest = fx.manifest(
        "odd.yaml",
        &sqs_manifest("odd", &url, &mq.endpoint(), "", ""),
    )?;
    let worker = start_worker(&fx, &manifest, "worker-a")?;
    wait_drained(&fx, &mq, "odd", &url, 10, &worker).await?;
    let mut all = good.clone();
    all.push(odd);
    fx.assert_stored_exactly("odd", &all).await?;
    let headers: serde_json::Value = sqlx::query_scalar(
        "SELECT e.headers FROM events e WHERE e.payload = '{\"odd\": true}'::jsonb",
    )
    .fetch_one(fx.pool())
    .await?;
    use base64::Engine as _;
    let base64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    ensure!(headers["nul"]["base64"] == base64(b"a\x00b"), "{headers}");
    ensure!(
        headers["gif"]["base64"] == base64(&[0xff, 0x00, 0xfe]),
        "{headers}"
    );
    ensure!(headers["ratio"] == "1.5", "{headers}");
    ensure!(
        counter(&worker, "messages_redelivered", "odd")? == 0.0,
        "stored on its first delivery\n{}",
        worker.log_tail()
    );
    ensure!(
        mq.receive_all(&dlq).await?.is_empty() && fx.database_dead_letters("odd").await?.is_empty(),
        "nothing dead-lettered"
    );
    Ok(())
}

/// Every wait has a deadline: a server that takes a receive and never answers it fails that
/// receive within `waitTimeSeconds` + the margin (readiness false, one log line), and the
/// worker carries on once the server answers again.
#[tokio::test]
async fn hung_receive_times_out_and_the_worker_carries_on() -> Result<()> {
    let fx = Fixture::start().await?;
    let mq = ElasticMq::start()?;
    let proxy = SqsProxy::start(mq.port())?;
    let (url, _) = queue_pair(&mq, "hung").await?;
    let manifest = fx.manifest(
        "hung.yaml",
        &sqs_manifest("hung", &url, &proxy.endpoint(), "", ""),
    )?;
    let worker = start_worker(&fx, &manifest, "worker-a")?;
    mq.send_bodies(&url, bodies("hung", 10)).await?;
    wait_drained(&fx, &mq, "hung", &url, 10, &worker).await?;
    proxy.hang_receives(true);
    wait_for(LONG, "a receive is held", || async {
        Ok(proxy.hung_receives() > 0)
    })
    .await?;
    let held = Instant::now();
    wait_for(
        LONG,
        "the held receive times out: readiness false",
        || async { Ok(worker.http_get("/readyz")?.0 == 503) },
    )
    .await
    .with_context(|| worker.log_tail())?;
    ensure!(
        held.elapsed() < Duration::from_secs(45),
        "the receive's deadline is waitTimeSeconds plus margins, not {:?}",
        held.elapsed()
    );
    proxy.hang_receives(false);
    mq.send_bodies(&url, bodies("later", 10)).await?;
    wait_drained(&fx, &mq, "hung", &url, 20, &worker).await?;
    worker.wait_ready(LONG).await
}

/// SQS's default retention, which a dead-letter queue created without attributes keeps.
const FOUR_DAYS: &str = "345600";

/// The queue's `MessageRetentionPeriod`, in seconds.
async fn retention_seconds(client: &Client, queue_url: &str) -> Result<String> {
    client
        .get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::MessageRetentionPeriod)
        .send()
        .await
        .map_err(|err| sqs_error("GetQueueAttributes", err))?
        .attributes
        .unwrap_or_default()
        .remove(&QueueAttributeName::MessageRetentionPeriod)
        .context("no MessageRetentionPeriod")
}

/// Moto (ElasticMQ neither reports nor sets `MessageRetentionPeriod`) with `{name}` and
/// `{name}-dlq` keeping messages 4 days; returns moto, its client and both URLs.
async fn moto_dead_letter_four_days(
    fx: &Fixture,
    name: &str,
) -> Result<(Moto, Client, String, String)> {
    let moto = Moto::start(false, &fx.dir.path().join("moto.log"))?;
    let client = moto.client("us-east-1");
    let mut urls = Vec::new();
    for queue in [name.to_owned(), format!("{name}-dlq")] {
        let url = client
            .create_queue()
            .queue_name(&queue)
            .attributes(QueueAttributeName::MessageRetentionPeriod, FOUR_DAYS)
            .send()
            .await
            .map_err(|err| sqs_error("CreateQueue", err))?
            .queue_url
            .context("no QueueUrl")?;
        urls.push(url);
    }
    let dlq = urls.pop().context("no DLQ")?;
    let queue = urls.pop().context("no queue")?;
    ensure!(retention_seconds(&client, &dlq).await? == FOUR_DAYS);
    Ok((moto, client, queue, dlq))
}

#[tokio::test]
async fn dead_letter_queue_kept_four_days_is_raised_to_retention_days() -> Result<()> {
    let fx = Fixture::start().await?;
    let (moto, client, queue, dlq) = moto_dead_letter_four_days(&fx, "brief").await?;
    let manifest = fx.manifest(
        "brief.yaml",
        &sqs_manifest("brief", &queue, &moto.endpoint(), "", ""),
    )?;
    let worker = start_worker(&fx, &manifest, "worker-a")?;
    worker.wait_ready(LONG).await?;
    let kept = retention_seconds(&client, &dlq).await?;
    ensure!(
        kept == "1209600",
        "the dead-letter queue keeps messages {kept} s, not retentionDays (14 days)"
    );
    Ok(())
}

#[tokio::test]
async fn dead_letter_retention_raise_denied_exits_naming_retention_days() -> Result<()> {
    let fx = Fixture::start().await?;
    let (moto, client, queue, dlq) = moto_dead_letter_four_days(&fx, "denied").await?;
    let proxy = SqsProxy::start(moto.port())?;
    proxy.deny_set_attributes(true);
    let manifest = fx.manifest(
        "denied.yaml",
        &sqs_manifest("denied", &queue, &proxy.endpoint(), "", ""),
    )?;
    let mut worker = start_worker(&fx, &manifest, "worker-a")?;
    let log = assert_fatal_exit(
        &mut worker,
        &[
            "spec.delivery.deadLetter.retentionDays",
            "acceptShorterRetention",
            "AccessDenied",
        ],
    )?;
    ensure!(
        log.lines()
            .any(|line| line.starts_with("error: spec.delivery.deadLetter.retentionDays: ")),
        "the exit line does not lead with the setting:\n{log}"
    );
    ensure!(retention_seconds(&client, &dlq).await? == FOUR_DAYS);
    Ok(())
}

#[tokio::test]
async fn accept_shorter_retention_runs_with_a_four_day_dead_letter_queue() -> Result<()> {
    let fx = Fixture::start().await?;
    let (moto, client, queue, dlq) = moto_dead_letter_four_days(&fx, "accepted").await?;
    let manifest = fx.manifest(
        "accepted.yaml",
        &sqs_manifest(
            "accepted",
            &queue,
            &moto.endpoint(),
            "",
            ", deadLetter: {acceptShorterRetention: true}",
        ),
    )?;
    let worker = start_worker(&fx, &manifest, "worker-a")?;
    worker.wait_ready(LONG).await?;
    ensure!(
        worker.log().contains("acceptShorterRetention"),
        "no warning about the shorter retention:\n{}",
        worker.log_tail()
    );
    ensure!(retention_seconds(&client, &dlq).await? == FOUR_DAYS);
    Ok(())
}

#[tokio::test]
async fn retention_days_over_fourteen_is_refused_for_sqs_naming_the_field() -> Result<()> {
    let fx = Fixture::start().await?;
    let mq = ElasticMq::start()?;
    let (queue, _) = queue_pair(&mq, "forever").await?;
    let manifest = fx.manifest(
        "forever.yaml",
        &sqs_manifest(
            "forever",
            &queue,
            &mq.endpoint(),
            "",
            ", deadLetter: {retentionDays: 30}",
        ),
    )?;
    let mut worker = start_worker(&fx, &manifest, "worker-a")?;
    assert_fatal_exit(
        &mut worker,
        &["spec.delivery.deadLetter.retentionDays", "14 days"],
    )?;
    Ok(())
}

/// Issue 30: the source queue's `MessageRetentionPeriod` is compared with the dedup window at
/// start: 4 days within the default 30 pass quietly; over a 1-day window, a warning names both.
#[tokio::test]
async fn source_queue_kept_longer_than_the_dedup_window_is_warned_about_at_start() -> Result<()> {
    let fx = Fixture::start().await?;
    let (moto, _client, queue, _dlq) = moto_dead_letter_four_days(&fx, "kept").await?;
    let manifest = fx.manifest(
        "kept.yaml",
        &sqs_manifest("kept", &queue, &moto.endpoint(), "", ""),
    )?;
    let within = start_worker(&fx, &manifest, "worker-a")?;
    within.wait_ready(LONG).await?;
    ensure!(
        !within.log().contains(RETENTION_WARNING),
        "4 days within a 30-day window were warned about:\n{}",
        within.log_tail()
    );
    within.kill()?;

    fx.store
        .maintain_events(Duration::from_secs(86_400), 0)
        .await?;
    let beyond = start_worker(&fx, &manifest, "worker-b")?;
    beyond.wait_ready(LONG).await?;
    beyond.assert_retention_warned("4d", "MessageRetentionPeriod of the source queue")?;
    Ok(())
}
