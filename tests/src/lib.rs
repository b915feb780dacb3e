//! Test harness for Switchboard: real PostgreSQL and Redis servers, the real worker binary, and
//! helpers to produce messages and inspect what landed.

pub mod brokers;
pub mod cluster;
pub mod control_plane;
pub mod helm;
pub mod otel;
pub mod prometheus;
pub mod proxy;
pub mod send;
pub mod servers;
pub mod todos_lock;
pub mod wait;
pub mod worker;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::Signal;
use sqlx::PgPool;
use switchboard_store::Store;
use tempfile::TempDir;

use crate::servers::{Postgres, Redis};
use crate::wait::wait_for;
use crate::worker::{WorkerEnv, WorkerProcess, killed_by};

/// Applies the migrations before `version` only: the schema of an earlier release.
pub async fn migrate_before(pool: &PgPool, version: i64) -> Result<()> {
    let mut earlier = sqlx::migrate::Migrator::new(servers::workspace_path("migrations")).await?;
    earlier.migrations = earlier
        .migrations
        .iter()
        .filter(|m| m.version < version)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    earlier.run(pool).await?;
    Ok(())
}

/// Makes every partition of `events` hold `interval` (and an ingest's statement timeout at most
/// `grace`): drops the partitions there are (the migration's holds a day; they must be empty)
/// so that the next ingest creates a short one.
pub async fn short_event_partitions(
    store: &Store,
    interval: Duration,
    grace: Duration,
) -> Result<()> {
    store.set_event_partitioning(interval, grace).await?;
    for name in sqlx::query_scalar::<_, String>("DELETE FROM event_partitions RETURNING name")
        .fetch_all(store.pool())
        .await?
    {
        sqlx::query(&format!("DROP TABLE \"{name}\""))
            .execute(store.pool())
            .await?;
    }
    Ok(())
}

/// PostgreSQL (migrated) + Redis + a scratch directory, for one test.
#[derive(Debug)]
pub struct Fixture {
    pub postgres: Postgres,
    pub redis: Redis,
    pub dir: TempDir,
    pub store: Store,
    pub env: WorkerEnv,
    /// More environment for every worker this fixture starts (a broker's credentials).
    pub extra_env: Vec<(String, String)>,
}

impl Fixture {
    /// Starts both servers and applies the migrations.
    pub async fn start() -> Result<Self> {
        Self::start_with(Postgres::start()?).await
    }

    /// Like [`Fixture::start`] with a PostgreSQL started by the caller.
    pub async fn start_with(postgres: Postgres) -> Result<Self> {
        let redis = Redis::start()?;
        let dir = tempfile::Builder::new()
            .prefix("switchboard-test-")
            .tempdir()?;
        let store = Store::connect(&postgres.url(), 4, "switchboard-tests").await?;
        store.migrate().await?;
        let env = WorkerEnv {
            database_url: postgres.url(),
            redis_url: redis.url(),
            log_dir: dir.path().to_path_buf(),
        };
        Ok(Self {
            postgres,
            redis,
            dir,
            store,
            env,
            extra_env: Vec::new(),
        })
    }

    pub fn pool(&self) -> &PgPool {
        self.store.pool()
    }

    /// Writes a manifest file and returns its path.
    pub fn manifest(&self, file: &str, yaml: &str) -> Result<PathBuf> {
        let path = self.dir.path().join(file);
        // Written aside and renamed into place: a worker starting while a test rewrites its
        // manifest reads the old one or the new one, never an empty file.
        let aside = self.dir.path().join(format!(".{file}.writing"));
        std::fs::write(&aside, yaml)?;
        std::fs::rename(&aside, &path)?;
        Ok(path)
    }

    /// Writes `{name}.yaml`: adapter `test/{name}` reading stream `name` into queue `name`.
    pub fn stream_adapter(&self, name: &str, delivery: &str, payload: &str) -> Result<PathBuf> {
        self.manifest(
            &format!("{name}.yaml"),
            &stream_manifest(name, name, delivery, payload),
        )
    }

    /// Writes `{name}.yaml`: adapter `test/{name}` reading list `name` into queue `name`.
    pub fn list_adapter(&self, name: &str, delivery: &str, payload: &str) -> Result<PathBuf> {
        let redis = format!("mode: list, list: {name}");
        self.manifest(
            &format!("{name}.yaml"),
            &adapter_manifest(name, &redis, delivery, payload),
        )
    }

