//! Events in time partitions, on a real PostgreSQL: exactly one todo per message inside the dedup
//! window — after the first delivery's partition rotated, and across partition boundaries with
//! concurrent ingesters —, retention by dropping partitions while ingests run, ingestion that
//! does not wait for maintenance, and the online migration of an unpartitioned `events` table.
//! Partitions last a second or two here (the product's last a day): the same statements.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use sqlx::{Connection, PgConnection, PgPool};
use switchboard_store::{Dedup, IngestBatch, Lookup, NewEvent, Store, StoreError, Stored};
use switchboard_tests::servers::Postgres;
use switchboard_tests::wait::wait_for;
use switchboard_tests::{migrate_before, short_event_partitions};

/// A migrated database whose partitions hold `interval` each, and a store for the ingesters
/// whose statements run under a timeout within `grace`.
async fn partitioned(interval: Duration, grace: Duration) -> Result<(Postgres, Store)> {
    let postgres = Postgres::start()?;
    let store = ingester(&postgres, grace).await?;
    store.migrate().await?;
    // The partition the migration created is a day long: start from short ones.
    short_event_partitions(&store, interval, grace).await?;
    Ok((postgres, store))
}

/// A store whose statements PostgreSQL cancels within `grace`.
async fn ingester(postgres: &Postgres, grace: Duration) -> Result<Store> {
    Ok(Store::connect(&postgres.url(), 2, "storage-test")
        .await?
        .with_operation_timeout(grace))
}

fn event(external_id: &str, key: &str, n: usize) -> NewEvent {
    NewEvent {
        external_id: external_id.to_owned(),
        idempotency_key: key.to_owned(),
        payload: format!("{{\"n\":{n}}}"),
        headers: "{}".to_owned(),
        traceparent: None,
        tracestate: None,
        lookup: Lookup::Untimed,
    }
}

/// The database's clock, Unix ms (a broker's clock in sync with it).
async fn db_now_ms(store: &Store) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
            .fetch_one(store.pool())
            .await?,
    )
}

/// [`event`] with the broker time `sent_at_ms` every delivery of it repeats.
fn timed(external_id: &str, key: &str, n: usize, sent_at_ms: i64) -> NewEvent {
    NewEvent {
        lookup: Lookup::Since(sent_at_ms),
        ..event(external_id, key, n)
    }
}

/// One batch of `events` from `source` into `queue`, retried while the database says wait.
async fn ingest(
    store: &Store,
    source: &str,
    queue: &str,
    dedup: Dedup,
    events: &[NewEvent],
) -> Result<Vec<Stored>> {
    let batch = IngestBatch {
        source,
        queue,
        dedup,
        positions: &[],
        events,
    };
    let started = Instant::now();
    loop {
        match store.ingest_batch(&batch).await {
            Err(err) if err.is_retryable() && started.elapsed() < Duration::from_secs(60) => {}
            done => return done.map_err(anyhow::Error::from),
        }
    }
}

/// Holds every ingest of `source` that advances its position `p` at its checkpoint (after its
/// events and keys are written, before it commits): a row lock, released with the transaction.
async fn hold_checkpoint(
    store: &Store,
    source: &str,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut blocker = store.pool().begin().await?;
    sqlx::query(
        "INSERT INTO source_positions (source, partition, position) VALUES ($1, 'p', '{0}')",
    )
    .bind(source)
    .execute(&mut *blocker)
    .await?;
    Ok(blocker)
}

/// Ingests `message` on `ingester` in a task of its own, advancing position `p` (so that
/// [`hold_checkpoint`] holds it).
fn ingest_held(
    ingester: Store,
    source: &'static str,
    queue: &'static str,
    message: NewEvent,
) -> tokio::task::JoinHandle<Result<Vec<Stored>, StoreError>> {
    tokio::spawn(async move {
        let (events, positions) = (
            [message],
            [switchboard_store::Position {
                partition: "p".to_owned(),
                value: vec![1],
            }],
        );
        let batch = IngestBatch {
            source,
            queue,
            dedup: Dedup::NativeId,
            positions: &positions,
            events: &events,
        };
        ingester.ingest_batch(&batch).await
    })
}

/// Waits until the database's clock is in a partition later than the one holding `now()`.
async fn next_partition(store: &Store) -> Result<()> {
    let upper: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM upper)::float8 FROM event_partitions \
         WHERE lower <= now() AND now() < upper",
    )
    .fetch_one(store.pool())
    .await
    .context("no partition holds now()")?;
    wait_for(Duration::from_secs(30), "the partition rotates", || async {
        let now: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
            .fetch_one(store.pool())
            .await?;
        Ok(now >= upper)
    })
    .await
}

/// Per source: how many events and todos each key has, over both event tables.
async fn events_per_key(pool: &PgPool, source: &str) -> Result<BTreeMap<String, i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT external_id, count(*) FROM \
         (SELECT external_id FROM events WHERE source = $1 \
          UNION ALL SELECT external_id FROM events_unpartitioned WHERE source = $1) e \
         GROUP BY external_id",
    )
    .bind(source)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

async fn todos_per_key(pool: &PgPool, queue: &str) -> Result<BTreeMap<String, i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT idempotency_key, count(*) FROM todos WHERE queue = $1 GROUP BY idempotency_key",
    )
    .bind(queue)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// The native id kinds every broker gives, by the shape of their ids: a Redis stream entry id
/// (broker time in it), an SQS MessageId (random), a RabbitMQ message-id (producer's text, no
/// broker time).
fn native_ids(kind: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| match kind {
            "stream" => format!("1765000000{i:03}-{i}"),
            "sqs" => format!(
                "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
                fastrand::u32(..),
                fastrand::u16(..),
                fastrand::u16(..0xfff),
                fastrand::u16(..0xfff),
                fastrand::u64(..1 << 48)
            ),
            _ => format!("order-{i}-{}", fastrand::u32(..)),
        })
        .collect()
}

#[tokio::test]
async fn a_native_id_redelivered_after_its_partition_rotated_creates_no_second_todo() -> Result<()>
{
    let (_postgres, store) = partitioned(Duration::from_secs(1), Duration::from_secs(1)).await?;
    for kind in ["stream", "sqs", "amqp"] {
        let source = format!("{kind}:test/rotated");
        let queue = format!("rotated-{kind}");
        let ids = native_ids(kind, 100);
        // A stream entry id and an SQS MessageId come with the broker's time, looked for from
        // then on; a RabbitMQ message-id is the producer's: looked for everywhere.
        let sent = db_now_ms(&store).await? - 50;
        let events: Vec<NewEvent> = ids
            .iter()
            .enumerate()
            .map(|(n, id)| match kind {
                "amqp" => event(id, &format!("{source}:{id}"), n),
                _ => timed(id, &format!("{source}:{id}"), n, sent),
            })
            .collect();
        let first = ingest(&store, &source, &queue, Dedup::NativeId, &events).await?;
        ensure!(first.iter().all(|s| *s == Stored::New), "{kind}: {first:?}");
        // Half of the todos are done: a native id stays a duplicate whatever its todo's status.
        sqlx::query(
            "UPDATE todos SET status = 'done' WHERE queue = $1 AND (payload->>'n')::int % 2 = 0",
        )
        .bind(&queue)
        .execute(store.pool())
        .await?;
        for rotation in 1..=2 {
            next_partition(&store).await?;
            let again = ingest(&store, &source, &queue, Dedup::NativeId, &events).await?;
            ensure!(
                again.iter().all(|s| *s == Stored::Duplicate),
                "{kind}, rotation {rotation}: a redelivery was stored again: {again:?}"
            );
        }
        let todos = todos_per_key(store.pool(), &queue).await?;
        let expected: BTreeSet<String> = ids.iter().map(|id| format!("{source}:{id}")).collect();
        ensure!(
            todos.keys().cloned().collect::<BTreeSet<_>>() == expected
                && todos.values().all(|n| *n == 1),
            "{kind}: every key once: {todos:?}"
        );
    }
    ensure!(
        store.event_partitions().await?.len() >= 3,
        "the redeliveries came in later partitions"
    );
    Ok(())
}

