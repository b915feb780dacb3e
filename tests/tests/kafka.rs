//! Kafka-specific behaviour against a real Kafka node (KRaft) and the real worker binary: two
//! workers of one group sharing three partitions under SIGKILLs, a rebalance while batches are
//! in flight, dead letters byte-identical with their key and headers, and issue 27's examples:
//! a re-created topic (once, and twelve times while its records flow), a binary key holding
//! NUL, a key twice in one batch, a dead letter too large for the producer, a pattern matching
//! the dead-letter topic, the lag after aborted transactions and under `startFrom: latest`; and
//! offset commits the broker refuses, committed once it accepts them.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use nix::sys::signal::Signal;
use switchboard_tests::brokers::kafka::{KafkaServer, Record, undecodable_record};
use switchboard_tests::brokers::{BrokerFixture, KafkaBroker, kafka_group};
use switchboard_tests::proxy::CuttingProxy;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{RETENTION_WARNING, WorkerProcess};
use switchboard_tests::{Fixture, source_manifest};

const LONG: Duration = Duration::from_secs(240);

fn bodies(range: std::ops::Range<usize>) -> Vec<Vec<u8>> {
    range
        .map(|i| format!(r#"{{"order":{i}}}"#).into_bytes())
        .collect()
}

/// PostgreSQL + Kafka + topic `name` (three partitions) and `name.dlq`, and the manifest.
struct Setup {
    fx: Fixture,
    broker: KafkaBroker,
    name: &'static str,
    manifest: std::path::PathBuf,
}

impl Setup {
    async fn start(name: &'static str, delivery: &str, payload: &str) -> Result<Self> {
        let fx = Fixture::start().await?;
        let (broker, _) = KafkaBroker::start(&fx).await?;
        let source = broker.create(&fx, name).await?;
        let manifest = fx.manifest(
            &format!("{name}.yaml"),
            &source_manifest(name, &source, delivery, payload),
        )?;
        Ok(Self {
            fx,
            broker,
            name,
            manifest,
        })
    }

    fn server(&self) -> &KafkaServer {
        &self.broker.server
    }

    fn worker(&self, consumer: &str) -> Result<WorkerProcess> {
        self.fx.worker(&self.manifest, consumer)
    }

    async fn todos(&self) -> Result<i64> {
        self.fx.todo_count(self.name).await
    }

    async fn lag(&self) -> Result<u64> {
        self.server().lag(self.name, &kafka_group(self.name)).await
    }

    /// The backlog the worker reports (the group's lag as its probe reads it).
    fn backlog(&self, worker: &WorkerProcess) -> Result<f64> {
        worker.metric(&format!(
            r#"switchboard_backlog_messages{{adapter="test/{}"}}"#,
            self.name
        ))
    }

    /// No committed offset is past a record without its todo: for every partition, every
    /// offset below the committed one has its event (offsets are dense here: no transactions).
    /// External ids are `{topic}:{topic-id}:{partition}:{offset}`.
    async fn assert_commits_only_stored_records(&self) -> Result<()> {
        let offsets = self
            .server()
            .group_offsets(self.name, &kafka_group(self.name))
            .await?;
        for (partition, committed, _) in offsets {
            let Some(committed) = committed else { continue };
            let stored: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM events WHERE source = $1 AND external_id LIKE $2 \
                 AND split_part(external_id, ':', 3) = $3 \
                 AND split_part(external_id, ':', 4)::bigint < $4",
            )
            .bind(format!("kafka:test/{}", self.name))
            .bind(format!("{}:%", self.name))
            .bind(partition.to_string())
            .bind(committed)
            .fetch_one(self.fx.pool())
            .await?;
            ensure!(
                stored == committed,
                "partition {partition} committed up to {committed} with only {stored} records below it stored"
            );
        }
        Ok(())
    }

    /// How many todos hold one of the JSON bodies `wanted`.
    async fn stored_among(&self, wanted: &[Vec<u8>]) -> Result<i64> {
        let wanted: Vec<serde_json::Value> = wanted
            .iter()
            .map(|body| serde_json::from_slice(body))
            .collect::<Result<_, _>>()?;
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM todos WHERE queue = $1 AND payload = ANY($2)")
                .bind(self.name)
                .bind(&wanted)
                .fetch_one(self.fx.pool())
                .await?,
        )
    }

    async fn wait_settled(&self, expected: i64, workers: &[&WorkerProcess]) -> Result<()> {
        let settled = wait_for(LONG, &format!("{expected} todos and no lag"), || async {
            Ok(self.todos().await? >= expected && self.lag().await? == 0)
        })
        .await;
        let Err(err) = settled else { return Ok(()) };
        // What a stall leaves behind: how far each partition got, and each worker's view.
        let todos = self.todos().await;
        let offsets = self
            .server()
            .group_offsets(self.name, &kafka_group(self.name))
            .await;
        let mut report =
            format!("todos {todos:?}; (partition, committed, high watermark) {offsets:?}");
        for worker in workers {
            let metrics = worker.http_get("/metrics").map(|(_, body)| body);
            let samples: Vec<&str> = metrics
                .as_deref()
                .unwrap_or_default()
                .lines()
                .filter(|line| line.starts_with("switchboard_"))
                .collect();
            report.push_str(&format!("\n{}\n{}", worker.log_tail(), samples.join("\n")));
        }
        Err(err.context(report))
    }
}

