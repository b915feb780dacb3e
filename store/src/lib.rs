//! All SQL of Switchboard's queue adapters: the migrator and the batched event+todo ingest.
//!
//! One batch is one statement (so one transaction): `switchboard_ingest` inserts the events,
//! creates their todos, and advances the source's checkpoint, atomically. Events are kept for
//! the dedup window in time partitions ([`Store::maintain_events`]). Two deduplication rules:
//!
//! - [`Dedup::NativeId`]: the broker's message id is the event's `external_id`; an event that
//!   exists already is a redelivery — no second todo, whatever the first todo's status.
//! - [`Dedup::BodyHash`]: no native id; identical bodies collapse only while a live (`pending`
//!   or `claimed`) todo with the same key exists. Each stored body gets its own event
//!   (`external_id` = `sha256:<hex>@<event id>`).

mod adapters;
mod dead_letters;
mod deliveries;
mod event_storage;
mod pool;
mod reports;
pub use adapters::{Mirrored, QueueAdapterRow};
pub use dead_letters::{KeptLetter, KeptLetterRow};
pub use deliveries::{AttemptRecord, MAX_ATTEMPTS};
pub use event_storage::{EventPartition, Maintained};
pub use pool::BATCH_CONNECTION_IDLE;
pub use reports::WorkerReport;

use std::time::Duration;

use sqlx::{PgPool, Row};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Why a store operation failed. `Unavailable` is retryable; `Rejected` means PostgreSQL refused
/// the data itself and retrying the same rows cannot help.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("DATABASE_URL is invalid")]
    InvalidUrl(#[source] sqlx::Error),
    #[error("DATABASE_URL: the scheme {scheme} is not PostgreSQL's (postgres:// or postgresql://)")]
    UnsupportedScheme { scheme: String },
    /// SQLSTATE classes 28 (invalid authorization: a wrong password, an unknown role, no
    /// `pg_hba.conf` entry) and 3D (the database does not exist): this URL can never connect.
    #[error(
        "DATABASE_URL: PostgreSQL refused the connection (check the user, password and database name)"
    )]
    Refused(#[source] sqlx::Error),
    #[error("database is unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// The server's certificate does not verify, or TLS is impossible as `DATABASE_URL` asks:
    /// a misconfiguration waiting cannot fix.
    #[error(
        "DATABASE_URL: TLS with the database failed: with sslmode=verify-full the server's certificate must chain to the CA in PGSSLROOTCERT (spec.database.caSecretRef or caConfigMapRef, Helm value worker.defaultDatabaseCa) and name DATABASE_URL's host"
    )]
    Tls(#[source] sqlx::Error),
    /// Nothing accepts connections at the address (the server is down, or the host or port of
    /// `DATABASE_URL` is wrong): retried, since a server that is down comes back.
    #[error(
        "database at {host}:{port} is unreachable (is it running, and are DATABASE_URL's host and port right?)"
    )]
    Unreachable {
        host: String,
        port: u16,
        #[source]
        source: sqlx::Error,
    },
    #[error("database did not answer within {0:?}; the connection was closed")]
    TimedOut(Duration),
    #[error("database rejected the data")]
    Rejected(#[source] sqlx::Error),
    /// Classes 42 (syntax error or access rule violation: a missing table or column, a denied
    /// privilege), 0A (feature not supported) and every class waiting cannot fix and the data
    /// is not at fault for: the statement can never succeed against this database.
    #[error(
        "database refused the statement with SQLSTATE {code} (schema, privilege or version mismatch; retrying cannot fix it)"
    )]
    Statement {
        code: String,
        #[source]
        source: sqlx::Error,
    },
    #[error(
        "database is not migrated (missing: {missing}); run `switchboard-worker migrate` first"
    )]
    NotMigrated { missing: String },
    #[error("migration failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
}

