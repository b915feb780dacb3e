//! The worker's own delivery counts, for brokers that do not count deliveries (Kafka): a poison
//! message that crashes every worker it reaches must still reach `maxDeliveries`.
//!
//! Counting every delivery would cost a write per message. Instead each partition of a source has
//! a *mark*: the position up to which messages have been handed to a pipeline, raised (one
//! statement per batch) before the batch is handed on. A message at or above the mark was never
//! handed to anyone, so it is a first delivery and writes nothing; only a message below it (its
//! worker died before its offset was committed, or its partition moved) is counted, by key.

use sqlx::Row;

use crate::{Store, StoreError};

const RAISE_MARKS_SQL: &str = r#"
WITH input AS (
    SELECT * FROM unnest($2::text[], $3::bigint[]) WITH ORDINALITY AS t(partition, mark, ord)
), previous AS (
    SELECT d.partition, d.mark FROM delivery_marks d JOIN input USING (partition)
    WHERE d.source = $1
), raised AS (
    INSERT INTO delivery_marks (source, partition, mark)
    SELECT $1, partition, mark FROM input
    ON CONFLICT (source, partition) DO UPDATE
        SET mark = EXCLUDED.mark, updated_at = now()
        WHERE delivery_marks.mark < EXCLUDED.mark
)
SELECT previous.mark FROM input LEFT JOIN previous USING (partition) ORDER BY input.ord
"#;

const COUNT_SQL: &str = r#"
INSERT INTO deliveries AS d (source, key, count)
SELECT $1, key, 2 FROM unnest($2::text[]) AS t(key)
ON CONFLICT (source, key) DO UPDATE SET count = d.count + 1, updated_at = now()
RETURNING key, count
"#;

impl Store {
    /// Raises the mark of each `(partition, mark)` of `source` to at least `mark` and returns each
    /// one's previous mark (`None`: nothing was handed out from it before), in input order.
    pub async fn raise_delivery_marks(
        &self,
        source: &str,
        marks: &[(&str, i64)],
    ) -> Result<Vec<Option<i64>>, StoreError> {
        let partitions: Vec<&str> = marks.iter().map(|(partition, _)| *partition).collect();
        let values: Vec<i64> = marks.iter().map(|(_, mark)| *mark).collect();
        let rows = self
            .bounded(async |conn| {
                sqlx::query(RAISE_MARKS_SQL)
                    .bind(source)
                    .bind(&partitions)
                    .bind(&values)
                    .fetch_all(conn)
                    .await
            })
            .await?;
        rows.iter()
            .map(|row| row.try_get("mark").map_err(StoreError::classify))
            .collect()
    }

    /// Counts one more delivery of each of `keys` (messages below their partition's mark) and
    /// returns each one's count, this delivery included, in input order. A key counted for the
    /// first time has been delivered twice: its first delivery, above the mark, wrote nothing.
    pub async fn count_redeliveries(
        &self,
        source: &str,
        keys: &[&str],
    ) -> Result<Vec<u64>, StoreError> {
        let rows = self
            .bounded(async |conn| {
                sqlx::query(COUNT_SQL)
                    .bind(source)
                    .bind(keys)
                    .fetch_all(conn)
                    .await
            })
            .await?;
        let mut counts = std::collections::HashMap::with_capacity(rows.len());
        for row in &rows {
            let key: String = row.try_get("key").map_err(StoreError::classify)?;
            let count: i64 = row.try_get("count").map_err(StoreError::classify)?;
            counts.insert(key, u64::try_from(count).unwrap_or(0));
        }
        Ok(keys
            .iter()
            .map(|key| counts.get(*key).copied().unwrap_or(2))
            .collect())
    }
}
