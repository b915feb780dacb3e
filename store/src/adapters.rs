//! The `adapters` registry row mirrored from a QueueAdapter: upserted on every reconcile, deleted
//! when the resource goes away. Rows never hold secrets.

use crate::{Store, StoreError};

/// One queue adapter as the registry knows it (`family = 'queue'`, `trust_mode = 'connection'`).
#[derive(Debug, Clone, PartialEq)]
pub struct QueueAdapterRow<'a> {
    /// `namespace/name`.
    pub name: &'a str,
    pub enabled: bool,
    /// The adapter's settings as JSON, without secrets.
    pub config: &'a serde_json::Value,
    /// The resource's `metadata.generation`.
    pub generation: i64,
    /// The resource's `metadata.uid`: a re-created adapter of the same name has another.
    pub uid: &'a str,
}

/// What an upsert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mirrored {
    /// The row was inserted or changed.
    Written,
    /// The row already said exactly the same.
    Unchanged,
}

const UPSERT_SQL: &str = r#"
INSERT INTO adapters (name, family, trust_mode, enabled, config, generation, uid)
VALUES ($1, 'queue', 'connection', $2, $3, $4, $5)
ON CONFLICT (name) DO UPDATE
    SET family = EXCLUDED.family, trust_mode = EXCLUDED.trust_mode, enabled = EXCLUDED.enabled,
        config = EXCLUDED.config, generation = EXCLUDED.generation, uid = EXCLUDED.uid,
        updated_at = now()
    WHERE (adapters.family, adapters.trust_mode, adapters.enabled, adapters.config,
           adapters.generation, adapters.uid)
          IS DISTINCT FROM
          (EXCLUDED.family, EXCLUDED.trust_mode, EXCLUDED.enabled, EXCLUDED.config,
           EXCLUDED.generation, EXCLUDED.uid)
"#;

impl Store {
    /// Makes the row named `row.name` say exactly `row` (the QueueAdapter is the source of
    /// truth: a row of a deleted adapter of the same name, or one edited by hand, is
    /// overwritten). Writes nothing when the row already matches.
    pub async fn upsert_queue_adapter(
        &self,
        row: &QueueAdapterRow<'_>,
    ) -> Result<Mirrored, StoreError> {
        let result = sqlx::query(UPSERT_SQL)
            .bind(row.name)
            .bind(row.enabled)
            .bind(row.config)
            .bind(row.generation)
            .bind(row.uid)
            .execute(&self.pool)
            .await
            .map_err(StoreError::classify)?;
        Ok(if result.rows_affected() > 0 {
            Mirrored::Written
        } else {
            Mirrored::Unchanged
        })
    }

    /// Deletes the row named `name`. Succeeds when there is none; returns whether one was deleted.
    pub async fn delete_adapter(&self, name: &str) -> Result<bool, StoreError> {
        let result = sqlx::query("DELETE FROM adapters WHERE name = $1")
            .bind(name)
            .execute(&self.pool)
            .await
            .map_err(StoreError::classify)?;
        Ok(result.rows_affected() > 0)
    }

    /// The queue adapters' rows: `(name, uid)`.
    pub async fn queue_adapter_uids(&self) -> Result<Vec<(String, Option<String>)>, StoreError> {
        sqlx::query_as("SELECT name, uid FROM adapters WHERE family = 'queue'")
            .fetch_all(&self.pool)
            .await
            .map_err(StoreError::classify)
    }

    /// Deletes the row named `name` if it still belongs to the object `uid` (`None`: a row
    /// written before uids were stored). Returns whether it deleted one.
    pub async fn delete_adapter_of(
        &self,
        name: &str,
        uid: Option<&str>,
    ) -> Result<bool, StoreError> {
        let result =
            sqlx::query("DELETE FROM adapters WHERE name = $1 AND uid IS NOT DISTINCT FROM $2")
                .bind(name)
                .bind(uid)
                .execute(&self.pool)
                .await
                .map_err(StoreError::classify)?;
        Ok(result.rows_affected() > 0)
    }

    /// The longest `delivery.dedupWindowDays` any queue adapter's row asks for, if any does.
    pub async fn longest_dedup_window_days(&self) -> Result<Option<u32>, StoreError> {
        let days: Option<i64> = sqlx::query_scalar(
            "SELECT max((config #>> '{delivery,dedupWindowDays}')::bigint) FROM adapters \
             WHERE family = 'queue'",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(StoreError::classify)?;
        Ok(days.and_then(|d| u32::try_from(d).ok()))
    }
}
