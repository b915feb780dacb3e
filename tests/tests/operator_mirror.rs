//! The `adapters` row mirror against a real PostgreSQL: upserts write only when something
//! changed, an older generation never overwrites a newer one, and deletes are idempotent.

use anyhow::Result;
use switchboard_store::{Mirrored, QueueAdapterRow};
use switchboard_tests::Fixture;

async fn row(fx: &Fixture) -> Result<Option<(bool, serde_json::Value, i64)>> {
    Ok(sqlx::query_as(
        "SELECT enabled, config, generation FROM adapters WHERE name = 'shop/orders'",
    )
    .fetch_optional(fx.pool())
    .await?)
}

#[tokio::test]
async fn newer_generations_win_and_unchanged_rows_are_not_rewritten() -> Result<()> {
    let fx = Fixture::start().await?;
    let v2 = serde_json::json!({"target": {"queue": "orders"}, "delivery": {"batchSize": 2}});
    let v3 = serde_json::json!({"target": {"queue": "orders"}, "delivery": {"batchSize": 3}});
    let at = |generation, enabled, config| QueueAdapterRow {
        name: "shop/orders",
        enabled,
        config,
        generation,
    };
    assert_eq!(
        fx.store.upsert_queue_adapter(&at(2, true, &v2)).await?,
        Mirrored::Written
    );
    let (family, trust_mode): (String, String) =
        sqlx::query_as("SELECT family, trust_mode FROM adapters WHERE name = 'shop/orders'")
            .fetch_one(fx.pool())
            .await?;
    assert_eq!(
        (family.as_str(), trust_mode.as_str()),
        ("queue", "connection")
    );
    assert_eq!(
        fx.store.upsert_queue_adapter(&at(2, true, &v2)).await?,
        Mirrored::Unchanged
    );
    assert_eq!(
        fx.store.upsert_queue_adapter(&at(3, false, &v3)).await?,
        Mirrored::Written
    );
    // A late reconcile of generation 2 (an old replica, a stale cache) must not win.
    assert_eq!(
        fx.store.upsert_queue_adapter(&at(2, true, &v2)).await?,
        Mirrored::Unchanged
    );
    assert_eq!(row(&fx).await?, Some((false, v3.clone(), 3)));
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
        })
        .await?;
    assert!(fx.store.delete_adapter("shop/orders").await?);
    assert!(!fx.store.delete_adapter("shop/orders").await?);
    assert_eq!(row(&fx).await?, None);
    Ok(())
}