#[tokio::test]
async fn a_body_hash_collapses_while_its_todo_is_live_across_partitions() -> Result<()> {
    let (_postgres, store) = partitioned(Duration::from_secs(1), Duration::from_secs(1)).await?;
    let (source, queue) = ("redis:test/list", "bodies");
    let events: Vec<NewEvent> = (0..50)
        .map(|n| {
            let hash = format!("sha256:{n:064x}");
            event(&hash, &format!("{source}:{hash}"), n)
        })
        .collect();
    let first = ingest(&store, source, queue, Dedup::BodyHash, &events).await?;
    ensure!(first.iter().all(|s| *s == Stored::New), "{first:?}");
    next_partition(&store).await?;
    let live = ingest(&store, source, queue, Dedup::BodyHash, &events).await?;
    ensure!(
        live.iter().all(|s| *s == Stored::Duplicate),
        "live todos collapse their bodies in a later partition: {live:?}"
    );
    sqlx::query("UPDATE todos SET status = 'done' WHERE queue = $1")
        .bind(queue)
        .execute(store.pool())
        .await?;
    let after_done = ingest(&store, source, queue, Dedup::BodyHash, &events).await?;
    ensure!(
        after_done.iter().all(|s| *s == Stored::New),
        "a body whose todo is done is a new todo (the documented trade-off): {after_done:?}"
    );
    Ok(())
}

/// Four ingesters deliver the same fresh batch at once, round after round, for five partition
/// boundaries with the grace short enough that most rounds run outside it: every key ends with
/// one event and one todo, and exactly one ingester was told it stored it.
#[tokio::test]
async fn concurrent_ingesters_across_partition_boundaries_store_each_message_once() -> Result<()> {
    const INGESTERS: usize = 4;
    let interval = Duration::from_millis(700);
    let grace = Duration::from_millis(300);
    let (postgres, store) = partitioned(interval, grace).await?;
    let (source, queue) = ("sqs:test/concurrent", "concurrent");
    let mut stores = Vec::new();
    for _ in 0..INGESTERS {
        stores.push(ingester(&postgres, grace).await?);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(INGESTERS));
    let go_on = Arc::new(std::sync::atomic::AtomicBool::new(true));
    // Every other round's messages carry a broker time, the same for all their deliveries.
    let sent = db_now_ms(&store).await?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (ingester, store) in stores.into_iter().enumerate() {
        let (barrier, go_on) = (barrier.clone(), go_on.clone());
        tasks.push(tokio::spawn(async move {
            let mut stored = Vec::new();
            let mut round = 0usize;
            loop {
                barrier.wait().await;
                let mut events: Vec<NewEvent> = (0..40)
                    .map(|n| {
                        let id = format!("r{round}-m{n}");
                        let key = format!("{source}:{id}");
                        match round % 2 {
                            0 => event(&id, &key, n),
                            _ => timed(&id, &key, n, sent + round as i64),
                        }
                    })
                    .collect();
                fastrand::shuffle(&mut events);
                let outcomes = ingest(&store, source, queue, Dedup::NativeId, &events).await?;
                for (e, outcome) in events.iter().zip(outcomes) {
                    if outcome == Stored::New {
                        stored.push(e.external_id.clone());
                    }
                }
                // One decides for all whether another round starts.
                if ingester == 0 {
                    go_on.store(started.elapsed() < interval * 7, Ordering::SeqCst);
                }
                barrier.wait().await;
                if !go_on.load(Ordering::SeqCst) {
                    return anyhow::Ok((stored, round + 1));
                }
                round += 1;
            }
        }));
    }
    let mut told_stored = BTreeMap::<String, usize>::new();
    let mut rounds = 0;
    for task in tasks {
        let (stored, ran) = task.await??;
        rounds = ran;
        for id in stored {
            *told_stored.entry(id).or_default() += 1;
        }
    }
    let events = events_per_key(store.pool(), source).await?;
    let todos = todos_per_key(store.pool(), queue).await?;
    ensure!(
        events.len() == rounds * 40 && events.values().all(|n| *n == 1),
        "one event per message over {rounds} rounds: {} messages, duplicates {:?}",
        events.len(),
        events.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
    ensure!(
        todos.len() == rounds * 40 && todos.values().all(|n| *n == 1),
        "one todo per message"
    );
    ensure!(
        told_stored.len() == rounds * 40 && told_stored.values().all(|n| *n == 1),
        "exactly one ingester stored each message"
    );
    let spread: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT tableoid) FROM events WHERE source = $1")
            .bind(source)
            .fetch_one(store.pool())
            .await?;
    ensure!(
        spread >= 5,
        "the rounds crossed partition boundaries: {spread} partitions"
    );
    eprintln!("{rounds} rounds of {INGESTERS} ingesters over {spread} partitions");
    Ok(())
}

/// The race across a partition boundary, staged: the first delivery starts just before a
/// partition boundary and is held mid-statement (its event written, not committed); the
/// redelivery starts just after the boundary, in the next partition, where no partition's
/// unique index can see the first. It waits for the first to end and is a duplicate: one
/// event, one todo. Without a broker time the key's unique index in `event_keys` closes it
/// too; with one (below) only the partition locks do.
#[tokio::test]
async fn a_redelivery_racing_its_first_delivery_across_a_boundary_is_a_duplicate() -> Result<()> {
    race_across_a_boundary(false).await
}

/// The same race for a message with a broker time (sent just before its first delivery):
/// looked for from that time on, which still covers the partition before the boundary.
#[tokio::test]
async fn a_timed_redelivery_racing_its_first_delivery_across_a_boundary_is_a_duplicate()
-> Result<()> {
    race_across_a_boundary(true).await
}