    /// Fails unless `queue` holds exactly `expected` todos, all with distinct keys.
    pub async fn assert_exactly_once(&self, queue: &str, expected: i64) -> Result<()> {
        let todos = self.todo_count(queue).await?;
        let distinct = self.distinct_keys(queue).await?;
        anyhow::ensure!(
            todos == expected && distinct == expected,
            "expected {expected} todos with distinct keys, found {todos} todos / {distinct} keys"
        );
        Ok(())
    }

    /// Database connections that worker `consumer` holds.
    pub async fn connections_of(&self, consumer: &str) -> Result<i64> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(switchboard_worker::database_application_name(consumer))
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// Waits until worker `consumer` has no database connection left. After the worker was
    /// killed, every transaction it had begun is then committed or rolled back: a COMMIT it sent
    /// just before it died may still be completing when the process is already gone.
    pub async fn wait_disconnected(&self, consumer: &str) -> Result<()> {
        wait_for(
            Duration::from_secs(30),
            &format!("worker {consumer} holds no database connection"),
            || async { Ok(self.connections_of(consumer).await? == 0) },
        )
        .await
    }

    /// Runs worker `consumer` until the fault-injection hook aborts it right after its first
    /// commit, before it acknowledges anything, and until PostgreSQL has settled that worker's
    /// transactions ([`Fixture::wait_disconnected`]).
    pub async fn crash_after_first_commit(
        &self,
        manifest: &std::path::Path,
        consumer: &str,
    ) -> Result<()> {
        let mut crashing = self.worker_with(
            manifest,
            consumer,
            &[(switchboard_worker::ABORT_AFTER_COMMITS_ENV, "1")],
        )?;
        let status = crashing.wait_exit(Duration::from_secs(120))?;
        anyhow::ensure!(
            killed_by(status, Signal::SIGABRT),
            "expected the abort hook, got {status:?}\n{}",
            crashing.log_tail()
        );
        self.wait_disconnected(consumer).await
    }

    pub fn worker(&self, manifest: &std::path::Path, consumer: &str) -> Result<WorkerProcess> {
        self.worker_with(manifest, consumer, &[])
    }

    /// [`Fixture::worker`] with more environment variables.
    pub fn worker_with(
        &self,
        manifest: &std::path::Path,
        consumer: &str,
        env: &[(&str, &str)],
    ) -> Result<WorkerProcess> {
        let extra: Vec<(&str, &str)> = self
            .extra_env
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .chain(env.iter().copied())
            .collect();
        WorkerProcess::start(&self.env, manifest, consumer, &extra)
    }

    /// XADDs one entry per body (field `body`), pipelined; returns the entry ids.
    pub fn produce(
        &self,
        stream: &str,
        bodies: impl IntoIterator<Item = Vec<u8>>,
    ) -> Result<Vec<String>> {
        let mut conn = self.redis.connection()?;
        let mut ids = Vec::new();
        let bodies: Vec<Vec<u8>> = bodies.into_iter().collect();
        for chunk in bodies.chunks(1000) {
            let mut pipe = redis::pipe();
            for body in chunk {
                pipe.cmd("XADD").arg(stream).arg("*").arg("body").arg(body);
            }
            let chunk_ids: Vec<String> = pipe.query(&mut conn)?;
            ids.extend(chunk_ids);
        }
        Ok(ids)
    }

    /// Todos in `queue`.
    pub async fn todo_count(&self, queue: &str) -> Result<i64> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM todos WHERE queue = $1")
                .bind(queue)
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// The payloads of the todos in `queue`, each as its canonical JSON text, sorted: a
    /// multiset to compare with what was produced (see [`canonical_json`]).
    pub async fn stored_payloads(&self, queue: &str) -> Result<Vec<String>> {
        let payloads: Vec<serde_json::Value> =
            sqlx::query_scalar("SELECT payload FROM todos WHERE queue = $1")
                .bind(queue)
                .fetch_all(self.pool())
                .await?;
        let mut texts: Vec<String> = payloads.iter().map(ToString::to_string).collect();
        texts.sort();
        Ok(texts)
    }

