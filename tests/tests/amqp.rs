//! RabbitMQ behaviour beyond the contract suite, against a real node (Debian's
//! rabbitmq-server 3.10): producer retries, dead letters confirmed before the acknowledgement,
//! the missing-queue and `declare` paths, and the example manifest.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use lapin::BasicProperties;
use lapin::options::BasicGetOptions;
use lapin::types::AMQPValue;
use switchboard_tests::brokers::rabbitmq::{self, QueueType, RabbitMq, queue_arguments};
use switchboard_tests::servers::proc_kib;
use switchboard_tests::todos_lock::{TodosLock, wait_blocked_on_lock};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::WorkerProcess;
use switchboard_tests::{Fixture, source_manifest};

const LONG: Duration = Duration::from_secs(120);
/// A misconfigured worker exits within this.
const FATAL_EXIT: Duration = Duration::from_secs(30);

async fn start(fx: &mut Fixture) -> Result<RabbitMq> {
    let server = RabbitMq::start()?;
    fx.extra_env = vec![("AMQP_URL".to_owned(), server.url())];
    Ok(server)
}

fn counter(worker: &WorkerProcess, family: &str, name: &str) -> Result<f64> {
    worker.metric(&format!(
        r#"switchboard_{family}_total{{adapter="test/{name}"}}"#
    ))
}

fn with_id(id: &str) -> BasicProperties {
    BasicProperties::default().with_message_id(id.into())
}

/// Declares the quorum queue `name` and publishes `messages` to it.
async fn quorum_queue_holding(
    server: &RabbitMq,
    name: &str,
    messages: impl IntoIterator<Item = (Vec<u8>, BasicProperties)>,
) -> Result<()> {
    server
        .declare(name, queue_arguments(QueueType::Quorum, &[]))
        .await?;
    server.publish(name, messages).await
}

/// Waits for the worker to exit non-zero within [`FATAL_EXIT`] with every one of `needles` in
/// its log.
fn assert_fatal_exit(worker: &mut WorkerProcess, needles: &[&str]) -> Result<()> {
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
    Ok(())
}