/// Two workers of one group share three partitions; one or the other is SIGKILLed at random
/// moments and started again: every record exactly once, and no commit ever passes a record
/// that is not stored.
#[tokio::test]
async fn two_workers_sigkilled_at_random_moments_store_every_record_exactly_once() -> Result<()> {
    const TOTAL: usize = 20_000;
    let setup = Setup::start(
        "chaos2",
        "batchSize: 100, maxDeliveries: 20, claimIdleSeconds: 2",
        "",
    )
    .await?;
    setup.server().produce(setup.name, bodies(0..TOTAL)).await?;
    let mut rng = fastrand::Rng::new();
    let mut workers = [setup.worker("a-0")?, setup.worker("b-0")?];
    for kill in 1..=5 {
        let target = (setup.todos().await? + rng.i64(500..2_500)).min(TOTAL as i64 - 1);
        wait_for(LONG, "progress before the kill", || async {
            setup.assert_commits_only_stored_records().await?;
            Ok(setup.todos().await? >= target)
        })
        .await
        .map_err(|err| err.context(workers[0].log_tail()))?;
        let victim = rng.usize(0..2);
        let replacement = setup.worker(&format!("{}-{kill}", ["a", "b"][victim]))?;
        std::mem::replace(&mut workers[victim], replacement).kill()?;
    }
    setup
        .wait_settled(TOTAL as i64, &[&workers[0], &workers[1]])
        .await?;
    setup.assert_commits_only_stored_records().await?;
    setup
        .fx
        .assert_exactly_once(setup.name, TOTAL as i64)
        .await?;
    let letters = setup
        .server()
        .read_all(&format!("{}.dlq", setup.name))
        .await?;
    ensure!(letters.is_empty(), "nothing dead-lettered: {letters:?}");
    Ok(())
}