async fn race_across_a_boundary(with_broker_time: bool) -> Result<()> {
    let (postgres, store) =
        partitioned(Duration::from_secs(2), Duration::from_millis(1500)).await?;
    let (source, queue) = ("amqp:test/straddle", "straddle");
    let blocker = hold_checkpoint(&store, source).await?;
    // The partition for now exists (the first ingest creates it).
    ingest(
        &store,
        "warm:up",
        "warm",
        Dedup::NativeId,
        &[event("w", "w", 0)],
    )
    .await?;
    let upper: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM upper)::float8 FROM event_partitions \
         WHERE lower <= now() AND now() < upper",
    )
    .fetch_one(store.pool())
    .await?;
    let first_store = ingester(&postgres, Duration::from_millis(1500)).await?;
    let sent = db_now_ms(&store).await?;
    let message = move || {
        let plain = event("order-1", "amqp:test/straddle:order-1", 1);
        match with_broker_time {
            true => timed("order-1", "amqp:test/straddle:order-1", 1, sent),
            false => plain,
        }
    };
    let now = || async {
        anyhow::Ok(
            sqlx::query_scalar::<_, f64>("SELECT extract(epoch FROM now())::float8")
                .fetch_one(store.pool())
                .await?,
        )
    };
    wait_for(
        Duration::from_secs(10),
        "0.4 s before the boundary",
        || async { Ok(now().await? >= upper - 0.4) },
    )
    .await?;
    let first = ingest_held(first_store, source, queue, message());
    wait_for(
        Duration::from_secs(5),
        "the first delivery waits on the checkpoint",
        || async {
            Ok(sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
             WHERE application_name = 'storage-test' AND wait_event_type = 'Lock' \
               AND query LIKE '%switchboard_ingest%')",
            )
            .fetch_one(store.pool())
            .await?)
        },
    )
    .await?;
    wait_for(Duration::from_secs(5), "the boundary", || async {
        Ok(now().await? >= upper)
    })
    .await?;
    let second_store = ingester(&postgres, Duration::from_millis(1500)).await?;
    let second = tokio::spawn(async move {
        let events = [message()];
        ingest(&second_store, source, queue, Dedup::NativeId, &events).await
    });
    wait_for(
        Duration::from_secs(5),
        "the redelivery waits too",
        || async {
            Ok(sqlx::query_scalar::<_, bool>(
                "SELECT count(*) = 2 FROM pg_stat_activity \
             WHERE application_name = 'storage-test' AND wait_event_type = 'Lock'",
            )
            .fetch_one(store.pool())
            .await?)
        },
    )
    .await?;
    blocker.rollback().await?;
    ensure!(first.await?? == [Stored::New], "the first delivery stores");
    let second = second.await??;
    ensure!(second == [Stored::Duplicate], "the redelivery: {second:?}");
    let events = events_per_key(store.pool(), source).await?;
    ensure!(events.get("order-1") == Some(&1), "one event: {events:?}");
    let partitions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM event_partitions WHERE lower >= to_timestamp($1)")
            .bind(upper)
            .fetch_one(store.pool())
            .await?;
    ensure!(partitions >= 1, "the redelivery ran in the next partition");
    Ok(())
}

/// A broker clock ahead of the database's: the message is stored at its own time, in a
/// partition ahead, and its redeliveries before that time and after it are duplicates. A time
/// older than every partition (a replay of old records) is looked for everywhere.
#[tokio::test]
async fn broker_times_ahead_of_or_behind_the_database_clock_still_dedup() -> Result<()> {
    let (_postgres, store) = partitioned(Duration::from_secs(1), Duration::from_secs(1)).await?;
    let (source, queue) = ("kafka:test/skew", "skew");
    let now = db_now_ms(&store).await?;
    let batch = [
        timed("orders:0:1", "kafka:test/skew:orders:0:1", 1, now + 2_500),
        timed(
            "orders:0:2",
            "kafka:test/skew:orders:0:2",
            2,
            now - 40 * 86_400_000,
        ),
    ];
    let first = ingest(&store, source, queue, Dedup::NativeId, &batch).await?;
    ensure!(first == [Stored::New, Stored::New], "{first:?}");
    let stored_at: f64 = sqlx::query_scalar(
        "SELECT (extract(epoch FROM received_at) * 1000)::float8 FROM events \
         WHERE external_id = 'orders:0:1'",
    )
    .fetch_one(store.pool())
    .await?;
    ensure!(
        (stored_at - (now + 2_500) as f64).abs() < 1.0,
        "stored at its own time, ahead: {stored_at} for {}",
        now + 2_500
    );
    let before = ingest(&store, source, queue, Dedup::NativeId, &batch).await?;
    ensure!(
        before == [Stored::Duplicate; 2],
        "before its time: {before:?}"
    );
    wait_for(
        Duration::from_secs(30),
        "its time and its partition pass",
        || async { Ok(db_now_ms(&store).await? > now + 4_000) },
    )
    .await?;
    let after = ingest(&store, source, queue, Dedup::NativeId, &batch).await?;
    ensure!(after == [Stored::Duplicate; 2], "after its time: {after:?}");
    let todos = todos_per_key(store.pool(), queue).await?;
    ensure!(
        todos.len() == 2 && todos.values().all(|n| *n == 1),
        "{todos:?}"
    );
    Ok(())
}

/// Ingests run all along while maintenance creates and drops partitions for more than three
/// windows: events older than the window are gone (dropped, not deleted), the partitions and
/// the bytes on disk stay bounded, and not one ingest failed.
#[tokio::test]
async fn retention_drops_whole_partitions_and_bounds_the_disk_while_ingests_run() -> Result<()> {
    let interval = Duration::from_millis(500);
    let window = Duration::from_secs(2);
    let (postgres, store) = partitioned(interval, Duration::from_secs(1)).await?;
    let writer = ingester(&postgres, Duration::from_secs(1)).await?;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ingesting = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut batches = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let events: Vec<NewEvent> = (0..50)
                    .map(|n| {
                        let id = format!("b{batches}-m{n}");
                        event(&id, &format!("kafka:test/kept:{id}"), n)
                    })
                    .collect();
                let batch = IngestBatch {
                    source: "kafka:test/kept",
                    queue: "kept",
                    dedup: Dedup::NativeId,
                    positions: &[],
                    events: &events,
                };
                writer.ingest_batch(&batch).await?;
                batches += 1;
            }
            anyhow::Ok(batches)
        }
    });
    let started = Instant::now();
    let (mut dropped, mut rotations) = (0, 0);
    let mut largest = (0usize, 0i64);
    let mut sizes = Vec::new();
    while started.elapsed() < window * 4 {
        let done = store.maintain_events(window, 2).await?;
        dropped += done.dropped.len();
        rotations += usize::from(done.rotated_keys);
        // These keys have no broker time: the bytes count their generations in `event_keys`.
        let (oldest, partitions, bytes): (Option<f64>, i64, i64) = sqlx::query_as(
            "SELECT (SELECT extract(epoch FROM now() - min(received_at))::float8 FROM events), \
                    count(*), coalesce(sum(pg_total_relation_size(name::regclass)), 0)::bigint \
                      + pg_total_relation_size('event_keys_0') \
                      + pg_total_relation_size('event_keys_1') \
             FROM event_partitions",
        )
        .fetch_one(store.pool())
        .await?;
        // An event outlives the window by at most its partition's length (and one run).
        let limit = (window + interval * 2).as_secs_f64();
        ensure!(
            oldest.unwrap_or(0.0) <= limit,
            "the oldest event is {oldest:?} s old, past the window's {limit} s"
        );
        if started.elapsed() > window + interval {
            largest = largest.max((partitions as usize, bytes));
            sizes.push(bytes);
        }
    }
    stop.store(true, Ordering::SeqCst);
    let batches = ingesting.await??;
    let most = (window.as_millis() / interval.as_millis()) as usize + 2 + 2;
    ensure!(
        largest.0 <= most,
        "at most {most} partitions (window, ahead, the current and one being dropped): {largest:?}"
    );
    ensure!(
        dropped >= 6 && rotations >= 2,
        "partitions were dropped ({dropped}) and the keys' generations rotated ({rotations})"
    );
    // Ingesting all along at one pace, the disk holds a window's worth: the last third of the
    // run needs no more than the first (twice, for the pace's noise).
    let third = sizes.len() / 3;
    let first = sizes[..third].iter().max().copied().unwrap_or(0);
    let last = sizes[sizes.len() - third..]
        .iter()
        .max()
        .copied()
        .unwrap_or(0);
    ensure!(
        third > 0 && last <= first * 2,
        "the bytes in events stay bounded: {first} at most in the first third, {last} in the last"
    );
    eprintln!(
        "{batches} batches of 50 ingested meanwhile; {dropped} partitions dropped; bytes in \
         events after the first window between {} and {}",
        sizes.iter().min().copied().unwrap_or(0),
        sizes.iter().max().copied().unwrap_or(0)
    );
    Ok(())
}

/// Runs maintenance with `window` until it rotates the generations of `event_keys`.
async fn rotate_keys(store: &Store, window: Duration) -> Result<()> {
    wait_for(window * 3, "the keys' generations rotate", || async {
        Ok(store.maintain_events(window, 1).await?.rotated_keys)
    })
    .await
}

