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
    /// The resource's `metadata.generation`: a row of a newer generation is never overwritten.
    pub generation: i64,
}

/// What an upsert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mirrored {
    /// The row was inserted or changed.
    Written,
    /// The row already said the same, or belongs to a newer generation.
    Unchanged,
}

const UPSERT_SQL: &str = r#"
INSERT INTO adapters (name, family, trust_mode, enabled, config, generation)
VALUES ($1, 'queue', 'connection', $2, $3, $4)
ON CONFLICT (name) DO UPDATE
    SET family = EXCLUDED.family, trust_mode = EXCLUDED.trust_mode, enabled = EXCLUDED.enabled,
        config = EXCLUDED.config, generation = EXCLUDED.generation, updated_at = now()
    WHERE adapters.generation < EXCLUDED.generation
       OR (adapters.generation = EXCLUDED.generation
           AND (adapters.family, adapters.trust_mode, adapters.enabled, adapters.config)
               IS DISTINCT FROM
               (EXCLUDED.family, EXCLUDED.trust_mode, EXCLUDED.enabled, EXCLUDED.config))
"#;

impl Store {
    /// Inserts or updates the row named `row.name` unless the stored row has a newer generation.
    /// Writes nothing when the row already matches.
    pub async fn upsert_queue_adapter(
        &self,
        row: &QueueAdapterRow<'_>,
    ) -> Result<Mirrored, StoreError> {
        let result = sqlx::query(UPSERT_SQL)
            .bind(row.name)
            .bind(row.enabled)
            .bind(row.config)
            .bind(row.generation)
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
}