/// A second worker joins while the first has batches in flight, then leaves (SIGTERM): the
/// partitions move twice (cooperative-sticky), every record lands exactly once, and no commit
/// passes a record without its todo. Records keep coming throughout, so both moves happen
/// while batches are in flight.
#[tokio::test]
async fn rebalance_while_batches_are_in_flight_keeps_exactly_one_todo_per_record() -> Result<()> {
    const CHUNK: usize = 500;
    let setup = Setup::start("rebalance", "batchSize: 50, claimIdleSeconds: 2", "").await?;
    let mut produced = 4_000;
    setup
        .server()
        .produce(setup.name, bodies(0..produced))
        .await?;
    let first = setup.worker("first")?;
    wait_for(LONG, "the first worker makes progress", || async {
        Ok(setup.todos().await? >= 500)
    })
    .await
    .map_err(|err| err.context(first.log_tail()))?;
    let mut second = setup.worker("second")?;
    let stored = |worker: &WorkerProcess| {
        worker
            .metric(&format!(
                r#"switchboard_messages_stored_total{{adapter="test/{}"}}"#,
                setup.name
            ))
            .unwrap_or(0.0)
    };
    // Produce until the second worker (given partitions by the rebalance) stores records.
    let deadline = Instant::now() + LONG;
    while stored(&second) == 0.0 {
        ensure!(
            Instant::now() < deadline,
            "the second worker stored nothing\n{}",
            second.log_tail()
        );
        setup
            .server()
            .produce(setup.name, bodies(produced..produced + CHUNK))
            .await?;
        produced += CHUNK;
        setup.assert_commits_only_stored_records().await?;
    }
    second.signal(Signal::SIGTERM)?;
    // More records while its partitions move back to the first worker.
    for _ in 0..4 {
        setup
            .server()
            .produce(setup.name, bodies(produced..produced + CHUNK))
            .await?;
        produced += CHUNK;
        setup.assert_commits_only_stored_records().await?;
    }
    let status = second.wait_exit(Duration::from_secs(30))?;
    ensure!(
        status.success(),
        "the second worker exits 0: {status:?}\n{}",
        second.log_tail()
    );
    let total = i64::try_from(produced)?;
    setup.wait_settled(total, &[&first]).await?;
    setup.assert_commits_only_stored_records().await?;
    setup.fx.assert_exactly_once(setup.name, total).await?;
    // Assigned at start, then partitions revoked for the second worker and assigned back.
    let rebalances = first.metric(&format!(
        r#"switchboard_kafka_rebalances_total{{adapter="test/{}"}}"#,
        setup.name
    ))?;
    ensure!(
        rebalances >= 3.0,
        "the first worker took part in the rebalances: {rebalances}\n{}",
        first.log_tail()
    );
    Ok(())
}

/// The broker refuses the worker's offset commits while its records are stored (a proxy sends
/// them for another group: `GROUP_ID_NOT_FOUND`, as a commit sent during a rebalance gets
/// `REBALANCE_IN_PROGRESS`): each refusal is counted, nothing is committed, and once the broker
/// accepts commits again the settled offsets are committed with no new record to carry them.
/// (The `rdkafka` crate drops the result of an asynchronous commit, fede1024/rust-rdkafka#856:
/// a refused commit was never sent again and the partition's lag stayed for good.)
#[tokio::test]
async fn offsets_the_broker_refused_to_commit_are_committed_once_it_accepts_them() -> Result<()> {
    const TOTAL: usize = 30;
    let setup = Setup::start("refused", "batchSize: 10, claimIdleSeconds: 2", "").await?;
    let upstream = setup.broker.address(&setup.fx)?;
    let proxy = CuttingProxy::misdirecting_commits(&upstream).await?;
    let manifest = setup.fx.manifest(
        "refused-proxied.yaml",
        &std::fs::read_to_string(&setup.manifest)?.replace(&upstream, &proxy.address()),
    )?;
    proxy.misdirect(true);
    let worker = setup.fx.worker(&manifest, "w1")?;
    let produced = bodies(0..TOTAL);
    setup.server().produce(setup.name, produced.clone()).await?;
    let failures = || {
        worker.metric(&format!(
            r#"switchboard_kafka_commit_failures_total{{adapter="test/{}"}}"#,
            setup.name
        ))
    };
    wait_for(
        LONG,
        "every record stored and a refused commit counted",
        || async { Ok(setup.todos().await? >= TOTAL as i64 && failures()? >= 1.0) },
    )
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    setup
        .fx
        .assert_stored_exactly(setup.name, &produced)
        .await?;
    let lag = setup.lag().await?;
    ensure!(
        lag == TOTAL as u64,
        "the broker committed nothing: lag {lag}"
    );
    proxy.misdirect(false);
    setup.wait_settled(TOTAL as i64, &[&worker]).await?;
    setup.assert_commits_only_stored_records().await?;
    setup
        .fx
        .assert_exactly_once(setup.name, TOTAL as i64)
        .await?;
    Ok(())
}

