//! The `adapters` row mirror against a real PostgreSQL (and the real kube-apiserver): a row
//! says exactly what its QueueAdapter says (a re-created adapter's, a hand-edited row is
//! restored), upserts write only when something differs, rows of deleted adapters are swept and
//! deletes are idempotent.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kube::api::{DeleteParams, Patch, PatchParams};
use switchboard_store::{Mirrored, QueueAdapterRow};
use switchboard_tests::Fixture;
use switchboard_tests::control_plane::{OPERATOR_TIMEOUT, OperatorEnv, adapter_manifest};
use switchboard_tests::wait::wait_for;

async fn row(fx: &Fixture) -> Result<Option<(bool, serde_json::Value, i64)>> {
    Ok(sqlx::query_as(
        "SELECT enabled, config, generation FROM adapters WHERE name = 'shop/orders'",
    )
    .fetch_optional(fx.pool())
    .await?)
}

#[tokio::test]
async fn the_row_follows_the_object_uid_and_generation_and_unchanged_rows_are_not_rewritten()
-> Result<()> {
    let fx = Fixture::start().await?;
    let v2 = serde_json::json!({"target": {"queue": "orders"}, "delivery": {"batchSize": 2}});
    let v3 = serde_json::json!({"target": {"queue": "orders"}, "delivery": {"batchSize": 3}});
    let upsert = async |generation, enabled, config, uid| {
        let row = QueueAdapterRow {
            name: "shop/orders",
            enabled,
            config,
            generation,
            uid,
        };
        fx.store.upsert_queue_adapter(&row).await
    };
    assert_eq!(upsert(2, true, &v2, "uid-1").await?, Mirrored::Written);
    let (family, trust_mode): (String, String) =
        sqlx::query_as("SELECT family, trust_mode FROM adapters WHERE name = 'shop/orders'")
            .fetch_one(fx.pool())
            .await?;
    assert_eq!(
        (family.as_str(), trust_mode.as_str()),
        ("queue", "connection")
    );
    assert_eq!(upsert(2, true, &v2, "uid-1").await?, Mirrored::Unchanged);
    assert_eq!(upsert(3, false, &v3, "uid-1").await?, Mirrored::Written);
    // Deleted and re-created under the same name: generation 1 of another object wins.
    assert_eq!(upsert(1, true, &v2, "uid-2").await?, Mirrored::Written);
    assert_eq!(row(&fx).await?, Some((true, v2.clone(), 1)));
    // A row edited by hand (a higher generation, other content) is put back.
    sqlx::query("UPDATE adapters SET generation = 99, config = '{}' WHERE name = 'shop/orders'")
        .execute(fx.pool())
        .await?;
    assert_eq!(upsert(1, true, &v2, "uid-2").await?, Mirrored::Written);
    assert_eq!(row(&fx).await?, Some((true, v2.clone(), 1)));
    Ok(())
}

#[tokio::test]
async fn deleting_a_row_is_idempotent() -> Result<()> {
    let fx = Fixture::start().await?;
    assert!(
        !fx.store.delete_adapter("shop/orders").await?,
        "nothing to delete yet"
    );
    let config = serde_json::json!({});
    fx.store
        .upsert_queue_adapter(&QueueAdapterRow {
            name: "shop/orders",
            enabled: true,
            config: &config,
            generation: 1,
            uid: "uid-1",
        })
        .await?;
    assert!(fx.store.delete_adapter("shop/orders").await?);
    assert!(!fx.store.delete_adapter("shop/orders").await?);
    assert_eq!(row(&fx).await?, None);
    Ok(())
}

/// The row of `shop/name`: generation, `delivery.batchSize` and uid.
async fn mirrored(env: &OperatorEnv, name: &str) -> Result<Option<(i64, i64, Option<String>)>> {
    let row: Option<(i64, serde_json::Value, Option<String>)> =
        sqlx::query_as("SELECT generation, config, uid FROM adapters WHERE name = $1")
            .bind(format!("{}/{name}", env.namespace))
            .fetch_optional(env.fixture.pool())
            .await?;
    Ok(row.map(|(generation, config, uid)| {
        let batch = config["delivery"]["batchSize"].as_i64().unwrap_or(-1);
        (generation, batch, uid)
    }))
}

fn with_batch_size(name: &str, batch_size: u32) -> String {
    adapter_manifest(name, &format!("  delivery: {{batchSize: {batch_size}}}\n"))
}

async fn wait_mirrored(
    env: &OperatorEnv,
    name: &str,
    what: &str,
    expected: Option<(i64, i64, Option<String>)>,
) -> Result<()> {
    wait_for(OPERATOR_TIMEOUT, what, || async {
        Ok(mirrored(env, name).await? == expected)
    })
    .await
}