    /// Fails unless the todos of `queue` hold exactly the JSON bodies `produced`, each once
    /// (compared as sets of canonical JSON, not counted), and no two share a key.
    pub async fn assert_stored_exactly(&self, queue: &str, produced: &[Vec<u8>]) -> Result<()> {
        let mut expected = produced
            .iter()
            .map(|body| canonical_json(body))
            .collect::<Result<Vec<String>>>()?;
        expected.sort();
        let stored = self.stored_payloads(queue).await?;
        if stored != expected {
            let missing: Vec<&String> = expected.iter().filter(|e| !stored.contains(e)).collect();
            let mut seen = std::collections::HashSet::new();
            let extra: Vec<&String> = stored
                .iter()
                .filter(|s| !expected.contains(s) || !seen.insert(*s))
                .collect();
            anyhow::bail!(
                "stored set differs from the produced set: {} produced, {} stored; missing \
                 (first 10): {:?}; unexpected or stored twice (first 10): {:?}",
                expected.len(),
                stored.len(),
                &missing[..missing.len().min(10)],
                &extra[..extra.len().min(10)],
            );
        }
        let distinct = self.distinct_keys(queue).await?;
        anyhow::ensure!(
            usize::try_from(distinct)? == expected.len(),
            "{} todos share {distinct} keys",
            expected.len()
        );
        Ok(())
    }

    /// The dead letters PostgreSQL keeps for adapter `test/{name}` (the ones its broker
    /// refused): body and reason, oldest first.
    pub async fn database_dead_letters(&self, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        Ok(sqlx::query_as(
            "SELECT body, reason FROM dead_letters WHERE source LIKE '%:test/' || $1 ORDER BY id",
        )
        .bind(name)
        .fetch_all(self.pool())
        .await?)
    }

    /// Turns the whole server read-only (`default_transaction_read_only`, reloaded into every
    /// session, as a failover or an operator does) or writable again: reads work, writes fail
    /// with SQLSTATE 25006.
    pub async fn set_read_only(&self, read_only: bool) -> Result<()> {
        use sqlx::Connection as _;
        let mut conn = sqlx::PgConnection::connect(&self.postgres.url()).await?;
        sqlx::query("SET default_transaction_read_only = off")
            .execute(&mut conn)
            .await?;
        let statement = if read_only {
            "ALTER SYSTEM SET default_transaction_read_only = on"
        } else {
            "ALTER SYSTEM RESET default_transaction_read_only"
        };
        sqlx::query(statement).execute(&mut conn).await?;
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&mut conn)
            .await?;
        Ok(())
    }

    /// Distinct idempotency keys among the todos in `queue`.
    pub async fn distinct_keys(&self, queue: &str) -> Result<i64> {
        Ok(
            sqlx::query_scalar(
                "SELECT count(DISTINCT idempotency_key) FROM todos WHERE queue = $1",
            )
            .bind(queue)
            .fetch_one(self.pool())
            .await?,
        )
    }

    /// The first group's lag on `stream` as Redis reports it (`XINFO GROUPS`).
    pub fn group_lag(&self, stream: &str) -> Result<i64> {
        let mut conn = self.redis.connection()?;
        let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(stream)
            .query(&mut conn)?;
        match groups.first().and_then(|group| group.get("lag")) {
            Some(redis::Value::Int(lag)) => Ok(*lag),
            other => anyhow::bail!("no lag in XINFO GROUPS: {other:?}"),
        }
    }

    /// When the oldest entry `group` holds unacknowledged was added (Unix ms, from its ID in
    /// the `XPENDING` summary); `None` when nothing is pending.
    pub fn oldest_pending_ms(&self, stream: &str, group: &str) -> Result<Option<i64>> {
        let mut conn = self.redis.connection()?;
        let summary: redis::Value = redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .query(&mut conn)?;
        let redis::Value::Array(parts) = summary else {
            return Ok(None);
        };
        let Some(redis::Value::BulkString(id)) = parts.get(1) else {
            return Ok(None);
        };
        let id = String::from_utf8_lossy(id);
        let ms = id.split_once('-').map_or(id.as_ref(), |(ms, _)| ms);
        Ok(Some(ms.parse().with_context(|| format!("stream ID {id}"))?))
    }

    /// Entries of `group` delivered and not acknowledged.
    pub fn pending(&self, stream: &str, group: &str) -> Result<u64> {
        let mut conn = self.redis.connection()?;
        let summary: redis::Value = redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .query(&mut conn)?;
        Ok(match summary {
            redis::Value::Array(parts) => match parts.first() {
                Some(redis::Value::Int(n)) => u64::try_from(*n)?,
                _ => 0,
            },
            _ => 0,
        })
    }

    /// LPUSHes every body to `list`, pipelined.
    pub fn push(&self, list: &str, bodies: impl IntoIterator<Item = Vec<u8>>) -> Result<()> {
        let mut conn = self.redis.connection()?;
        let bodies: Vec<Vec<u8>> = bodies.into_iter().collect();
        for chunk in bodies.chunks(1000) {
            let mut pipe = redis::pipe();
            for body in chunk {
                pipe.cmd("LPUSH").arg(list).arg(body).ignore();
            }
            pipe.query::<()>(&mut conn)?;
        }
        Ok(())
    }

    /// Length of a list.
    pub fn llen(&self, key: &str) -> Result<u64> {
        let mut conn = self.redis.connection()?;
        Ok(redis::cmd("LLEN").arg(key).query(&mut conn)?)
    }

    /// Items of reliable list `list` not yet acknowledged: those left in it and those in its
    /// consumers' processing lists (`{list}:processing:*`), read in one atomic script. Two reads
    /// could miss items a reaper moves from a processing list back to the list between them.
    pub fn unacknowledged_items(&self, list: &str) -> Result<u64> {
        let mut conn = self.redis.connection()?;
        Ok(redis::cmd("EVAL")
            .arg(
                "local n = redis.call('LLEN', KEYS[1]) \
                 for _, key in ipairs(redis.call('KEYS', ARGV[1])) do \
                   n = n + redis.call('LLEN', key) \
                 end \
                 return n",
            )
            .arg(1)
            .arg(list)
            .arg(format!("{list}:processing:*"))
            .query(&mut conn)?)
    }

    /// Every entry of stream `key`, each as its fields (bulk-string values only).
    pub fn stream_entries(&self, key: &str) -> Result<Vec<HashMap<String, Vec<u8>>>> {
        let mut conn = self.redis.connection()?;
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(key)
            .arg("-")
            .arg("+")
            .query(&mut conn)?;
        Ok(reply
            .ids
            .into_iter()
            .map(|entry| {
                entry
                    .map
                    .into_iter()
                    .filter_map(|(field, value)| match value {
                        redis::Value::BulkString(bytes) => Some((field, bytes)),
                        _ => None,
                    })
                    .collect()
            })
            .collect())
    }

    /// Length of a stream.
    pub fn xlen(&self, key: &str) -> Result<u64> {
        let mut conn = self.redis.connection()?;
        Ok(redis::cmd("XLEN").arg(key).query(&mut conn)?)
    }
}