/// A poison record goes to `<topic>.dlq` with its key, value and headers byte-identical (a
/// header without a value included), plus the `x-dlq-*` context.
#[tokio::test]
async fn poison_record_is_dead_lettered_byte_identical_with_key_and_headers() -> Result<()> {
    let setup = Setup::start("dlq", "batchSize: 20, claimIdleSeconds: 2", "format: json").await?;
    let poison = Record {
        key: Some(b"customer-\xff\x00".to_vec()),
        value: Some(b"{\"order\": broken \xe2\x9c\x93".to_vec()),
        headers: vec![
            ("trace".to_owned(), Some(b"abc\x00\xff".to_vec())),
            ("empty".to_owned(), Some(Vec::new())),
            ("null".to_owned(), None),
            ("trace".to_owned(), Some(b"second".to_vec())),
        ],
    };
    let good = Record {
        key: Some(b"k".to_vec()),
        value: Some(br#"{"order":1}"#.to_vec()),
        headers: vec![("h".to_owned(), Some(b"v".to_vec()))],
    };
    setup
        .server()
        .produce_records(setup.name, vec![poison.clone(), good])
        .await?;
    let worker = setup.worker("w1")?;
    setup.wait_settled(1, &[&worker]).await?;
    let letters = setup
        .server()
        .read_all(&format!("{}.dlq", setup.name))
        .await?;
    ensure!(letters.len() == 1, "one dead letter: {letters:?}");
    let letter = &letters[0];
    ensure!(letter.key == poison.key, "key byte-identical: {letter:?}");
    ensure!(
        letter.value == poison.value,
        "value byte-identical: {letter:?}"
    );
    ensure!(
        letter.headers[..poison.headers.len()] == poison.headers[..],
        "original headers first, byte-identical, in order: {letter:?}"
    );
    ensure!(letter.header("x-dlq-reason").as_deref() == Some("invalid_json"));
    ensure!(letter.header("x-dlq-original-topic").as_deref() == Some(setup.name));
    ensure!(letter.header("x-dlq-delivery-count").as_deref() == Some("1"));
    ensure!(
        letter
            .header("x-dlq-error")
            .is_some_and(|error| !error.is_empty()),
        "{letter:?}"
    );
    let partition: i32 = letter
        .header("x-dlq-original-partition")
        .unwrap_or_default()
        .parse()?;
    let offset: i64 = letter
        .header("x-dlq-original-offset")
        .unwrap_or_default()
        .parse()?;
    ensure!((0..3).contains(&partition) && offset >= 0, "{letter:?}");
    // The good record's key and headers went to its event.
    let headers: serde_json::Value =
        sqlx::query_scalar("SELECT headers FROM events WHERE source = $1")
            .bind(format!("kafka:test/{}", setup.name))
            .fetch_one(setup.fx.pool())
            .await?;
    ensure!(
        headers.to_string().contains("kafka.key") && headers.to_string().contains("\"h\""),
        "the record's key and headers are the event's headers: {headers}"
    );
    Ok(())
}

/// Issue 27: a topic deleted and created again re-uses offsets 0…N. Its records are new
/// messages: stored (keys carry the topic id), not acknowledged as duplicates, and the worker
/// says once what happened.
#[tokio::test]
async fn recreated_topic_records_are_stored_not_taken_for_duplicates() -> Result<()> {
    let setup = Setup::start("recreated", "batchSize: 20, claimIdleSeconds: 2", "").await?;
    setup.server().produce(setup.name, bodies(0..30)).await?;
    let worker = setup.worker("w1")?;
    setup.wait_settled(30, &[&worker]).await?;
    setup.broker.recreate(&setup.fx, setup.name).await?;
    setup.server().produce(setup.name, bodies(30..60)).await?;
    setup.wait_settled(60, &[&worker]).await?;
    setup
        .fx
        .assert_stored_exactly(setup.name, &bodies(0..60))
        .await?;
    let ids: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT split_part(external_id, ':', 2)) FROM events WHERE source = $1",
    )
    .bind(format!("kafka:test/{}", setup.name))
    .fetch_one(setup.fx.pool())
    .await?;
    ensure!(
        ids == 2,
        "two incarnations, two topic ids in the keys: {ids}"
    );
    Ok(())
}

