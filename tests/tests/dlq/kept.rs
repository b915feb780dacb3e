//! `dlq redrive` of the dead letters kept in PostgreSQL, for every broker with a source: the
//! broker's dead-letter destination refuses a poison letter for good (as the contract suite's
//! `refuse_dead_letters` makes it), the worker keeps it in the `dead_letters` table, `dlq list`
//! shows it, and `dlq redrive --all` with a fixed worker running sends it back to the source
//! with its key: exactly one todo with its body, no row left. A redrive killed between the send
//! and the row's delete, then run again, still makes one todo. The plugins' send, which the
//! redrive uses, is `switchboard-worker send` too: tried here for the brokers it gained.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use sqlx::Connection as _;
use switchboard_tests::brokers::{
    AmqpClassicBroker, BrokerFixture, GatewayBroker, KafkaBroker, NatsBroker, RedisListBroker,
    RedisStreamBroker, SqsBroker,
};
use switchboard_tests::send::send;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{WorkerProcess, worker_binary};
use switchboard_tests::{Fixture, source_manifest};

use super::{body_of, letters_listed, path_text};

const LONG: Duration = Duration::from_secs(120);

/// Not JSON: poison under `format: json`, a JSON string under `format: auto`.
const POISON: &[u8] = b"{\"order\": broken, kept";

/// One adapter over broker `B` whose dead-letter destination refuses every letter.
struct Refusing<B> {
    fx: Fixture,
    broker: B,
    name: &'static str,
    source: String,
}

impl<B: BrokerFixture> Refusing<B> {
    async fn start(name: &'static str) -> Result<Self> {
        let mut fx = Fixture::start().await?;
        let (broker, env) = B::start(&fx).await?;
        fx.extra_env = env;
        let source = broker.create(&fx, name).await?;
        broker.refuse_dead_letters(&fx, name).await?;
        Ok(Self {
            fx,
            broker,
            name,
            source,
        })
    }

    /// The manifest: strict (`format: json`) or, once fixed, `format: auto`. Same adapter.
    fn manifest(&self, fixed: bool) -> Result<PathBuf> {
        let delivery = format!(
            "{}, batchSize: 10, maxDeliveries: 5",
            self.broker.delivery()
        );
        let payload = if fixed {
            "format: auto"
        } else {
            "format: json"
        };
        self.fx.manifest(
            &format!("{}.yaml", self.name),
            &source_manifest(self.name, &self.source, &delivery, payload),
        )
    }

    /// Produces the poison letter and runs the strict worker until it keeps it in PostgreSQL
    /// and acknowledged it; stops that worker. Returns the manifest's path.
    async fn keep_poison(&self) -> Result<String> {
        self.broker
            .produce(&self.fx, self.name, vec![POISON.to_vec()])
            .await?;
        let strict = self.fx.worker(&self.manifest(false)?, "strict")?;
        wait_for(LONG, "the poison kept in PostgreSQL", || async {
            Ok(!self.fx.database_dead_letters(self.name).await?.is_empty()
                && self.broker.unacknowledged(&self.fx, self.name).await? == 0)
        })
        .await
        .map_err(|err| err.context(strict.log_tail()))?;
        strict.kill()?;
        self.free_redis_key()?;
        let kept = self.fx.database_dead_letters(self.name).await?;
        ensure!(
            kept == vec![(POISON.to_vec(), "invalid_json".to_owned())],
            "one letter kept, byte-identical: {kept:?}"
        );
        Ok(path_text(&self.manifest(true)?)?.to_owned())
    }

