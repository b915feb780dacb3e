//! Runtime truth in `kubectl get qa`: the workers report their queue every few seconds, the
//! operator turns the fresh reports into `status.observed` (the BACKLOG and OLDEST columns) and
//! the `BrokerConnected`, `DatabaseReachable`, `Backlogged` and `DeadLettering` conditions; a
//! killed worker's report ages out. Real kube-apiserver, PostgreSQL, Redis and worker binary.

use anyhow::{Context, Result, ensure};
use sqlx::Connection;
use switchboard_api::QueueAdapter;
use switchboard_tests::Fixture;
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, adapter_manifest, condition,
};
use switchboard_tests::wait::wait_for;
use switchboard_worker::pipeline::REPORT_INTERVAL;

const NAME: &str = "orders";

fn condition_is(adapter: &QueueAdapter, type_: &str, status: &str) -> bool {
    condition(adapter, type_).is_some_and(|c| c.status == status)
}

fn observed(adapter: &QueueAdapter) -> Option<&switchboard_api::ObservedQueue> {
    adapter.status.as_ref()?.observed.as_ref()
}

/// How far `status.observed.oldestSince` may lie after the time the broker's oldest pending
/// entry was added: the reported reading is up to one probe old (the worker probes at least
/// every [`REPORT_INTERVAL`]), plus a second for the status's whole-second timestamps.
const OLDEST_TOLERANCE_MS: i64 = REPORT_INTERVAL.as_millis() as i64 + 1_000;

/// Whether `adapter`'s status shows what Redis says now: the group's lag as BACKLOG, its
/// pending count, and OLDEST within [`OLDEST_TOLERANCE_MS`] after (or a second before) the
/// time in the ID of the oldest entry the group holds unacknowledged.
fn matches_the_broker(fixture: &Fixture, adapter: &QueueAdapter) -> Result<bool> {
    let Some(observed) = observed(adapter) else {
        return Ok(false);
    };
    let lag = u64::try_from(fixture.group_lag(NAME)?)?;
    let pending = fixture.pending(NAME, "switchboard")?;
    let (Some(oldest_ms), Some(since)) = (
        fixture.oldest_pending_ms(NAME, "switchboard")?,
        observed.oldest_since.as_ref(),
    ) else {
        return Ok(false);
    };
    let late_ms = since.0.as_millisecond() - oldest_ms;
    Ok(observed.backlog == Some(lag)
        && observed.pending == Some(pending)
        && (-1_000..=OLDEST_TOLERANCE_MS).contains(&late_ms))
}

#[tokio::test]
async fn status_shows_the_queue_as_the_workers_see_it_and_ages_out_a_killed_worker() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let _operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&adapter_manifest(
        NAME,
        "  delivery: {batchSize: 50, alertOldestSeconds: 3}\n",
    ))
    .await?;
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;
    let mut pod = LocalPod::start(
        &env.admin,
        &deployment,
        "orders-worker-5d8c7-aaaaa",
        env.fixture.dir.path(),
    )
    .await?;

    // Drained: nothing waits, nothing is pending, the dead-letter stream is empty.
    env.fixture.produce(
        NAME,
        (0..200).map(|i| format!(r#"{{"order":{i}}}"#).into_bytes()),
    )?;
    wait_for(OPERATOR_TIMEOUT, "every message is a todo", || async {
        Ok(env.fixture.todo_count(NAME).await? == 200)
    })
    .await
    .with_context(|| pod.log_tail())?;
    let drained = env
        .wait_adapter(NAME, "the status reports a drained queue", |adapter| {
            observed(adapter)
                .is_some_and(|o| o.workers == 1 && o.backlog == Some(0) && o.pending == Some(0))
                && condition_is(adapter, "BrokerConnected", "True")
                && condition_is(adapter, "DatabaseReachable", "True")
                && condition_is(adapter, "Backlogged", "False")
                && condition_is(adapter, "DeadLettering", "False")
        })
        .await
        .with_context(|| pod.log_tail())?;
    ensure!(
        observed(&drained).is_some_and(|o| o.oldest_since.is_none() && o.dead_letters == Some(0)),
        "{:?}",
        drained.status
    );
    let table = env.plane.kubectl_ok(&["get", "qa", NAME, "-n", "shop"])?;
    let header = table.lines().next().unwrap_or_default();
    ensure!(
        header.contains("BACKLOG") && header.contains("OLDEST"),
        "kubectl get qa has no BACKLOG/OLDEST columns:\n{table}"
    );

    // PostgreSQL holds the todos locked: what the worker received stays pending, and ages.
    let mut locker = sqlx::PgConnection::connect(&env.fixture.postgres.url()).await?;
    sqlx::query("BEGIN").execute(&mut locker).await?;
    sqlx::query("LOCK TABLE todos IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await?;
    // More than the worker takes into hand (batches of 50): some stay undelivered.
    env.fixture.produce(
        NAME,
        (200..1_200).map(|i| format!(r#"{{"order":{i}}}"#).into_bytes()),
    )?;
    let backlogged = env
        .wait_adapter(
            NAME,
            "Backlogged turns True while the todos are locked",
            |adapter| condition_is(adapter, "Backlogged", "True"),
        )
        .await
        .with_context(|| pod.log_tail())?;
    ensure!(
        observed(&backlogged).is_some_and(|o| o.oldest_since.is_some()),
        "{:?}",
        backlogged.status
    );
    // Nothing moves while the lock is held: the status comes to match the broker's own
    // figures, read afresh on each look: its lag, its pending count, and the ID (the time it
    // was added) of the oldest entry it holds unacknowledged.
    let matched = env
        .wait_adapter(
            NAME,
            "BACKLOG, pending and OLDEST match the broker",
            |adapter| matches_the_broker(&env.fixture, adapter).unwrap_or(false),
        )
        .await
        .with_context(|| pod.log_tail())?;
    let backlog = observed(&matched).and_then(|o| o.backlog).unwrap_or(0);
    ensure!(
        backlog > 0 && observed(&matched).and_then(|o| o.pending) > Some(0),
        "the worker holds part of the queue, the rest waits: {:?}",
        matched.status
    );
    let table = env.plane.kubectl_ok(&["get", "qa", NAME, "-n", "shop"])?;
    ensure!(
        table
            .lines()
            .nth(1)
            .is_some_and(|row| row.contains(&format!(" {backlog} "))),
        "BACKLOG {backlog} not shown:\n{table}"
    );
    sqlx::query("ROLLBACK").execute(&mut locker).await?;
    wait_for(OPERATOR_TIMEOUT, "the held messages are stored", || async {
        Ok(env.fixture.todo_count(NAME).await? == 1_200)
    })
    .await
    .with_context(|| pod.log_tail())?;
    env.wait_adapter(NAME, "Backlogged turns False after the lock", |adapter| {
        condition_is(adapter, "Backlogged", "False")
            && observed(adapter).is_some_and(|o| o.pending == Some(0))
    })
    .await
    .with_context(|| pod.log_tail())?;

    // A killed worker stops reporting: its report ages out.
    pod.kill();
    let gone = env
        .wait_adapter(NAME, "the killed worker's report ages out", |adapter| {
            observed(adapter).is_some_and(|o| o.workers == 0)
        })
        .await?;
    for type_ in ["BrokerConnected", "DatabaseReachable", "Backlogged"] {
        let c = condition(&gone, type_).context("condition")?;
        ensure!(
            c.status == "Unknown" && c.reason == "NoReports",
            "{type_}: {c:?}"
        );
    }
    Ok(())
}
