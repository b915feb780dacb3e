//! The worker's own delivery counts, for brokers that do not count deliveries (Kafka): a poison
//! message that crashes every worker it reaches must still reach `maxDeliveries`.
//!
//! Counting every delivery would cost a write per message. Instead each partition of a source has
//! a *mark*: the position up to which messages have been handed to a pipeline, raised (one
//! statement per batch) before the batch is handed on. A message at or above the mark was never
//! handed to anyone, so it is a first delivery and writes nothing; only a message below it (its
//! worker died before its offset was committed, or its partition moved) is counted, by key.
//!
//! The same rows keep the **attempt history** of every broker's redelivered messages: each
//! delivery after the first the worker saw of a message is recorded (when, which consumer),
//! so a message that finally dead-letters carries its attempts even across worker crashes.
//! The store keeps the attempts as opaque JSON objects, the most recent [`MAX_ATTEMPTS`]; rows
//! are forgotten once their message is settled and pruned after the dead-letter retention.

use sqlx::Row;

use crate::{Store, StoreError};

// The raise commits without waiting for its WAL flush (`synchronous_commit` off for this
// transaction alone): it is on the receive path of every batch, and the batch's own commit,
// which waits, flushes the WAL past it. Only a PostgreSQL crash within a fraction of a second of
// the raise can lose it, and then a delivery goes uncounted (never a message).
const RAISE_MARKS_SQL: &str = r#"
WITH no_flush_wait AS (
    SELECT set_config('synchronous_commit', 'off', true)
), given AS (
    SELECT * FROM unnest($2::text[], $3::bigint[]) WITH ORDINALITY AS t(partition, mark, ord)
), input AS (
    -- A partition given twice is raised once, to its highest mark (one statement cannot
    -- update a row twice: SQLSTATE 21000).
    SELECT partition, max(mark) AS mark FROM given GROUP BY partition
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
SELECT previous.mark FROM given LEFT JOIN previous USING (partition) CROSS JOIN no_flush_wait
ORDER BY given.ord
"#;

const COUNT_SQL: &str = r#"
INSERT INTO deliveries AS d (source, key, count)
SELECT $1, key, 2 FROM (SELECT DISTINCT key FROM unnest($2::text[]) AS t(key)) AS k
ON CONFLICT (source, key) DO UPDATE SET count = d.count + 1, updated_at = now()
RETURNING key, count
"#;

/// How many attempts a row keeps: the most recent ones.
pub const MAX_ATTEMPTS: i64 = 20;

const RECORD_ATTEMPTS_SQL: &str = r#"
INSERT INTO deliveries AS d (source, key, count, attempts)
SELECT $1, t.key, t.count, jsonb_build_array(t.attempt::jsonb)
FROM unnest($2::text[], $3::bigint[], $4::text[]) AS t(key, count, attempt)
ON CONFLICT (source, key) DO UPDATE SET
    count = GREATEST(d.count, EXCLUDED.count),
    attempts = (
        SELECT coalesce(jsonb_agg(x.e ORDER BY x.o), '[]'::jsonb)
        FROM jsonb_array_elements(d.attempts || EXCLUDED.attempts) WITH ORDINALITY AS x(e, o)
        WHERE x.o > jsonb_array_length(d.attempts || EXCLUDED.attempts) - $5
    ),
    updated_at = now()
"#;

/// One delivery to record: the message's key within its source, its delivery count (this
/// delivery included) and the attempt as a JSON object's text.
#[derive(Debug, Clone, Copy)]
pub struct AttemptRecord<'a> {
    pub key: &'a str,
    pub count: u64,
    pub attempt: &'a str,
}

impl Store {
    /// Records one attempt per message (a key given twice keeps its first), keeping each
    /// message's most recent [`MAX_ATTEMPTS`].
    pub async fn record_attempts(
        &self,
        source: &str,
        records: &[AttemptRecord<'_>],
    ) -> Result<(), StoreError> {
        let mut seen = std::collections::HashSet::new();
        let records: Vec<&AttemptRecord<'_>> =
            records.iter().filter(|r| seen.insert(r.key)).collect();
        let keys: Vec<&str> = records.iter().map(|r| r.key).collect();
        let counts: Vec<i64> = records
            .iter()
            .map(|r| i64::try_from(r.count).unwrap_or(i64::MAX))
            .collect();
        let attempts: Vec<&str> = records.iter().map(|r| r.attempt).collect();
        self.bounded(async |conn| {
            sqlx::query(RECORD_ATTEMPTS_SQL)
                .bind(source)
                .bind(&keys)
                .bind(&counts)
                .bind(&attempts)
                .bind(MAX_ATTEMPTS)
                .execute(conn)
                .await
                .map(drop)
        })
        .await
    }

    /// The recorded attempts of each of `keys` that has any, as a JSON array's text, by key.
    pub async fn attempts(
        &self,
        source: &str,
        keys: &[&str],
    ) -> Result<std::collections::HashMap<String, String>, StoreError> {
        let rows = self
            .bounded(async |conn| {
                sqlx::query(
                    "SELECT key, attempts::text AS attempts FROM deliveries \
                     WHERE source = $1 AND key = ANY($2::text[])",
                )
                .bind(source)
                .bind(keys)
                .fetch_all(conn)
                .await
            })
            .await?;
        rows.iter()
            .map(|row| {
                let key: String = row.try_get("key").map_err(StoreError::classify)?;
                let attempts: String = row.try_get("attempts").map_err(StoreError::classify)?;
                Ok((key, attempts))
            })
            .collect()
    }

    /// Forgets the delivery counts and attempts of settled messages.
    pub async fn forget_deliveries(&self, source: &str, keys: &[&str]) -> Result<(), StoreError> {
        self.in_background(async |conn| {
            sqlx::query("DELETE FROM deliveries WHERE source = $1 AND key = ANY($2::text[])")
                .bind(source)
                .bind(keys)
                .execute(conn)
                .await
                .map(drop)
        })
        .await
    }

    /// Deletes the delivery counts and attempts of `source` untouched for longer than `age`
    /// (messages that left the broker some other way). Returns how many.
    pub async fn prune_deliveries(
        &self,
        source: &str,
        age: std::time::Duration,
    ) -> Result<u64, StoreError> {
        let seconds = age.as_secs_f64();
        self.in_background(async |conn| {
            sqlx::query(
                "DELETE FROM deliveries WHERE source = $1 \
                 AND updated_at < now() - make_interval(secs => $2)",
            )
            .bind(source)
            .bind(seconds)
            .execute(conn)
            .await
            .map(|done| done.rows_affected())
        })
        .await
    }

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
            .in_background(async |conn| {
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
    /// first time has been delivered twice: its first delivery, above the mark, wrote nothing. A
    /// key given twice (a fetch restarted while its records were buffered) is counted once.
    pub async fn count_redeliveries(
        &self,
        source: &str,
        keys: &[&str],
    ) -> Result<Vec<u64>, StoreError> {
        let rows = self
            .in_background(async |conn| {
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