    /// A Redis adapter's dead-letter key freed, as an operator does after the incident: the
    /// string that refused the letters fails every stream or list command on the key, `dlq`'s
    /// reading of the broker's letters too. Other brokers have no such key: nothing to do.
    fn free_redis_key(&self) -> Result<()> {
        let mut conn = self.fx.redis.connection()?;
        let key = format!("{}.dlq", self.name);
        let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn)?;
        if kind == "string" {
            redis::cmd("DEL").arg(&key).query::<i64>(&mut conn)?;
        }
        Ok(())
    }

    /// `switchboard-worker dlq <args>` with the fixture's environment.
    fn dlq(&self, args: &[&str]) -> Result<Command> {
        let mut cmd = Command::new(worker_binary()?);
        cmd.arg("dlq")
            .args(args)
            .env("DATABASE_URL", &self.fx.env.database_url)
            .env("REDIS_URL", &self.fx.env.redis_url)
            .envs(self.fx.extra_env.iter().map(|(key, value)| (key, value)))
            .stdin(Stdio::null());
        Ok(cmd)
    }

    /// `dlq redrive --all`, which must succeed having redriven one letter.
    fn redrive_one(&self, file: &str) -> Result<()> {
        let output = self.dlq(&["redrive", "--file", file, "--all"])?.output()?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        ensure!(
            output.status.success() && stdout.contains("1 redriven") && stdout.contains("0 failed"),
            "redrive ({:?}): {stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    }

    /// The fixed worker took everything redriven: exactly one todo, the poison's body, and
    /// no kept row left.
    async fn one_todo_no_row(&self, worker: &WorkerProcess) -> Result<()> {
        wait_for(LONG, "the copy stored and acknowledged", || async {
            Ok(self.fx.todo_count(self.name).await? >= 1
                && self.broker.unacknowledged(&self.fx, self.name).await? == 0)
        })
        .await
        .map_err(|err| err.context(worker.log_tail()))?;
        let text = std::str::from_utf8(POISON)?;
        let stored = self.fx.stored_payloads(self.name).await?;
        ensure!(
            stored == vec![serde_json::Value::from(text).to_string()],
            "exactly one todo with the letter's body: {stored:?}"
        );
        let left = self.fx.database_dead_letters(self.name).await?;
        ensure!(left.is_empty(), "no kept row left: {left:?}");
        Ok(())
    }
}

/// The kept letter is listed (marked as kept) and `redrive --all` puts it back: one todo.
async fn kept_letter_is_redriven_to_the_source<B: BrokerFixture>(name: &'static str) -> Result<()> {
    let case = Refusing::<B>::start(name).await?;
    let file = case.keep_poison().await?;
    let listed = case
        .dlq(&["list", "--file", &file, "-o", "json"])?
        .output()?;
    ensure!(
        listed.status.success(),
        "list: {}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let letters = letters_listed(&listed.stdout)?;
    ensure!(letters.len() == 1, "the kept letter alone: {letters:?}");
    ensure!(
        body_of(&letters[0])? == POISON
            && letters[0]["origin"]
                .as_str()
                .is_some_and(|origin| origin.contains("kept in PostgreSQL")),
        "the kept letter, byte-identical: {}",
        letters[0]
    );
    let worker = case.fx.worker(&case.manifest(true)?, "fixed")?;
    case.redrive_one(&file)?;
    case.one_todo_no_row(&worker).await
}

/// Holds a lock on every kept row (`SELECT … FOR UPDATE`) on its own connection: a redrive's
/// delete of a row waits for it, after the copy was sent.
struct RowsLock {
    conn: sqlx::PgConnection,
}

impl RowsLock {
    async fn take(database_url: &str) -> Result<Self> {
        let mut conn = sqlx::PgConnection::connect(database_url).await?;
        sqlx::query("BEGIN").execute(&mut conn).await?;
        sqlx::query("SELECT id FROM dead_letters FOR UPDATE")
            .fetch_all(&mut conn)
            .await?;
        Ok(Self { conn })
    }

    async fn release(mut self) -> Result<()> {
        sqlx::query("ROLLBACK").execute(&mut self.conn).await?;
        Ok(())
    }
}

/// A redrive SIGKILLed after the broker confirmed the copy and before the row was deleted
/// leaves the row; run again, it sends a second copy with the same key: still one todo.
async fn redrive_killed_between_send_and_delete_makes_one_todo<B: BrokerFixture>(
    name: &'static str,
) -> Result<()> {
    let case = Refusing::<B>::start(name).await?;
    let file = case.keep_poison().await?;
    let worker = case.fx.worker(&case.manifest(true)?, "fixed")?;
    let lock = RowsLock::take(&case.fx.env.database_url).await?;
    let mut redrive = case
        .dlq(&["redrive", "--file", &file, "--all"])?
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    wait_for(
        LONG,
        "the copy stored, the row's delete waiting",
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE 'DELETE FROM dead_letters%'",
            )
            .fetch_one(case.fx.pool())
            .await?;
            Ok(waiting > 0 && case.fx.todo_count(case.name).await? == 1)
        },
    )
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    redrive.kill()?;
    redrive.wait()?;
    // PostgreSQL notices a dead client only when it next talks to it: the killed command's
    // delete would still run once the lock is released. Its connection is ended, as a server
    // that noticed would.
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE query LIKE 'DELETE FROM dead_letters%'",
    )
    .fetch_all(case.fx.pool())
    .await?;
    ensure!(ended == [true], "the killed command's delete: {ended:?}");
    wait_for(LONG, "the killed command's connection gone", || async {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'DELETE FROM dead_letters%'",
        )
        .fetch_one(case.fx.pool())
        .await?;
        Ok(left == 0)
    })
    .await?;
    lock.release().await?;
    let kept = case.fx.database_dead_letters(case.name).await?;
    ensure!(kept.len() == 1, "the row outlives the kill: {kept:?}");

    case.redrive_one(&file)?;
    case.one_todo_no_row(&worker)
        .await
        .context("after the rerun")
}