/// A key without a broker time is looked for in `event_keys`, not in the partitions: an event
/// left in a partition without its key (as none is written since migration 0010) does not
/// make a duplicate, a key in either generation does — also once its partition is dropped.
/// After two rotations the key is gone, and with it the marker: `event_keys` stays bounded.
#[tokio::test]
async fn keys_without_a_broker_time_are_kept_in_two_generations_for_one_to_two_windows()
-> Result<()> {
    let window = Duration::from_secs(2);
    let (_postgres, store) = partitioned(Duration::from_secs(1), Duration::from_secs(1)).await?;
    let (source, queue) = ("amqp:test/generations", "generations");
    let batch = |first: usize| -> Vec<NewEvent> {
        (first..first + 20)
            .map(|n| event(&format!("order-{n}"), &format!("{source}:order-{n}"), n))
            .collect()
    };
    let (older, newer) = (batch(0), batch(100));
    let stored = ingest(&store, source, queue, Dedup::NativeId, &older).await?;
    ensure!(stored.iter().all(|s| *s == Stored::New), "{stored:?}");

    // An event an hour old without its key: only the partitions could know it.
    sqlx::query("SELECT switchboard_add_event_partition(now() - interval '1 hour')")
        .execute(store.pool())
        .await?;
    sqlx::query(
        "INSERT INTO events (source, external_id, payload, received_at) \
         VALUES ($1, 'order-900', '{}', now() - interval '1 hour')",
    )
    .bind(source)
    .execute(store.pool())
    .await?;
    let unkeyed = ingest(&store, source, queue, Dedup::NativeId, &batch(900)[..1]).await?;
    ensure!(
        unkeyed == [Stored::New],
        "a key without a broker time is not looked for in the partitions: {unkeyed:?}"
    );

    rotate_keys(&store, window).await?;
    let stored = ingest(&store, source, queue, Dedup::NativeId, &newer).await?;
    ensure!(stored.iter().all(|s| *s == Stored::New), "{stored:?}");
    let again = ingest(&store, source, queue, Dedup::NativeId, &older).await?;
    ensure!(
        again.iter().all(|s| *s == Stored::Duplicate),
        "the older generation still knows the keys of the window before: {again:?}"
    );
    let partitions_left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM events WHERE source = $1 AND external_id = 'order-0'",
    )
    .bind(source)
    .fetch_one(store.pool())
    .await?;

    rotate_keys(&store, window).await?;
    let newer_again = ingest(&store, source, queue, Dedup::NativeId, &newer).await?;
    ensure!(
        newer_again.iter().all(|s| *s == Stored::Duplicate),
        "keys a rotation made older are kept one more window: {newer_again:?}"
    );
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT external_id FROM event_keys WHERE source = $1 ORDER BY external_id",
    )
    .bind(source)
    .fetch_all(store.pool())
    .await?;
    let expected: Vec<String> = {
        let mut ids: Vec<String> = newer.iter().map(|e| e.external_id.clone()).collect();
        ids.sort();
        ids
    };
    ensure!(
        keys == expected,
        "after two rotations only the newer keys are kept: {keys:?}"
    );
    eprintln!(
        "order-0's event was still in a partition at the first redelivery: {partitions_left}"
    );
    Ok(())
}

/// How each generation of `event_keys` is indexed, generation 0 first: `btree unique` (0010) or
/// `hash exclusion` (0013).
async fn key_layouts(store: &Store) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT am.amname || CASE WHEN i.indisunique THEN ' unique' \
                                  WHEN con.contype = 'x' THEN ' exclusion' ELSE '' END \
         FROM pg_index i \
         JOIN pg_class c ON c.oid = i.indexrelid \
         JOIN pg_am am ON am.oid = c.relam \
         LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid \
         WHERE i.indrelid IN ('event_keys_0'::regclass, 'event_keys_1'::regclass) \
         ORDER BY i.indrelid::regclass::text",
    )
    .fetch_all(store.pool())
    .await?)
}

/// Keys without a broker time are indexed by a hash of (source, external_id) since migration
/// 0013. An installation whose generation holds keys under 0010's B-tree keeps them there and
/// finds them; the rotation that empties a generation gives it the hash layout (building it over
/// millions of keys would hold every ingest meanwhile). Exactly once throughout, also for two
/// ingests of the same new keys at once, and no ingest reads a generation whole.
#[tokio::test]
async fn keys_under_the_b_tree_are_found_and_each_generation_is_hashed_once_emptied() -> Result<()>
{
    let window = Duration::from_secs(2);
    let postgres = Postgres::start()?;
    let store = ingester(&postgres, Duration::from_secs(1)).await?;
    migrate_before(store.pool(), 13).await?;
    short_event_partitions(&store, Duration::from_secs(1), Duration::from_secs(1)).await?;
    let (source, queue) = ("amqp:test/hashed", "hashed");
    let batch = |first: usize| -> Vec<NewEvent> {
        (first..first + 20)
            .map(|n| event(&format!("order-{n}"), &format!("{source}:order-{n}"), n))
            .collect()
    };
    let all = |stored: Vec<Stored>, expected: Stored, what: &str| -> Result<()> {
        ensure!(stored.iter().all(|s| *s == expected), "{what}: {stored:?}");
        Ok(())
    };
    let (before, between, after) = (batch(0), batch(100), batch(200));
    let stored = ingest(&store, source, queue, Dedup::NativeId, &before).await?;
    all(stored, Stored::New, "before the migration")?;

    store.migrate().await?;
    let layouts = key_layouts(&store).await?;
    ensure!(
        layouts == ["btree unique", "hash exclusion"],
        "the generation holding keys keeps its B-tree, the empty one is hashed: {layouts:?}"
    );
    let again = ingest(&store, source, queue, Dedup::NativeId, &before).await?;
    all(
        again,
        Stored::Duplicate,
        "keys under the B-tree, after the migration",
    )?;

    rotate_keys(&store, window).await?;
    let stored = ingest(&store, source, queue, Dedup::NativeId, &between).await?;
    all(stored, Stored::New, "into the hashed generation")?;
    for (keys, what) in [(&before, "under the B-tree"), (&between, "hashed")] {
        let again = ingest(&store, source, queue, Dedup::NativeId, keys).await?;
        all(again, Stored::Duplicate, what)?;
    }
    ensure!(key_layouts(&store).await? == ["btree unique", "hash exclusion"]);

    rotate_keys(&store, window).await?;
    let layouts = key_layouts(&store).await?;
    ensure!(
        layouts == ["hash exclusion", "hash exclusion"],
        "the rotation that emptied the B-tree's generation hashed it: {layouts:?}"
    );
    let racer = ingester(&postgres, Duration::from_secs(1)).await?;
    let (first, second) = tokio::join!(
        ingest(&store, source, queue, Dedup::NativeId, &after),
        ingest(&racer, source, queue, Dedup::NativeId, &after)
    );
    let news = first?
        .into_iter()
        .zip(second?)
        .map(|pair| match pair {
            (Stored::New, Stored::Duplicate) | (Stored::Duplicate, Stored::New) => Ok(()),
            other => Err(anyhow::anyhow!(
                "each key is new to exactly one ingest: {other:?}"
            )),
        })
        .collect::<Result<Vec<()>>>()?;
    ensure!(news.len() == after.len());
    let again = ingest(&store, source, queue, Dedup::NativeId, &between).await?;
    all(again, Stored::Duplicate, "the hashed older generation")?;
    // `before`'s events went with their partitions (maintenance drops them past the window).
    let events = events_per_key(store.pool(), source).await?;
    ensure!(
        events.values().all(|n| *n == 1)
            && between
                .iter()
                .chain(&after)
                .all(|e| events.contains_key(&e.external_id)),
        "{events:?}"
    );
    let todos = todos_per_key(store.pool(), queue).await?;
    ensure!(
        todos.len() == 60 && todos.values().all(|n| *n == 1),
        "{todos:?}"
    );
    // An ingest's own scans, counted in its transaction (`pg_stat_xact_*`).
    let mut conn = PgConnection::connect(&postgres.url()).await?;
    let mut tx = conn.begin().await?;
    sqlx::query("SET LOCAL statement_timeout = '900ms'")
        .execute(&mut *tx)
        .await?;
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE new_event) FROM switchboard_ingest( \
             $1, $2, false, $3, $3, array_fill('{}'::text, ARRAY[20]), \
             array_fill('{}'::text, ARRAY[20]), array_fill(NULL::text, ARRAY[20]), \
             array_fill(NULL::text, ARRAY[20]), array_fill(NULL::bigint, ARRAY[20]), \
             ARRAY[]::text[], ARRAY[]::text[])",
    )
    .bind(source)
    .bind(queue)
    .bind((300..320).map(|n| format!("order-{n}")).collect::<Vec<_>>())
    .fetch_one(&mut *tx)
    .await?;
    let (sequential, index): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(seq_scan), 0)::bigint, coalesce(sum(idx_scan), 0)::bigint \
         FROM pg_stat_xact_user_tables WHERE relname IN ('event_keys_0', 'event_keys_1')",
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    ensure!(
        stored == 20 && sequential == 0 && index >= 40,
        "no ingest reads a generation whole: {stored} stored, {sequential} sequential scans, \
         {index} index scans"
    );
    Ok(())
}

