//! The events' time partitions: created ahead, dropped whole once the dedup window has passed
//! them. `migrations/0009_partitioned_events.sql` says why dedup stays exact across them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{Connection as _, PgConnection};

use crate::{Store, StoreError};

/// One partition of `events`: the events that arrived in `[lower, upper)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventPartition {
    pub name: String,
    pub lower: SystemTime,
    pub upper: SystemTime,
}

/// What one maintenance run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Maintained {
    /// Partitions created (for now and the intervals ahead).
    pub created: Vec<String>,
    /// Partitions dropped: every event in them was older than the window.
    pub dropped: Vec<String>,
    /// `events_unpartitioned` (the events from before partitioning) was emptied: all of them
    /// were older than the window.
    pub emptied_unpartitioned: bool,
    /// The older generation of the keys without a broker time (`event_keys`) was emptied and
    /// made the current: the current had been current for the window.
    pub rotated_keys: bool,
}

/// How long a maintenance statement may wait for a lock. A DDL statement waiting for its lock
/// makes every later ingest queue behind it: give up, and try again at the next run.
const LOCK_TIMEOUT: &str = "5s";

/// `DETACH PARTITION … CONCURRENTLY` waits for every transaction that may still see the
/// partition, not for a lock queue.
const STATEMENT_TIMEOUT: &str = "10min";

impl Store {
    /// Records `window` as the dedup window, creates the partitions of `events` for now and the
    /// next `ahead` intervals, drops every partition whose events are all older than `window`
    /// (`DETACH … CONCURRENTLY`, then `DROP TABLE`: never a bulk `DELETE`), empties
    /// `events_unpartitioned` once its rows are all older than `window`, and rotates the
    /// generations of `event_keys` once the current one has been current for `window`
    /// (`TRUNCATE` of the older, under a lock ingests wait milliseconds for). Ingests go on
    /// meanwhile; a run cut short is finished by the next. Runs on a connection of its own: a
    /// concurrent detach cannot run in a transaction, nor under an ingest's statement timeout.
    pub async fn maintain_events(
        &self,
        window: Duration,
        ahead: u32,
    ) -> Result<Maintained, StoreError> {
        let options = (*self.pool.connect_options()).clone();
        let mut conn = PgConnection::connect_with(&options)
            .await
            .map_err(StoreError::classify)?;
        let done = maintain(&mut conn, window, ahead).await;
        let _ = conn.close().await;
        done.map_err(StoreError::classify)
    }

    /// The partitions of `events`, oldest first.
    pub async fn event_partitions(&self) -> Result<Vec<EventPartition>, StoreError> {
        let mut conn = self.acquire(&self.background).await?;
        partitions(&mut conn).await.map_err(StoreError::classify)
    }

    /// The dedup window maintenance keeps events for (the longest any adapter asks for, as the
    /// operator last recorded it).
    pub async fn dedup_window(&self) -> Result<Duration, StoreError> {
        let seconds: f64 = self
            .in_background(async |conn| {
                sqlx::query_scalar(
                    "SELECT extract(epoch FROM dedup_window)::float8 FROM event_storage",
                )
                .fetch_one(conn)
                .await
            })
            .await?;
        Ok(Duration::try_from_secs_f64(seconds).unwrap_or_default())
    }

    /// How much time each partition created from now on holds, and the grace: the longest
    /// `statement_timeout` an ingest may run under (see the migration).
    pub async fn set_event_partitioning(
        &self,
        interval: Duration,
        grace: Duration,
    ) -> Result<(), StoreError> {
        self.bounded(async |conn| {
            sqlx::query(
                "UPDATE event_storage SET partition_interval = make_interval(secs => $1), \
                 grace = make_interval(secs => $2)",
            )
            .bind(interval.as_secs_f64())
            .bind(grace.as_secs_f64())
            .execute(conn)
            .await
            .map(drop)
        })
        .await
    }
}