#[tokio::test]
async fn redis_stream_kept_letter_is_redriven() -> Result<()> {
    kept_letter_is_redriven_to_the_source::<RedisStreamBroker>("keptstream").await
}

#[tokio::test]
async fn redis_list_kept_letter_is_redriven() -> Result<()> {
    kept_letter_is_redriven_to_the_source::<RedisListBroker>("keptlist").await
}

#[tokio::test]
async fn sqs_kept_letter_is_redriven() -> Result<()> {
    kept_letter_is_redriven_to_the_source::<SqsBroker>("kept-sqs").await
}

#[tokio::test]
async fn nats_kept_letter_is_redriven() -> Result<()> {
    kept_letter_is_redriven_to_the_source::<NatsBroker>("keptnats").await
}

#[tokio::test]
async fn amqp_kept_letter_is_redriven() -> Result<()> {
    kept_letter_is_redriven_to_the_source::<AmqpClassicBroker>("kept-amqp").await
}

#[tokio::test]
async fn kafka_kept_letter_is_redriven() -> Result<()> {
    kept_letter_is_redriven_to_the_source::<KafkaBroker>("kept-kafka").await
}

#[tokio::test]
async fn gateway_kept_letter_is_redriven() -> Result<()> {
    kept_letter_is_redriven_to_the_source::<GatewayBroker>("kept-gateway").await
}

#[tokio::test]
async fn redis_stream_kept_redrive_killed_between_send_and_delete_makes_one_todo() -> Result<()> {
    redrive_killed_between_send_and_delete_makes_one_todo::<RedisStreamBroker>("keptkill").await
}

/// `switchboard-worker send --attr level=L0 [--attr extra]` to a source of broker `B`: one todo
/// with the body, and the attributes among its event's headers where the broker has headers
/// (not a Redis list).
async fn sent_message_is_stored<B: BrokerFixture>(
    name: &'static str,
    extra: Option<&str>,
    headers: bool,
) -> Result<()> {
    let mut fx = Fixture::start().await?;
    let (broker, env) = B::start(&fx).await?;
    fx.extra_env = env;
    let source = broker.create(&fx, name).await?;
    let manifest = fx.manifest(
        &format!("{name}.yaml"),
        &source_manifest(name, &source, broker.delivery(), ""),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    let env = [("REDIS_URL".to_owned(), fx.env.redis_url.clone())];
    fx.extra_env.extend(env);
    let attributes: Vec<&str> = std::iter::once("level=L0").chain(extra).collect();
    send(&fx, &manifest, &attributes, br#"{"content":"hello"}"#)?;
    wait_for(LONG, "1 todo, nothing un-acknowledged", || async {
        Ok(fx.todo_count(name).await? >= 1 && broker.unacknowledged(&fx, name).await? == 0)
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    fx.assert_stored_exactly(name, &[br#"{"content":"hello"}"#.to_vec()])
        .await?;
    let carried: serde_json::Value = sqlx::query_scalar(
        "SELECT e.headers FROM todos t JOIN events e ON e.id = t.event_id WHERE t.queue = $1",
    )
    .bind(name)
    .fetch_one(fx.pool())
    .await?;
    let text = carried.to_string();
    ensure!(
        text.contains("L0") == headers && text.contains("chunk_id") == headers,
        "the attributes among the event's headers: {headers}: {text}"
    );
    Ok(())
}

#[tokio::test]
async fn send_to_a_redis_stream_ends_in_one_todo() -> Result<()> {
    sent_message_is_stored::<RedisStreamBroker>("sentstream", None, true).await
}

#[tokio::test]
async fn send_to_a_redis_list_ends_in_one_todo() -> Result<()> {
    sent_message_is_stored::<RedisListBroker>("sentlist", None, false).await
}

#[tokio::test]
async fn send_to_nats_ends_in_one_todo() -> Result<()> {
    sent_message_is_stored::<NatsBroker>("sentnats", Some("Nats-Subject=sentnats.x"), true).await
}

#[tokio::test]
async fn send_to_rabbitmq_ends_in_one_todo() -> Result<()> {
    sent_message_is_stored::<AmqpClassicBroker>("sent-amqp", None, true).await
}

#[tokio::test]
async fn send_to_kafka_ends_in_one_todo() -> Result<()> {
    sent_message_is_stored::<KafkaBroker>("sent-kafka", None, true).await
}
