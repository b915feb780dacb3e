//! PostgreSQL's dead-letter table: dead letters the broker's dead-letter destination refused for
//! good (too large for it, a publish it rejects however often it is retried). Kept here, the
//! original can still be acknowledged: nothing is lost and nothing blocks. One row per message
//! (`UNIQUE (source, idempotency_key)`): a redelivery of a message whose letter is kept already
//! adds nothing.

use sqlx::Row;

use crate::{Store, StoreError};

/// A dead letter to keep.
#[derive(Debug, Clone, Copy)]
pub struct KeptLetter<'a> {
    /// The original's idempotency key: one row per message.
    pub idempotency_key: &'a str,
    pub external_id: &'a str,
    /// The original body, byte-for-byte.
    pub body: &'a [u8],
    /// The original headers as a JSON object's text (as `events.headers`).
    pub headers: &'a str,
    pub reason: &'a str,
    pub error: &'a str,
    pub delivery_count: u64,
    /// The attempts as a JSON object's text.
    pub attempts: &'a str,
    /// What the broker answered when it refused the letter.
    pub refused_because: &'a str,
}

/// A dead letter kept in the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptLetterRow {
    pub id: i64,
    pub idempotency_key: String,
    pub external_id: String,
    pub body: Vec<u8>,
    /// A JSON object's text.
    pub headers: String,
    pub reason: String,
    pub error: String,
    pub delivery_count: u64,
    /// A JSON object's text.
    pub attempts: String,
    pub refused_because: String,
    /// When it was kept (Unix ms).
    pub dead_lettered_at_ms: u64,
}

const KEEP_SQL: &str = r#"
INSERT INTO dead_letters (source, idempotency_key, external_id, body, headers, reason, error,
                          delivery_count, attempts, refused_because)
SELECT $1, t.key, t.external_id, t.body, t.headers::jsonb, t.reason, t.error, t.delivery_count,
       t.attempts::jsonb, t.refused_because
FROM unnest($2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[], $7::text[],
            $8::bigint[], $9::text[], $10::text[])
     WITH ORDINALITY AS t(key, external_id, body, headers, reason, error, delivery_count,
                          attempts, refused_because, ord)
ORDER BY t.ord
ON CONFLICT (source, idempotency_key) DO NOTHING
"#;

impl Store {
    /// Keeps `letters` of `source` in one statement; a letter whose message is kept already
    /// is not kept twice. Returns how many rows are new.
    pub async fn keep_dead_letters<'a>(
        &self,
        source: &str,
        letters: &[KeptLetter<'a>],
    ) -> Result<u64, StoreError> {
        let column = |f: fn(&KeptLetter<'a>) -> &'a str| letters.iter().map(f).collect::<Vec<_>>();
        let bodies: Vec<&[u8]> = letters.iter().map(|letter| letter.body).collect();
        let counts: Vec<i64> = letters
            .iter()
            .map(|letter| i64::try_from(letter.delivery_count).unwrap_or(i64::MAX))
            .collect();
        let query = sqlx::query(KEEP_SQL)
            .bind(source)
            .bind(column(|l| l.idempotency_key))
            .bind(column(|l| l.external_id))
            .bind(bodies)
            .bind(column(|l| l.headers))
            .bind(column(|l| l.reason))
            .bind(column(|l| l.error))
            .bind(counts)
            .bind(column(|l| l.attempts))
            .bind(column(|l| l.refused_because));
        self.bounded(async |conn| query.execute(conn).await.map(|done| done.rows_affected()))
            .await
    }

    /// How many dead letters are kept for `source`.
    pub async fn kept_dead_letter_count(&self, source: &str) -> Result<u64, StoreError> {
        let count: i64 = self
            .bounded(async |conn| {
                sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE source = $1")
                    .bind(source)
                    .fetch_one(conn)
                    .await
            })
            .await?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    /// The dead letters kept for `source` whose id is above `after`, oldest first, at most
    /// `limit` (one page of a keyset walk).
    pub async fn kept_dead_letters(
        &self,
        source: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<KeptLetterRow>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .bounded(async |conn| {
                sqlx::query(
                    "SELECT id, idempotency_key, external_id, body, headers::text AS headers, \
                     reason, error, delivery_count, attempts::text AS attempts, refused_because, \
                     (extract(epoch FROM dead_lettered_at) * 1000)::bigint AS at_ms \
                     FROM dead_letters WHERE source = $1 AND id > $2 ORDER BY id LIMIT $3",
                )
                .bind(source)
                .bind(after)
                .bind(limit)
                .fetch_all(conn)
                .await
            })
            .await?;
        rows.iter()
            .map(|row| {
                let count: i64 = row.try_get("delivery_count")?;
                let at_ms: i64 = row.try_get("at_ms")?;
                Ok(KeptLetterRow {
                    id: row.try_get("id")?,
                    idempotency_key: row.try_get("idempotency_key")?,
                    external_id: row.try_get("external_id")?,
                    body: row.try_get("body")?,
                    headers: row.try_get("headers")?,
                    reason: row.try_get("reason")?,
                    error: row.try_get("error")?,
                    delivery_count: u64::try_from(count).unwrap_or(0),
                    attempts: row.try_get("attempts")?,
                    refused_because: row.try_get("refused_because")?,
                    dead_lettered_at_ms: u64::try_from(at_ms).unwrap_or(0),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::classify)
    }

    /// Deletes the kept dead letters `ids` of `source`. Returns how many were deleted.
    pub async fn delete_kept_dead_letters(
        &self,
        source: &str,
        ids: &[i64],
    ) -> Result<u64, StoreError> {
        self.bounded(async |conn| {
            sqlx::query("DELETE FROM dead_letters WHERE source = $1 AND id = ANY($2::bigint[])")
                .bind(source)
                .bind(ids)
                .execute(conn)
                .await
                .map(|done| done.rows_affected())
        })
        .await
    }
}