/// Issue 27: the topic is deleted and created again while its records flow, twelve times, and
/// records go into each new incarnation at once: no record is stored twice (a record of the new
/// incarnation taking the old id, or one of the old taking the new one), the last incarnation's
/// records are all stored, and nothing stored was never produced. Records of an incarnation not
/// read before its deletion are gone with it (Kafka deleted them).
#[tokio::test]
async fn topic_recreated_while_its_records_flow_never_stores_a_record_twice() -> Result<()> {
    const CYCLES: usize = 12;
    const WAVE: usize = 300;
    let setup = Setup::start("recreatedflow", "batchSize: 10, claimIdleSeconds: 2", "").await?;
    let worker = setup.worker("w1")?;
    for cycle in 0..CYCLES {
        let before = setup.todos().await?;
        setup
            .server()
            .produce(setup.name, bodies(cycle * WAVE..(cycle + 1) * WAVE))
            .await?;
        wait_for(
            LONG,
            &format!("records of wave {cycle} flowing"),
            || async { Ok(setup.todos().await? >= before + 20) },
        )
        .await
        .map_err(|err| err.context(worker.log_tail()))?;
        setup.broker.recreate(&setup.fx, setup.name).await?;
    }
    let last = bodies(CYCLES * WAVE..(CYCLES + 1) * WAVE);
    setup.server().produce(setup.name, last.clone()).await?;
    wait_for(
        LONG,
        "the last incarnation's records stored, no lag",
        || async { Ok(setup.stored_among(&last).await? >= WAVE as i64 && setup.lag().await? == 0) },
    )
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let stored = setup.fx.stored_payloads(setup.name).await?;
    let distinct: std::collections::BTreeSet<&String> = stored.iter().collect();
    if distinct.len() != stored.len() {
        let twice: Vec<(String, String)> = sqlx::query_as(
            "SELECT payload::text, idempotency_key FROM todos WHERE queue = $1 AND payload IN \
             (SELECT payload FROM todos WHERE queue = $1 GROUP BY payload HAVING count(*) > 1) \
             ORDER BY payload::text, id LIMIT 8",
        )
        .bind(setup.name)
        .fetch_all(setup.fx.pool())
        .await?;
        anyhow::bail!(
            "{} records stored twice of {} stored; (body, key) of the first: {twice:?}\n{}",
            stored.len() - distinct.len(),
            stored.len(),
            worker.log_tail()
        );
    }
    ensure!(
        setup.stored_among(&bodies(0..(CYCLES + 1) * WAVE)).await? == stored.len() as i64,
        "only produced records are stored"
    );
    ensure!(setup.stored_among(&last).await? == WAVE as i64);
    Ok(())
}

/// Issue 27: a record whose key is an `IntegerSerializer` value (NUL bytes) and whose header
/// value is not UTF-8 is stored (key and header encoded) with its neighbours; nothing is
/// rejected or dead-lettered.
#[tokio::test]
async fn binary_key_with_nul_and_non_utf8_header_are_stored_with_the_neighbours() -> Result<()> {
    let setup = Setup::start("binarykey", "batchSize: 30, claimIdleSeconds: 2", "").await?;
    let odd = br#"{"odd":true}"#.to_vec();
    let mut records: Vec<Record> = bodies(0..10).into_iter().map(plain).collect();
    records.push(undecodable_record(odd.clone()));
    records.extend(bodies(10..20).into_iter().map(plain));
    setup.server().produce_records(setup.name, records).await?;
    let worker = setup.worker("w1")?;
    setup.wait_settled(21, &[&worker]).await?;
    let mut expected = bodies(0..20);
    expected.push(odd);
    setup
        .fx
        .assert_stored_exactly(setup.name, &expected)
        .await?;
    let letters = setup.broker.dead_letters(&setup.fx, setup.name).await?;
    ensure!(letters.is_empty(), "nothing dead-lettered: {letters:?}");
    let headers: serde_json::Value = sqlx::query_scalar(
        "SELECT headers FROM events WHERE source = $1 AND headers ? 'kafka.key'",
    )
    .bind(format!("kafka:test/{}", setup.name))
    .fetch_one(setup.fx.pool())
    .await?;
    ensure!(
        headers["kafka.key"]["base64"] == "AAABLA==" && headers["trace"]["base64"] == "/wD+",
        "key and header stored base64-encoded: {headers}"
    );
    Ok(())
}