/// The batch statement writes a key without a broker time with `ON CONFLICT DO NOTHING` into
/// the current generation, whose hash constraint is its arbiter: a second writer of the same key
/// while the first has not committed waits for it and writes nothing — or writes the key if the
/// first rolls back. (Two deliveries in one partition also collide on its unique index, and
/// across a bound within the grace on the bound's lock: this is the guard under both.)
#[tokio::test]
async fn the_hash_constraint_makes_a_second_writer_of_a_key_wait_and_write_nothing() -> Result<()> {
    let (postgres, store) = partitioned(Duration::from_secs(3600), Duration::from_secs(10)).await?;
    const WRITE: &str = "INSERT INTO event_keys (generation, source, external_id) \
                         SELECT keys_generation, 'amqp:test/arbiter', $1 FROM event_storage \
                         ON CONFLICT DO NOTHING";
    for first_commits in [true, false] {
        let key = format!("order-{first_commits}");
        let mut first = PgConnection::connect(&postgres.url()).await?;
        let mut first = first.begin().await?;
        sqlx::query(WRITE).bind(&key).execute(&mut *first).await?;
        let second = {
            let (url, key) = (postgres.url(), key.clone());
            tokio::spawn(async move {
                let mut second = PgConnection::connect(&url).await?;
                anyhow::Ok(
                    sqlx::query(WRITE)
                        .bind(&key)
                        .execute(&mut second)
                        .await?
                        .rows_affected(),
                )
            })
        };
        wait_for(
            Duration::from_secs(10),
            "the second writer waits for the first",
            || async {
                Ok(sqlx::query_scalar::<_, bool>(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND datname = current_database())",
                )
                .fetch_one(store.pool())
                .await?)
            },
        )
        .await?;
        if first_commits {
            first.commit().await?;
        } else {
            first.rollback().await?;
        }
        let written = second.await??;
        let expected = if first_commits { 0 } else { 1 };
        ensure!(
            written == expected,
            "first commits: {first_commits}; the second wrote {written} keys"
        );
        let kept: i64 =
            sqlx::query_scalar("SELECT count(*) FROM event_keys WHERE external_id = $1")
                .bind(&key)
                .fetch_one(store.pool())
                .await?;
        ensure!(kept == 1, "{kept} copies of the key");
    }
    Ok(())
}

/// A rotation waits for an ingest of keys in flight and holds new ones meanwhile: the key it
/// wrote is in the generation that becomes the older, and its redelivery is a duplicate.
#[tokio::test]
async fn a_rotation_waits_for_the_ingest_in_flight_and_its_redelivery_is_a_duplicate() -> Result<()>
{
    let window = Duration::from_secs(1);
    let grace = Duration::from_secs(10);
    let (postgres, store) = partitioned(Duration::from_secs(3600), grace).await?;
    let (source, queue) = ("amqp:test/rotating", "rotating");
    let message = || event("order-1", "amqp:test/rotating:order-1", 1);
    let blocker = hold_checkpoint(&store, source).await?;
    let first = ingest_held(ingester(&postgres, grace).await?, source, queue, message());
    let waiting = |count: i64| {
        let pool = store.pool().clone();
        async move {
            Ok(sqlx::query_scalar::<_, bool>(
                "SELECT count(*) = $1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND datname = current_database()",
            )
            .bind(count)
            .fetch_one(&pool)
            .await?)
        }
    };
    wait_for(Duration::from_secs(5), "the first delivery waits", || {
        waiting(1)
    })
    .await?;
    // Due, but held behind the ingest's lock on `event_keys`.
    wait_for(
        Duration::from_secs(5),
        "a window since migration",
        || async {
            Ok(sqlx::query_scalar::<_, bool>(
                "SELECT keys_rotated_at <= now() - make_interval(secs => $1) FROM event_storage",
            )
            .bind(window.as_secs_f64())
            .fetch_one(store.pool())
            .await?)
        },
    )
    .await?;
    // In this task: sqlx's maintenance future is not `Send` for every lifetime.
    let release = async {
        wait_for(Duration::from_secs(5), "the rotation waits too", || {
            waiting(2)
        })
        .await?;
        blocker.rollback().await?;
        anyhow::Ok(())
    };
    let (rotation, released) = tokio::join!(store.maintain_events(window, 1), release);
    released?;
    ensure!(first.await?? == [Stored::New], "the first delivery stores");
    ensure!(rotation?.rotated_keys, "the rotation ran after it");
    let again = ingest(&store, source, queue, Dedup::NativeId, &[message()]).await?;
    ensure!(again == [Stored::Duplicate], "the redelivery: {again:?}");
    Ok(())
}

/// A redriven copy's original key may have been stored with the broker's time (the original
/// was stored, its acknowledgement lost, the broker dead-lettered it): the copy is looked for
/// everywhere. A key a copy stored first is known to later deliveries either way.
#[tokio::test]
async fn a_redriven_copy_is_looked_for_everywhere_and_known_to_later_deliveries() -> Result<()> {
    let (_postgres, store) = partitioned(Duration::from_secs(1), Duration::from_secs(1)).await?;
    let (source, queue) = ("sqs:test/redriven", "redriven");
    let sent = db_now_ms(&store).await? - 50;
    let copy = |id: &str| NewEvent {
        lookup: Lookup::Everywhere,
        ..event(id, &format!("{source}:{id}"), 1)
    };
    let original = [timed("m-1", "sqs:test/redriven:m-1", 1, sent)];
    ensure!(ingest(&store, source, queue, Dedup::NativeId, &original).await? == [Stored::New]);
    next_partition(&store).await?;
    let copied = ingest(&store, source, queue, Dedup::NativeId, &[copy("m-1")]).await?;
    ensure!(
        copied == [Stored::Duplicate],
        "the copy of a stored original: {copied:?}"
    );

    ensure!(ingest(&store, source, queue, Dedup::NativeId, &[copy("m-2")]).await? == [Stored::New]);
    next_partition(&store).await?;
    for (kind, later) in [
        ("untimed", event("m-2", "sqs:test/redriven:m-2", 1)),
        ("timed", timed("m-2", "sqs:test/redriven:m-2", 1, sent)),
        ("copy", copy("m-2")),
    ] {
        let stored = ingest(&store, source, queue, Dedup::NativeId, &[later]).await?;
        ensure!(
            stored == [Stored::Duplicate],
            "a {kind} delivery of a key a copy stored: {stored:?}"
        );
    }
    Ok(())
}

