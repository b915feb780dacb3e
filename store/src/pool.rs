//! Connections: the pool (or, for a worker, the batch pool and the background work's own
//! connection), the operation deadline every query runs under, and why a connection failed.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection as _, PgConnection, PgPool, Postgres};

use crate::{DEFAULT_OPERATION_TIMEOUT, Store, StoreError, is_certificate_refused};

/// How long a batch connection of a worker's store may sit unused before it is closed (see
/// [`Store::with_background_connection`]).
pub const BATCH_CONNECTION_IDLE: Duration = Duration::from_secs(30);

impl Store {
    /// Connects a pool of at most `max_connections` to `url`. `application_name` is what
    /// `pg_stat_activity` shows for its connections (PostgreSQL keeps the first 63 bytes).
    pub async fn connect(
        url: &str,
        max_connections: u32,
        application_name: &str,
    ) -> Result<Self, StoreError> {
        if let Some((scheme, _)) = url.split_once("://")
            && !matches!(scheme, "postgres" | "postgresql")
        {
            let plain = scheme.len() <= 20
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
            return Err(StoreError::UnsupportedScheme {
                scheme: if plain {
                    format!("`{scheme}://`")
                } else {
                    "of the URL".to_owned()
                },
            });
        }
        let options: PgConnectOptions = url.parse().map_err(StoreError::InvalidUrl)?;
        let pool = lazy_pool(
            PgPoolOptions::new().max_connections(max_connections),
            options.application_name(application_name),
        );
        Ok(Self {
            background: pool.clone(),
            pool,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
        }
        .with_operation_timeout(DEFAULT_OPERATION_TIMEOUT))
    }

    /// Gives the background work (probes, reports, delivery marks, pruning) one connection of
    /// its own, out of the pool's `max_connections`, and closes a batch connection once it sat
    /// unused for [`BATCH_CONNECTION_IDLE`]: an idle worker holds one connection, a busy one as
    /// many as before. (One pool hands its idle connections out in turn, so every connection a
    /// burst opened stays in use by the probes and none is ever idle long enough to close.)
    #[must_use]
    pub fn with_background_connection(self) -> Self {
        let options = (*self.pool.connect_options()).clone();
        let batches = self.pool.options().get_max_connections().saturating_sub(1);
        Self {
            pool: lazy_pool(
                PgPoolOptions::new()
                    .max_connections(batches.max(1))
                    .idle_timeout(BATCH_CONNECTION_IDLE),
                options.clone(),
            ),
            background: lazy_pool(PgPoolOptions::new().max_connections(1), options),
            operation_timeout: self.operation_timeout,
        }
    }

    /// Bounds each of [`Store::ingest_batch`], [`Store::ping`], [`Store::position`] and
    /// [`Store::events_exist`] by `timeout`: a database that accepts connections but does not
    /// answer (a hung server, a network that drops packets) fails them with
    /// [`StoreError::TimedOut`], which is retryable.
    ///
    /// PostgreSQL is told to cancel a statement (lock waits included) a little earlier, at nine
    /// tenths of `timeout`: a stuck statement then ends on the server rather than running after
    /// its retry, and its connection stays usable. The client-side deadline is for a server or a
    /// network that answers nothing at all.
    #[must_use]
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        let server_side = timeout.mul_f64(0.9).max(Duration::from_millis(1));
        let options = (*self.pool.connect_options()).clone().options([(
            "statement_timeout",
            format!("{}ms", server_side.as_millis()),
        )]);
        self.pool.set_connect_options(options.clone());
        self.background.set_connect_options(options);
        self.operation_timeout = timeout;
        self
    }

    /// Runs `op` on a connection of the pool within the operation timeout. A connection that
    /// does not answer in time is closed, not returned to the pool: a dropped query leaves it
    /// mid-protocol, and the pool's check on return would wait on it as long as it hangs.
    pub(crate) async fn bounded<T>(
        &self,
        op: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        self.bounded_on(&self.pool, op).await
    }

    /// [`Store::bounded`] on the background work's connection.
    pub(crate) async fn in_background<T>(
        &self,
        op: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        self.bounded_on(&self.background, op).await
    }

    async fn bounded_on<T>(
        &self,
        pool: &PgPool,
        op: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        let mut conn = self.acquire(pool).await?;
        match tokio::time::timeout(self.operation_timeout, op(&mut conn)).await {
            Ok(result) => result.map_err(StoreError::classify),
            Err(_elapsed) => {
                conn.close_on_drop();
                Err(StoreError::TimedOut(self.operation_timeout))
            }
        }
    }

    /// The database's `host:port` (never the credentials of `DATABASE_URL`).
    pub fn endpoint(&self) -> String {
        let options = self.pool.connect_options();
        format!("{}:{}", options.get_host(), options.get_port())
    }

    /// A connection of the pool. When the pool only says it timed out (it retries refused
    /// connections until then), one direct attempt finds out why.
    pub(crate) async fn acquire(
        &self,
        pool: &PgPool,
    ) -> Result<PoolConnection<Postgres>, StoreError> {
        match pool.acquire().await {
            Ok(conn) => Ok(conn),
            Err(sqlx::Error::PoolTimedOut) => Err(self.why_no_connection().await),
            Err(err) => Err(StoreError::classify(err)),
        }
    }

    async fn why_no_connection(&self) -> StoreError {
        const ATTEMPT: Duration = Duration::from_secs(5);
        let options = self.pool.connect_options();
        let unreachable = |source| StoreError::Unreachable {
            host: options.get_host().to_owned(),
            port: options.get_port(),
            source,
        };
        match tokio::time::timeout(ATTEMPT, PgConnection::connect_with(&options)).await {
            // It connects: every connection of the pool is busy.
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
                StoreError::Unavailable(sqlx::Error::PoolTimedOut)
            }
            Ok(Err(sqlx::Error::Io(io))) if !is_certificate_refused(&io) => {
                unreachable(sqlx::Error::Io(io))
            }
            Ok(Err(err)) => StoreError::classify(err),
            Err(_elapsed) => unreachable(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer to a connection attempt within {ATTEMPT:?}"),
            ))),
        }
    }
}

/// A pool that connects on first use and keeps no connection open for its own sake.
fn lazy_pool(pool: PgPoolOptions, options: PgConnectOptions) -> PgPool {
    pool.min_connections(0)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options)
}
