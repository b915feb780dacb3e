//! `make demo`: the whole pipeline on this machine. Ephemeral PostgreSQL + Redis, migrate, run
//! the worker on examples/orders-stream.yaml, produce 20,000 messages, kill -9 the worker
//! mid-way, restart it, and show that every message became exactly one todo.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use switchboard_tests::servers::{Postgres, Redis, workspace_path};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{WorkerEnv, WorkerProcess, migrate};

const TOTAL: usize = 20_000;
const QUEUE: &str = "orders";
const STREAM: &str = "orders";

async fn todo_count(pool: &sqlx::PgPool) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM todos WHERE queue = $1")
            .bind(QUEUE)
            .fetch_one(pool)
            .await?,
    )
}

fn pending(conn: &mut redis::Connection) -> Result<i64> {
    let summary: Vec<redis::Value> = redis::cmd("XPENDING")
        .arg(STREAM)
        .arg("switchboard")
        .query(conn)?;
    Ok(match summary.first() {
        Some(redis::Value::Int(n)) => *n,
        _ => 0,
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    println!("== Switchboard demo: Redis stream → PostgreSQL todos, store-then-ack ==");
    let postgres = Postgres::start()?;
    let redis = Redis::start()?;
    println!("PostgreSQL on {}  Redis on {}", postgres.url(), redis.url());
    let dir = tempfile::tempdir()?;
    let env = WorkerEnv {
        database_url: postgres.url(),
        redis_url: redis.url(),
        log_dir: dir.path().to_path_buf(),
    };
    let migrated = migrate(&env)?;
    ensure!(migrated.status.success(), "migrate failed: {migrated:?}");
    println!("migrated the database (switchboard-worker migrate)");

    let manifest = workspace_path("examples/orders-stream.yaml");
    let pool = sqlx::PgPool::connect(&postgres.url()).await?;
    let mut conn = redis.connection()?;
    let worker = WorkerProcess::start(&env, &manifest, "demo-1", &[])?;
    println!("worker started on {} (consumer demo-1)", manifest.display());

    let started = Instant::now();
    for chunk in 0..TOTAL / 1000 {
        let mut pipe = redis::pipe();
        for i in chunk * 1000..(chunk + 1) * 1000 {
            pipe.cmd("XADD")
                .arg(STREAM)
                .arg("*")
                .arg("body")
                .arg(format!(r#"{{"order":{i},"total":{}}}"#, i * 3 % 1000))
                .ignore();
        }
        pipe.query::<()>(&mut conn)?;
    }
    println!("produced {TOTAL} messages with XADD");

    let halfway = i64::try_from(TOTAL / 2)?;
    wait_for(
        Duration::from_secs(120),
        "half of the messages are stored",
        || async {
            // Poll tightly so the kill lands while batches are in flight.
            let stored = todo_count(&pool).await?;
            if stored > 0 {
                println!("  stored {stored:>6} / {TOTAL}");
            }
            Ok(stored >= halfway)
        },
    )
    .await?;
    let pid = worker.pid();
    worker.kill()?;
    println!("kill -9 {pid}: the worker died mid-way, with its batch in hand un-acknowledged");
    println!("  pending (delivered, not acked): {}", pending(&mut conn)?);

    let restarted = WorkerProcess::start(&env, &manifest, "demo-1", &[])?;
    println!("worker restarted (consumer demo-1 replays its own pending entries first)");
    let total = i64::try_from(TOTAL)?;
    wait_for(
        Duration::from_secs(120),
        "every message is stored and acknowledged",
        || async {
            let stored = todo_count(&pool).await?;
            let pending = pending(&mut redis.connection()?)?;
            println!("  stored {stored:>6} / {TOTAL}   pending {pending}");
            tokio::time::sleep(Duration::from_millis(150)).await;
            Ok(stored >= total && pending == 0)
        },
    )
    .await?;

    let (todos, distinct): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT idempotency_key) FROM todos WHERE queue = $1",
    )
    .bind(QUEUE)
    .fetch_one(&pool)
    .await?;
    let dead_letters: i64 = redis::cmd("XLEN").arg("orders.dlq").query(&mut conn)?;
    let duplicates = restarted
        .metric(r#"switchboard_messages_duplicate_total{adapter="default/orders"}"#)
        .context("reading the worker's metrics")?;
    println!();
    println!(
        "todos count = {todos}   distinct keys = {distinct}   pending = {}   dead letters = {dead_letters}",
        pending(&mut conn)?
    );
    println!("redelivered after the crash and deduplicated: {duplicates}");
    println!("took {:.1?}", started.elapsed());
    ensure!(
        todos == total && distinct == total,
        "expected exactly {TOTAL} todos"
    );
    ensure!(dead_letters == 0, "nothing should be dead-lettered");
    println!("OK: {TOTAL} messages → {TOTAL} todos, exactly once, through a kill -9.");
    Ok(())
}