impl StoreError {
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable(_) | StoreError::Unreachable { .. } | StoreError::TimedOut(_)
        )
    }

    /// Retrying cannot help and the data is not at fault: the worker must stop and say why.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            StoreError::Statement { .. }
                | StoreError::InvalidUrl(_)
                | StoreError::UnsupportedScheme { .. }
                | StoreError::Refused(_)
                | StoreError::Tls(_)
                | StoreError::NotMigrated { .. }
                | StoreError::Migrate(_)
        )
    }

    /// What PostgreSQL's SQLSTATE says about a failure: transient only where waiting can fix
    /// it (the connection, the server's resources or state, a concurrent transaction), the
    /// data's fault where the rows are (those rows are dead-lettered), else the statement's
    /// (fatal).
    fn classify(err: sqlx::Error) -> Self {
        let code = match &err {
            sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
            sqlx::Error::Encode(_) => return StoreError::Rejected(err),
            // rustls reports a certificate it refuses as I/O failing with its error inside.
            sqlx::Error::Tls(_) => return StoreError::Tls(err),
            sqlx::Error::Io(io) if is_certificate_refused(io) => return StoreError::Tls(err),
            // The connection, not the data: I/O, a pool, a protocol hiccup.
            sqlx::Error::Io(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => return StoreError::Unavailable(err),
            // A result the code does not expect (a column, a type): the schema, not the data.
            _ => None,
        };
        let code = code.unwrap_or_else(|| "(none)".to_owned());
        match (code.get(..2).unwrap_or(""), code.as_str()) {
            // 08 connection exception, 53 insufficient resources, 57 operator intervention
            // (admin shutdown, 57014 a statement timeout or cancel), 58 system error, 40
            // serialization failure or deadlock, 55P03 lock not available, 25006 a read-only
            // transaction (a server in recovery, a failover, a read-only switch).
            ("08" | "53" | "57" | "58" | "40", _) | (_, "55P03" | "25006") => {
                StoreError::Unavailable(err)
            }
            // 21 cardinality violation (a row affected twice by one statement), 22 data
            // exception (bad JSON text, NUL in jsonb, …), 23 integrity violations other than
            // the conflicts the statements handle, 54 program limit exceeded (an index row or
            // a value too large): the rows are at fault.
            ("21" | "22" | "23" | "54", _) => StoreError::Rejected(err),
            ("28" | "3D", _) => StoreError::Refused(err),
            // 42 syntax or access rule, 0A feature not supported, and every class waiting
            // cannot fix: the statement can never succeed (fatal, naming the SQLSTATE).
            _ => StoreError::Statement { code, source: err },
        }
    }
}

/// Whether `err` is rustls refusing the server's certificate (an unknown issuer, another name).
fn is_certificate_refused(err: &std::io::Error) -> bool {
    err.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|tls| matches!(tls, rustls::Error::InvalidCertificate(_)))
}

/// One message to store.
#[derive(Debug, Clone)]
pub struct NewEvent {
    /// Unique within the source: the broker's native message id.
    pub external_id: String,
    /// The todo's idempotency key.
    pub idempotency_key: String,
    /// The payload as JSON text.
    pub payload: String,
    /// The headers as a JSON object's text.
    pub headers: String,
    /// The W3C trace context the todo keeps (`todos.traceparent`, `todos.tracestate`).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// Where an earlier delivery of the message is looked for (docs/storage.md).
    pub lookup: Lookup,
}

/// Where an earlier delivery of a message is looked for: what dates its first delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// When the broker accepted it (Unix ms), a time every delivery repeats and whose id the
    /// broker gave: among the events that arrived since.
    Since(i64),
    /// Its key has no broker time (a producer's id: a RabbitMQ `message-id`, an envelope id):
    /// among the keys kept without one.
    Untimed,
    /// A redriven copy's original key, which its first delivery may have stored either way:
    /// everywhere.
    Everywhere,
}

impl Lookup {
    /// The batch function's `p_sent_ms`: the time, NULL for a key without one, 0 (the epoch,
    /// before every event) everywhere.
    fn sent_ms(self) -> Option<i64> {
        match self {
            Lookup::Since(ms) => Some(ms),
            Lookup::Untimed => None,
            Lookup::Everywhere => Some(0),
        }
    }
}

/// How a batch is deduplicated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dedup {
    /// By the broker's native message id (`external_id`), permanently.
    NativeId,
    /// By idempotency key (a body hash), while a live todo holds it.
    BodyHash,
}

/// A native position within a source, opaque to the store: the highest per partition is kept.
/// Positions of one partition compare element by element (a Redis entry id is `[ms, seq]`, a
/// Kafka offset `[offset]`), in Rust as in PostgreSQL's `bigint[]`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    /// The partition within the source (`""` for a source with a single sequence).
    pub partition: String,
    /// The position within the partition.
    pub value: Vec<i64>,
}

