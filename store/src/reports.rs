//! Worker reports: each worker upserts what it last saw of its queue every few seconds; the
//! operator reads the fresh ones of every adapter and deletes those of workers long gone.

use std::time::{Duration, SystemTime};

use crate::{Store, StoreError};

/// What one worker last saw of its queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerReport {
    /// `namespace/name`.
    pub adapter: String,
    /// The consumer name (the pod's name).
    pub worker: String,
    /// When the report was written (the database's clock).
    pub reported_at: SystemTime,
    /// Messages not yet delivered to any consumer, if the broker says.
    pub backlog: Option<u64>,
    /// Messages delivered and not yet acknowledged, if the broker says.
    pub pending: Option<u64>,
    /// When the oldest unacknowledged message arrived.
    pub oldest_since: Option<SystemTime>,
    /// Messages in the dead-letter destination, if the broker says.
    pub dead_letters: Option<u64>,
    pub broker_up: bool,
    pub database_up: bool,
}

const UPSERT_SQL: &str = r#"
INSERT INTO worker_reports
    (adapter, worker, reported_at, backlog, pending, oldest_since, dead_letters, broker_up, database_up)
VALUES ($1, $2, now(), $3, $4, to_timestamp($5::float8 / 1000), $6, $7, $8)
ON CONFLICT (adapter, worker) DO UPDATE
    SET reported_at = now(), backlog = EXCLUDED.backlog, pending = EXCLUDED.pending,
        oldest_since = EXCLUDED.oldest_since, dead_letters = EXCLUDED.dead_letters,
        broker_up = EXCLUDED.broker_up, database_up = EXCLUDED.database_up
"#;

const FRESH_SQL: &str = r#"
SELECT adapter, worker,
       (extract(epoch FROM reported_at) * 1000)::bigint,
       backlog, pending,
       (extract(epoch FROM oldest_since) * 1000)::bigint,
       dead_letters, broker_up, database_up
FROM worker_reports
WHERE reported_at > now() - make_interval(secs => $1::float8)
ORDER BY adapter, worker
"#;

type ReportRow = (
    String,
    String,
    i64,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    bool,
    bool,
);

fn to_i64(value: Option<u64>) -> Option<i64> {
    value.map(|v| i64::try_from(v).unwrap_or(i64::MAX))
}

fn to_u64(value: Option<i64>) -> Option<u64> {
    value.map(|v| u64::try_from(v).unwrap_or(0))
}

fn unix_ms(time: SystemTime) -> i64 {
    let ms = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    i64::try_from(ms).unwrap_or(i64::MAX)
}

fn from_unix_ms(ms: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl Store {
    /// Writes this worker's report (its `reported_at` is the database's `now()`).
    pub async fn report_worker(&self, report: &WorkerReport) -> Result<(), StoreError> {
        let oldest_ms = report.oldest_since.map(unix_ms);
        self.in_background(async |conn| {
            sqlx::query(UPSERT_SQL)
                .bind(&report.adapter)
                .bind(&report.worker)
                .bind(to_i64(report.backlog))
                .bind(to_i64(report.pending))
                .bind(oldest_ms)
                .bind(to_i64(report.dead_letters))
                .bind(report.broker_up)
                .bind(report.database_up)
                .execute(conn)
                .await
                .map(drop)
        })
        .await
    }

    /// Every report written within `fresh_for`, by adapter and worker.
    pub async fn fresh_worker_reports(
        &self,
        fresh_for: Duration,
    ) -> Result<Vec<WorkerReport>, StoreError> {
        let rows: Vec<ReportRow> = self
            .bounded(async |conn| {
                sqlx::query_as(FRESH_SQL)
                    .bind(fresh_for.as_secs_f64())
                    .fetch_all(conn)
                    .await
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(
                |(adapter, worker, reported, backlog, pending, oldest, dead, broker, database)| {
                    WorkerReport {
                        adapter,
                        worker,
                        reported_at: from_unix_ms(reported),
                        backlog: to_u64(backlog),
                        pending: to_u64(pending),
                        oldest_since: oldest.map(from_unix_ms),
                        dead_letters: to_u64(dead),
                        broker_up: broker,
                        database_up: database,
                    }
                },
            )
            .collect())
    }

    /// Deletes the reports older than `older_than` (workers gone); returns how many.
    pub async fn delete_stale_worker_reports(
        &self,
        older_than: Duration,
    ) -> Result<u64, StoreError> {
        self.bounded(async |conn| {
            sqlx::query(
                "DELETE FROM worker_reports WHERE reported_at < now() - make_interval(secs => $1::float8)",
            )
            .bind(older_than.as_secs_f64())
            .execute(conn)
            .await
            .map(|done| done.rows_affected())
        })
        .await
    }
}
