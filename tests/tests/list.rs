//! Redis reliable-list mode, end to end against real redis-server and PostgreSQL.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use nix::sys::signal::Signal;
use switchboard_tests::Fixture;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{WorkerProcess, killed_by};

const LONG: Duration = Duration::from_secs(120);

fn bodies(range: std::ops::Range<usize>) -> impl Iterator<Item = Vec<u8>> {
    range.map(|i| format!(r#"{{"job":{i}}}"#).into_bytes())
}

/// Waits until `expected` todos exist and the list and every processing list are empty.
async fn wait_drained(fx: &Fixture, list: &str, expected: i64) -> Result<()> {
    wait_for(
        LONG,
        &format!("{expected} todos and {list} drained"),
        || async {
            Ok(fx.todo_count(list).await? >= expected && fx.unacknowledged_items(list)? == 0)
        },
    )
    .await
}

#[tokio::test]
async fn list_chaos_sigkill_under_new_consumer_names_stores_every_body_exactly_once() -> Result<()>
{
    const TOTAL: i64 = 20_000;
    let fx = Fixture::start().await?;
    let manifest = fx.list_adapter(
        "jobs",
        "batchSize: 200, maxDeliveries: 10, claimIdleSeconds: 1",
        "",
    )?;
    fx.push("jobs", bodies(0..20_000))?;
    let mut rng = fastrand::Rng::new();
    for generation in 0..6 {
        let worker = fx.worker(&manifest, &format!("jobs-{generation}"))?;
        let target = (fx.todo_count("jobs").await? + rng.i64(200..2_500)).min(TOTAL - 1);
        wait_for(LONG, "progress before the kill", || async {
            Ok(fx.todo_count("jobs").await? >= target)
        })
        .await?;
        worker.kill()?;
    }
    let _last = fx.worker(&manifest, "jobs-final")?;
    wait_drained(&fx, "jobs", TOTAL).await?;
    fx.assert_exactly_once("jobs", TOTAL).await?;
    ensure!(fx.llen("jobs.dlq")? == 0, "nothing may be dead-lettered");
    Ok(())
}

#[tokio::test]
async fn consumer_killed_holding_a_batch_is_reaped_by_another_within_two_heartbeat_ttls()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.list_adapter("reap", "batchSize: 100, claimIdleSeconds: 2", "")?;
    fx.push("reap", bodies(0..100))?;
    // The first consumer takes the whole list as one batch, commits, and dies before LREM.
    let mut holder = WorkerProcess::start(
        &fx.env,
        &manifest,
        "holder",
        &[(switchboard_worker::ABORT_AFTER_COMMITS_ENV, "1")],
    )?;
    let status = holder.wait_exit(LONG)?;
    let died = Instant::now();
    ensure!(killed_by(status, Signal::SIGABRT), "{status:?}");
    ensure!(
        fx.llen("reap:processing:holder")? == 100,
        "the dead consumer holds its batch"
    );

    let _reaper = fx.worker(&manifest, "reaper")?;
    wait_for(
        LONG,
        "the dead consumer's items are returned and stored",
        || async { Ok(fx.llen("reap:processing:holder")? == 0) },
    )
    .await?;
    let took = died.elapsed();
    ensure!(
        took <= Duration::from_secs(4),
        "reaped after {took:?}, more than 2 × the 2 s heartbeat TTL"
    );
    wait_drained(&fx, "reap", 100).await?;
    fx.assert_exactly_once("reap", 100).await
}

#[tokio::test]
async fn identical_bodies_collapse_while_the_todo_is_live_and_make_a_new_todo_after_done()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.list_adapter("same", "", "")?;
    let _worker = fx.worker(&manifest, "w1")?;
    let body = br#"{"same":true}"#.to_vec();
    fx.push("same", [body.clone(), body.clone()])?;
    wait_for(LONG, "both copies handled", || async {
        Ok(fx.todo_count("same").await? >= 1 && fx.unacknowledged_items("same")? == 0)
    })
    .await?;
    ensure!(
        fx.todo_count("same").await? == 1,
        "identical bodies collapse while the todo is pending"
    );

    sqlx::query("UPDATE todos SET status = 'done' WHERE queue = 'same'")
        .execute(fx.pool())
        .await?;
    fx.push("same", [body])?;
    wait_for(LONG, "a new todo after done", || async {
        Ok(fx.todo_count("same").await? == 2)
    })
    .await?;
    let statuses: Vec<String> =
        sqlx::query_scalar("SELECT status FROM todos WHERE queue = 'same' ORDER BY id")
            .fetch_all(fx.pool())
            .await?;
    assert_eq!(statuses, ["done", "pending"]);
    let keys: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT idempotency_key) FROM todos WHERE queue = 'same'",
    )
    .fetch_one(fx.pool())
    .await?;
    ensure!(keys == 1, "both todos share the body-hash key");
    Ok(())
}