/// A batch of messages from one source into one queue.
#[derive(Debug, Clone)]
pub struct IngestBatch<'a> {
    pub source: &'a str,
    pub queue: &'a str,
    pub dedup: Dedup,
    /// The highest native position in the batch per partition, where the source has positions.
    pub positions: &'a [Position],
    pub events: &'a [NewEvent],
}

/// What happened to each message of a batch, in input order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// A new event and a new todo.
    New,
    /// A new event whose todo key already had a live todo.
    NewEventOnly,
    /// A redelivery: the event existed already (native id), or a live todo holds the key (body hash).
    Duplicate,
}

/// How long one of the worker's operations (a batch, a ping, a checkpoint read) may take by
/// default before the store gives up on the connection.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(30);

/// Connection pool and queries.
#[derive(Debug, Clone)]
pub struct Store {
    /// Batches (and everything, unless [`Store::with_background_connection`] split them).
    pool: PgPool,
    /// The worker's background work: probes, reports, delivery marks, pruning.
    background: PgPool,
    operation_timeout: Duration,
}

// The batch statement: `switchboard_ingest` (migrations/0009_partitioned_events.sql) checks the
// dedup markers after taking its locks, which needs a statement of its own inside one call.
const INGEST_SQL: &str = "SELECT ord, new_event, new_todo \
     FROM switchboard_ingest($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";

impl Store {
    /// Applies pending migrations. Safe when several processes run it at once (advisory lock).
    /// A database it cannot reach is said as `run` says it (`DATABASE_URL`'s host and port),
    /// not as the pool's time-out.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.acquire(&self.pool).await?;
        // A migration may take longer than an ingest may: not under the pool's statement
        // timeout (each migration bounds its own lock waits). The connection is closed after,
        // not handed back without its timeout.
        conn.close_on_drop();
        sqlx::query("SET statement_timeout = 0")
            .execute(&mut *conn)
            .await
            .map_err(StoreError::classify)?;
        MIGRATOR.run(&mut *conn).await.map_err(StoreError::Migrate)
    }

    /// Fails with [`StoreError::NotMigrated`] unless every migration has been applied.
    pub async fn ensure_migrated(&self) -> Result<(), StoreError> {
        let mut conn = self.acquire(&self.background).await?;
        let applied: Vec<i64> =
            match sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                .fetch_all(&mut *conn)
                .await
            {
                Ok(versions) => versions,
                Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P01") => {
                    Vec::new()
                }
                Err(err) => return Err(StoreError::classify(err)),
            };
        drop(conn);
        let missing: Vec<String> = MIGRATOR
            .iter()
            .filter(|m| !applied.contains(&m.version))
            .map(|m| format!("{}_{}", m.version, m.description))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(StoreError::NotMigrated {
                missing: missing.join(", "),
            })
        }
    }

    /// Cheap liveness probe of the database.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.in_background(async |conn| sqlx::query("SELECT 1").execute(conn).await.map(drop))
            .await
    }

    /// Stores a batch in one transaction (one statement). Returns one outcome per event.
    pub async fn ingest_batch(&self, batch: &IngestBatch<'_>) -> Result<Vec<Stored>, StoreError> {
        let column = |f: fn(&NewEvent) -> &str| batch.events.iter().map(f).collect::<Vec<&str>>();
        let optional = |f: fn(&NewEvent) -> Option<&str>| {
            batch.events.iter().map(f).collect::<Vec<Option<&str>>>()
        };
        let partitions: Vec<&str> = batch
            .positions
            .iter()
            .map(|p| p.partition.as_str())
            .collect();
        // `bigint[]` literals: `{1700000000000,7}`.
        let positions: Vec<String> = batch
            .positions
            .iter()
            .map(|p| {
                let parts: Vec<String> = p.value.iter().map(i64::to_string).collect();
                format!("{{{}}}", parts.join(","))
            })
            .collect();
        let query = sqlx::query(INGEST_SQL)
            .bind(batch.source)
            .bind(batch.queue)
            .bind(batch.dedup == Dedup::BodyHash)
            .bind(column(|e| &e.external_id))
            .bind(column(|e| &e.idempotency_key))
            .bind(column(|e| &e.payload))
            .bind(column(|e| &e.headers))
            .bind(optional(|e| e.traceparent.as_deref()))
            .bind(optional(|e| e.tracestate.as_deref()))
            .bind(
                batch
                    .events
                    .iter()
                    .map(|e| e.lookup.sent_ms())
                    .collect::<Vec<_>>(),
            )
            .bind(partitions)
            .bind(positions);
        let rows = self
            .bounded(async |conn| query.fetch_all(conn).await)
            .await?;
        rows.iter()
            .map(|row| {
                let new_event: bool = row.try_get("new_event").map_err(StoreError::classify)?;
                let new_todo: bool = row.try_get("new_todo").map_err(StoreError::classify)?;
                Ok(match (new_event, new_todo) {
                    (true, true) => Stored::New,
                    (true, false) => Stored::NewEventOnly,
                    (false, _) => Stored::Duplicate,
                })
            })
            .collect()
    }

    /// Which of `external_ids` already have an event from `source`, in input order.
    pub async fn events_exist(
        &self,
        source: &str,
        external_ids: &[&str],
    ) -> Result<Vec<bool>, StoreError> {
        self.bounded(async |conn| {
            sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM events e \
                 WHERE e.source = $1 AND e.external_id = input.wanted) \
                 OR EXISTS (SELECT 1 FROM events_unpartitioned e \
                 WHERE e.source = $1 AND e.external_id = input.wanted) \
                 FROM unnest($2::text[]) WITH ORDINALITY AS input(wanted, ord) ORDER BY input.ord",
            )
            .bind(source)
            .bind(external_ids)
            .fetch_all(conn)
            .await
        })
        .await
    }

    /// The highest native position stored for `partition` of `source`, if any.
    pub async fn position(
        &self,
        source: &str,
        partition: &str,
    ) -> Result<Option<Vec<i64>>, StoreError> {
        self.bounded(async |conn| {
            sqlx::query_scalar(
                "SELECT position FROM source_positions WHERE source = $1 AND partition = $2",
            )
            .bind(source)
            .bind(partition)
            .fetch_optional(conn)
            .await
        })
        .await
    }

    /// The pool, for callers that need ad-hoc queries (tests, tools).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

