//! Runtime truth in `kubectl get qa`: the workers report their queue every few seconds, the
//! operator turns the fresh reports into `status.observed` (the BACKLOG and OLDEST columns) and
//! the `BrokerConnected`, `DatabaseReachable`, `Backlogged` and `DeadLettering` conditions; a
//! killed worker's report ages out. Real kube-apiserver, PostgreSQL, Redis and worker binary.

use anyhow::{Context, Result, ensure};
use sqlx::Connection;
use switchboard_api::QueueAdapter;
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, adapter_manifest, condition,
};
use switchboard_tests::wait::wait_for;

const NAME: &str = "orders";

fn condition_is(adapter: &QueueAdapter, type_: &str, status: &str) -> bool {
    condition(adapter, type_).is_some_and(|c| c.status == status)
}

fn observed(adapter: &QueueAdapter) -> Option<&switchboard_api::ObservedQueue> {
    adapter.status.as_ref()?.observed.as_ref()
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
    env.fixture.produce(
        NAME,
        (200..300).map(|i| format!(r#"{{"order":{i}}}"#).into_bytes()),
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
    // Nothing moves while the lock is held: the status matches the broker within one report.
    let pending = env.fixture.pending(NAME, "switchboard")?;
    ensure!(
        pending > 0,
        "the worker received nothing while the lock was held"
    );
    env.wait_adapter(NAME, "BACKLOG and pending match the broker", |adapter| {
        observed(adapter).is_some_and(|o| o.pending == Some(pending) && o.backlog == Some(0))
    })
    .await?;
    let table = env.plane.kubectl_ok(&["get", "qa", NAME, "-n", "shop"])?;
    ensure!(
        table.lines().nth(1).is_some_and(|row| row.contains(" 0 ")),
        "BACKLOG 0 not shown:\n{table}"
    );
    sqlx::query("ROLLBACK").execute(&mut locker).await?;
    wait_for(OPERATOR_TIMEOUT, "the held messages are stored", || async {
        Ok(env.fixture.todo_count(NAME).await? == 300)
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
