//! Redis Streams store-then-ack, end to end: the real worker binary against real PostgreSQL and
//! redis-server processes.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use nix::sys::signal::Signal;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{WorkerProcess, migrate};
use switchboard_tests::{Fixture, field};

const ISSUE_MANIFEST: &str = "\
apiVersion: switchboard.dev/v1alpha1
kind: QueueAdapter
metadata: {name: orders, namespace: default}
spec:
  source: {redis: {mode: stream, stream: orders, group: switchboard}}
  target: {queue: orders}
  delivery: {batchSize: 200, maxDeliveries: 3, claimIdleSeconds: 5}
";

const LONG: Duration = Duration::from_secs(120);

fn bodies(range: std::ops::Range<usize>) -> impl Iterator<Item = Vec<u8>> {
    range.map(|i| format!(r#"{{"order":{i}}}"#).into_bytes())
}

/// Waits until `queue` holds `expected` todos and `stream`'s group has nothing pending.
async fn wait_stored(
    fx: &Fixture,
    queue: &str,
    stream: &str,
    group: &str,
    expected: i64,
) -> Result<()> {
    wait_for(
        LONG,
        &format!("{expected} todos in {queue} and nothing pending"),
        || async { Ok(fx.todo_count(queue).await? >= expected && fx.pending(stream, group)? == 0) },
    )
    .await
}

#[tokio::test]
async fn issue_manifest_runs_unchanged_and_stores_every_entry() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.manifest("orders.yaml", ISSUE_MANIFEST)?;
    let ids = fx.produce("orders", bodies(0..1000))?;
    let worker = fx.worker(&manifest, "worker-a")?;
    wait_stored(&fx, "orders", "orders", "switchboard", 1000).await?;
    fx.assert_exactly_once("orders", 1000).await?;

    let (key, payload, event_source): (String, serde_json::Value, String) = sqlx::query_as(
        "SELECT t.idempotency_key, t.payload, e.source FROM todos t JOIN events e ON e.id = t.event_id \
         WHERE e.external_id = $1",
    )
    .bind(&ids[7])
    .fetch_one(fx.pool())
    .await?;
    assert_eq!(key, format!("redis:default/orders:{}", ids[7]));
    assert_eq!(payload, serde_json::json!({"order": 7}));
    assert_eq!(event_source, "redis:default/orders");

    wait_for(LONG, "metrics report 1000 stored and acked", || async {
        Ok(
            worker.metric(r#"switchboard_messages_acked_total{adapter="default/orders"}"#)?
                >= 1000.0,
        )
    })
    .await?;
    let (_, metrics) = worker.http_get("/metrics")?;
    for family in [
        r#"switchboard_messages_received_total{adapter="default/orders"} 1000"#,
        r#"switchboard_messages_stored_total{adapter="default/orders"} 1000"#,
        r#"switchboard_messages_duplicate_total{adapter="default/orders"} 0"#,
        r#"switchboard_delivery_guarantee_info{adapter="default/orders",guarantee="at_least_once"} 1"#,
        // Its old name, kept for one release.
        r#"switchboard_delivery_guarantee{adapter="default/orders",guarantee="at_least_once"} 1"#,
        "switchboard_commit_duration_seconds_bucket",
        "switchboard_end_to_end_latency_seconds_bucket",
        "switchboard_batch_size_bucket",
        "switchboard_oldest_pending_age_seconds",
        "switchboard_backlog_messages",
    ] {
        ensure!(
            metrics.contains(family),
            "metrics lack {family}:\n{metrics}"
        );
    }
    assert_eq!(worker.http_get("/healthz")?.0, 200);
    assert_eq!(worker.http_get("/readyz")?.0, 200);
    Ok(())
}

#[tokio::test]
async fn run_refuses_an_unmigrated_database_and_migrate_is_concurrency_safe() -> Result<()> {
    let fx = Fixture::start().await?;
    sqlx::query("CREATE DATABASE fresh")
        .execute(fx.pool())
        .await?;
    let mut env = fx.env.clone();
    env.database_url = fx.postgres.url_for("fresh");
    let manifest = fx.manifest("orders.yaml", ISSUE_MANIFEST)?;

    let mut refused = WorkerProcess::start(&env, &manifest, "w", &[])?;
    let status = refused.wait_exit(Duration::from_secs(30))?;
    ensure!(!status.success(), "run must fail on an unmigrated database");
    ensure!(
        refused.log().contains("switchboard-worker migrate"),
        "the error must say to run migrate:\n{}",
        refused.log()
    );

    let runs: Vec<_> = (0..3)
        .map(|_| {
            let env = env.clone();
            std::thread::spawn(move || migrate(&env))
        })
        .collect();
    for run in runs {
        let output = run.join().expect("migrate thread")?;
        ensure!(
            output.status.success(),
            "concurrent migrate failed: {output:?}"
        );
    }
    let again = migrate(&env)?;
    ensure!(again.status.success(), "repeated migrate failed: {again:?}");
    Ok(())
}

#[tokio::test]
async fn crash_between_commit_and_ack_leaves_exactly_one_todo_per_entry() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("crash", "batchSize: 100", "")?;
    fx.produce("crash", bodies(0..500))?;

    fx.crash_after_first_commit(&manifest, "w1").await?;
    // Whole batches were committed (the first, and possibly those committing beside it), and
    // none was acknowledged: everything delivered is still pending.
    let committed = fx.todo_count("crash").await?;
    let pending = fx.pending("crash", "switchboard")?;
    ensure!(
        committed >= 100 && committed % 100 == 0,
        "whole batches committed, found {committed}"
    );
    ensure!(
        pending >= u64::try_from(committed)?,
        "{committed} committed but only {pending} pending: something was acked"
    );
    let worker = fx.worker(&manifest, "w1")?;
    wait_stored(&fx, "crash", "crash", "switchboard", 500).await?;
    fx.assert_exactly_once("crash", 500).await?;
    ensure!(
        fx.connections_of("w1").await? > 0,
        "the connections waited for above are named as a live worker's are"
    );
    wait_for(LONG, "the replayed batches count as duplicates", || async {
        Ok(
            worker.metric(r#"switchboard_messages_duplicate_total{adapter="test/crash"}"#)?
                == committed as f64,
        )
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn redelivered_entry_whose_todo_is_done_creates_no_second_todo() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("done", "batchSize: 10", "")?;
    let ids = fx.produce("done", bodies(0..1))?;
    fx.crash_after_first_commit(&manifest, "w1").await?;
    let updated = sqlx::query("UPDATE todos SET status = 'done' WHERE queue = 'done'")
        .execute(fx.pool())
        .await?
        .rows_affected();
    ensure!(updated == 1, "one todo committed before the crash");
    ensure!(
        fx.pending("done", "switchboard")? == 1,
        "the entry is still pending"
    );

    let worker = fx.worker(&manifest, "w1")?;
    wait_stored(&fx, "done", "done", "switchboard", 1).await?;
    fx.assert_exactly_once("done", 1).await?;
    let status: String = sqlx::query_scalar("SELECT status FROM todos WHERE idempotency_key = $1")
        .bind(format!("redis:test/done:{}", ids[0]))
        .fetch_one(fx.pool())
        .await?;
    assert_eq!(status, "done");
    assert_eq!(
        worker.metric(r#"switchboard_messages_duplicate_total{adapter="test/done"}"#)?,
        1.0
    );
    Ok(())
}

#[tokio::test]
async fn chaos_sigkill_at_random_moments_stores_every_entry_exactly_once() -> Result<()> {
    const TOTAL: i64 = 20_000;
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter(
        "chaos",
        "batchSize: 200, maxDeliveries: 10, claimIdleSeconds: 2",
        "",
    )?;
    fx.produce("chaos", bodies(0..20_000))?;
    let mut rng = fastrand::Rng::new();
    let mut kills = 0;
    let mut generation = 0;
    let mut consumer = "chaos-0".to_owned();
    while kills < 6 {
        let worker = fx.worker(&manifest, &consumer)?;
        let stored = fx.todo_count("chaos").await?;
        // Kill once a random amount of further progress has been made.
        let target = (stored + rng.i64(200..2_500)).min(TOTAL - 1);
        wait_for(LONG, "progress before the kill", || async {
            Ok(fx.todo_count("chaos").await? >= target)
        })
        .await?;
        worker.kill()?;
        kills += 1;
        generation += 1;
        if rng.bool() {
            consumer = format!("chaos-{generation}");
        }
    }
    let _last = fx.worker(&manifest, &format!("chaos-final-{generation}"))?;
    wait_stored(&fx, "chaos", "chaos", "switchboard", TOTAL).await?;
    fx.assert_exactly_once("chaos", TOTAL).await?;
    ensure!(fx.xlen("chaos.dlq")? == 0, "nothing may be dead-lettered");
    ensure!(kills >= 5);
    Ok(())
}

#[tokio::test]
async fn redis_restart_without_persistence_is_recovered_without_skipping_new_entries() -> Result<()>
{
    let mut fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("rr", "batchSize: 50", "")?;
    fx.produce("rr", bodies(0..300))?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_stored(&fx, "rr", "rr", "switchboard", 300).await?;

    fx.redis.restart_empty()?;
    fx.produce("rr", bodies(300..600))?;
    wait_stored(&fx, "rr", "rr", "switchboard", 600).await?;
    fx.assert_exactly_once("rr", 600).await?;
    ensure!(
        worker.metric(r#"switchboard_redis_consumer_group_recreated_total{adapter="test/rr"}"#)?
            >= 1.0,
        "the recreation must be counted"
    );
    ensure!(
        worker.metric(r#"switchboard_broker_reconnects_total{adapter="test/rr"}"#)? >= 1.0,
        "the reconnection must be counted"
    );
    ensure!(
        worker.log().contains("recreated at the last stored entry"),
        "{}",
        worker.log_tail()
    );
    Ok(())
}

#[tokio::test]
async fn postgres_outage_loses_nothing_duplicates_nothing_and_flips_readiness() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("pg", "batchSize: 100", "")?;
    let worker = fx.worker(&manifest, "w1")?;
    fx.produce("pg", bodies(0..500))?;
    wait_stored(&fx, "pg", "pg", "switchboard", 500).await?;
    assert_eq!(worker.http_get("/readyz")?.0, 200);

    fx.postgres.stop();
    fx.produce("pg", bodies(500..1000))?;
    wait_for(LONG, "readiness turns false during the outage", || async {
        Ok(worker.http_get("/readyz")?.0 == 503)
    })
    .await?;
    let outage_started = Instant::now();
    // Keep producing through a 10 s outage; the worker holds its batch and backs off.
    let mut next = 1000;
    while outage_started.elapsed() < Duration::from_secs(10) {
        fx.produce("pg", bodies(next..next + 100))?;
        next += 100;
        ensure!(
            worker.http_get("/readyz")?.0 == 503,
            "must stay unready while the database is down"
        );
        ensure!(
            worker.http_get("/healthz")?.0 == 200,
            "a backing-off loop is not stuck"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    fx.postgres.restart()?;
    let log = recovered_after_one_outage(&fx, &worker, "pg", i64::try_from(next)?).await?;
    ensure!(
        log.contains("dependency recovered"),
        "{}",
        worker.log_tail()
    );
    Ok(())
}

/// After a database outage: every entry of stream `name` stored exactly once, readiness back,
/// and the outage logged once. Returns the worker's log.
async fn recovered_after_one_outage(
    fx: &Fixture,
    worker: &WorkerProcess,
    name: &str,
    total: i64,
) -> Result<String> {
    wait_stored(fx, name, name, "switchboard", total).await?;
    fx.assert_exactly_once(name, total).await?;
    wait_for(LONG, "readiness returns", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await?;
    let log = worker.log();
    let outage_lines = log.matches("dependency unavailable").count();
    ensure!(
        outage_lines == 1,
        "one log line per outage, found {outage_lines}:\n{log}"
    );
    Ok(log)
}

/// Worker `w1` on stream `name` with a 2 s `--database-timeout`, once it has stored `stored`
/// entries.
async fn worker_with_a_short_database_timeout(
    fx: &Fixture,
    name: &str,
    stored: usize,
) -> Result<WorkerProcess> {
    let manifest = fx.stream_adapter(name, "batchSize: 100", "")?;
    let worker = WorkerProcess::start(
        &fx.env,
        &manifest,
        "w1",
        &[("SWITCHBOARD_DATABASE_TIMEOUT", "2s")],
    )?;
    fx.produce(name, bodies(0..stored))?;
    wait_stored(fx, name, name, "switchboard", i64::try_from(stored)?).await?;
    Ok(worker)
}

#[tokio::test]
async fn hung_database_flips_readiness_and_recovers_without_loss_or_duplicates() -> Result<()> {
    let fx = Fixture::start().await?;
    let worker = worker_with_a_short_database_timeout(&fx, "stall", 500).await?;
    ensure!(
        worker.http_get("/readyz")?.0 == 200,
        "ready before the hang"
    );

    // A database that accepts connections and answers nothing (as an address left behind by a
    // failover does): no error ever arrives, only the timeout can tell.
    fx.postgres.set_running(false)?;
    fx.produce("stall", bodies(500..1000))?;
    wait_for(
        Duration::from_secs(30),
        "readiness turns false while the database hangs (timeout 2 s)",
        || async { Ok(worker.http_get("/readyz")?.0 == 503) },
    )
    .await
    .with_context(|| worker.log_tail())?;
    ensure!(
        worker.http_get("/healthz")?.0 == 200,
        "a loop that backs off is alive"
    );
    ensure!(
        fx.pending("stall", "switchboard")? >= 1,
        "the batch in hand stays un-acknowledged"
    );

    fx.postgres.set_running(true)?;
    recovered_after_one_outage(&fx, &worker, "stall", 1000).await?;
    Ok(())
}

#[tokio::test]
async fn statement_stuck_in_the_database_times_out_and_is_retried_without_loss_or_duplicates()
-> Result<()> {
    let fx = Fixture::start().await?;
    let worker = worker_with_a_short_database_timeout(&fx, "stuck", 300).await?;

    // The database answers pings, but the batch's INSERT waits behind a lock: without a
    // client-side deadline the batch would wait as long as the lock is held.
    let mut lock = fx.pool().begin().await?;
    sqlx::query("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await?;
    fx.produce("stuck", bodies(300..600))?;
    let errors =
        r#"switchboard_dependency_errors_total{adapter="test/stuck",dependency="database"}"#;
    wait_for(
        Duration::from_secs(30),
        "the stuck batch times out, again and again, while the lock is still held",
        || async { Ok(worker.metric(errors).unwrap_or(0.0) >= 3.0) },
    )
    .await
    .with_context(|| worker.log_tail())?;
    ensure!(
        worker
            .log()
            .contains("canceling statement due to statement timeout"),
        "PostgreSQL ends the stuck statement itself:\n{}",
        worker.log_tail()
    );
    // Each timed-out statement ended on the server: retries do not pile up waiting backends.
    let connections = fx.connections_of("w1").await?;
    let pool = i64::try_from(switchboard_worker::transport::IN_FLIGHT + 1)?;
    ensure!(
        connections <= pool,
        "{connections} connections, more than the worker's pool of {pool}"
    );
    ensure!(
        fx.pending("stuck", "switchboard")? >= 1,
        "the batch that timed out stays un-acknowledged"
    );
    lock.rollback().await?;

    wait_stored(&fx, "stuck", "stuck", "switchboard", 600).await?;
    fx.assert_exactly_once("stuck", 600).await?;
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE source = $1")
        .bind("redis:test/stuck")
        .fetch_one(fx.pool())
        .await?;
    ensure!(events == 600, "one event per entry, found {events}");
    Ok(())
}

#[tokio::test]
async fn poison_entries_are_dead_lettered_with_context_while_their_batch_is_stored() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("poison", "batchSize: 50", "format: json")?;
    let mut all: Vec<Vec<u8>> = bodies(0..60).collect();
    let invalid = b"{this is not json".to_vec();
    let nul = br#"{"text": "nul \u0000 inside"}"#.to_vec();
    all.insert(10, invalid.clone());
    all.insert(40, nul.clone());
    let ids = fx.produce("poison", all)?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_stored(&fx, "poison", "poison", "switchboard", 60).await?;
    wait_for(LONG, "two dead letters", || async {
        Ok(fx.xlen("poison.dlq")? == 2)
    })
    .await?;
    fx.assert_exactly_once("poison", 60).await?;
    ensure!(fx.pending("poison", "switchboard")? == 0);

    let letters = fx.stream_entries("poison.dlq")?;
    let by_origin = |id: &str| {
        letters
            .iter()
            .find(|l| field(l, "origin_id").ok().as_deref() == Some(id))
    };
    let invalid_letter = by_origin(&ids[10]).context("invalid JSON entry dead-lettered")?;
    assert_eq!(
        invalid_letter.get("body"),
        Some(&invalid),
        "body must be byte-identical"
    );
    assert_eq!(field(invalid_letter, "reason")?, "invalid_json");
    let nul_letter = by_origin(&ids[40]).context("NUL entry dead-lettered")?;
    assert_eq!(nul_letter.get("body"), Some(&nul));
    assert_eq!(field(nul_letter, "reason")?, "nul_character");
    for letter in [invalid_letter, nul_letter] {
        assert_eq!(field(letter, "origin_stream")?, "poison");
        assert_eq!(field(letter, "adapter")?, "test/poison");
        assert_eq!(field(letter, "consumer")?, "w1");
        assert_eq!(field(letter, "group")?, "switchboard");
        assert_eq!(field(letter, "delivery_count")?, "1");
        ensure!(!field(letter, "last_error")?.is_empty());
        ensure!(field(letter, "first_seen")?.ends_with('Z'));
        ensure!(field(letter, "last_seen")?.ends_with('Z'));
        assert_eq!(field(letter, "headers")?, "{}");
    }
    assert_eq!(
        worker.metric(r#"switchboard_messages_dead_lettered_total{adapter="test/poison",reason="invalid_json"}"#)?,
        1.0
    );
    Ok(())
}

#[tokio::test]
async fn entry_delivered_max_times_to_dead_consumers_is_dead_lettered_not_stored() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter(
        "md",
        "batchSize: 10, maxDeliveries: 3, claimIdleSeconds: 1",
        "",
    )?;
    let mut conn = fx.redis.connection()?;
    redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("md")
        .arg("switchboard")
        .arg("0")
        .arg("MKSTREAM")
        .query::<()>(&mut conn)?;
    let ids = fx.produce("md", bodies(0..1))?;
    // A consumer that reads the entry and dies, twice claimed again by others that die too.
    redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("switchboard")
        .arg("ghost-1")
        .arg("STREAMS")
        .arg("md")
        .arg(">")
        .query::<redis::Value>(&mut conn)?;
    for ghost in ["ghost-2", "ghost-3"] {
        redis::cmd("XCLAIM")
            .arg("md")
            .arg("switchboard")
            .arg(ghost)
            .arg(0)
            .arg(&ids[0])
            .query::<redis::Value>(&mut conn)?;
    }
    let _worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "the entry is dead-lettered", || async {
        Ok(fx.xlen("md.dlq")? == 1)
    })
    .await?;
    wait_for(LONG, "nothing pending", || async {
        Ok(fx.pending("md", "switchboard")? == 0)
    })
    .await?;
    let letters = fx.stream_entries("md.dlq")?;
    assert_eq!(field(&letters[0], "reason")?, "max_deliveries");
    assert_eq!(field(&letters[0], "delivery_count")?, "4");
    assert_eq!(field(&letters[0], "origin_id")?, ids[0]);
    assert_eq!(letters[0].get("body"), Some(&br#"{"order":0}"#.to_vec()));
    ensure!(
        fx.todo_count("md").await? == 0,
        "a dead-lettered entry is not stored"
    );
    Ok(())
}

#[tokio::test]
async fn entry_past_max_deliveries_that_was_stored_is_acknowledged_not_dead_lettered() -> Result<()>
{
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("lost", "batchSize: 10, maxDeliveries: 1", "")?;
    fx.produce("lost", bodies(0..5))?;
    // The first delivery is committed, its ack is lost: the worker dies in between.
    fx.crash_after_first_commit(&manifest, "w1").await?;
    ensure!(fx.todo_count("lost").await? == 5, "the batch was committed");
    ensure!(
        fx.pending("lost", "switchboard")? == 5,
        "and not acknowledged"
    );

    // Redelivered once more than maxDeliveries allows, but stored: acknowledged as duplicates.
    let worker = fx.worker(&manifest, "w1")?;
    wait_stored(&fx, "lost", "lost", "switchboard", 5)
        .await
        .with_context(|| worker.log_tail())?;
    fx.assert_exactly_once("lost", 5).await?;
    ensure!(
        fx.xlen("lost.dlq")? == 0,
        "a stored entry must not be dead-lettered"
    );
    ensure!(
        worker.metric(r#"switchboard_messages_duplicate_total{adapter="test/lost"}"#)? == 5.0,
        "counted as duplicates"
    );
    Ok(())
}

#[tokio::test]
async fn idle_consumer_without_pending_entries_is_removed() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("idle", "claimIdleSeconds: 1", "")?;
    let mut conn = fx.redis.connection()?;
    redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("idle")
        .arg("switchboard")
        .arg("0")
        .arg("MKSTREAM")
        .query::<()>(&mut conn)?;
    redis::cmd("XGROUP")
        .arg("CREATECONSUMER")
        .arg("idle")
        .arg("switchboard")
        .arg("gone")
        .query::<()>(&mut conn)?;
    let _worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "the idle consumer is removed", || async {
        let mut conn = fx.redis.connection()?;
        let consumers: Vec<redis::Value> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg("idle")
            .arg("switchboard")
            .query(&mut conn)?;
        let names = format!("{consumers:?}");
        Ok(!names.contains("gone") && names.contains("w1"))
    })
    .await
}

#[tokio::test]
async fn sigterm_during_steady_flow_exits_zero_and_acks_only_stored_entries() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("term", "batchSize: 100", "")?;
    let mut worker = fx.worker(&manifest, "w1")?;
    let mut produced = 0;
    // A steady flow: keep adding while the worker stores.
    while fx.todo_count("term").await? < 2_000 {
        fx.produce("term", bodies(produced..produced + 200))?;
        produced += 200;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fx.produce("term", bodies(produced..produced + 2_000))?;
    produced += 2_000;
    worker.signal(Signal::SIGTERM)?;
    let signalled = Instant::now();
    let status = worker.wait_exit(Duration::from_secs(10))?;
    ensure!(
        status.success(),
        "exit code must be 0, got {status:?}\n{}",
        worker.log_tail()
    );
    ensure!(
        signalled.elapsed() < Duration::from_secs(10),
        "must exit within the shutdown timeout"
    );

    let unstored = acked_without_a_todo(&fx, "term", "redis:test/term").await?;
    ensure!(
        unstored.is_empty(),
        "acknowledged without a todo: {unstored:?}"
    );

    let _restarted = fx.worker(&manifest, "w1")?;
    let total = i64::try_from(produced)?;
    wait_stored(&fx, "term", "term", "switchboard", total).await?;
    fx.assert_exactly_once("term", total).await?;
    Ok(())
}

#[tokio::test]
async fn changed_mounted_secret_stops_the_worker_cleanly_after_storing_and_acking_its_batch()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("rotate", "batchSize: 100", "")?;
    // As kubelet mounts them: `<secret>/<VARIABLE>`, beside its own `..data` entries.
    let secrets = fx.dir.path().join("secrets");
    let redis_url = fx.env.redis_url.clone();
    for (secret, variable, value) in [
        ("redis", "REDIS_URL", redis_url.as_str()),
        (
            "switchboard-db",
            "DATABASE_URL",
            fx.env.database_url.as_str(),
        ),
    ] {
        std::fs::create_dir_all(secrets.join(secret))?;
        std::fs::write(secrets.join(secret).join(variable), value)?;
    }
    std::fs::create_dir_all(secrets.join("..data"))?;
    let dir = secrets.display().to_string();
    let mut worker = fx.worker_with(&manifest, "w1", &[("SWITCHBOARD_SECRETS_DIR", &dir)])?;
    let mut produced = 0;
    while fx.todo_count("rotate").await? < 500 {
        fx.produce("rotate", bodies(produced..produced + 100))?;
        produced += 100;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(
        worker.metric(r#"switchboard_worker_secret_restarts_total{adapter="test/rotate"}"#)? == 0.0,
        "the restart counter is exported at zero"
    );
    // The Secret rotates (kubelet rewrites the file) while messages keep coming.
    let rotated = format!("{redis_url}?rotated=1");
    std::fs::write(secrets.join("redis").join("REDIS_URL"), &rotated)?;
    let changed = Instant::now();
    let status = loop {
        fx.produce("rotate", bodies(produced..produced + 50))?;
        produced += 50;
        if let Some(status) = worker.try_exit()? {
            break status;
        }
        ensure!(
            changed.elapsed() < Duration::from_secs(30),
            "the worker still runs 30 s after its Secret changed\n{}",
            worker.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(
        status.success(),
        "exit code must be 0, got {status:?}\n{}",
        worker.log_tail()
    );
    let log = worker.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("mounted Secret changed"))
        .collect();
    ensure!(
        lines.len() == 1 && lines[0].contains("secret=redis"),
        "one line naming the Secret that changed: {lines:?}"
    );
    ensure!(
        !log.contains("rotated=1") && !log.contains(&redis_url),
        "a Secret's value in the log"
    );
    let unstored = acked_without_a_todo(&fx, "rotate", "redis:test/rotate").await?;
    ensure!(
        unstored.is_empty(),
        "acknowledged without a todo: {unstored:?}"
    );

    // Restarted (as kubelet would), it stores the rest: every message exactly once.
    let _restarted = fx.worker(&manifest, "w1")?;
    let total = i64::try_from(produced)?;
    wait_stored(&fx, "rotate", "rotate", "switchboard", total).await?;
    fx.assert_exactly_once("rotate", total).await?;
    Ok(())
}

fn last_delivered_id(groups: &[redis::Value]) -> Option<String> {
    let redis::Value::Array(fields) = groups.first()? else {
        return None;
    };
    fields
        .chunks_exact(2)
        .find_map(|pair| match (&pair[0], &pair[1]) {
            (redis::Value::BulkString(name), redis::Value::BulkString(value))
                if name == b"last-delivered-id" =>
            {
                Some(String::from_utf8_lossy(value).into_owned())
            }
            _ => None,
        })
}

/// Entries of `stream` that the group delivered and no longer holds as pending — so they were
/// acknowledged — yet have no event in `source`. Store-then-ack means this is always empty.
async fn acked_without_a_todo(fx: &Fixture, stream: &str, source: &str) -> Result<Vec<String>> {
    let mut conn = fx.redis.connection()?;
    let groups: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(&mut conn)?;
    let delivered_up_to = last_delivered_id(&groups).with_context(|| format!("{groups:?}"))?;
    let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg("switchboard")
        .arg("-")
        .arg("+")
        .arg(1_000_000)
        .query(&mut conn)?;
    let pending: std::collections::HashSet<String> =
        pending.into_iter().map(|(id, ..)| id).collect();
    let stored: Vec<String> =
        sqlx::query_scalar("SELECT external_id FROM events WHERE source = $1")
            .bind(source)
            .fetch_all(fx.pool())
            .await?;
    let stored: std::collections::HashSet<String> = stored.into_iter().collect();
    let delivered: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg(&delivered_up_to)
        .query(&mut conn)?;
    Ok(delivered
        .ids
        .into_iter()
        .map(|entry| entry.id)
        .filter(|id| !pending.contains(id) && !stored.contains(id))
        .collect())
}

#[tokio::test]
async fn sigterm_while_blocked_on_an_empty_stream_exits_within_a_second() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("quiet", "", "")?;
    let mut worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "worker ready", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await?;
    worker.signal(Signal::SIGTERM)?;
    let signalled = Instant::now();
    let status = worker.wait_exit(Duration::from_secs(5))?;
    ensure!(status.success(), "{status:?}");
    let took = signalled.elapsed();
    ensure!(
        took < Duration::from_millis(1500),
        "blocking read delayed shutdown by {took:?}"
    );
    Ok(())
}

#[tokio::test]
async fn sigterm_with_a_hung_database_exits_zero_within_the_timeout_leaving_the_batch_unacked()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("hung", "", "")?;
    let received = r#"switchboard_messages_received_total{adapter="test/hung"}"#;
    let mut worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "worker ready", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await?;
    // A database that answers nothing: the batch cannot be committed.
    fx.postgres.set_running(false)?;
    fx.produce("hung", bodies(0..10))?;
    wait_for(LONG, "a batch is in hand", || async {
        Ok(worker.metric(received)? >= 1.0)
    })
    .await?;
    worker.signal(Signal::SIGTERM)?;
    let signalled = Instant::now();
    let status = worker.wait_exit(Duration::from_secs(20))?;
    let took = signalled.elapsed();
    ensure!(
        status.success(),
        "exit 0, got {status:?}\n{}",
        worker.log_tail()
    );
    ensure!(
        took < Duration::from_secs(12),
        "the 10 s shutdown timeout bounds the exit, took {took:?}"
    );

    fx.postgres.set_running(true)?;
    let unstored = acked_without_a_todo(&fx, "hung", "redis:test/hung").await?;
    ensure!(
        unstored.is_empty(),
        "acknowledged without a todo: {unstored:?}"
    );
    ensure!(
        fx.pending("hung", "switchboard")? >= 1,
        "the batch in hand stays pending"
    );
    let _restarted = fx.worker(&manifest, "w1")?;
    wait_stored(&fx, "hung", "hung", "switchboard", 10).await?;
    fx.assert_exactly_once("hung", 10).await
}

#[tokio::test]
async fn two_workers_share_one_group_without_duplicate_todos() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("pair", "batchSize: 50", "")?;
    let a = fx.worker(&manifest, "a")?;
    let b = fx.worker(&manifest, "b")?;
    // Both reading before anything is produced: under load one worker could start late enough
    // for the other to have taken everything.
    a.wait_ready(LONG).await?;
    b.wait_ready(LONG).await?;
    for chunk in 0..20 {
        fx.produce("pair", bodies(chunk * 500..(chunk + 1) * 500))?;
    }
    wait_stored(&fx, "pair", "pair", "switchboard", 10_000).await?;
    fx.assert_exactly_once("pair", 10_000).await?;
    let stored_a = a.metric(r#"switchboard_messages_stored_total{adapter="test/pair"}"#)?;
    let stored_b = b.metric(r#"switchboard_messages_stored_total{adapter="test/pair"}"#)?;
    ensure!(
        stored_a > 0.0 && stored_b > 0.0,
        "both consumers must take work: a={stored_a} b={stored_b}"
    );
    ensure!(
        (stored_a + stored_b - 10_000.0).abs() < f64::EPSILON,
        "a={stored_a} b={stored_b}"
    );
    Ok(())
}

#[tokio::test]
async fn other_fields_become_headers_and_an_entry_without_a_body_is_stored_whole() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("hdr", "", "")?;
    let mut conn = fx.redis.connection()?;
    let with_body: String = redis::cmd("XADD")
        .arg("hdr")
        .arg("*")
        .arg("body")
        .arg("plain text")
        .arg("kind")
        .arg("order")
        .query(&mut conn)?;
    let without_body: String = redis::cmd("XADD")
        .arg("hdr")
        .arg("*")
        .arg("sku")
        .arg("A-1")
        .arg("qty")
        .arg("2")
        .query(&mut conn)?;
    let _worker = fx.worker(&manifest, "w1")?;
    wait_stored(&fx, "hdr", "hdr", "switchboard", 2).await?;
    let fx = &fx;
    let row = |id: String| async move {
        sqlx::query_as::<_, (serde_json::Value, serde_json::Value)>(
            "SELECT payload, headers FROM events WHERE external_id = $1",
        )
        .bind(id)
        .fetch_one(fx.pool())
        .await
    };
    let (payload, headers) = row(with_body).await?;
    assert_eq!(
        payload,
        serde_json::json!("plain text"),
        "auto: text becomes a JSON string"
    );
    assert_eq!(headers, serde_json::json!({"kind": "order"}));
    let (payload, headers) = row(without_body).await?;
    assert_eq!(payload, serde_json::json!({"sku": "A-1", "qty": "2"}));
    assert_eq!(headers, serde_json::json!({}));
    Ok(())
}

#[tokio::test]
async fn redis_acl_user_in_the_url_is_used() -> Result<()> {
    let fx = Fixture::start().await?;
    let mut conn = fx.redis.connection()?;
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("ingest")
        .arg("on")
        .arg(">s3cret")
        .arg("~acl*")
        .arg("+@all")
        .query::<()>(&mut conn)?;
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("off")
        .query::<()>(&mut conn)?;
    let mut env = fx.env.clone();
    env.redis_url = fx
        .env
        .redis_url
        .replace("redis://", "redis://ingest:s3cret@");
    let manifest = fx.stream_adapter("acl", "", "")?;
    let worker = WorkerProcess::start(&env, &manifest, "w1", &[])?;
    let mut user = redis::Client::open(env.redis_url.as_str())?.get_connection()?;
    redis::cmd("XADD")
        .arg("acl")
        .arg("*")
        .arg("body")
        .arg("{}")
        .query::<String>(&mut user)?;
    wait_for(LONG, "the entry is stored through the ACL user", || async {
        Ok(fx.todo_count("acl").await? == 1)
    })
    .await?;
    ensure!(
        !worker.log().contains("s3cret"),
        "the password must never be logged"
    );
    Ok(())
}

#[tokio::test]
async fn dead_letter_key_of_the_wrong_type_keeps_the_letter_in_postgresql_naming_the_setting()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter(
        "wrongdlq",
        "batchSize: 10, claimIdleSeconds: 1",
        "format: json",
    )?;
    let mut conn = fx.redis.connection()?;
    // The dead-letter key holds the wrong type: XADD to it fails with WRONGTYPE, which no
    // retry can fix. The letter is kept in PostgreSQL instead, and the batch settles.
    redis::cmd("SET")
        .arg("wrongdlq.dlq")
        .arg("not a stream")
        .query::<()>(&mut conn)?;
    let mut all: Vec<Vec<u8>> = bodies(0..5).collect();
    all.push(b"{broken".to_vec());
    fx.produce("wrongdlq", all)?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "the batch settles with its letter kept", || async {
        Ok(fx.pending("wrongdlq", "switchboard")? == 0
            && !fx.database_dead_letters("wrongdlq").await?.is_empty())
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    ensure!(
        fx.database_dead_letters("wrongdlq").await?
            == vec![(b"{broken".to_vec(), "invalid_json".to_owned())],
        "the letter is kept byte-identical"
    );
    let log = worker.log();
    ensure!(
        log.contains("spec.delivery.deadLetter.stream"),
        "the log names the setting to fix:\n{log}"
    );
    fx.assert_exactly_once("wrongdlq", 5).await
}

/// Issue 32: an idle worker holds one PostgreSQL connection. A burst stores batches on
/// connections of their own beside the probes' one; once the stream is drained they close
/// after `BATCH_CONNECTION_IDLE` (the probes and reports keep to their own connection, so no
/// batch connection is kept alive by them), and the next batch opens one again.
#[tokio::test]
async fn idle_worker_holds_one_database_connection_after_a_burst() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("idle", "batchSize: 100", "")?;
    fx.produce("idle", bodies(0..2_000))?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_stored(&fx, "idle", "idle", "switchboard", 2_000).await?;
    let busy = fx.connections_of("w1").await?;
    ensure!(
        busy >= 2,
        "batches are stored on connections besides the probes' one: {busy}"
    );
    let closed = switchboard_store::BATCH_CONNECTION_IDLE * 3;
    wait_for(
        closed,
        "the idle worker's batch connections close",
        || async { Ok(fx.connections_of("w1").await? == 1) },
    )
    .await
    .with_context(|| worker.log_tail())?;
    fx.produce("idle", bodies(2_000..2_100))?;
    wait_stored(&fx, "idle", "idle", "switchboard", 2_100).await?;
    fx.assert_exactly_once("idle", 2_100).await?;
    Ok(())
}

/// Issue 32: an idle worker's heap is not inflated by transparent huge pages (a touched 2 MiB
/// range backed by a whole huge page tripled an idle worker's heap). The worker turns them off
/// for itself (`prctl(PR_SET_THP_DISABLE)`), which the kernel reports as `THP_enabled: 0`.
#[tokio::test]
async fn worker_runs_without_transparent_huge_pages() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("nothp", "batchSize: 100", "")?;
    let worker = fx.worker(&manifest, "w1")?;
    worker.wait_ready(LONG).await?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", worker.pid()))?;
    let thp = status
        .lines()
        .find_map(|line| line.strip_prefix("THP_enabled:"))
        .context("this kernel reports THP_enabled in /proc/PID/status (Linux 5.0 or later)")?;
    ensure!(
        thp.trim() == "0",
        "transparent huge pages are off for the worker: THP_enabled {}",
        thp.trim()
    );
    Ok(())
}