#[tokio::test]
async fn list_poison_and_items_moved_too_often_are_dead_lettered_with_context() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.list_adapter(
        "bad",
        "batchSize: 20, maxDeliveries: 3, claimIdleSeconds: 1",
        "format: json",
    )?;
    let invalid = b"{not json".to_vec();
    let mut all: Vec<Vec<u8>> = bodies(0..30).collect();
    all.insert(7, invalid.clone());
    fx.push("bad", all)?;
    // An item that consumers which died have already moved 3 times.
    let tired = br#"{"tired":true}"#.to_vec();
    let mut conn = fx.redis.connection()?;
    let hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&tired));
    redis::pipe()
        .cmd("LPUSH")
        .arg("bad:processing:ghost")
        .arg(&tired)
        .ignore()
        .cmd("SADD")
        .arg("bad:consumers")
        .arg("ghost")
        .ignore()
        .cmd("HSET")
        .arg("bad:deliveries")
        .arg(&hash)
        .arg(3)
        .ignore()
        .query::<()>(&mut conn)?;

    let _worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "two dead letters and the rest stored", || async {
        Ok(fx.llen("bad.dlq")? == 2
            && fx.todo_count("bad").await? == 30
            && fx.unacknowledged_items("bad")? == 0)
    })
    .await?;
    fx.assert_exactly_once("bad", 30).await?;
    let records: Vec<String> = redis::cmd("LRANGE")
        .arg("bad.dlq")
        .arg(0)
        .arg(-1)
        .query(&mut conn)?;
    let records: Vec<serde_json::Value> = records
        .iter()
        .map(|r| serde_json::from_str(r))
        .collect::<Result<_, _>>()?;
    let invalid_record = records
        .iter()
        .find(|r| r["reason"] == "invalid_json")
        .context("invalid JSON dead letter")?;
    assert_eq!(invalid_record["body"], "{not json");
    assert_eq!(invalid_record["origin_list"], "bad");
    assert_eq!(invalid_record["adapter"], "test/bad");
    assert_eq!(invalid_record["consumer"], "w1");
    ensure!(
        invalid_record["last_error"]
            .as_str()
            .is_some_and(|e| !e.is_empty())
    );
    ensure!(
        invalid_record["first_seen"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );
    let tired_record = records
        .iter()
        .find(|r| r["reason"] == "max_deliveries")
        .context("max deliveries dead letter")?;
    assert_eq!(tired_record["body"], r#"{"tired":true}"#);
    assert_eq!(tired_record["delivery_count"], 4);
    Ok(())
}

#[tokio::test]
async fn list_sigterm_exits_zero_and_strands_nothing_in_the_processing_list() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.list_adapter("stop", "batchSize: 100", "")?;
    let mut worker = fx.worker(&manifest, "w1")?;
    let mut pushed = 0;
    while fx.todo_count("stop").await? < 1_000 {
        fx.push("stop", bodies(pushed..pushed + 200))?;
        pushed += 200;
    }
    fx.push("stop", bodies(pushed..pushed + 3_000))?;
    pushed += 3_000;
    worker.signal(Signal::SIGTERM)?;
    let status = worker.wait_exit(Duration::from_secs(10))?;
    ensure!(status.success(), "{status:?}\n{}", worker.log_tail());
    ensure!(
        fx.llen("stop:processing:w1")? == 0,
        "nothing stranded in the processing list"
    );

    let _next = fx.worker(&manifest, "w2")?;
    let total = i64::try_from(pushed)?;
    wait_drained(&fx, "stop", total).await?;
    fx.assert_exactly_once("stop", total).await
}

/// A Redis restart drops the worker's blocking read: it reads again on a new connection,
/// counted as a broker reconnection (the first connection is not), and stores what is pushed
/// after the restart.
#[tokio::test]
async fn redis_restart_is_a_counted_reconnection_and_the_list_is_read_again() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let manifest = fx.list_adapter("rl", "batchSize: 50", "")?;
    fx.push("rl", bodies(0..100))?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_drained(&fx, "rl", 100).await?;
    let reconnects = || worker.metric(r#"switchboard_broker_reconnects_total{adapter="test/rl"}"#);
    ensure!(
        reconnects()? == 0.0,
        "the first connection is no reconnection"
    );

    fx.redis.restart_empty()?;
    fx.push("rl", bodies(100..200))?;
    wait_drained(&fx, "rl", 200).await?;
    fx.assert_exactly_once("rl", 200).await?;
    ensure!(
        reconnects()? >= 1.0,
        "the reconnection is counted\n{}",
        worker.log_tail()
    );
    Ok(())
}
