//! The transport contract, one suite for every broker: the same behaviours, against each real
//! server, with the real worker binary and a real PostgreSQL. A broker joins by implementing
//! `BrokerFixture` (tests/src/brokers) and one line in the `contract_suite!` list at the end.

use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, ensure};
use nix::sys::signal::Signal;
use switchboard_tests::brokers::{
    AmqpClassicBroker, AmqpQuorumBroker, BrokerFixture, GatewayBroker, KafkaBroker, NatsBroker,
    RedisListBroker, RedisStreamBroker, SqsBroker,
};
use switchboard_tests::otel::{Collector, SpanKind};
use switchboard_tests::proxy::CuttingProxy;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::WorkerProcess;
use switchboard_tests::{Fixture, short_event_partitions, source_manifest};

/// A wait's deadline: far above what a quiet machine needs, so that one several times slower
/// still passes (CI's run of `ffd1c99` was up to 3.5× slower than a local run, and the gateway's
/// chaos and SIGTERM cases missed 180 s there).
const LONG: Duration = Duration::from_secs(300);

fn bodies(range: std::ops::Range<usize>) -> Vec<Vec<u8>> {
    range
        .map(|i| format!(r#"{{"order":{i}}}"#).into_bytes())
        .collect()
}

/// PostgreSQL + the broker + one queue `name`, and its manifest.
struct Contract<B> {
    fx: Fixture,
    broker: B,
    name: &'static str,
    source: String,
}

impl<B: BrokerFixture> Contract<B> {
    async fn start(name: &'static str) -> Result<Self> {
        let mut fx = Fixture::start().await?;
        let (broker, env) = B::start(&fx).await?;
        fx.extra_env = env;
        let source = broker.create(&fx, name).await?;
        Ok(Self {
            fx,
            broker,
            name,
            source,
        })
    }

    /// The adapter's manifest with `delivery` and `payload` settings (YAML flow bodies).
    fn manifest(&self, delivery: &str, payload: &str) -> Result<std::path::PathBuf> {
        let name = self.name;
        let delivery = format!("{}, {delivery}", self.broker.delivery());
        self.fx.manifest(
            &format!("{name}.yaml"),
            &source_manifest(name, &self.source, &delivery, payload),
        )
    }

    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.broker.produce(&self.fx, self.name, bodies).await
    }

    async fn todos(&self) -> Result<i64> {
        self.fx.todo_count(self.name).await
    }

    async fn unacknowledged(&self) -> Result<u64> {
        self.broker.unacknowledged(&self.fx, self.name).await
    }

    /// Waits until `expected` todos exist and the broker holds nothing un-acknowledged.
    async fn wait_settled(&self, expected: i64, worker: &WorkerProcess) -> Result<()> {
        let last = std::cell::Cell::new((0, 0));
        wait_for(
            LONG,
            &format!("{expected} todos and nothing un-acknowledged"),
            || async {
                let seen = (self.todos().await?, self.unacknowledged().await?);
                last.set(seen);
                Ok(seen.0 >= expected && seen.1 == 0)
            },
        )
        .await
        .map_err(|err| {
            let (todos, held) = last.get();
            err.context(format!(
                "last seen: {todos} todos, {held} un-acknowledged\n{}",
                worker.log_tail()
            ))
        })
    }

    /// Exactly `expected` todos, distinct keys, nothing un-acknowledged, no dead letter.
    async fn assert_exactly_once(&self, expected: i64) -> Result<()> {
        self.fx.assert_exactly_once(self.name, expected).await?;
        let letters = self.broker.dead_letters(&self.fx, self.name).await?;
        ensure!(
            letters.is_empty(),
            "nothing may be dead-lettered: {letters:?}"
        );
        ensure!(self.unacknowledged().await? == 0);
        Ok(())
    }

    /// The stored bodies are exactly `produced` (as sets), nothing is un-acknowledged and
    /// nothing is dead-lettered, neither at the broker nor in PostgreSQL.
    async fn assert_stored_exactly(&self, produced: &[Vec<u8>]) -> Result<()> {
        self.fx.assert_stored_exactly(self.name, produced).await?;
        let letters = self.broker.dead_letters(&self.fx, self.name).await?;
        ensure!(
            letters.is_empty(),
            "nothing may be dead-lettered: {letters:?}"
        );
        let kept = self.fx.database_dead_letters(self.name).await?;
        ensure!(kept.is_empty(), "nothing may be dead-lettered: {kept:?}");
        ensure!(self.unacknowledged().await? == 0);
        Ok(())
    }

    fn metric(&self, worker: &WorkerProcess, family: &str) -> Result<f64> {
        worker.metric(&format!(r#"{family}{{adapter="test/{}"}}"#, self.name))
    }
}

/// The chaos run: 5,000 messages produced in waves while workers are SIGKILLed at random
/// moments (≥ 5, some under new consumer names) and the broker is SIGKILLed twice with batches
/// in flight; then the set of stored bodies is exactly the set produced, nothing is left
/// un-acknowledged and nothing is dead-lettered.
async fn chaos_worker_and_broker_kills<B: BrokerFixture>() -> Result<()> {
    const TOTAL: usize = 5_000;
    const WAVES: usize = 7;
    const BROKER_KILLS: [usize; 2] = [2, 5];
    let started = Instant::now();
    let mut contract = Contract::<B>::start("chaos").await?;
    let manifest = contract.manifest("batchSize: 100, maxDeliveries: 50", "")?;
    let produced = bodies(0..TOTAL);
    let wave = TOTAL.div_ceil(WAVES);
    let mut rng = fastrand::Rng::new();
    let mut consumer = "chaos-0".to_owned();
    let (mut worker_kills, mut broker_kills) = (0, 0);
    for (round, chunk) in produced.chunks(wave).enumerate() {
        contract.produce(chunk.to_vec()).await?;
        let worker = contract.fx.worker(&manifest, &consumer)?;
        let stored = contract.todos().await?;
        let target = (stored + rng.i64(50..300)).min(TOTAL as i64 - 1);
        wait_for(LONG, "progress before the kill", || async {
            Ok(contract.todos().await? >= target)
        })
        .await
        .map_err(|err| err.context(worker.log_tail()))?;
        if BROKER_KILLS.contains(&round) {
            // The broker dies under the running worker, with batches in flight.
            let Contract { fx, broker, .. } = &mut contract;
            broker.crash(fx).await?;
            broker_kills += 1;
            let after = contract.todos().await?;
            let produced_so_far = ((round + 1) * wave).min(TOTAL) as i64;
            wait_for(LONG, "progress after the broker came back", || async {
                let stored = contract.todos().await?;
                Ok(stored > after || stored >= produced_so_far)
            })
            .await
            .map_err(|err| err.context(worker.log_tail()))?;
        }
        worker.kill()?;
        worker_kills += 1;
        if rng.bool() {
            consumer = format!("chaos-{round}");
        }
    }
    ensure!(worker_kills >= 5 && broker_kills >= 2);
    let last = contract.fx.worker(&manifest, "chaos-final")?;
    let settled = contract.wait_settled(TOTAL as i64, &last).await;
    let mut letters = contract
        .broker
        .dead_letters(&contract.fx, contract.name)
        .await?;
    letters.extend(contract.fx.database_dead_letters(contract.name).await?);
    // The figures the closing notes quote, printed whether or not the run settled.
    println!(
        "chaos: produced {TOTAL} stored {} worker_kills {worker_kills} broker_kills \
         {broker_kills} dead_letters {} in {:.0} s",
        contract.todos().await?,
        letters.len(),
        started.elapsed().as_secs_f64()
    );
    settled?;
    contract.assert_stored_exactly(&produced).await?;
    ensure!(letters.is_empty(), "no dead letter: {letters:?}");
    Ok(())
}

/// A crash after the commit and before the acknowledgement: the redelivery is a duplicate
/// (`rotate`: arriving in a later partition of `events` than the first delivery).
async fn crash_between_commit_and_ack<B: BrokerFixture>(rotate: bool) -> Result<()> {
    const TOTAL: usize = 300;
    let contract = Contract::<B>::start("crash").await?;
    if rotate {
        // Partitions of a second: the redeliveries arrive in later ones.
        short_event_partitions(
            &contract.fx.store,
            Duration::from_secs(1),
            Duration::from_secs(600),
        )
        .await?;
    }
    let manifest = contract.manifest("batchSize: 50", "")?;
    contract.produce(bodies(0..TOTAL)).await?;
    contract
        .fx
        .crash_after_first_commit(&manifest, "crashing")
        .await?;
    let committed = contract.todos().await?;
    ensure!(committed > 0, "the crashed worker committed a batch");
    if rotate {
        let pool = contract.fx.pool();
        wait_for(
            LONG,
            "the committed batch's partition has rotated",
            || async {
                Ok(sqlx::query_scalar::<_, bool>(
                    "SELECT now() >= p.upper FROM event_partitions p \
                 WHERE p.lower <= (SELECT max(received_at) FROM events) \
                   AND (SELECT max(received_at) FROM events) < p.upper",
                )
                .fetch_one(pool)
                .await?)
            },
        )
        .await?;
    }
    let worker = contract.fx.worker(&manifest, "survivor")?;
    contract.wait_settled(TOTAL as i64, &worker).await?;
    contract.assert_exactly_once(TOTAL as i64).await?;
    wait_for(
        LONG,
        "the committed batch comes back as duplicates",
        || async {
            Ok(
                contract.metric(&worker, "switchboard_messages_duplicate_total")?
                    >= committed as f64,
            )
        },
    )
    .await?;
    if rotate {
        let partitions: i64 = sqlx::query_scalar("SELECT count(DISTINCT tableoid) FROM events")
            .fetch_one(contract.fx.pool())
            .await?;
        ensure!(
            partitions >= 2,
            "the redeliveries came in a later partition: {partitions}"
        );
    }
    Ok(())
}

/// Poison is dead-lettered at once, byte-identical, while the rest of its batch is stored.
async fn poison_is_dead_lettered_at_once<B: BrokerFixture>() -> Result<()> {
    let contract = Contract::<B>::start("poison").await?;
    let manifest = contract.manifest("batchSize: 20, maxDeliveries: 5", "format: json")?;
    let poison = b"{\"order\": broken\n  trailing \xe2\x9c\x93".to_vec();
    let mut all = bodies(0..10);
    all.push(poison.clone());
    all.extend(bodies(10..20));
    contract.produce(all).await?;
    let worker = contract.fx.worker(&manifest, "w1")?;
    contract.wait_settled(20, &worker).await?;
    contract.fx.assert_exactly_once(contract.name, 20).await?;
    let letters = contract
        .broker
        .dead_letters(&contract.fx, contract.name)
        .await?;
    ensure!(
        letters == vec![(poison, "invalid_json".to_owned())],
        "one dead letter, the body byte-identical: {letters:?}"
    );
    ensure!(
        contract.metric(&worker, "switchboard_messages_redelivered_total")? == 0.0,
        "poison is dead-lettered on its first delivery"
    );
    Ok(())
}

/// A poison storm (1,000 bodies that are not JSON between good ones) is a handful of warn
/// lines, not one per message, and every line the worker logs names its adapter (its span),
/// its tasks' and the broker client's included.
async fn poison_storm_logs_few_lines_each_naming_the_adapter<B: BrokerFixture>() -> Result<()> {
    const STORM: usize = 1_000;
    let contract = Contract::<B>::start("storm").await?;
    let manifest = contract.manifest("batchSize: 100", "format: json")?;
    let mut all = bodies(0..10);
    all.extend((0..STORM).map(|i| format!("not json {i}").into_bytes()));
    all.extend(bodies(10..20));
    contract.produce(all).await?;
    let worker = contract.fx.worker(&manifest, "w1")?;
    contract.wait_settled(20, &worker).await?;
    let dead_lettered = worker.metric(&format!(
        r#"switchboard_messages_dead_lettered_total{{adapter="test/{}",reason="invalid_json"}}"#,
        contract.name
    ))?;
    ensure!(
        dead_lettered == STORM as f64,
        "{STORM} dead-lettered, counted: {dead_lettered}"
    );
    let log = worker.log();
    let warnings: Vec<&str> = log.lines().filter(|line| line.contains(" WARN ")).collect();
    ensure!(
        warnings.len() <= 10,
        "a poison storm of {STORM} is at most 10 warn lines, not {}:\n{}",
        warnings.len(),
        warnings.join("\n")
    );
    let adapter = format!("adapter=test/{}", contract.name);
    let unnamed: Vec<&str> = log
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.contains(&adapter))
        .collect();
    ensure!(
        unnamed.is_empty(),
        "every line names the adapter ({adapter}); these do not:\n{}",
        unnamed.join("\n")
    );
    Ok(())
}

/// A message whose workers keep dying before they store it is dead-lettered once it was
/// delivered more than maxDeliveries times: the workers are real processes killed while their
/// batch waits on a lock of the todos table.
async fn max_deliveries_dead_letters<B: BrokerFixture>() -> Result<()> {
    const MAX: u32 = 2;
    let contract = Contract::<B>::start("maxdel").await?;
    let manifest = contract.manifest(&format!("batchSize: 10, maxDeliveries: {MAX}"), "")?;
    // Every dying worker must hold all three: its store blocks, so it receives no more after.
    contract
        .broker
        .produce_together(&contract.fx, contract.name, bodies(0..3))
        .await?;
    let mut lock = sqlx::PgConnection::connect(&contract.fx.postgres.url()).await?;
    use sqlx::Connection as _;
    sqlx::query("BEGIN").execute(&mut lock).await?;
    sqlx::query("LOCK TABLE todos IN ACCESS EXCLUSIVE MODE")
        .execute(&mut lock)
        .await?;
    for delivery in 1..=MAX {
        let worker = contract
            .fx
            .worker(&manifest, &format!("dying-{delivery}"))?;
        wait_for(LONG, "the worker received the messages", || async {
            Ok(contract.metric(&worker, "switchboard_messages_received_total")? >= 3.0)
        })
        .await
        .map_err(|err| err.context(worker.log_tail()))?;
        worker.kill()?;
        // Its statement waits on the lock and would run once the lock is released: end it, as
        // PostgreSQL would once it noticed the client is gone.
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(switchboard_worker::database_application_name(&format!(
            "dying-{delivery}"
        )))
        .execute(contract.fx.pool())
        .await?;
        contract
            .fx
            .wait_disconnected(&format!("dying-{delivery}"))
            .await?;
    }
    sqlx::query("ROLLBACK").execute(&mut lock).await?;
    let worker = contract.fx.worker(&manifest, "last")?;
    wait_for(
        LONG,
        "three dead letters and nothing un-acknowledged",
        || async {
            Ok(contract
                .broker
                .dead_letters(&contract.fx, contract.name)
                .await?
                .len()
                == 3
                && contract.unacknowledged().await? == 0)
        },
    )
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let letters = contract
        .broker
        .dead_letters(&contract.fx, contract.name)
        .await?;
    ensure!(
        letters.iter().all(|(_, reason)| reason == "max_deliveries"),
        "{letters:?}"
    );
    let mut letter_bodies: Vec<Vec<u8>> = letters.into_iter().map(|(body, _)| body).collect();
    letter_bodies.sort();
    ensure!(letter_bodies == bodies(0..3), "byte-identical bodies");
    ensure!(
        contract.todos().await? == 0,
        "nothing past maxDeliveries is stored"
    );
    Ok(())
}

/// SIGTERM mid-flow: exit 0, and nothing acknowledged that was not stored.
async fn sigterm_acks_only_what_was_stored<B: BrokerFixture>() -> Result<()> {
    const TOTAL: usize = 3_000;
    let contract = Contract::<B>::start("term").await?;
    let manifest = contract.manifest("batchSize: 100", "")?;
    contract.produce(bodies(0..TOTAL)).await?;
    let mut worker = contract.fx.worker(&manifest, "w1")?;
    wait_for(LONG, "some progress", || async {
        Ok(contract.todos().await? >= 300)
    })
    .await?;
    worker.signal(Signal::SIGTERM)?;
    let status = worker.wait_exit(Duration::from_secs(30))?;
    ensure!(
        status.success(),
        "exit 0 after SIGTERM, got {status:?}\n{}",
        worker.log_tail()
    );
    // Whatever left the broker is stored: stored + still held = produced.
    let stored = contract.todos().await?;
    let held = contract.unacknowledged().await?;
    ensure!(
        stored + i64::try_from(held)? >= TOTAL as i64,
        "acknowledged without being stored: {stored} stored, {held} held of {TOTAL}"
    );
    let worker = contract.fx.worker(&manifest, "w2")?;
    contract.wait_settled(TOTAL as i64, &worker).await?;
    contract.assert_exactly_once(TOTAL as i64).await
}

/// The broker restarts under a running worker, which recovers by itself.
async fn broker_restart_is_recovered<B: BrokerFixture>() -> Result<()> {
    let mut contract = Contract::<B>::start("restart").await?;
    let manifest = contract.manifest("batchSize: 50", "")?;
    let worker = contract.fx.worker(&manifest, "w1")?;
    contract.produce(bodies(0..300)).await?;
    contract.wait_settled(300, &worker).await?;
    let Contract { fx, broker, .. } = &mut contract;
    broker.restart(fx).await?;
    contract.produce(bodies(300..600)).await?;
    contract.wait_settled(600, &worker).await?;
    contract.assert_exactly_once(600).await?;
    // A broker outage line (if the restart made one) says where the broker is.
    let log = worker.log();
    for down in log
        .lines()
        .filter(|line| line.contains("dependency unavailable") && line.contains("\"broker\""))
    {
        ensure!(down.contains("endpoint=127.0.0.1:"), "{down}");
    }
    wait_for(LONG, "readiness returns", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await
}

/// PostgreSQL down for 10 s: readiness false meanwhile, then every message exactly once.
async fn database_outage_is_recovered<B: BrokerFixture>() -> Result<()> {
    let mut contract = Contract::<B>::start("pgdown").await?;
    let manifest = contract.manifest("batchSize: 50", "")?;
    let worker = contract.fx.worker(&manifest, "w1")?;
    contract.produce(bodies(0..200)).await?;
    contract.wait_settled(200, &worker).await?;
    let stopped = SystemTime::now();
    contract.fx.postgres.stop();
    contract.produce(bodies(200..400)).await?;
    wait_for(LONG, "readiness turns false during the outage", || async {
        Ok(worker.http_get("/readyz")?.0 == 503)
    })
    .await?;
    let outage = Instant::now();
    readiness_names_the_database_and_since_when(&worker, stopped, &contract.fx.env.database_url)?;
    wait_for(Duration::from_secs(20), "a 10 s outage", || async {
        ensure!(
            worker.http_get("/healthz")?.0 == 200,
            "a backing-off loop is not stuck"
        );
        Ok(outage.elapsed() >= Duration::from_secs(10))
    })
    .await?;
    contract.fx.postgres.restart()?;
    contract.wait_settled(400, &worker).await?;
    contract.assert_exactly_once(400).await?;
    wait_for(LONG, "readiness returns", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await?;
    // The outage line says where the database is, never its credentials.
    let log = worker.log();
    let down = log
        .lines()
        .find(|line| line.contains("dependency unavailable"))
        .with_context(|| worker.log_tail())?;
    let at = format!("endpoint=127.0.0.1:{}", contract.fx.postgres.port());
    ensure!(
        down.contains(&at) && !down.contains("postgres://"),
        "{down}"
    );
    Ok(())
}

/// `/readyz` while PostgreSQL is down (stopped at `stopped`): 503, and a line
/// `database unavailable since <RFC 3339> (<n>s): <error>` with a start no earlier than the stop
/// (to the second) and no later than now, and nothing of `database_url`.
fn readiness_names_the_database_and_since_when(
    worker: &WorkerProcess,
    stopped: SystemTime,
    database_url: &str,
) -> Result<()> {
    let (status, body) = worker.http_get("/readyz")?;
    ensure!(status == 503, "{status}: {body}");
    let since = body
        .lines()
        .find_map(|line| line.strip_prefix("database unavailable since "))
        .and_then(|rest| rest.split_once(' '))
        .with_context(|| format!("/readyz does not name the database: {body}"))?
        .0;
    let since = humantime::parse_rfc3339(since).with_context(|| body.clone())?;
    ensure!(
        since + Duration::from_secs(1) >= stopped && since <= SystemTime::now(),
        "the outage's start {since:?} is not between the stop {stopped:?} and now: {body}"
    );
    ensure!(
        !body.contains(database_url) && !body.contains("postgres@"),
        "/readyz shows the database's credentials: {body}"
    );
    Ok(())
}

/// PostgreSQL turns read-only for 10 s under a flowing worker (reads work, writes fail, as
/// during a failover): a wait, never poison. Then exactly the produced set is stored.
async fn database_read_only_is_waited_out<B: BrokerFixture>() -> Result<()> {
    let contract = Contract::<B>::start("readonly").await?;
    let manifest = contract.manifest("batchSize: 50", "")?;
    let produced = bodies(0..1_000);
    contract.produce(produced[..500].to_vec()).await?;
    let worker = contract.fx.worker(&manifest, "w1")?;
    wait_for(LONG, "some progress", || async {
        Ok(contract.todos().await? >= 100)
    })
    .await?;
    contract.fx.set_read_only(true).await?;
    contract.produce(produced[500..].to_vec()).await?;
    let outage = Instant::now();
    wait_for(Duration::from_secs(20), "10 s read-only", || async {
        Ok(outage.elapsed() >= Duration::from_secs(10))
    })
    .await?;
    contract.fx.set_read_only(false).await?;
    contract.wait_settled(1_000, &worker).await?;
    contract.assert_stored_exactly(&produced).await
}

/// The source is deleted and created again under a running worker (the broker may re-use its
/// positions: NATS sequences, Kafka offsets): every new message is stored, none taken for a
/// redelivery of the old incarnation's.
async fn recreated_source_is_stored_not_deduplicated<B: BrokerFixture>() -> Result<()> {
    let contract = Contract::<B>::start("recreated").await?;
    let manifest = contract.manifest("batchSize: 50", "")?;
    let produced = bodies(0..400);
    contract.produce(produced[..100].to_vec()).await?;
    let worker = contract.fx.worker(&manifest, "w1")?;
    contract.wait_settled(100, &worker).await?;
    contract
        .broker
        .recreate(&contract.fx, contract.name)
        .await?;
    contract.produce(produced[100..].to_vec()).await?;
    contract.wait_settled(400, &worker).await?;
    contract.assert_stored_exactly(&produced).await
}

/// A message with a part the client cannot take as text (a header value that is not UTF-8, a
/// binary key, an attribute that is not a string) between good ones: the good ones are stored,
/// and it is stored too (that part encoded) or dead-lettered byte-identical, exactly once.
async fn undecodable_part_spares_the_neighbours<B: BrokerFixture>() -> Result<()> {
    let contract = Contract::<B>::start("undecodable").await?;
    let manifest = contract.manifest("batchSize: 20", "")?;
    let odd = br#"{"odd":true}"#.to_vec();
    let worker = contract.fx.worker(&manifest, "w1")?;
    contract.produce(bodies(0..10)).await?;
    contract
        .broker
        .produce_undecodable(&contract.fx, contract.name, odd.clone())
        .await?;
    contract.produce(bodies(10..20)).await?;
    wait_for(LONG, "20 todos and nothing un-acknowledged", || async {
        Ok(contract.todos().await? >= 20 && contract.unacknowledged().await? == 0)
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let mut letters = contract
        .broker
        .dead_letters(&contract.fx, contract.name)
        .await?;
    letters.extend(contract.fx.database_dead_letters(contract.name).await?);
    let mut expected = bodies(0..20);
    match letters.as_slice() {
        [] => expected.push(odd),
        [(body, _)] => ensure!(
            *body == odd,
            "the dead letter is the odd message: {letters:?}"
        ),
        _ => anyhow::bail!("one dead letter at most: {letters:?}"),
    }
    contract
        .fx
        .assert_stored_exactly(contract.name, &expected)
        .await?;
    // A lease that ran out while a slow machine stored its batch redelivers a message too; its
    // first acknowledgement is then refused as stale. Any other redelivery is a dropped
    // connection.
    let redelivered = contract.metric(&worker, "switchboard_messages_redelivered_total")?;
    let stale = contract.metric(&worker, "switchboard_stale_receipts_total")?;
    ensure!(
        redelivered <= stale,
        "{redelivered} messages were redelivered, {stale} after a lease ran out: a connection \
         was dropped for the undecodable one\n{}",
        worker.log_tail()
    );
    Ok(())
}

/// Poison whose dead letter the broker refuses for good: the letter is kept in PostgreSQL's
/// dead-letter table, byte-identical, and the batch is stored and acknowledged (no wedge).
async fn refused_dead_letter_is_kept_in_the_database<B: BrokerFixture>() -> Result<()> {
    let contract = Contract::<B>::start("refused").await?;
    contract
        .broker
        .refuse_dead_letters(&contract.fx, contract.name)
        .await?;
    let manifest = contract.manifest("batchSize: 20, maxDeliveries: 5", "format: json")?;
    let poison = b"{\"order\": broken".to_vec();
    let mut all = bodies(0..10);
    all.push(poison.clone());
    all.extend(bodies(10..20));
    contract.produce(all).await?;
    let worker = contract.fx.worker(&manifest, "w1")?;
    wait_for(
        LONG,
        "20 todos, one kept letter, nothing un-acknowledged",
        || async {
            Ok(contract.todos().await? >= 20
                && !contract
                    .fx
                    .database_dead_letters(contract.name)
                    .await?
                    .is_empty()
                && contract.unacknowledged().await? == 0)
        },
    )
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    contract
        .fx
        .assert_stored_exactly(contract.name, &bodies(0..20))
        .await?;
    let kept = contract.fx.database_dead_letters(contract.name).await?;
    ensure!(
        kept == vec![(poison, "invalid_json".to_owned())],
        "one letter kept, byte-identical: {kept:?}"
    );
    Ok(())
}

/// Every connection between the worker and the broker is reset again and again while batches
/// flow (a proxy in between cuts them mid-receive, mid-store and mid-acknowledgement): the
/// worker reconnects each time, and exactly the produced set is stored.
async fn connections_cut_mid_flow_lose_nothing<B: BrokerFixture>() -> Result<()> {
    const TOTAL: usize = 2_000;
    const CUTS: usize = 8;
    let contract = Contract::<B>::start("cut").await?;
    let upstream = contract.broker.address(&contract.fx)?;
    let proxy = CuttingProxy::start(&upstream).await?;
    let via = |text: &str| text.replace(&upstream, &proxy.address());
    let name = contract.name;
    let delivery = format!("{}, batchSize: 10", contract.broker.delivery());
    let manifest = contract.fx.manifest(
        &format!("{name}.yaml"),
        &source_manifest(name, &via(&contract.source), &delivery, ""),
    )?;
    // The worker's broker environment, pointed at the proxy.
    let mut env = vec![("REDIS_URL".to_owned(), via(&contract.fx.env.redis_url))];
    env.extend(
        contract
            .fx
            .extra_env
            .iter()
            .map(|(key, value)| (key.clone(), via(value))),
    );
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let produced = bodies(0..TOTAL);
    let worker = contract.fx.worker_with(&manifest, "w1", &env)?;
    let mut rng = fastrand::Rng::new();
    let mut opened_before_cuts = None;
    // A wave per cut, cut while the wave is being received, stored and acknowledged.
    for (cut, wave) in produced.chunks(TOTAL / CUTS).enumerate() {
        let before = contract.todos().await?;
        contract.produce(wave.to_vec()).await?;
        let target = before + rng.i64(10..(wave.len() as i64 / 2));
        wait_for(LONG, &format!("progress before cut {cut}"), || async {
            Ok(contract.todos().await? >= target)
        })
        .await
        .map_err(|err| err.context(worker.log_tail()))?;
        opened_before_cuts.get_or_insert(proxy.connections());
        proxy.cut();
    }
    contract.wait_settled(TOTAL as i64, &worker).await?;
    contract.assert_stored_exactly(&produced).await?;
    ensure!(
        Some(proxy.connections()) > opened_before_cuts,
        "the worker reconnected through the proxy after the cuts"
    );
    Ok(())
}

/// How a broker's message carries its trace context: its own headers (the W3C `traceparent`
/// and `tracestate`), or, where it has none (a Redis list item), a CloudEvent's
/// distributed-tracing extension in the body.
#[derive(Clone, Copy, Debug)]
enum Carrier {
    Headers,
    CloudEvent,
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// With traces exported to a real OpenTelemetry Collector, a message sent with a trace context
/// (and one with a malformed `traceparent`, and one with none) is stored once each; the todo
/// keeps the context (`todos.traceparent`, `tracestate`) and the event its headers as sent;
/// the batch span — a root, `process {destination}`, kind consumer, with the messaging
/// attributes of OpenTelemetry's conventions — links to the producer's span; the malformed one
/// is counted and carries nothing.
async fn trace_context_reaches_the_todo_and_the_batch_span_links_to_it<B: BrokerFixture>(
    carrier: Carrier,
    system: &str,
) -> Result<()> {
    let mut contract = Contract::<B>::start("traced").await?;
    let collector = Collector::start(&contract.fx)?;
    contract.fx.extra_env.extend([
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
            collector.http_endpoint(),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "100".to_owned()),
    ]);
    let payload = match carrier {
        Carrier::Headers => "",
        Carrier::CloudEvent => "envelope: cloudevents",
    };
    let manifest = contract.manifest("batchSize: 20", payload)?;
    let worker = contract.fx.worker(&manifest, "w1")?;
    let (fx, name) = (&contract.fx, contract.name);
    let (body_name, header_prefix) = match carrier {
        Carrier::Headers => ("traced", ""),
        Carrier::CloudEvent => ("traced", "ce-"),
    };
    let message = |order: u32, traceparent: Option<&str>| match carrier {
        Carrier::Headers => {
            let mut headers = vec![("tenant", "acme")];
            if let Some(traceparent) = traceparent {
                headers.extend([("traceparent", traceparent), ("tracestate", TRACESTATE)]);
            }
            let headers: Vec<(String, String)> = headers
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            (format!(r#"{{"order":{order}}}"#).into_bytes(), headers)
        }
        Carrier::CloudEvent => {
            let mut event = serde_json::json!({
                "specversion": "1.0", "id": format!("{body_name}-{order}"),
                "source": "urn:test", "type": "order", "data": {"order": order},
            });
            if let Some(traceparent) = traceparent {
                event["traceparent"] = traceparent.into();
                event["tracestate"] = TRACESTATE.into();
            }
            (event.to_string().into_bytes(), Vec::new())
        }
    };
    for (order, traceparent) in [
        (1, Some(TRACEPARENT)),
        (2, Some("00-not-a-trace-context-01")),
        (3, None),
    ] {
        let (body, headers) = message(order, traceparent);
        if headers.is_empty() {
            contract.broker.produce(fx, name, vec![body]).await?;
        } else {
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            contract
                .broker
                .produce_with_headers(fx, name, body, &headers)
                .await?;
        }
    }
    contract.wait_settled(3, &worker).await?;
    contract.assert_exactly_once(3).await?;
    let rows: Vec<(
        serde_json::Value,
        Option<String>,
        Option<String>,
        serde_json::Value,
    )> = sqlx::query_as(
        "SELECT t.payload, t.traceparent, t.tracestate, e.headers FROM todos t \
             JOIN events e ON e.id = t.event_id WHERE t.queue = $1 ORDER BY t.payload::text",
    )
    .bind(name)
    .fetch_all(fx.pool())
    .await?;
    let order = |row: &(serde_json::Value, _, _, _)| row.0["order"].as_u64();
    let traced = rows
        .iter()
        .find(|row| order(row) == Some(1))
        .context("order 1")?;
    ensure!(
        traced.1.as_deref() == Some(TRACEPARENT) && traced.2.as_deref() == Some(TRACESTATE),
        "the todo keeps the trace context: {traced:?}"
    );
    ensure!(
        traced.3[format!("{header_prefix}traceparent")] == TRACEPARENT
            && traced.3[format!("{header_prefix}tracestate")] == TRACESTATE,
        "the event keeps the headers as sent: {}",
        traced.3
    );
    if let Carrier::Headers = carrier {
        ensure!(
            traced.3["tenant"] == "acme",
            "other headers kept: {}",
            traced.3
        );
    }
    for untraced in rows.iter().filter(|row| order(row) != Some(1)) {
        ensure!(
            untraced.1.is_none() && untraced.2.is_none(),
            "no trace context from a malformed or missing traceparent: {untraced:?}"
        );
    }
    ensure!(
        worker.metric("switchboard_trace_contexts_malformed_total")? == 1.0,
        "the malformed traceparent is counted"
    );
    let spans = collector
        .wait_for_spans(
            LONG,
            "a batch span linked to the producer's span, and its settle span",
            |spans| {
                spans.iter().any(|span| {
                    span.name.starts_with("process ")
                        && span.links.iter().any(|link| link.trace_id == TRACE_ID)
                }) && spans.iter().any(|span| span.name == "settle")
            },
        )
        .await
        .map_err(|err| {
            let names: Vec<String> = collector
                .spans()
                .unwrap_or_default()
                .iter()
                .map(|span| format!("{} {:?}", span.name, span.links))
                .collect();
            err.context(format!("spans received: {names:?}\n{}", worker.log_tail()))
        })?;
    let batch = spans
        .iter()
        .find(|span| span.links.iter().any(|link| link.trace_id == TRACE_ID))
        .context("the linked batch span")?;
    let link = batch
        .links
        .iter()
        .find(|link| link.trace_id == TRACE_ID)
        .context("the link")?;
    ensure!(link.span_id == "00f067aa0ba902b7", "{link:?}");
    ensure!(link.trace_state == TRACESTATE, "{link:?}");
    ensure!(
        batch.kind == SpanKind::Consumer
            && batch.parent_span_id.is_empty()
            && batch.trace_id != TRACE_ID
            && batch.service_name() == Some("switchboard-worker"),
        "a root consumer span of the worker, linking, not continuing: {batch:?}"
    );
    let destination = batch
        .attribute_str("messaging.destination.name")
        .context("messaging.destination.name")?;
    ensure!(
        batch.name == format!("process {destination}") && !destination.is_empty(),
        "{batch:?}"
    );
    ensure!(
        batch.attribute_str("messaging.system") == Some(system),
        "{batch:?}"
    );
    ensure!(batch.attribute_str("messaging.operation.type") == Some("process"));
    let count = batch.attributes.get("messaging.batch.message_count");
    ensure!(
        count
            .and_then(|count| count.as_i64())
            .is_some_and(|count| (1..=3).contains(&count)),
        "{batch:?}"
    );
    // The latency histograms keep, per bucket, the trace of the last batch that observed it as
    // an exemplar (OpenMetrics): each must be the trace of an exported batch span; the
    // end-to-end one only where the broker gives an enqueue time (it observed something).
    let (_, metrics) = worker.http_get("/metrics")?;
    let mut exemplars: Vec<String> = Vec::new();
    for histogram in [
        "switchboard_commit_duration_seconds",
        "switchboard_end_to_end_latency_seconds",
    ] {
        let observed = metrics.lines().any(|line| {
            line.starts_with(&format!("{histogram}_count"))
                && line.split_whitespace().last() != Some("0")
        });
        let found: Vec<String> = metrics
            .lines()
            .filter(|line| line.starts_with(&format!("{histogram}_bucket")))
            .filter_map(|line| line.split("trace_id=\"").nth(1))
            .filter_map(|rest| rest.split('"').next())
            .map(str::to_owned)
            .collect();
        ensure!(
            !observed || !found.is_empty(),
            "{histogram}: exemplars with trace ids: {metrics}"
        );
        exemplars.extend(found);
    }
    ensure!(
        !exemplars.is_empty(),
        "the commit histogram always observes: {metrics}"
    );
    collector
        .wait_for_spans(LONG, "a batch span for every exemplar's trace", |spans| {
            exemplars.iter().all(|id| {
                spans
                    .iter()
                    .any(|span| span.name.starts_with("process ") && &span.trace_id == id)
            })
        })
        .await?;
    for step in ["store", "settle"] {
        ensure!(
            spans
                .iter()
                .any(|span| span.name == step && span.parent_span_id == batch.span_id),
            "a {step} span inside the batch span: {spans:#?}"
        );
    }
    Ok(())
}

/// The suite, for one broker.
/// `chaos:`, `recreate:`, `undecodable:` and `cut:` take attributes for those tests of a broker: an `#[ignore]` there
/// names a limit that broker's page states (docs/brokers/<broker>.md, "Not guaranteed");
/// `trace:` says how its messages carry a trace context and its `messaging.system`.
macro_rules! contract_suite {
    ($($module:ident => $broker:ty {
        chaos: [$(#[$chaos:meta])*],
        recreate: [$(#[$recreate:meta])*],
        undecodable: [$(#[$undecodable:meta])*],
        cut: [$(#[$cut:meta])*],
        trace: ($carrier:expr, $system:literal) $(,)?
    }),* $(,)?) => {$(
        mod $module {
            use super::*;

            $(#[$chaos])*
            #[tokio::test]
            async fn worker_and_broker_sigkills_mid_flow_store_exactly_the_produced_set() -> Result<()> {
                chaos_worker_and_broker_kills::<$broker>().await
            }

            #[tokio::test]
            async fn crash_between_commit_and_ack_leaves_exactly_one_todo_per_message() -> Result<()> {
                crash_between_commit_and_ack::<$broker>(false).await
            }

            #[tokio::test]
            async fn redelivery_after_its_partition_rotated_is_a_duplicate() -> Result<()> {
                crash_between_commit_and_ack::<$broker>(true).await
            }

            #[tokio::test]
            async fn poison_is_dead_lettered_at_once_byte_identical_while_its_batch_is_stored() -> Result<()> {
                poison_is_dead_lettered_at_once::<$broker>().await
            }

            #[tokio::test]
            async fn poison_storm_logs_few_lines_each_naming_the_adapter() -> Result<()> {
                super::poison_storm_logs_few_lines_each_naming_the_adapter::<$broker>().await
            }

            #[tokio::test]
            async fn message_delivered_past_max_deliveries_is_dead_lettered_not_stored() -> Result<()> {
                max_deliveries_dead_letters::<$broker>().await
            }

            #[tokio::test]
            async fn sigterm_exits_zero_and_acknowledges_only_stored_messages() -> Result<()> {
                sigterm_acks_only_what_was_stored::<$broker>().await
            }

            #[tokio::test]
            async fn broker_restart_mid_flow_is_recovered_without_loss_or_duplicates() -> Result<()> {
                broker_restart_is_recovered::<$broker>().await
            }

            #[tokio::test]
            async fn database_down_for_10_seconds_loses_nothing_and_flips_readiness() -> Result<()> {
                database_outage_is_recovered::<$broker>().await
            }

            #[tokio::test]
            async fn database_read_only_for_10_seconds_is_waited_out_not_dead_lettered() -> Result<()> {
                database_read_only_is_waited_out::<$broker>().await
            }

            $(#[$recreate])*
            #[tokio::test]
            async fn recreated_source_stores_its_new_messages_not_as_duplicates() -> Result<()> {
                recreated_source_is_stored_not_deduplicated::<$broker>().await
            }

            $(#[$undecodable])*
            #[tokio::test]
            async fn undecodable_header_key_or_attribute_spares_its_neighbours() -> Result<()> {
                undecodable_part_spares_the_neighbours::<$broker>().await
            }

            #[tokio::test]
            async fn dead_letter_the_broker_refuses_is_kept_in_postgresql() -> Result<()> {
                refused_dead_letter_is_kept_in_the_database::<$broker>().await
            }

            $(#[$cut])*
            #[tokio::test]
            async fn connections_cut_mid_receive_and_mid_ack_lose_nothing() -> Result<()> {
                connections_cut_mid_flow_lose_nothing::<$broker>().await
            }

            #[tokio::test]
            async fn trace_context_reaches_the_todo_and_the_batch_span_links_to_it() -> Result<()> {
                super::trace_context_reaches_the_todo_and_the_batch_span_links_to_it::<$broker>($carrier, $system).await
            }
        }
    )*};
}

contract_suite! {
    redis_stream => RedisStreamBroker { chaos: [], recreate: [], undecodable: [], cut: [], trace: (Carrier::Headers, "redis") },
    redis_list => RedisListBroker {
        chaos: [],
        recreate: [],
        undecodable: [],
        cut: [],
        trace: (Carrier::CloudEvent, "redis"),
    },
    sqs_standard => SqsBroker { chaos: [], recreate: [], undecodable: [], cut: [], trace: (Carrier::Headers, "aws_sqs") },
    nats => NatsBroker { chaos: [], recreate: [], undecodable: [], cut: [], trace: (Carrier::Headers, "nats") },
    amqp_quorum => AmqpQuorumBroker {
        chaos: [],
        recreate: [],
        undecodable: [],
        cut: [],
        trace: (Carrier::Headers, "rabbitmq"),
    },
    amqp_classic => AmqpClassicBroker { chaos: [], recreate: [], undecodable: [], cut: [], trace: (Carrier::Headers, "rabbitmq") },
    kafka => KafkaBroker { chaos: [], recreate: [], undecodable: [], cut: [], trace: (Carrier::Headers, "kafka") },
    gateway => GatewayBroker { chaos: [], recreate: [], undecodable: [], cut: [], trace: (Carrier::Headers, "aws_sqs") },
}