/// The partition for now is missing (maintenance never ran, or failed for longer than it
/// creates ahead): the ingest creates it and stores.
#[tokio::test]
async fn ingestion_does_not_wait_for_maintenance() -> Result<()> {
    let (_postgres, store) = partitioned(Duration::from_secs(3600), Duration::from_secs(1)).await?;
    ensure!(store.event_partitions().await?.is_empty());
    let events = [event("1-0", "redis:test/heal:1-0", 0)];
    let stored = ingest(&store, "redis:test/heal", "heal", Dedup::NativeId, &events).await?;
    ensure!(stored == [Stored::New], "{stored:?}");
    ensure!(store.event_partitions().await?.len() == 1);
    Ok(())
}

/// The batch function keeps one generic plan per session (migration 0011): with
/// `plan_cache_mode = auto` PostgreSQL planned its main statement anew on every call, about
/// 0.9 ms of CPU per batch. A migration that redefines the function with `CREATE OR REPLACE`
/// drops its settings unless it repeats them.
#[tokio::test]
async fn the_batch_function_is_planned_generically_on_the_latest_schema() -> Result<()> {
    let (_postgres, store) = partitioned(Duration::from_secs(3600), Duration::from_secs(1)).await?;
    let settings: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(proconfig) FROM pg_proc WHERE proname = 'switchboard_ingest'",
    )
    .fetch_all(store.pool())
    .await?;
    ensure!(
        settings
            .iter()
            .any(|s| s == "plan_cache_mode=force_generic_plan")
            && settings.iter().any(|s| s == "jit=off")
            && settings.iter().any(|s| s == "enable_nestloop=off"),
        "switchboard_ingest's settings: {settings:?}"
    );
    Ok(())
}

/// The batch statement's joins do not grow with the square of the batch. Its generic plan takes
/// every `unnest` of the batch for ten rows; with 0011 it joined the batch, the events and the
/// todos it inserted (CTE scans) by nested loops, and a batch of 1,000 cost PostgreSQL three
/// times what one of 0010's per-call plans did. The plan of a batch of 1,000, written by
/// `auto_explain` (JSON) to the server's log: every nested loop in it is a per-key probe (its
/// inner side a `LIMIT 1`), none loops over a CTE.
#[tokio::test]
async fn the_batch_statement_joins_its_ctes_without_nested_loops() -> Result<()> {
    let (postgres, _store) =
        partitioned(Duration::from_secs(3600), Duration::from_secs(60)).await?;
    let mut conn = PgConnection::connect(&postgres.url()).await?;
    for setting in [
        "SET statement_timeout = '30s'",
        "LOAD 'auto_explain'",
        "SET auto_explain.log_min_duration = 0",
        "SET auto_explain.log_nested_statements = on",
        "SET auto_explain.log_format = json",
    ] {
        sqlx::query(setting).execute(&mut conn).await?;
    }
    let call = "SELECT count(*) FROM switchboard_ingest('redis:test/joins', 'joins', false, \
         ARRAY(SELECT '1900000000000-' || g FROM generate_series(1, 1000) g), \
         ARRAY(SELECT 'redis:test/joins:' || g FROM generate_series(1, 1000) g), \
         array_fill('{}'::text, ARRAY[1000]), array_fill('{}'::text, ARRAY[1000]), \
         array_fill(NULL::text, ARRAY[1000]), array_fill(NULL::text, ARRAY[1000]), \
         array_fill((extract(epoch FROM now()) * 1000)::bigint, ARRAY[1000]), \
         ARRAY[]::text[], ARRAY[]::text[])";
    let stored: i64 = sqlx::query_scalar(call).fetch_one(&mut conn).await?;
    ensure!(stored == 1000, "the batch returned {stored} rows");
    conn.close().await?;
    let log = postgres.log();
    let plan = log
        .split("plan:")
        .filter_map(|entry| {
            let json = &entry[entry.find('{')?..];
            serde_json::Deserializer::from_str(json)
                .into_iter::<serde_json::Value>()
                .next()?
                .ok()
        })
        .find(|plan| {
            plan["Query Text"]
                .as_str()
                .is_some_and(|q| q.contains("new_todos"))
        })
        .with_context(|| format!("no plan of the batch statement in the log:\n{log}"))?;
    let mut loops = Vec::new();
    nested_loop_inners(&plan["Plan"], &mut loops);
    ensure!(!loops.is_empty(), "the probes are nested loops: {plan}");
    ensure!(
        loops.iter().all(|inner| inner == "Limit"),
        "a nested loop of the batch statement loops over something else than a probe: {loops:?}"
    );
    Ok(())
}

