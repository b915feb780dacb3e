//! What a hostile first hour with the worker found (issue 10), pinned against the real worker
//! binary, PostgreSQL and redis-server: undecodable stream entries, gauges during a database
//! outage, permanent misconfiguration, and the dead-letter and waiting gauges.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use switchboard_tests::servers::{Postgres, Redis};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{WorkerEnv, WorkerProcess, migrate};
use switchboard_tests::{Fixture, field};

const LONG: Duration = Duration::from_secs(120);
const GROUP: &str = "switchboard";

fn bodies(range: std::ops::Range<usize>) -> impl Iterator<Item = Vec<u8>> {
    range.map(|i| format!(r#"{{"order":{i}}}"#).into_bytes())
}

/// XADDs an entry whose second field name is not UTF-8 (`body '{"bad":n}' \xff\xfe v`).
fn produce_undecodable(fx: &Fixture, stream: &str, n: usize) -> Result<String> {
    let mut conn = fx.redis.connection()?;
    Ok(redis::cmd("XADD")
        .arg(stream)
        .arg("*")
        .arg("body")
        .arg(format!(r#"{{"bad":{n}}}"#))
        .arg(&[0xff_u8, 0xfe][..])
        .arg("v")
        .query(&mut conn)?)
}

/// Waits until `queue` holds `todos` todos, `dlq` holds `letters` entries and nothing of the
/// group is pending.
async fn wait_settled(fx: &Fixture, name: &str, todos: i64, letters: u64) -> Result<()> {
    let dlq = format!("{name}.dlq");
    wait_for(
        LONG,
        &format!("{todos} todos, {letters} dead letters, nothing pending"),
        || async {
            Ok(fx.todo_count(name).await? == todos
                && fx.xlen(&dlq)? == letters
                && fx.pending(name, GROUP)? == 0)
        },
    )
    .await
}

#[tokio::test]
async fn undecodable_stream_entry_is_dead_lettered_while_its_batch_is_stored_also_after_a_restart()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("raw", "batchSize: 20", "")?;
    fx.produce("raw", bodies(0..3))?;
    let bad = produce_undecodable(&fx, "raw", 1)?;
    fx.produce("raw", bodies(3..6))?;

    // The first worker commits the batch and dies before settling it: the undecodable entry is
    // left in its own pending entries, which a restart under the same name replays.
    fx.crash_after_first_commit(&manifest, "w1").await?;
    ensure!(
        fx.pending("raw", GROUP)? == 7,
        "the whole batch stays pending"
    );
    let worker = fx.worker(&manifest, "w1")?;
    wait_settled(&fx, "raw", 6, 1).await?;

    let letters = fx.stream_entries("raw.dlq")?;
    let letter = &letters[0];
    assert_eq!(field(letter, "origin_id")?, bad);
    assert_eq!(field(letter, "reason")?, "undecodable");
    ensure!(field(letter, "last_error")?.contains("not valid UTF-8"));
    let body: serde_json::Value = serde_json::from_slice(&letter["body"])?;
    assert_eq!(
        body,
        serde_json::json!({"fields": [["body", r#"{"bad":1}"#], [{"base64": "//4="}, "v"]]}),
        "the dead letter shows the entry's raw fields"
    );

    // New entries, good and undecodable, keep flowing; the broker is never taken for down.
    fx.produce("raw", bodies(6..9))?;
    produce_undecodable(&fx, "raw", 2)?;
    fx.produce("raw", bodies(9..12))?;
    wait_settled(&fx, "raw", 12, 2).await?;
    fx.assert_exactly_once("raw", 12).await?;
    assert_eq!(worker.http_get("/readyz")?.0, 200, "{}", worker.log_tail());
    assert_eq!(
        worker.metric(r#"switchboard_dependency_up{adapter="test/raw",dependency="broker"}"#)?,
        1.0
    );
    assert_eq!(
        worker.metric(
            r#"switchboard_dependency_errors_total{adapter="test/raw",dependency="broker"}"#
        )?,
        0.0,
        "a decode problem is not a broker failure"
    );
    assert_eq!(
        worker.metric(
            r#"switchboard_messages_dead_lettered_total{adapter="test/raw",reason="undecodable"}"#
        )?,
        2.0
    );
    Ok(())
}

#[tokio::test]
async fn backlog_gauge_follows_the_real_lag_during_a_database_outage() -> Result<()> {
    // claimIdleSeconds 2: the queue is probed every second.
    const INTERVAL: Duration = Duration::from_secs(1);
    let mut fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("lag", "batchSize: 100, claimIdleSeconds: 2", "")?;
    let worker = fx.worker(&manifest, "w1")?;
    fx.produce("lag", bodies(0..300))?;
    wait_for(LONG, "300 todos", || async {
        Ok(fx.todo_count("lag").await? == 300 && fx.pending("lag", GROUP)? == 0)
    })
    .await?;

    fx.postgres.stop();
    let backlog = r#"switchboard_backlog_messages{adapter="test/lag"}"#;
    let outage = Instant::now();
    let mut next = 300;
    let mut checks = 0;
    while outage.elapsed() < Duration::from_secs(10) {
        fx.produce("lag", bodies(next..next + 500))?;
        next += 500;
        // The worker holds a few batches in hand; everything else is lag, growing.
        let lag = fx.group_lag("lag")?;
        ensure!(lag > 0, "the lag grows while the database is down: {lag}");
        let produced_at = Instant::now();
        wait_for(
            INTERVAL * 2 + Duration::from_millis(500),
            &format!("the backlog gauge shows the real lag (about {lag})"),
            || async { Ok(worker.metric(backlog)? == fx.group_lag("lag")? as f64) },
        )
        .await
        .with_context(|| worker.log_tail())?;
        ensure!(produced_at.elapsed() <= INTERVAL * 2 + Duration::from_millis(500));
        checks += 1;
    }
    ensure!(checks >= 3, "only {checks} checks during the outage");
    // The first entry not delivered has waited since early in the outage.
    let waited =
        worker.metric(r#"switchboard_redis_oldest_waiting_age_seconds{adapter="test/lag"}"#)?;
    ensure!(
        waited >= 5.0,
        "the oldest waiting entry is as old as the outage, gauge says {waited}"
    );
    ensure!(
        worker.http_get("/readyz")?.0 == 503,
        "unready during the outage"
    );
    fx.postgres.restart()?;
    let total = i64::try_from(next)?;
    wait_for(LONG, "everything stored after the outage", || async {
        Ok(fx.todo_count("lag").await? == total && fx.pending("lag", GROUP)? == 0)
    })
    .await?;
    fx.assert_exactly_once("lag", total).await?;
    wait_for(
        LONG,
        "the backlog and waiting gauges return to 0",
        || async {
            Ok(worker.metric(backlog)? == 0.0
                && worker.metric(
                    r#"switchboard_redis_oldest_waiting_age_seconds{adapter="test/lag"}"#,
                )? == 0.0)
        },
    )
    .await
}

/// An `hba_file` letting `postgres` in without a password and everyone else only with theirs.
fn password_hba() -> Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new()
        .prefix("switchboard-hba-")
        .tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let file = dir.path().join("pg_hba.conf");
    std::fs::write(
        &file,
        "local all all trust\n\
         host all postgres 127.0.0.1/32 trust\n\
         host all all 127.0.0.1/32 scram-sha-256\n",
    )?;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
    Ok(dir)
}

/// Runs a worker that must exit non-zero within 30 s with a line naming `setting`, without
/// printing `secret`.
fn exits_naming(
    env: &WorkerEnv,
    manifest: &std::path::Path,
    case: &str,
    setting: &str,
    secret: &str,
) -> Result<()> {
    let mut worker = WorkerProcess::start(env, manifest, "w1", &[])?;
    let started = Instant::now();
    let status = worker
        .wait_exit(Duration::from_secs(30))
        .with_context(|| format!("{case}: must exit"))?;
    let log = worker.log();
    ensure!(!status.success(), "{case}: must exit non-zero\n{log}");
    ensure!(started.elapsed() <= Duration::from_secs(30));
    let line = log
        .lines()
        .find(|line| line.starts_with("error: "))
        .with_context(|| format!("{case}: no error line\n{log}"))?;
    eprintln!("{case}: {line}");
    ensure!(
        line.contains(setting),
        "{case}: the error line must name {setting}: {line}"
    );
    ensure!(
        !log.contains(secret) && !log.contains("right-password"),
        "{case}: a password must never be printed\n{log}"
    );
    Ok(())
}

#[tokio::test]
async fn permanent_misconfiguration_exits_non_zero_within_30s_naming_the_setting() -> Result<()> {
    const SECRET: &str = "hunter2-secret";
    let hba = password_hba()?;
    let hba_file = hba.path().join("pg_hba.conf");
    let postgres = Postgres::start_with(&[
        ("fsync", "off"),
        ("hba_file", hba_file.to_str().context("utf-8 path")?),
    ])?;
    let fx = Fixture::start_with(postgres).await?;
    sqlx::query("CREATE ROLE ingest LOGIN PASSWORD 'right-password'")
        .execute(fx.pool())
        .await?;
    let mut conn = fx.redis.connection()?;
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("ingest")
        .arg("on")
        .arg(">right-password")
        .arg("~*")
        .arg("+@all")
        .query::<()>(&mut conn)?;
    redis::cmd("SET")
        .arg("typed")
        .arg("a string, not a stream")
        .query::<()>(&mut conn)?;
    let manifest = fx.stream_adapter("orders", "", "")?;
    let port = fx.postgres.port();
    let redis_port = fx
        .env
        .redis_url
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .context("redis port")?
        .to_owned();

    let database = |url: String| WorkerEnv {
        database_url: url,
        ..fx.env.clone()
    };
    let redis = |url: String| WorkerEnv {
        redis_url: url,
        ..fx.env.clone()
    };
    let cases = [
        (
            "wrong database password (28P01)",
            database(format!(
                "postgres://ingest:{SECRET}@127.0.0.1:{port}/postgres"
            )),
            "DATABASE_URL",
        ),
        (
            "a database that does not exist (3D000)",
            database(format!(
                "postgres://postgres:{SECRET}@127.0.0.1:{port}/nope"
            )),
            "DATABASE_URL",
        ),
        (
            "DATABASE_URL with another scheme",
            database(format!("mysql://root:{SECRET}@127.0.0.1:3306/orders")),
            "DATABASE_URL",
        ),
        (
            "wrong Redis password (WRONGPASS)",
            redis(format!("redis://ingest:{SECRET}@127.0.0.1:{redis_port}/0")),
            "REDIS_URL",
        ),
        (
            "Redis database index out of range",
            redis(format!(
                "redis://ingest:right-password@127.0.0.1:{redis_port}/99"
            )),
            "REDIS_URL",
        ),
        (
            "a Redis URL with a bad port",
            redis(format!("redis://:{SECRET}@127.0.0.1:63a79/0")),
            "REDIS_URL: the Redis URL is invalid: the port `63a79`",
        ),
    ];
    for (case, env, setting) in &cases {
        exits_naming(env, &manifest, case, setting, SECRET)?;
    }
    let wrong_type = fx.stream_adapter("typed", "", "")?;
    exits_naming(
        &fx.env,
        &wrong_type,
        "a source stream key of the wrong type (WRONGTYPE)",
        "spec.source.redis.stream: Redis key `typed`",
        SECRET,
    )?;

    // A Redis that requires a password the URL lacks (NOAUTH).
    let locked = Redis::start()?;
    let mut locked_conn = locked.connection()?;
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg(SECRET)
        .query::<()>(&mut locked_conn)?;
    exits_naming(
        &redis(locked.url()),
        &manifest,
        "Redis requires a password (NOAUTH)",
        "REDIS_URL",
        SECRET,
    )?;

    // A database nobody listens on is retried (it may be starting), and the log says so.
    let closed = switchboard_tests::servers::free_port()?;
    let refused = WorkerProcess::start(
        &database(format!("postgres://postgres@127.0.0.1:{closed}/postgres")),
        &manifest,
        "w2",
        &[],
    )?;
    wait_for(LONG, "the refused database is named in the log", || async {
        Ok(refused
            .log()
            .contains(&format!("database at 127.0.0.1:{closed} is unreachable")))
    })
    .await
    .with_context(|| refused.log_tail())?;
    ensure!(
        !refused.log().contains("pool timed out"),
        "{}",
        refused.log_tail()
    );
    ensure!(refused.http_get("/healthz")?.0 == 200, "still retrying");
    Ok(())
}

#[test]
fn migrate_against_an_unreachable_database_names_database_url_and_its_host_and_port_never_the_password()
-> Result<()> {
    const SECRET: &str = "hunter2-secret";
    // A reserved loopback port nobody listens on: every connection attempt is refused.
    let closed = switchboard_tests::servers::free_port()?;
    let logs = tempfile::tempdir()?;
    let env = WorkerEnv {
        database_url: format!("postgres://postgres:{SECRET}@127.0.0.1:{closed}/postgres"),
        redis_url: String::new(),
        log_dir: logs.path().to_owned(),
    };
    let output = migrate(&env)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(!output.status.success(), "migrate succeeded: {stderr}");
    for expected in ["DATABASE_URL", &format!("127.0.0.1:{closed}")] {
        ensure!(
            stderr.contains(expected),
            "stderr lacks {expected}: {stderr}"
        );
    }
    ensure!(!stderr.contains("pool timed out"), "{stderr}");
    ensure!(
        !stderr.contains(SECRET) && !String::from_utf8_lossy(&output.stdout).contains(SECRET),
        "the password leaked: {stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn dead_letter_gauge_shows_the_dlq_length_after_a_restart() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("dl", "batchSize: 10, claimIdleSeconds: 2", "format: json")?;
    let mut all: Vec<Vec<u8>> = bodies(0..5).collect();
    all.push(b"{not json".to_vec());
    all.push(b"[also not".to_vec());
    fx.produce("dl", all)?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_settled(&fx, "dl", 5, 2).await?;
    let gauge = r#"switchboard_dead_letter_messages{adapter="test/dl"}"#;
    wait_for(LONG, "the gauge shows 2 dead letters", || async {
        Ok(worker.metric(gauge)? == 2.0)
    })
    .await?;
    worker.kill()?;

    // The next process has dead-lettered nothing itself, and still shows the two of before.
    let restarted = fx.worker(&manifest, "w1")?;
    wait_for(
        LONG,
        "the restarted worker shows 2 dead letters",
        || async { Ok(restarted.metric(gauge)? == 2.0) },
    )
    .await
    .with_context(|| restarted.log_tail())?;
    assert_eq!(
        restarted.metric(
            r#"switchboard_messages_dead_lettered_total{adapter="test/dl",reason="invalid_json"}"#
        )?,
        0.0
    );
    assert_eq!(
        restarted.metric(r#"switchboard_redis_oldest_waiting_age_seconds{adapter="test/dl"}"#)?,
        0.0,
        "nothing waits"
    );
    Ok(())
}