/// Issue 27: a batch holding the same record twice (a fetch restarted while its records were
/// still in hand) is counted once, not refused by PostgreSQL for good (SQLSTATE 21000).
#[tokio::test]
async fn a_key_twice_in_one_batch_is_counted_once_not_a_database_error() -> Result<()> {
    let fx = Fixture::start().await?;
    let source = "kafka:test/twice";
    let key = "kafka:test/twice:orders:AAAAAAAAAAAAAAAAAAAAAQ:0:7";
    let counts = fx.store.count_redeliveries(source, &[key, key]).await?;
    ensure!(
        counts == vec![2, 2],
        "one count for the one record: {counts:?}"
    );
    let counts = fx.store.count_redeliveries(source, &[key]).await?;
    ensure!(counts == vec![3], "{counts:?}");
    Ok(())
}

/// Issue 27: a poison record of ~1 MB (within the broker's limit, above the dead-letter
/// producer's `message.max.bytes`) cannot be dead-lettered at the broker, ever: the letter is
/// kept in PostgreSQL, the batch stored and everything committed (no wedge).
#[tokio::test]
async fn dead_letter_too_large_for_the_producer_is_kept_in_postgresql() -> Result<()> {
    let setup = Setup::start(
        "oversized",
        "batchSize: 20, claimIdleSeconds: 2",
        "format: json, maxBytes: 2000000",
    )
    .await?;
    let mut poison = b"{\"order\": broken ".to_vec();
    poison.resize(1_000_100, b'x');
    let mut all = bodies(0..10);
    all.push(poison.clone());
    all.extend(bodies(10..20));
    setup.server().produce(setup.name, all).await?;
    let worker = setup.worker("w1")?;
    setup.wait_settled(20, &[&worker]).await?;
    wait_for(LONG, "the letter kept in PostgreSQL", || async {
        Ok(!setup.fx.database_dead_letters(setup.name).await?.is_empty())
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    setup
        .fx
        .assert_stored_exactly(setup.name, &bodies(0..20))
        .await?;
    let kept = setup.fx.database_dead_letters(setup.name).await?;
    ensure!(
        kept == vec![(poison, "invalid_json".to_owned())],
        "one letter kept, byte-identical: {} letters",
        kept.len()
    );
    ensure!(setup.lag().await? == 0);
    Ok(())
}

/// Issue 27: a `topicPattern` that matches the default dead-letter topic (`^name-.*` and
/// `name-eu.dlq`) would make the worker read its own dead letters: it exits at start, naming
/// both settings.
#[tokio::test]
async fn pattern_matching_the_dead_letter_topic_is_fatal_naming_both_settings() -> Result<()> {
    let fx = Fixture::start().await?;
    let (broker, _) = KafkaBroker::start(&fx).await?;
    broker.server.create_topic("own-eu", 1).await?;
    broker.server.create_topic("own-eu.dlq", 1).await?;
    let source = format!(
        "kafka: {{bootstrapServers: \"{}\", topicPattern: '^own-.*', sessionTimeoutSeconds: 6}}",
        broker.server.bootstrap()
    );
    let manifest = fx.manifest(
        "own.yaml",
        &source_manifest("own", &source, "batchSize: 10", ""),
    )?;
    let mut worker = fx.worker(&manifest, "w1")?;
    let status = worker.wait_exit(Duration::from_secs(60))?;
    let log = worker.log();
    ensure!(
        !status.success(),
        "the worker refuses to start: {status:?}\n{log}"
    );
    ensure!(
        log.contains("spec.source.kafka.topicPattern")
            && log.contains("spec.delivery.deadLetter.topic")
            && log.contains("own-eu.dlq"),
        "the error names both settings and the topic:\n{log}"
    );
    Ok(())
}

/// Issue 27: aborted transactions leave records and markers the group never delivers; the lag
/// reaches 0 once the committed records are stored (the position past the markers is
/// committed), and no fetch is "restarted" for a backlog that is not there.
#[tokio::test]
async fn lag_reaches_zero_after_aborted_transactions() -> Result<()> {
    let setup = Setup::start("aborted", "batchSize: 20, claimIdleSeconds: 2", "").await?;
    setup.server().produce(setup.name, bodies(0..5)).await?;
    setup
        .server()
        .produce_aborted(setup.name, bodies(100..123))
        .await?;
    setup.server().produce(setup.name, bodies(5..10)).await?;
    setup
        .server()
        .produce_aborted(setup.name, bodies(200..223))
        .await?;
    let worker = setup.worker("w1")?;
    setup.wait_settled(10, &[&worker]).await?;
    setup
        .fx
        .assert_stored_exactly(setup.name, &bodies(0..10))
        .await?;
    wait_for(LONG, "the worker reports no backlog", || async {
        Ok(setup.backlog(&worker)? == 0.0)
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    Ok(())
}

/// Issue 27: under `startFrom: latest` the records produced before the group existed are never
/// read; the worker reports no backlog for them, and stores what comes afterwards.
#[tokio::test]
async fn start_from_latest_reports_no_backlog_for_records_it_will_never_read() -> Result<()> {
    let fx = Fixture::start().await?;
    let (broker, _) = KafkaBroker::start(&fx).await?;
    let name = "latest";
    let source = broker.create(&fx, name).await?;
    let source = source.replace("topics:", "startFrom: latest, topics:");
    let manifest = fx.manifest(
        &format!("{name}.yaml"),
        &source_manifest(name, &source, "batchSize: 20, claimIdleSeconds: 2", ""),
    )?;
    broker.server.produce(name, bodies(0..123)).await?;
    let worker = fx.worker(&manifest, "w1")?;
    // The probe sets each partition's lag before the backlog it sums.
    let lags = |worker: &WorkerProcess| -> Result<Vec<f64>> {
        let (_, metrics) = worker.http_get("/metrics")?;
        Ok(metrics
            .lines()
            .filter(|line| {
                line.starts_with(&format!(
                    r#"switchboard_kafka_partition_lag{{adapter="test/{name}",topic="{name}""#
                ))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse().ok())
            .collect())
    };
    wait_for(LONG, "the probe reads every partition's lag", || async {
        Ok(lags(&worker)?.len() == 3)
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let lags = lags(&worker)?;
    ensure!(
        lags.iter().all(|lag| *lag == 0.0),
        "no lag for records it will never read: {lags:?}\n{}",
        worker.log_tail()
    );
    // The group's first position is taken a moment after it joins: records keep coming until
    // some are stored, and none of the 123 from before is ever stored.
    let deadline = Instant::now() + LONG;
    let mut produced = 123;
    while fx.todo_count(name).await? == 0 {
        ensure!(
            Instant::now() < deadline,
            "nothing produced afterwards was stored\n{}",
            worker.log_tail()
        );
        broker
            .server
            .produce(name, bodies(produced..produced + 10))
            .await?;
        produced += 10;
        let _ = wait_for(Duration::from_secs(2), "a record stored", || async {
            Ok(fx.todo_count(name).await? > 0)
        })
        .await;
    }
    let before: Vec<String> = bodies(0..123)
        .into_iter()
        .map(|body| String::from_utf8_lossy(&body).into_owned())
        .collect();
    let stored = fx.stored_payloads(name).await?;
    ensure!(
        stored.iter().all(|payload| !before.contains(payload)),
        "records from before the group existed are never read: {stored:?}"
    );
    Ok(())
}

fn plain(value: Vec<u8>) -> Record {
    Record {
        key: None,
        value: Some(value),
        headers: Vec::new(),
    }
}

/// Four days in milliseconds.
const FOUR_DAYS_MS: &str = "345600000";

#[tokio::test]
async fn dead_letter_topic_kept_four_days_is_raised_to_retention_days() -> Result<()> {
    let setup = Setup::start("brief", "claimIdleSeconds: 2", "").await?;
    // max.message.bytes: a setting of the topic's own that raising retention.ms must keep.
    setup
        .server()
        .set_topic_configs(
            "brief.dlq",
            &[
                ("retention.ms", FOUR_DAYS_MS),
                ("max.message.bytes", "2000000"),
            ],
        )
        .await?;
    let worker = setup.worker("worker-a")?;
    worker.wait_ready(LONG).await?;
    let server = setup.server();
    let kept = server.topic_config("brief.dlq", "retention.ms").await?;
    ensure!(
        kept.as_deref() == Some("1209600000"),
        "retention.ms of brief.dlq is {kept:?}, not 14 days\n{}",
        worker.log_tail()
    );
    let max = server
        .topic_config("brief.dlq", "max.message.bytes")
        .await?;
    ensure!(
        max.as_deref() == Some("2000000"),
        "raising retention.ms reset max.message.bytes: {max:?}"
    );
    Ok(())
}

#[tokio::test]
async fn accept_shorter_retention_leaves_a_four_day_dead_letter_topic() -> Result<()> {
    let setup = Setup::start(
        "accepted",
        "claimIdleSeconds: 2, deadLetter: {acceptShorterRetention: true}",
        "",
    )
    .await?;
    setup
        .server()
        .set_topic_config("accepted.dlq", "retention.ms", FOUR_DAYS_MS)
        .await?;
    let worker = setup.worker("worker-a")?;
    worker.wait_ready(LONG).await?;
    let kept = setup
        .server()
        .topic_config("accepted.dlq", "retention.ms")
        .await?;
    ensure!(
        kept.as_deref() == Some(FOUR_DAYS_MS),
        "retention.ms changed: {kept:?}"
    );
    ensure!(
        worker.log().contains("acceptShorterRetention"),
        "no warning about the shorter retention:\n{}",
        worker.log_tail()
    );
    Ok(())
}

/// Reads gauge `family` of the adapter.
fn gauge(setup: &Setup, worker: &WorkerProcess, family: &str) -> Result<f64> {
    worker.metric(&format!(
        r#"switchboard_{family}{{adapter="test/{}"}}"#,
        setup.name
    ))
}

#[tokio::test]
async fn dead_letter_gauges_count_the_topic_and_age_its_oldest_letter() -> Result<()> {
    let setup = Setup::start("gauged", "claimIdleSeconds: 2", "format: json").await?;
    let mut records = bodies(0..3);
    records.push(b"{\"order\": broken".to_vec());
    records.push(b"not json either".to_vec());
    setup.server().produce(setup.name, records).await?;
    let worker = setup.worker("w1")?;
    setup.wait_settled(3, &[&worker]).await?;
    wait_for(LONG, "2 dead letters counted, the oldest aged", || async {
        Ok(gauge(&setup, &worker, "dead_letter_messages")? == 2.0
            && gauge(&setup, &worker, "oldest_dead_letter_age_seconds")? > 0.0)
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let age = gauge(&setup, &worker, "oldest_dead_letter_age_seconds")?;
    ensure!(
        age < 120.0,
        "the age counts from the letter's write: {age} s"
    );
    Ok(())
}

/// Issue 30: the longest `retention.ms` of the named topics is compared with the dedup window at
/// start: the broker's default (7 days) within the default window passes quietly; over a 1-day
/// window a warning names both; `-1` is said at info level.
#[tokio::test]
async fn topic_retention_longer_than_the_dedup_window_is_warned_about_at_start() -> Result<()> {
    let setup = Setup::start("kept", "claimIdleSeconds: 2", "").await?;
    let within = setup.worker("worker-a")?;
    within.wait_ready(LONG).await?;
    ensure!(
        !within.log().contains(RETENTION_WARNING) && !within.log().contains("without a time limit"),
        "7 days within a 30-day window were warned about:\n{}",
        within.log_tail()
    );
    within.kill()?;

    setup
        .fx
        .store
        .maintain_events(Duration::from_secs(86_400), 0)
        .await?;
    let beyond = setup.worker("worker-b")?;
    beyond.wait_ready(LONG).await?;
    beyond.assert_retention_warned("7d", "retention.ms of topic kept")?;
    beyond.kill()?;

    setup
        .server()
        .set_topic_config("kept", "retention.ms", "-1")
        .await?;
    let unlimited = setup.worker("worker-c")?;
    unlimited.wait_ready(LONG).await?;
    let log = unlimited.log();
    ensure!(
        log.contains("without a time limit") && !log.contains(RETENTION_WARNING),
        "retention.ms -1 is said at info level, not warned about:\n{log}"
    );
    Ok(())
}
