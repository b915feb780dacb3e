//! A lock on the todos table that holds a worker's batch in its transaction: the way tests make
//! a commit slower than a broker's lease, or keep a batch un-stored while workers die.

use std::time::Duration;

use anyhow::{Context, Result};
use sqlx::Connection;

use crate::Fixture;
use crate::wait::wait_for;
use crate::worker::WorkerProcess;

const LONG: Duration = Duration::from_secs(120);

/// Holds `LOCK TABLE todos IN ACCESS EXCLUSIVE MODE` on its own connection until dropped or
/// released.
pub struct TodosLock {
    conn: sqlx::PgConnection,
}

impl TodosLock {
    pub async fn take(database_url: &str) -> Result<Self> {
        let mut conn = sqlx::PgConnection::connect(database_url).await?;
        sqlx::query("BEGIN").execute(&mut conn).await?;
        sqlx::query("LOCK TABLE todos IN ACCESS EXCLUSIVE MODE")
            .execute(&mut conn)
            .await?;
        Ok(Self { conn })
    }

    pub async fn release(mut self) -> Result<()> {
        sqlx::query("ROLLBACK").execute(&mut self.conn).await?;
        Ok(())
    }
}

/// Waits until a connection of worker `consumer` waits for a lock (it is storing a batch
/// behind [`TodosLock`]).
pub async fn wait_blocked_on_lock(fx: &Fixture, worker: &WorkerProcess) -> Result<()> {
    let application = switchboard_worker::database_application_name(&worker.consumer);
    wait_for(LONG, "the worker waits for the lock on todos", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
             AND wait_event_type = 'Lock'",
        )
        .bind(&application)
        .fetch_one(fx.pool())
        .await?;
        Ok(waiting > 0)
    })
    .await
    .with_context(|| worker.log_tail())
}