/// The node type of the inner side of every nested loop under `node`.
fn nested_loop_inners(node: &serde_json::Value, inners: &mut Vec<String>) {
    let children = node["Plans"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if node["Node Type"] == "Nested Loop" {
        let inner = children
            .iter()
            .find(|child| child["Parent Relationship"] == "Inner")
            .and_then(|child| child["Node Type"].as_str());
        inners.push(inner.unwrap_or("none").to_owned());
    }
    for child in children {
        nested_loop_inners(child, inners);
    }
}

/// Every key lookup of the batch statement is a probe per key, whatever the statistics: the
/// generic plan is made on a session's first call, possibly while the day's partition is still
/// empty and never analyzed. Before migration 0011 such a partition's plan read every event of
/// the source in it for each batch (a hash anti join over them), so batches grew slower with
/// the partition until autovacuum analyzed it. Here one session stores 40 batches of 500 into
/// a partition that is never analyzed; the next batch's lookups, counted by PostgreSQL in its
/// transaction, read none of the 20,000 events already there.
#[tokio::test]
async fn the_batch_statement_probes_each_key_in_a_partition_never_analyzed() -> Result<()> {
    let (postgres, store) = partitioned(Duration::from_secs(3600), Duration::from_secs(60)).await?;
    let mut conn = PgConnection::connect(&postgres.url()).await?;
    sqlx::query("SET statement_timeout = '30s'")
        .execute(&mut conn)
        .await?;
    let call = "SELECT count(*) FROM switchboard_ingest('redis:test/probe', 'probe', false, \
         ARRAY(SELECT '1900000000000-' || ($1 * 1000 + g) FROM generate_series(1, 500) g), \
         ARRAY(SELECT 'redis:test/probe:' || ($1 * 1000 + g) FROM generate_series(1, 500) g), \
         array_fill('{}'::text, ARRAY[500]), array_fill('{}'::text, ARRAY[500]), \
         array_fill(NULL::text, ARRAY[500]), array_fill(NULL::text, ARRAY[500]), \
         array_fill((extract(epoch FROM now()) * 1000)::bigint, ARRAY[500]), \
         ARRAY[]::text[], ARRAY[]::text[])";
    sqlx::query(call).bind(0_i64).execute(&mut conn).await?;
    let partition: String = sqlx::query_scalar(
        "SELECT name FROM event_partitions WHERE lower <= now() AND now() < upper",
    )
    .fetch_one(&mut conn)
    .await?;
    sqlx::query(&format!(
        "ALTER TABLE {partition} SET (autovacuum_enabled = false)"
    ))
    .execute(&mut conn)
    .await?;
    for batch in 1..40_i64 {
        sqlx::query(call).bind(batch).execute(&mut conn).await?;
    }
    let mut tx = conn.begin().await?;
    sqlx::query(call).bind(40_i64).execute(&mut *tx).await?;
    let (index_scans, fetched, sequential): (i64, i64, i64) = sqlx::query_as(
        "SELECT coalesce(idx_scan, 0), coalesce(idx_tup_fetch, 0), coalesce(seq_tup_read, 0) \
         FROM pg_stat_xact_user_tables WHERE relname = $1",
    )
    .bind(&partition)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    let analyzed: Option<i64> =
        sqlx::query_scalar("SELECT analyze_count FROM pg_stat_user_tables WHERE relname = $1")
            .bind(&partition)
            .fetch_one(store.pool())
            .await?;
    ensure!(
        analyzed == Some(0),
        "{partition} was analyzed: {analyzed:?}"
    );
    ensure!(
        fetched < 500 && sequential == 0 && index_scans >= 500,
        "the 41st batch read {fetched} events by index ({index_scans} scans) and {sequential} by \
         sequential scan of {partition}'s 20,000"
    );
    Ok(())
}

/// An ingest without a statement timeout within the grace (a pooler or role that resets it, a
/// session in REPEATABLE READ) could break dedup at a partition boundary: it is refused,
/// naming the setting, and the worker stops on it rather than retrying.
#[tokio::test]
async fn an_ingest_that_could_outlive_the_grace_is_refused_naming_the_setting() -> Result<()> {
    let (postgres, store) = partitioned(Duration::from_secs(3600), Duration::from_secs(1)).await?;
    let unbounded = Store::connect(&postgres.url(), 1, "unbounded")
        .await?
        .with_operation_timeout(Duration::from_secs(60));
    let events = [event("1-0", "redis:test/slow:1-0", 0)];
    let batch = IngestBatch {
        source: "redis:test/slow",
        queue: "slow",
        dedup: Dedup::NativeId,
        positions: &[],
        events: &events,
    };
    let err = unbounded.ingest_batch(&batch).await.unwrap_err();
    ensure!(
        matches!(err, StoreError::Statement { .. }) && err.is_fatal(),
        "{err:?}"
    );
    let chain = format!("{:#}", anyhow::Error::from(err));
    ensure!(
        chain.contains("statement_timeout") && chain.contains("event_storage.grace"),
        "{chain}"
    );
    ensure!(
        ingest(&store, "redis:test/slow", "slow", Dedup::NativeId, &events).await? == [Stored::New]
    );
    Ok(())
}

/// The batch statement of the release before partitioning, as its workers still run it during
/// an upgrade.
const PREVIOUS_RELEASE_INGEST: &str = r#"
WITH input AS (
    SELECT *, ord = min(ord) OVER (PARTITION BY external_id) AS first_of_id
    FROM unnest($3::text[], $4::text[], $5::text[]) WITH ORDINALITY AS t(external_id, idempotency_key, payload, ord)
), new_events AS (
    INSERT INTO events (source, external_id, payload)
    SELECT $1, external_id, payload::jsonb FROM input WHERE first_of_id
    ORDER BY ord
    ON CONFLICT (source, external_id) DO NOTHING
    RETURNING id, external_id, payload
)
INSERT INTO todos (queue, idempotency_key, event_id, payload)
SELECT $2, input.idempotency_key, new_events.id, new_events.payload
FROM new_events JOIN input USING (external_id)
WHERE input.first_of_id
ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'claimed') DO NOTHING
"#;

/// A database of the previous release holding a million events (and their todos) is migrated
/// while that release's worker ingests fresh messages and redeliveries of old ones: the old
/// worker stops on the new layout (a fatal statement error, nothing acknowledged), the new
/// one takes over its batch; every message has one event and one todo, the redeliveries of
/// events from before the migration are duplicates. Then, once the window has passed the old
/// table's rows, maintenance empties it.
#[tokio::test]
async fn a_million_unpartitioned_events_are_migrated_while_a_worker_ingests() -> Result<()> {
    const OLD: usize = 1_000_000;
    let postgres = Postgres::start()?;
    let store = Store::connect(&postgres.url(), 4, "storage-test").await?;
    migrate_before(store.pool(), 9).await?;
    let (source, queue) = ("sqs:test/upgrade", "upgrade");
    let filled = Instant::now();
    // Tens of seconds on a busy machine: a connection without the store's statement timeout.
    let mut fill = PgConnection::connect(&postgres.url()).await?;
    sqlx::query(
        "INSERT INTO events (source, external_id, payload, received_at) \
         SELECT $1, md5(n::text), jsonb_build_object('n', n), now() - interval '1 day' \
         FROM generate_series(1, $2) n",
    )
    .bind(source)
    .bind(OLD as i64)
    .execute(&mut fill)
    .await?;
    sqlx::query(
        "INSERT INTO todos (queue, idempotency_key, event_id, payload) \
         SELECT $2, $1 || ':' || external_id, id, payload FROM events",
    )
    .bind(source)
    .bind(queue)
    .execute(&mut fill)
    .await?;
    let filled = filled.elapsed();

    let old_ids: Arc<Vec<String>> = Arc::new(
        sqlx::query_scalar("SELECT external_id FROM events ORDER BY random() LIMIT 5000")
            .fetch_all(&mut fill)
            .await?,
    );
    // A batch: 20 fresh messages and 20 redeliveries of old ones.
    let batch = move |b: usize| -> Vec<NewEvent> {
        (0..40)
            .map(|i| {
                let id = if i < 20 {
                    format!("fresh-{b}-{i}")
                } else {
                    old_ids[fastrand::usize(..old_ids.len())].clone()
                };
                event(&id, &format!("{source}:{id}"), i)
            })
            .collect()
    };
    let produced = Arc::new(std::sync::Mutex::new(BTreeSet::<String>::new()));
    let old_worker = tokio::spawn({
        let store = store.clone();
        let produced = produced.clone();
        let batch = batch.clone();
        async move {
            let mut slowest = Duration::ZERO;
            for b in 0.. {
                let events = batch(b);
                produced
                    .lock()
                    .unwrap()
                    .extend(events.iter().map(|e| e.external_id.clone()));
                let column = |f: fn(&NewEvent) -> &str| events.iter().map(f).collect::<Vec<_>>();
                let started = Instant::now();
                let done = sqlx::query(PREVIOUS_RELEASE_INGEST)
                    .bind(source)
                    .bind(queue)
                    .bind(column(|e| &e.external_id))
                    .bind(column(|e| &e.idempotency_key))
                    .bind(column(|e| &e.payload))
                    .execute(store.pool())
                    .await;
                slowest = slowest.max(started.elapsed());
                if let Err(err) = done {
                    return anyhow::Ok((b, events, err, slowest));
                }
            }
            unreachable!()
        }
    });
    wait_for(
        Duration::from_secs(30),
        "the old worker ingests",
        || async { Ok(produced.lock().unwrap().len() >= 400) },
    )
    .await?;
    let migrating = Instant::now();
    store.migrate().await?;
    let migration = migrating.elapsed();
    let (stopped_at, unstored, err, slowest) = old_worker.await??;
    let code = err
        .as_database_error()
        .and_then(|db| db.code())
        .map(|c| c.into_owned());
    ensure!(
        code.as_deref() == Some("42P10"),
        "the old worker stops on the new layout: {err}"
    );
    // The new release: the old worker's last batch was never acknowledged, so it comes again.
    ensure!(
        ingest(&store, source, queue, Dedup::NativeId, &unstored)
            .await?
            .len()
            == 40
    );
    for b in stopped_at + 1..stopped_at + 50 {
        let events = batch(b);
        produced
            .lock()
            .unwrap()
            .extend(events.iter().map(|e| e.external_id.clone()));
        let stored = ingest(&store, source, queue, Dedup::NativeId, &events).await?;
        ensure!(
            stored[20..].iter().all(|s| *s == Stored::Duplicate),
            "a redelivery of an event from before the migration is a duplicate: {stored:?}"
        );
    }
    let events = events_per_key(store.pool(), source).await?;
    let todos = todos_per_key(store.pool(), queue).await?;
    let produced = produced.lock().unwrap().clone();
    ensure!(
        events.len() >= OLD && events.values().all(|n| *n == 1),
        "one event per message"
    );
    ensure!(
        produced
            .iter()
            .all(|id| events.contains_key(id) && todos.get(&format!("{source}:{id}")) == Some(&1)),
        "every message produced has its event and one todo"
    );
    ensure!(
        todos.len() == events.len() && todos.values().all(|n| *n == 1),
        "one todo per event"
    );
    eprintln!(
        "{OLD} events filled in {filled:?}; migrated in {migration:?} (the longest lock: the \
         migration's transaction); the old worker's slowest batch meanwhile {slowest:?}"
    );

    // Past the window (a second here), the old table is emptied, the partitions stay.
    wait_for(Duration::from_secs(10), "a second passes", || async {
        Ok(sqlx::query_scalar::<_, bool>(
            "SELECT unpartitioned_until <= now() - interval '1 second' FROM event_storage",
        )
        .fetch_one(store.pool())
        .await?)
    })
    .await?;
    let done = store.maintain_events(Duration::from_secs(1), 1).await?;
    ensure!(done.emptied_unpartitioned, "{done:?}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM events_unpartitioned")
        .fetch_one(store.pool())
        .await?;
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(store.pool())
        .await?;
    ensure!(
        left == 0 && kept > 0,
        "old table {left} rows, partitions {kept}"
    );
    Ok(())
}