#[tokio::test]
async fn a_re_created_adapter_gets_its_own_row_orphans_are_swept_and_hand_edits_restored()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    let mut operator = env.start_operator("operator-a", &[])?;
    for batch_size in [11, 12, 13] {
        env.apply_adapter(&with_batch_size("a", batch_size)).await?;
    }
    let old = env.adapters().get("a").await?;
    let old_uid = old.metadata.uid.clone();
    ensure!(old.metadata.generation == Some(3));
    wait_mirrored(
        &env,
        "a",
        "generation 3 is mirrored",
        Some((3, 13, old_uid)),
    )
    .await
    .with_context(|| operator.log_tail())?;

    // Deleted while the operator is down, its finalizer removed by hand.
    operator.terminate(Duration::from_secs(30))?;
    env.adapters().delete("a", &DeleteParams::default()).await?;
    env.adapters()
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await?;
    wait_for(OPERATOR_TIMEOUT, "the QueueAdapter is gone", || async {
        Ok(env.adapters().get_opt("a").await?.is_none())
    })
    .await?;
    // The orphan row goes when the operator starts, not a resync later.
    let operator = env.start_operator("operator-a", &["--resync-interval", "1h"])?;
    wait_mirrored(&env, "a", "the orphan row is removed at start", None)
        .await
        .with_context(|| operator.log_tail())?;
    let created = env.apply_adapter(&with_batch_size("a", 50)).await?;
    ensure!(created.metadata.generation == Some(1));
    wait_mirrored(
        &env,
        "a",
        "the re-created adapter's row",
        Some((1, 50, created.metadata.uid.clone())),
    )
    .await
    .with_context(|| operator.log_tail())?;
    drop(operator);

    // Within one resync: a hand-edited row is restored, a row with no QueueAdapter removed.
    let operator = env.start_operator("operator-a", &["--resync-interval", "2s"])?;
    sqlx::query("UPDATE adapters SET generation = 99, config = '{}' WHERE name = 'shop/a'")
        .execute(env.fixture.pool())
        .await?;
    sqlx::query(
        "INSERT INTO adapters (name, family, trust_mode, config, generation) \
         VALUES ('shop/ghost', 'queue', 'connection', '{}', 1)",
    )
    .execute(env.fixture.pool())
    .await?;
    let restored = Some((1, 50, created.metadata.uid.clone()));
    wait_mirrored(
        &env,
        "a",
        "the hand-edited row is restored",
        restored.clone(),
    )
    .await
    .with_context(|| operator.log_tail())?;
    wait_mirrored(
        &env,
        "ghost",
        "the row with no QueueAdapter is removed",
        None,
    )
    .await?;
    sqlx::query("DELETE FROM adapters WHERE name = 'shop/a'")
        .execute(env.fixture.pool())
        .await?;
    wait_mirrored(&env, "a", "the row deleted by hand is back", restored).await?;
    Ok(())
}

/// The leader maintains the events partitions: the next days' exist, a partition whose events
/// are all older than the longest dedup window (here an adapter's 36 days, above the operator's
/// default 30) is dropped, one inside it is kept; the metrics say when and how many.
#[tokio::test]
async fn the_leader_keeps_event_partitions_for_the_longest_dedup_window() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let pool = env.fixture.pool().clone();
    let operator =
        env.start_operator("operator-a", &["--storage-maintenance-interval", "300ms"])?;
    env.apply_adapter(&adapter_manifest(
        "orders",
        "  delivery: {dedupWindowDays: 36}\n",
    ))
    .await?;
    wait_for(OPERATOR_TIMEOUT, "the adapter's row", || async {
        Ok(row(&env.fixture).await?.is_some())
    })
    .await?;
    // Partitions of events that arrived 40 and 35 days ago (an installation running for weeks).
    for days in [40, 35] {
        sqlx::query("SELECT switchboard_add_event_partition(now() - make_interval(days => $1))")
            .bind(days)
            .execute(&pool)
            .await?;
    }
    let exists = async |days: i32| -> Result<bool> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM event_partitions \
             WHERE lower <= now() - make_interval(days => $1) \
               AND now() - make_interval(days => $1) < upper)",
        )
        .bind(days)
        .fetch_one(&pool)
        .await?)
    };
    wait_for(
        OPERATOR_TIMEOUT,
        "the 40-day-old partition is dropped",
        || async { Ok(!exists(40).await?) },
    )
    .await
    .with_context(|| operator.log_tail())?;
    let maintained = operator
        .metric_sum("switchboard_operator_events_maintained_timestamp_seconds")
        .await?;
    wait_for(OPERATOR_TIMEOUT, "two more maintenance runs", || async {
        Ok(operator
            .metric_sum("switchboard_operator_events_maintained_timestamp_seconds")
            .await?
            >= maintained + 1.0)
    })
    .await?;
    ensure!(
        exists(35).await?,
        "inside the adapter's 36-day window: kept"
    );
    for days in 0..=3 {
        ensure!(
            exists(-days).await?,
            "the partition {days} days ahead exists"
        );
    }
    let partitions: i64 = sqlx::query_scalar("SELECT count(*) FROM event_partitions")
        .fetch_one(&pool)
        .await?;
    ensure!(
        operator
            .metric_sum("switchboard_operator_event_partitions")
            .await?
            == partitions as f64
    );
    ensure!(
        operator
            .metric_sum("switchboard_operator_events_maintenance_failures_total")
            .await?
            == 0.0
    );
    Ok(())
}