async fn maintain(
    conn: &mut PgConnection,
    window: Duration,
    ahead: u32,
) -> Result<Maintained, sqlx::Error> {
    sqlx::raw_sql(&format!(
        "SET lock_timeout = '{LOCK_TIMEOUT}'; SET statement_timeout = '{STATEMENT_TIMEOUT}'"
    ))
    .execute(&mut *conn)
    .await?;
    sqlx::query("UPDATE event_storage SET dedup_window = make_interval(secs => $1)")
        .bind(window.as_secs_f64())
        .execute(&mut *conn)
        .await?;

    let before = partitions(conn).await?;
    sqlx::query(
        "SELECT switchboard_add_event_partition(now() + s.partition_interval * n) \
         FROM event_storage s, generate_series(0, $1) AS n",
    )
    .bind(i32::try_from(ahead).unwrap_or(i32::MAX))
    .execute(&mut *conn)
    .await?;
    let created = partitions(conn)
        .await?
        .into_iter()
        .filter(|p| !before.contains(p))
        .map(|p| p.name)
        .collect();

    let expired: Vec<String> = sqlx::query_scalar(
        "SELECT p.name FROM event_partitions p, event_storage s \
         WHERE p.upper <= now() - s.dedup_window ORDER BY p.lower",
    )
    .fetch_all(&mut *conn)
    .await?;
    for name in &expired {
        drop_partition(conn, name).await?;
    }

    let emptied_unpartitioned: bool = sqlx::query_scalar(
        "SELECT s.unpartitioned_until <= now() - s.dedup_window \
                AND EXISTS (SELECT 1 FROM events_unpartitioned) \
         FROM event_storage s",
    )
    .fetch_one(&mut *conn)
    .await?;
    if emptied_unpartitioned {
        sqlx::query("TRUNCATE events_unpartitioned")
            .execute(&mut *conn)
            .await?;
    }
    let rotated_keys: bool = sqlx::query_scalar("SELECT switchboard_rotate_event_keys()")
        .fetch_one(&mut *conn)
        .await?;
    sqlx::query("UPDATE event_storage SET maintained_at = now()")
        .execute(&mut *conn)
        .await?;
    Ok(Maintained {
        created,
        dropped: expired,
        emptied_unpartitioned,
        rotated_keys,
    })
}

/// Detaches `name` from `events` without blocking ingests (or finishes a detach an earlier run
/// began), drops it, and forgets it.
async fn drop_partition(conn: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    let quoted = format!("\"{}\"", name.replace('"', "\"\""));
    let pending: Option<bool> = sqlx::query_scalar(
        "SELECT i.inhdetachpending FROM pg_inherits i \
         WHERE i.inhrelid = to_regclass($1) AND i.inhparent = 'events'::regclass",
    )
    .bind(&quoted)
    .fetch_optional(&mut *conn)
    .await?;
    match pending {
        Some(false) => {
            sqlx::query(&format!(
                "ALTER TABLE events DETACH PARTITION {quoted} CONCURRENTLY"
            ))
            .execute(&mut *conn)
            .await?;
        }
        Some(true) => {
            sqlx::query(&format!(
                "ALTER TABLE events DETACH PARTITION {quoted} FINALIZE"
            ))
            .execute(&mut *conn)
            .await?;
        }
        None => {}
    }
    sqlx::query(&format!("DROP TABLE IF EXISTS {quoted}"))
        .execute(&mut *conn)
        .await?;
    sqlx::query("DELETE FROM event_partitions WHERE name = $1")
        .bind(name)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn partitions(conn: &mut PgConnection) -> Result<Vec<EventPartition>, sqlx::Error> {
    let rows: Vec<(String, f64, f64)> = sqlx::query_as(
        "SELECT name, extract(epoch FROM lower)::float8, extract(epoch FROM upper)::float8 \
         FROM event_partitions ORDER BY lower",
    )
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, lower, upper)| EventPartition {
            name,
            lower: at(lower),
            upper: at(upper),
        })
        .collect())
}

/// The time `seconds` after the Unix epoch (partitions start after it).
fn at(seconds: f64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs_f64(seconds.max(0.0))
}