/// Starts the migrations from `version` on while a transaction of the previous release has run
/// `first` (taking its first lock), waits until the migration waits for a lock or backs off from
/// one, then goes on with `then` in that transaction and commits. Neither may fail: a migration
/// that waits for a lock while holding one the previous release's statement takes next
/// deadlocks with it, and PostgreSQL fails one of them.
async fn migrate_between_two_locks(
    version: i64,
    first: &str,
    then: impl AsyncFnOnce(&mut PgConnection) -> Result<()>,
) -> Result<()> {
    let postgres = Postgres::start()?;
    let store = Store::connect(&postgres.url(), 2, "storage-test").await?;
    migrate_before(store.pool(), version).await?;
    let mut previous = PgConnection::connect(&postgres.url()).await?;
    let mut tx = previous.begin().await?;
    sqlx::raw_sql(first).execute(&mut *tx).await?;
    // In this task (the migration's future is not Send): the previous release goes on once the
    // migration waits.
    let previous_release = async {
        wait_for(
            Duration::from_secs(30),
            "the migration waits for a lock or backs off from one",
            || async {
                Ok(sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted) \
                         OR EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep')",
                )
                .fetch_one(store.pool())
                .await?)
            },
        )
        .await?;
        then(&mut tx)
            .await
            .context("the previous release's transaction")?;
        tx.commit().await?;
        anyhow::Ok(())
    };
    let (migrated, previous_release) = tokio::join!(store.migrate(), previous_release);
    previous_release?;
    migrated.context("the migration")?;
    ensure!(
        ingest(
            &store,
            "sqs:test/after",
            "after",
            Dedup::NativeId,
            &[event("a", "k", 1)]
        )
        .await?
            == [Stored::New]
    );
    Ok(())
}

/// The previous release's batch statement locks `events` then `todos` when it is parsed and
/// `todos` then `events` when it runs again from a connection's plan cache: the migration to
/// partitions, started while such a statement holds either, waits for it (CI saw this migration
/// deadlock with the old worker of the test above).
#[tokio::test]
async fn the_partitioning_migration_waits_for_a_previous_statement_holding_either_table()
-> Result<()> {
    for held in ["events", "todos"] {
        migrate_between_two_locks(
            9,
            &format!("LOCK TABLE {held} IN ROW EXCLUSIVE MODE"),
            async |conn| {
                sqlx::query(PREVIOUS_RELEASE_INGEST)
                    .bind("sqs:test/upgrade")
                    .bind("upgrade")
                    .bind(["before"])
                    .bind(["sqs:test/upgrade:before"])
                    .bind([r#"{"n":1}"#])
                    .execute(conn)
                    .await?;
                Ok(())
            },
        )
        .await
        .with_context(|| format!("the previous statement holding {held}"))?;
    }
    Ok(())
}

/// The previous release's batch function reads `event_storage` before it writes `events`: the
/// migration to untimed keys, started while an ingest is between the two, waits for it.
#[tokio::test]
async fn the_untimed_keys_migration_waits_for_a_previous_ingest_between_its_tables() -> Result<()> {
    migrate_between_two_locks(
        10,
        "SET LOCAL statement_timeout = '30s'; SELECT grace FROM event_storage",
        async |conn| {
            sqlx::query(
                "SELECT * FROM switchboard_ingest('sqs:test/upgrade', 'upgrade', false, \
                 ARRAY['before'], ARRAY['sqs:test/upgrade:before'], ARRAY['{}'], ARRAY['{}'], \
                 ARRAY[NULL], ARRAY[NULL], ARRAY[NULL]::bigint[], ARRAY[]::text[], ARRAY[]::text[])",
            )
            .execute(conn)
            .await?;
            Ok(())
        },
    )
    .await
}

/// Partitions are insert-only: autovacuum visits them (vacuum on inserts, PostgreSQL 13+) and
/// analyzes them; they hold no dead rows (retention drops them whole, nothing deletes).
#[tokio::test]
async fn autovacuum_vacuums_and_analyzes_insert_only_partitions_which_hold_no_dead_rows()
-> Result<()> {
    let postgres = Postgres::start_with(&[
        ("fsync", "off"),
        ("synchronous_commit", "off"),
        ("autovacuum_naptime", "1s"),
    ])?;
    let store = ingester(&postgres, Duration::from_secs(1)).await?;
    store.migrate().await?;
    short_event_partitions(&store, Duration::from_secs(3600), Duration::from_secs(1)).await?;
    for batch in 0..20 {
        let events: Vec<NewEvent> = (0..500)
            .map(|n| {
                let id = format!("{batch}-{n}");
                event(&id, &format!("redis:test/vacuum:{id}"), n)
            })
            .collect();
        ingest(
            &store,
            "redis:test/vacuum",
            "vacuum",
            Dedup::NativeId,
            &events,
        )
        .await?;
    }
    wait_for(
        Duration::from_secs(60),
        "autovacuum vacuumed and analyzed the partition",
        || async {
            Ok(sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_user_tables s \
                 JOIN event_partitions p ON s.relid = p.name::regclass \
                 WHERE s.last_autovacuum IS NOT NULL AND s.last_autoanalyze IS NOT NULL)",
            )
            .fetch_one(store.pool())
            .await?)
        },
    )
    .await?;
    let dead: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(s.n_dead_tup), 0)::bigint FROM pg_stat_user_tables s \
         JOIN event_partitions p ON s.relid = p.name::regclass",
    )
    .fetch_one(store.pool())
    .await?;
    ensure!(
        dead == 0,
        "insert-only partitions have no dead rows: {dead}"
    );
    Ok(())
}