#[tokio::test]
async fn same_message_id_delivered_twice_creates_one_todo() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let name = "retried";
    // A producer retrying after a lost confirm: the same message-id twice in a row (the
    // second copy a little different, as a re-serialised retry may be), then once more after
    // the first was stored.
    quorum_queue_holding(
        &server,
        name,
        [
            (br#"{"order":1}"#.to_vec(), with_id("order-1")),
            (br#"{"order": 1}"#.to_vec(), with_id("order-1")),
            (br#"{"order":2}"#.to_vec(), with_id("order-2")),
        ],
    )
    .await?;
    let manifest = fx.manifest(
        "retried.yaml",
        &source_manifest(
            name,
            &format!("amqp: {{queue: {name}}}"),
            "batchSize: 10",
            "",
        ),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "the first messages settled", || async {
        Ok(server.messages(name).await? == 0 && fx.todo_count(name).await? >= 2)
    })
    .await
    .with_context(|| worker.log_tail())?;
    server
        .publish(name, [(br#"{"order":1}"#.to_vec(), with_id("order-1"))])
        .await?;
    wait_for(LONG, "the late retry counted as a duplicate", || async {
        Ok(counter(&worker, "messages_duplicate", name)? >= 1.0
            && server.messages(name).await? == 0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    fx.assert_exactly_once(name, 2).await
}

#[tokio::test]
async fn dead_letter_publish_is_confirmed_before_the_original_is_acknowledged() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let name = "blocked";
    server
        .declare(name, queue_arguments(QueueType::Classic, &[]))
        .await?;
    // The dead-letter queue holds one message and refuses publishes beyond that (publishers
    // get a nack): filled, it blocks every dead letter.
    let dlq = format!("{name}.dlq");
    let limits = [
        ("x-max-length", AMQPValue::LongLongInt(1)),
        ("x-overflow", rabbitmq::text("reject-publish")),
    ];
    server
        .declare(&dlq, queue_arguments(QueueType::Classic, &limits))
        .await?;
    server
        .publish(&dlq, [(b"filler".to_vec(), with_id("filler"))])
        .await?;
    let poison = b"{\"order\": broken".to_vec();
    server
        .publish(name, [(poison.clone(), with_id("poison-1"))])
        .await?;
    let manifest = fx.manifest(
        "blocked.yaml",
        &source_manifest(
            name,
            &format!("amqp: {{queue: {name}}}"),
            "batchSize: 10",
            "format: json",
        ),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "dead-letter publishes refused and retried", || async {
        Ok(worker.metric(r#"switchboard_dependency_errors_total{adapter="test/blocked",dependency="broker"}"#)? >= 2.0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    ensure!(
        server.messages(name).await? == 1,
        "the original must stay un-acknowledged while its dead letter is refused\n{}",
        worker.log_tail()
    );
    let held = server.peek(&dlq).await?;
    ensure!(
        held.len() == 1 && held[0].0 == b"filler",
        "only the filler is in the dead-letter queue: {held:?}"
    );
    // Unblock: take the filler out; the next retry is confirmed, then the original acked.
    let (connection, channel) = server.channel().await?;
    let filler = channel
        .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })
        .await?;
    ensure!(filler.is_some(), "the filler was there");
    let _ = connection.close(200, "done".into()).await;
    wait_for(
        LONG,
        "the dead letter written and the original acked",
        || async { Ok(server.messages(name).await? == 0) },
    )
    .await
    .with_context(|| worker.log_tail())?;
    let letters = server.peek(&dlq).await?;
    ensure!(letters.len() == 1, "one dead letter: {letters:?}");
    let (body, properties) = &letters[0];
    ensure!(body == &poison, "byte-identical body");
    ensure!(
        properties.message_id().as_ref().map(|id| id.as_str()) == Some("poison-1"),
        "the original properties are kept: {properties:?}"
    );
    for (header, expected) in [
        ("x-switchboard-reason", Some("invalid_json")),
        ("x-switchboard-delivery-count", Some("1")),
        ("x-switchboard-original-routing-key", Some(name)),
        ("x-switchboard-queue", Some(name)),
    ] {
        let value = rabbitmq::header(properties, header);
        ensure!(
            value.as_deref() == expected,
            "{header}: {value:?} in {properties:?}"
        );
    }
    ensure!(rabbitmq::header(properties, "x-switchboard-error").is_some());
    ensure!(rabbitmq::header(properties, "x-switchboard-last-seen").is_some());
    ensure!(fx.todo_count(name).await? == 0, "poison is never stored");
    Ok(())
}

/// A batch held in the database while the connection is cut: its delivery tags belong to the
/// lost channel. They are counted as stale and never sent on the new channel (an unknown tag
/// there would close it); RabbitMQ redelivers the messages and their keys deduplicate them.
/// The outage is logged once.
#[tokio::test]
async fn tags_of_a_lost_channel_are_stale_and_never_used_on_the_new_one() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let mut server = start(&mut fx).await?;
    let name = "reconnect";
    server
        .declare(name, queue_arguments(QueueType::Quorum, &[]))
        .await?;
    let manifest = fx.manifest(
        "reconnect.yaml",
        &source_manifest(
            name,
            &format!("amqp: {{queue: {name}}}"),
            "batchSize: 10",
            "",
        ),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "the worker is ready", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await
    .with_context(|| worker.log_tail())?;
    let lock = TodosLock::take(&fx.postgres.url()).await?;
    server
        .publish(
            name,
            (0..10).map(|i| {
                (
                    format!(r#"{{"n":{i}}}"#).into_bytes(),
                    with_id(&format!("n-{i}")),
                )
            }),
        )
        .await?;
    wait_blocked_on_lock(&fx, &worker).await?;
    server.stop();
    lock.release().await?;
    wait_for(LONG, "the held batch's acks counted as stale", || async {
        Ok(worker.metric(&format!(
            r#"switchboard_stale_receipts_total{{adapter="test/{name}"}}"#
        ))? >= 10.0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    // The worker keeps trying to reconnect (with backoff) while the broker is down.
    wait_for(LONG, "readiness false during the outage", || async {
        Ok(worker.http_get("/readyz")?.0 == 503
            && worker.metric(&format!(
                r#"switchboard_dependency_errors_total{{adapter="test/{name}",dependency="broker"}}"#
            ))? >= 3.0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    server.start_node()?;
    wait_for(LONG, "the redeliveries settled as duplicates", || async {
        Ok(server.messages(name).await? == 0
            && counter(&worker, "messages_duplicate", name)? >= 10.0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    fx.assert_exactly_once(name, 10).await?;
    let reconnects = counter(&worker, "broker_reconnects", name)?;
    ensure!(reconnects >= 1.0, "the reconnection is counted");
    ensure!(
        counter(&worker, "amqp_sessions_opened", name)? == reconnects + 1.0,
        "the deprecated sessions count is still 1 + reconnects"
    );
    let log = worker.log();
    let outages = log
        .lines()
        .filter(|line| line.contains("dependency unavailable") && line.contains("broker"))
        .count();
    ensure!(outages == 1, "one line per outage, got {outages}:\n{log}");
    ensure!(
        !log.contains("PRECONDITION_FAILED"),
        "no stale tag was sent on the new channel:\n{log}"
    );
    Ok(())
}

#[tokio::test]
async fn missing_queue_exits_non_zero_naming_it_unless_declare_is_set() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let missing = fx.manifest(
        "missing.yaml",
        &source_manifest("missing", "amqp: {queue: nowhere}", "batchSize: 10", ""),
    )?;
    let mut worker = fx.worker(&missing, "w1")?;
    assert_fatal_exit(&mut worker, &["spec.source.amqp.queue", "nowhere"])?;

    let declared = fx.manifest(
        "declared.yaml",
        &source_manifest(
            "declared",
            "amqp: {queue: created, declare: {type: classic}}",
            "batchSize: 10",
            "",
        ),
    )?;
    let worker = fx.worker(&declared, "w2")?;
    wait_for(LONG, "the worker declared the queue", || async {
        Ok(server.messages("created").await.is_ok())
    })
    .await
    .with_context(|| worker.log_tail())?;
    server
        .publish(
            "created",
            (0..20).map(|i| {
                (
                    format!(r#"{{"n":{i}}}"#).into_bytes(),
                    with_id(&format!("n-{i}")),
                )
            }),
        )
        .await?;
    wait_for(LONG, "20 todos", || async {
        Ok(fx.todo_count("declared").await? == 20 && server.messages("created").await? == 0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    fx.assert_exactly_once("declared", 20).await
}

#[test]
fn orders_amqp_example_is_a_valid_manifest() -> Result<()> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/orders-amqp.yaml");
    let yaml = std::fs::read_to_string(&path)?;
    let adapter = switchboard_api::load_manifest(&yaml)
        .map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))?;
    let amqp = adapter
        .spec
        .source
        .amqp
        .as_ref()
        .context("the example's source is not amqp")?;
    ensure!(amqp.url_secret_ref.is_some());
    ensure!(
        amqp.declare
            .as_ref()
            .is_some_and(|d| !d.bindings.is_empty())
    );
    Ok(())
}

#[test]
fn misspelled_amqp_field_is_rejected_naming_it() -> Result<()> {
    let yaml = source_manifest("typo", "amqp: {queue: orders, decalre: {}}", "", "");
    let err = switchboard_api::load_manifest(&yaml).expect_err("unknown field");
    ensure!(
        err.to_string().contains("spec.source.amqp.decalre"),
        "{err}"
    );
    Ok(())
}

#[test]
fn dead_letter_targets_of_another_broker_are_refused_naming_the_field() -> Result<()> {
    for (source, delivery, field) in [
        (
            "amqp: {queue: orders}",
            "deadLetter: {queueUrl: \"http://sqs/q-dlq\"}",
            "spec.delivery.deadLetter.queueUrl",
        ),
        (
            "amqp: {queue: orders}",
            "deadLetter: {routingKey: orders}",
            "spec.delivery.deadLetter.routingKey",
        ),
        (
            "redis: {mode: stream, stream: orders}",
            "deadLetter: {exchange: dead}",
            "spec.delivery.deadLetter.exchange",
        ),
        (
            "sqs: {queueUrl: \"http://sqs/q\", region: us-east-1}",
            "deadLetter: {exchange: dead}",
            "spec.delivery.deadLetter.exchange",
        ),
    ] {
        let yaml = source_manifest("orders", source, delivery, "");
        let err = switchboard_api::load_manifest(&yaml).expect_err("refused");
        ensure!(err.to_string().contains(field), "{source}: {err}");
    }
    let yaml = source_manifest(
        "orders",
        "amqp: {queue: orders}",
        "deadLetter: {exchange: dead, routingKey: orders.failed}",
        "",
    );
    switchboard_api::load_manifest(&yaml).map_err(|err| anyhow::anyhow!("{err}"))?;
    Ok(())
}

/// A manifest for queue `name` with `delivery` settings, JSON payloads.
fn json_manifest(fx: &Fixture, name: &str, delivery: &str) -> Result<std::path::PathBuf> {
    fx.manifest(
        &format!("{name}.yaml"),
        &source_manifest(
            name,
            &format!("amqp: {{queue: {name}}}"),
            delivery,
            "format: json",
        ),
    )
}

const POISON: &[u8] = b"{\"order\": broken";

/// Ten good messages, then the poison message with `properties`.
fn good_then_poison(properties: BasicProperties) -> Vec<(Vec<u8>, BasicProperties)> {
    let mut messages: Vec<(Vec<u8>, BasicProperties)> = (0..10)
        .map(|i| {
            (
                format!(r#"{{"order":{i}}}"#).into_bytes(),
                with_id(&format!("order-{i}")),
            )
        })
        .collect();
    messages.push((POISON.to_vec(), properties));
    messages
}

/// Waits for 10 todos, the one dead letter of `name`, and nothing un-acknowledged; returns the
/// letter's properties.
async fn the_one_dead_letter(
    fx: &Fixture,
    server: &RabbitMq,
    name: &str,
    worker: &WorkerProcess,
) -> Result<BasicProperties> {
    let dlq = format!("{name}.dlq");
    wait_for(
        LONG,
        "10 todos, one dead letter, nothing un-acknowledged",
        || async {
            Ok(fx.todo_count(name).await? == 10
                && server.messages(&dlq).await? >= 1
                && server.messages(name).await? == 0)
        },
    )
    .await
    .with_context(|| worker.log_tail())?;
    let mut letters = server.peek(&dlq).await?;
    ensure!(letters.len() == 1, "one dead letter: {letters:?}");
    let (body, properties) = letters.remove(0);
    ensure!(body == POISON, "byte-identical body");
    Ok(properties)
}

/// A poison message with a per-message TTL: its dead letter does not inherit `expiration` (it
/// would expire in the dead-letter queue); the TTL is kept as a header.
#[tokio::test]
async fn dead_letter_does_not_inherit_the_per_message_ttl() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let name = "ttl";
    server
        .declare(name, queue_arguments(QueueType::Classic, &[]))
        .await?;
    let poison = with_id("poison-ttl").with_expiration("60000".into());
    server.publish(name, good_then_poison(poison)).await?;
    let worker = fx.worker(&json_manifest(&fx, name, "batchSize: 20")?, "w1")?;
    let letter = the_one_dead_letter(&fx, &server, name, &worker).await?;
    ensure!(
        letter.expiration().is_none(),
        "the dead letter must not expire: {letter:?}"
    );
    ensure!(
        rabbitmq::header(&letter, "x-switchboard-original-expiration").as_deref() == Some("60000"),
        "the TTL is kept as a header: {letter:?}"
    );
    Ok(())
}

/// A poison message published with the producer's validated `user-id`: the dead letter, which
/// the worker publishes as its own user, does not copy it (RabbitMQ would refuse the publish
/// with 406 PRECONDITION_FAILED, wedging the batch); it is kept as a header.
#[tokio::test]
async fn dead_letter_does_not_copy_the_producers_user_id() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let name = "userid";
    server
        .declare(name, queue_arguments(QueueType::Quorum, &[]))
        .await?;
    server
        .ctl(&["add_user", "producer", "producer-secret"])
        .await?;
    server
        .ctl(&["set_permissions", "-p", "/", "producer", ".*", ".*", ".*"])
        .await?;
    // The producer's own connection: RabbitMQ accepts its user-id because it is its user.
    let producer_url = server
        .url()
        .replace("guest:guest", "producer:producer-secret");
    let connection =
        lapin::Connection::connect(&producer_url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await?;
    for (body, properties) in
        good_then_poison(with_id("poison-user").with_user_id("producer".into()))
    {
        let confirm = channel
            .basic_publish(
                "".into(),
                name.into(),
                lapin::options::BasicPublishOptions::default(),
                &body,
                properties.with_user_id("producer".into()),
            )
            .await?
            .await?;
        ensure!(confirm.is_ack(), "the producer's publish is confirmed");
    }
    let _ = connection.close(200, "done".into()).await;
    let worker = fx.worker(&json_manifest(&fx, name, "batchSize: 20")?, "w1")?;
    let letter = the_one_dead_letter(&fx, &server, name, &worker).await?;
    ensure!(letter.user_id().is_none(), "no user-id copied: {letter:?}");
    ensure!(
        rabbitmq::header(&letter, "x-switchboard-original-user-id").as_deref() == Some("producer"),
        "the user-id is kept as a header: {letter:?}"
    );
    ensure!(
        !worker.log().contains("PRECONDITION_FAILED"),
        "no publish refused:\n{}",
        worker.log_tail()
    );
    Ok(())
}

/// A quorum-queue message redelivered before it turned out poison: its dead letter carries the
/// count as `x-switchboard-delivery-count`, never RabbitMQ's `x-delivery-count` (a letter moved
/// back would count on from it).
#[tokio::test]
async fn dead_letter_carries_no_x_delivery_count() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let name = "counted";
    server
        .declare(name, queue_arguments(QueueType::Quorum, &[]))
        .await?;
    // A classic dead-letter queue: a quorum one would add its own x-delivery-count when read.
    server
        .declare(
            &format!("{name}.dlq"),
            queue_arguments(QueueType::Classic, &[]),
        )
        .await?;
    server
        .publish(name, good_then_poison(with_id("poison-counted")))
        .await?;
    let manifest = json_manifest(&fx, name, "batchSize: 20, maxDeliveries: 5")?;
    // The first worker dies while its batch waits on a lock: everything is redelivered.
    let lock = TodosLock::take(&fx.postgres.url()).await?;
    let dying = fx.worker(&manifest, "dying")?;
    wait_blocked_on_lock(&fx, &dying).await?;
    dying.kill()?;
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(switchboard_worker::database_application_name("dying"))
    .execute(fx.pool())
    .await?;
    fx.wait_disconnected("dying").await?;
    lock.release().await?;
    let worker = fx.worker(&manifest, "w2")?;
    let letter = the_one_dead_letter(&fx, &server, name, &worker).await?;
    ensure!(
        rabbitmq::header(&letter, "x-delivery-count").is_none(),
        "RabbitMQ's counter is not copied: {letter:?}"
    );
    ensure!(
        rabbitmq::header(&letter, "x-switchboard-delivery-count").as_deref() == Some("2"),
        "the count travels as the worker's header: {letter:?}"
    );
    Ok(())
}

/// A memory alarm blocks the publishing connection while a poison message's dead letter is
/// being written: consuming goes on, the block is reported as such (log, gauge), and when the
/// alarm clears the poison message has exactly one dead letter (no re-publish after a confirm
/// timeout).
#[tokio::test]
async fn blocked_connection_publishes_one_dead_letter_and_says_so() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let name = "alarm";
    server
        .declare(name, queue_arguments(QueueType::Quorum, &[]))
        .await?;
    server
        .publish(name, good_then_poison(with_id("poison-alarm")))
        .await?;
    server
        .ctl(&["set_vm_memory_high_watermark", "absolute", "1MB"])
        .await?;
    let worker = fx.worker(&json_manifest(&fx, name, "batchSize: 20")?, "w1")?;
    let blocked = format!(r#"switchboard_amqp_publishing_blocked{{adapter="test/{name}"}}"#);
    let errors = format!(
        r#"switchboard_dependency_errors_total{{adapter="test/{name}",dependency="broker"}}"#
    );
    // Long enough for confirms to time out (10 s) more than once.
    wait_for(
        LONG,
        "the block reported and outlasting confirm timeouts",
        || async { Ok(worker.metric(&blocked)? == 1.0 && worker.metric(&errors)? >= 3.0) },
    )
    .await
    .with_context(|| worker.log_tail())?;
    ensure!(
        fx.todo_count(name).await? == 10,
        "the good messages are stored during the alarm"
    );
    server.ctl(&["set_vm_memory_high_watermark", "0.4"]).await?;
    let letter = the_one_dead_letter(&fx, &server, name, &worker).await?;
    ensure!(
        letter.message_id().as_ref().map(|id| id.as_str()) == Some("poison-alarm"),
        "{letter:?}"
    );
    wait_for(LONG, "the unblock reported", || async {
        Ok(worker.metric(&blocked)? == 0.0)
    })
    .await?;
    let log = worker.log();
    let reports = log
        .lines()
        .filter(|line| line.contains("RabbitMQ blocked the publishing connection"))
        .count();
    ensure!(
        reports == 1,
        "the block is logged once, got {reports}:\n{log}"
    );
    ensure!(
        server.peek(&format!("{name}.dlq")).await?.len() == 1,
        "still one dead letter"
    );
    Ok(())
}

/// A quorum queue whose `x-delivery-limit` is below maxDeliveries would have RabbitMQ drop
/// messages behind the worker's back: the worker refuses to start, naming both settings. A
/// limit at or above maxDeliveries is fine.
#[tokio::test]
async fn quorum_delivery_limit_below_max_deliveries_is_refused() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let limited = [("x-delivery-limit", AMQPValue::LongLongInt(2))];
    server
        .declare("limited", queue_arguments(QueueType::Quorum, &limited))
        .await?;
    let manifest = json_manifest(&fx, "limited", "batchSize: 10, maxDeliveries: 5")?;
    let mut worker = fx.worker(&manifest, "w1")?;
    assert_fatal_exit(
        &mut worker,
        &["spec.delivery.maxDeliveries", "x-delivery-limit 2"],
    )?;

    let roomy = [
        ("x-delivery-limit", AMQPValue::LongLongInt(10)),
        ("x-max-length", AMQPValue::LongLongInt(1000)),
    ];
    server
        .declare("roomy", queue_arguments(QueueType::Quorum, &roomy))
        .await?;
    server
        .publish(
            "roomy",
            (0..5).map(|i| {
                (
                    format!(r#"{{"n":{i}}}"#).into_bytes(),
                    with_id(&format!("n-{i}")),
                )
            }),
        )
        .await?;
    let manifest = json_manifest(&fx, "roomy", "batchSize: 10, maxDeliveries: 5")?;
    let worker = fx.worker(&manifest, "w2")?;
    wait_for(LONG, "5 todos", || async {
        Ok(fx.todo_count("roomy").await? == 5 && server.messages("roomy").await? == 0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    Ok(())
}

/// A classic queue full to its `x-max-length` with `x-overflow: reject-publish` after a worker
/// crash: the redelivered messages cannot be published again with their count. Storing does not
/// wait on that publish: every message is stored, in one session.
///
/// The queue is kept full without a race: RabbitMQ counts only ready messages against the
/// length, so once the crash requeued what the crashed worker held, a policy lowers the length
/// to what stays ready after the next worker took its prefetch (the redelivered messages, at
/// the head). Its recount publishes then meet a full queue whatever the timing. (A producer
/// refilling the queue in bursts raced them: CI saw every recount accepted.)
#[tokio::test]
async fn full_classic_queue_after_a_crash_still_stores() -> Result<()> {
    use lapin::options::BasicPublishOptions;
    const TOTAL: usize = 170;
    const BATCH: usize = 10;
    let prefetch = BATCH * (switchboard_worker::transport::HELD + 1);
    ensure!(
        prefetch < TOTAL,
        "the next worker must leave messages ready"
    );
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let name = "full";
    let limits = [
        ("x-max-length", AMQPValue::LongLongInt(TOTAL as i64)),
        ("x-overflow", rabbitmq::text("reject-publish")),
    ];
    server
        .declare(name, queue_arguments(QueueType::Classic, &limits))
        .await?;
    let message = |id: &str| (format!(r#"{{"id":"{id}"}}"#).into_bytes(), with_id(id));
    server
        .publish(name, (0..TOTAL).map(|i| message(&format!("n-{i}"))))
        .await?;
    let manifest = json_manifest(&fx, name, &format!("batchSize: {BATCH}"))?;
    fx.crash_after_first_commit(&manifest, "crashing").await?;
    let ready = TOTAL - prefetch;
    server
        .ctl(&[
            "set_policy",
            "--apply-to",
            "queues",
            "full-cap",
            "^full$",
            &format!(r#"{{"max-length":{ready}}}"#),
        ])
        .await?;
    // The queue applies a policy on its own time: probes are published until one is refused
    // (each one accepted before is one more message to store).
    let (connection, channel) = server.channel().await?;
    let accepted = std::cell::Cell::new(0);
    wait_for(LONG, "the queue refuses a publish", || async {
        let id = format!("probe-{}", accepted.get());
        let (body, properties) = message(&id);
        let confirm = channel
            .basic_publish(
                "".into(),
                name.into(),
                BasicPublishOptions::default(),
                &body,
                properties.with_delivery_mode(2),
            )
            .await?
            .await?;
        if confirm.is_ack() {
            accepted.set(accepted.get() + 1);
        }
        Ok(!confirm.is_ack())
    })
    .await?;
    let _ = connection.close(200, "capped".into()).await;
    let worker = fx.worker(&manifest, "survivor")?;
    wait_for(
        LONG,
        "redeliveries stored without their recount",
        || async { Ok(counter(&worker, "amqp_redeliveries_not_recounted", name)? > 0.0) },
    )
    .await
    .with_context(|| worker.log_tail())?;
    let expected = i64::try_from(TOTAL + accepted.get())?;
    wait_for(LONG, "every message stored and acknowledged", || async {
        Ok(fx.todo_count(name).await? == expected && server.messages(name).await? == 0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    fx.assert_exactly_once(name, expected).await?;
    ensure!(
        counter(&worker, "broker_reconnects", name)? == 0.0,
        "one session, no reconnect loop\n{}",
        worker.log_tail()
    );
    Ok(())
}

/// The arguments `rabbitmqctl list_queues` shows for queue `name`.
async fn listed_arguments(server: &RabbitMq, name: &str) -> Result<String> {
    let listed = server
        .ctl(&[
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "arguments",
        ])
        .await?;
    listed
        .lines()
        .find_map(|line| {
            let (queue, arguments) = line.split_once('\t')?;
            (queue == name).then(|| arguments.to_owned())
        })
        .with_context(|| format!("queue {name} is not listed:\n{listed}"))
}

#[tokio::test]
async fn dead_letter_queue_is_declared_with_retention_days_as_message_ttl() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    server
        .declare("kept", queue_arguments(QueueType::Quorum, &[]))
        .await?;
    let manifest = json_manifest(&fx, "kept", "batchSize: 10, deadLetter: {retentionDays: 9}")?;
    let worker = fx.worker(&manifest, "w1")?;
    worker.wait_ready(LONG).await?;
    let arguments = listed_arguments(&server, "kept.dlq").await?;
    ensure!(
        arguments.contains("x-message-ttl") && arguments.contains("777600000"),
        "kept.dlq is not declared with x-message-ttl of 9 days: {arguments}"
    );
    Ok(())
}

#[tokio::test]
async fn existing_dead_letter_queue_with_shorter_ttl_exits_naming_retention_days() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    server
        .declare("brief", queue_arguments(QueueType::Quorum, &[]))
        .await?;
    let four_days = [("x-message-ttl", AMQPValue::LongLongInt(345_600_000))];
    server
        .declare("brief.dlq", queue_arguments(QueueType::Quorum, &four_days))
        .await?;
    let manifest = json_manifest(&fx, "brief", "batchSize: 10")?;
    let mut worker = fx.worker(&manifest, "w1")?;
    assert_fatal_exit(
        &mut worker,
        &[
            "spec.delivery.deadLetter.retentionDays",
            "acceptShorterRetention",
            "345600 s",
        ],
    )?;

    let manifest = json_manifest(
        &fx,
        "brief",
        "batchSize: 10, deadLetter: {acceptShorterRetention: true}",
    )?;
    let worker = fx.worker(&manifest, "w2")?;
    worker.wait_ready(LONG).await?;
    ensure!(
        worker.log().contains("acceptShorterRetention"),
        "no warning about the shorter retention:\n{}",
        worker.log_tail()
    );
    Ok(())
}

/// Issue 32: a RabbitMQ worker that has stored a burst and gone quiet does not back lapin's
/// frame buffers. lapin 4.12 keeps 32 frames of the negotiated `frame_max` (RabbitMQ's
/// 128 KiB) each way per connection and zero-filled both, 8 MiB of every worker's memory; the
/// patched copy (vendor/lapin/PATCH.md) allocates them zeroed and starts an emptied buffer over
/// at its beginning, so only the pages its bursts reached are backed. Measured against a Redis
/// stream worker of the same binary after the same burst, so the build's own heap cancels out.
#[tokio::test]
async fn quiet_worker_backs_few_pages_of_its_frame_buffers() -> Result<()> {
    const BURST: usize = 2_000;
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    let body = |n: usize| format!(r#"{{"order":{n},"note":"{}"}}"#, "x".repeat(200)).into_bytes();
    let name = "quiet";
    let burst = (0..BURST).map(|n| (body(n), with_id(&format!("order-{n}"))));
    quorum_queue_holding(&server, name, burst).await?;
    let amqp = fx.worker(&json_manifest(&fx, name, "batchSize: 100")?, "w1")?;
    fx.produce("beside", (0..BURST).map(body))?;
    let stream = fx.worker(&fx.stream_adapter("beside", "batchSize: 100", "")?, "w1")?;
    for (worker, queue) in [(&amqp, name), (&stream, "beside")] {
        wait_for(LONG, "the burst stored", || async {
            Ok(fx.todo_count(queue).await? >= BURST as i64)
        })
        .await
        .with_context(|| worker.log_tail())?;
    }
    let (amqp_kib, stream_kib) = (anonymous_kib(&amqp)?, anonymous_kib(&stream)?);
    println!("quiet workers: RabbitMQ {amqp_kib} KiB anonymous, Redis stream {stream_kib} KiB");
    ensure!(
        amqp_kib < stream_kib + 6 * 1024,
        "the RabbitMQ worker backs {amqp_kib} KiB of anonymous memory, the Redis stream \
         worker {stream_kib} KiB: lapin's two frame buffers were 8 MiB"
    );
    fx.assert_exactly_once(name, BURST as i64).await?;
    fx.assert_exactly_once("beside", BURST as i64).await
}

/// The anonymous memory `worker` backs (`/proc/PID/smaps_rollup`), in KiB.
fn anonymous_kib(worker: &WorkerProcess) -> Result<u64> {
    proc_kib(worker.pid(), "smaps_rollup", "Anonymous")
        .context("no Anonymous: line in /proc/PID/smaps_rollup")
}

/// Issue 29: a RabbitMQ adapter's `switchboard_oldest_dead_letter_age_seconds` is the age of the
/// dead-letter queue's head, which the probe reads by taking it and giving it back. It counts
/// from when the letter was dead-lettered (the worker's `x-switchboard-last-seen`; the `x-death`
/// time of a letter RabbitMQ moved itself), follows the head when the head is removed, is 0 when
/// the queue is empty, and reading it removes no letter — for a quorum and a classic
/// dead-letter queue.
#[tokio::test]
async fn oldest_dead_letter_age_is_the_heads_and_reading_it_removes_no_letter() -> Result<()> {
    const HOUR: f64 = 3_600.0;
    let mut fx = Fixture::start().await?;
    let server = start(&mut fx).await?;
    for queue_type in [QueueType::Quorum, QueueType::Classic] {
        let name = format!("aged-{}", queue_type.as_str());
        let dlq = format!("{name}.dlq");
        server
            .declare(&name, queue_arguments(queue_type, &[]))
            .await?;
        server
            .declare(&dlq, queue_arguments(queue_type, &[]))
            .await?;
        let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3_600);
        let written = with_id("written-an-hour-ago").with_headers(
            [
                (
                    "x-switchboard-last-seen".into(),
                    rabbitmq::text(&humantime::format_rfc3339_millis(an_hour_ago).to_string()),
                ),
                (
                    "x-switchboard-reason".into(),
                    rabbitmq::text("max_deliveries"),
                ),
            ]
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
            .into(),
        );
        server.publish(&dlq, [(b"{}".to_vec(), written)]).await?;
        // A letter RabbitMQ dead-letters itself: expired in a queue that routes to the DLQ.
        let expiring = format!("{name}.expiring");
        let routed = [
            ("x-message-ttl", AMQPValue::LongLongInt(1)),
            ("x-dead-letter-exchange", rabbitmq::text("")),
            ("x-dead-letter-routing-key", rabbitmq::text(&dlq)),
        ];
        server
            .declare(&expiring, queue_arguments(QueueType::Classic, &routed))
            .await?;
        server
            .publish(&expiring, [(b"{}".to_vec(), with_id("moved-now"))])
            .await?;
        wait_for(LONG, "RabbitMQ moved the expired message", || async {
            Ok(server.messages(&dlq).await? == 2)
        })
        .await?;

        let worker = fx.worker(&json_manifest(&fx, &name, "batchSize: 10")?, "w1")?;
        let gauge = |family: &str| {
            worker.metric(&format!(r#"switchboard_{family}{{adapter="test/{name}"}}"#))
        };
        let age = || gauge("oldest_dead_letter_age_seconds");
        wait_for(LONG, "the head letter's age, an hour", || async {
            Ok(gauge("dead_letter_messages")? == 2.0 && (HOUR..HOUR + 60.0).contains(&age()?))
        })
        .await
        .with_context(|| format!("{queue_type:?}: age {:?}\n{}", age(), worker.log_tail()))?;

        let (connection, channel) = server.channel().await?;
        let take = || async {
            let got = channel
                .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: false })
                .await?
                .context("no letter ready")?;
            got.delivery.ack(Default::default()).await?;
            anyhow::Ok(got.delivery)
        };
        let head = take().await?;
        ensure!(
            head.properties.message_id().as_ref().map(|id| id.as_str())
                == Some("written-an-hour-ago"),
            "{queue_type:?}: the head read and given back is still the head, got {:?}",
            head.properties.message_id()
        );
        wait_for(LONG, "the next letter's age, seconds", || async {
            Ok(gauge("dead_letter_messages")? == 1.0 && age()? < 60.0)
        })
        .await
        .with_context(|| format!("{queue_type:?}: age {:?}\n{}", age(), worker.log_tail()))?;
        let moved = take().await?;
        ensure!(
            moved.redelivered,
            "{queue_type:?}: the letter RabbitMQ moved was read and given back, not removed"
        );
        if queue_type == QueueType::Quorum {
            let reads = rabbitmq::header(&moved.properties, "x-delivery-count")
                .and_then(|count| count.parse::<u64>().ok());
            ensure!(
                reads.is_some_and(|reads| reads >= 1),
                "the quorum queue counted the probe's readings: x-delivery-count {reads:?}"
            );
        }
        wait_for(LONG, "no dead letter, age 0", || async {
            Ok(gauge("dead_letter_messages")? == 0.0 && age()? == 0.0)
        })
        .await
        .with_context(|| format!("{queue_type:?}: age {:?}\n{}", age(), worker.log_tail()))?;
        let _ = connection.close(200, "done".into()).await;
    }
    Ok(())
}