/// Field `name` of a stream entry (see [`Fixture::stream_entries`]), as text.
pub fn field(entry: &HashMap<String, Vec<u8>>, name: &str) -> Result<String> {
    entry
        .get(name)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .with_context(|| format!("entry lacks field {name}"))
}

/// A manifest for adapter `test/{name}` storing into queue `name`. `source` is the body of
/// `spec.source` (`sqs: {queueUrl: …}`); `delivery` and `payload` are YAML flow-mapping bodies,
/// e.g. `batchSize: 50`.
pub fn source_manifest(name: &str, source: &str, delivery: &str, payload: &str) -> String {
    format!(
        "apiVersion: switchboard.dev/v1alpha1\n\
         kind: QueueAdapter\n\
         metadata: {{name: {name}, namespace: test}}\n\
         spec:\n\
         \x20 source: {{{source}}}\n\
         \x20 target: {{queue: {name}}}\n\
         \x20 delivery: {{{delivery}}}\n\
         \x20 payload: {{{payload}}}\n"
    )
}

/// [`source_manifest`] for Redis: `redis` is the body of `spec.source.redis`.
pub fn adapter_manifest(name: &str, redis: &str, delivery: &str, payload: &str) -> String {
    source_manifest(name, &format!("redis: {{{redis}}}"), delivery, payload)
}

/// A stream-mode manifest reading `stream` (see [`adapter_manifest`]).
pub fn stream_manifest(name: &str, stream: &str, delivery: &str, payload: &str) -> String {
    adapter_manifest(
        name,
        &format!("mode: stream, stream: {stream}"),
        delivery,
        payload,
    )
}

/// `body` parsed as JSON and written back in serde_json's canonical form (object keys
/// sorted), as PostgreSQL's jsonb gives it back.
pub fn canonical_json(body: &[u8]) -> Result<String> {
    let value: serde_json::Value =
        serde_json::from_slice(body).with_context(|| format!("not JSON: {body:?}"))?;
    Ok(value.to_string())
}