#[cfg(test)]
mod tests {
    use super::StoreError;

    /// A PostgreSQL error with only a SQLSTATE.
    #[derive(Debug)]
    struct Sqlstate(&'static str);

    impl std::fmt::Display for Sqlstate {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Sqlstate {}

    impl sqlx::error::DatabaseError for Sqlstate {
        fn message(&self) -> &str {
            self.0
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn classify(code: &'static str) -> StoreError {
        StoreError::classify(sqlx::Error::Database(Box::new(Sqlstate(code))))
    }

    #[test]
    fn only_what_waiting_can_fix_is_retried() {
        // Connection, resources, operator intervention (admin shutdown, statement timeout),
        // system, serialization/deadlock, a lock not available, a read-only server.
        for code in [
            "08006", "53300", "57P01", "57014", "57P03", "58030", "40001", "40P01", "55P03",
            "25006",
        ] {
            assert!(classify(code).is_retryable(), "{code} is transient");
        }
    }

    #[test]
    fn data_errors_are_the_rows_fault_not_an_outage() {
        // 21000: ON CONFLICT DO UPDATE cannot affect a row a second time; 54000: an index row
        // too large; 22P05: \u0000 in jsonb; 23505: a unique violation.
        for code in ["21000", "54000", "54001", "22P05", "22021", "23505"] {
            let err = classify(code);
            assert!(matches!(err, StoreError::Rejected(_)), "{code}: {err:?}");
            assert!(!err.is_retryable() && !err.is_fatal(), "{code}");
        }
    }

    #[test]
    fn unknown_classes_stop_the_worker_instead_of_retrying_forever() {
        for code in ["42P01", "0A000", "XX000", "P0001", "55006", "F0000"] {
            let err = classify(code);
            assert!(err.is_fatal() && !err.is_retryable(), "{code}: {err:?}");
            assert!(err.to_string().contains(code), "names the SQLSTATE: {err}");
        }
        assert!(
            StoreError::classify(sqlx::Error::ColumnNotFound("id".into())).is_fatal(),
            "an unexpected result is the statement's fault"
        );
        assert!(StoreError::classify(sqlx::Error::PoolTimedOut).is_retryable());
    }
}
