//! The growth row: the worker's throughput into an events table that already holds
//! `--growth-rows` events (half with random keys, half with monotonic ones, arrived over the
//! dedup window's 30 daily partitions) against an empty one — with monotonic keys (Redis stream
//! entry ids) and with random ones (CloudEvents ids, UUIDv4, as SQS MessageIds are). Beside it
//! the previous release's layout (one table, one unique B-tree), which the worker no longer
//! writes: the bench drives it with that release's batch statement, and the current layout
//! with the current one, for the same ratio. One fill per layout and state (a fill takes minutes),
//! then a first round right after it (nothing cached) and `--repeats` rounds: the ratios are of
//! their medians, the first round's beside.

use std::time::Instant;

use anyhow::{Result, ensure};
use sqlx::{Connection, PgConnection};
use switchboard_store::{Dedup, IngestBatch, Lookup, NewEvent};

use crate::measure::{CpuSpent, Measurement};
use crate::table::{Table, print_table, verdict};
use crate::{Bench, Mode, PhaseDatabase, order_body};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct GrowthArgs {
    /// Events already in the table for the growth row (0 skips it).
    #[arg(long, default_value_t = 50_000_000)]
    pub(crate) growth_rows: u64,
    /// Run the growth row only.
    #[arg(long)]
    pub(crate) growth_only: bool,
}

/// The days the filled events arrived over (the default dedup window).
const FILL_DAYS: i32 = 30;

/// Events one fill statement inserts.
const FILL_CHUNK: u64 = 1_000_000;

/// The disk one filled event takes at the growth row's peak: heap, indexes and `event_keys`
/// (25 GB for 50M events when a run filled the disk), and the WAL PostgreSQL keeps besides
/// (`max_wal_size` 8 GB, more between checkpoints).
const DISK_PER_EVENT: u64 = 520;
const DISK_FOR_WAL: u64 = 10 << 30;

/// The kinds of keys, each read by an adapter of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// Redis stream entry ids: every insert at the right end of the index.
    Monotonic,
    /// CloudEvents ids (UUIDv4) on a Redis stream with `envelope: cloudevents`: every insert on
    /// a random index page.
    Random,
}

impl Keys {
    const ALL: [Keys; 2] = [Keys::Monotonic, Keys::Random];

    fn adapter(self) -> &'static str {
        match self {
            Keys::Monotonic => "growth-stream",
            Keys::Random => "growth-random",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Keys::Monotonic => "stream ids",
            Keys::Random => "random ids",
        }
    }

    fn payload(self) -> &'static str {
        match self {
            Keys::Monotonic => "",
            Keys::Random => "envelope: cloudevents",
        }
    }

    fn source(self) -> String {
        format!("redis:test/{}", self.adapter())
    }

    /// The external id the worker stores for message `i` (random: a fresh UUIDv4).
    fn external_id(self, i: usize) -> String {
        match self {
            Keys::Monotonic => format!("1800000000000-{i}"),
            Keys::Random => format!("ce:urn:bench:{}", uuid_v4()),
        }
    }

    /// The body the producer sends for message `i` with key `external_id`.
    fn body(self, i: usize, external_id: &str) -> Vec<u8> {
        match self {
            Keys::Monotonic => order_body(i),
            Keys::Random => {
                let id = external_id.trim_start_matches("ce:urn:bench:");
                let data = String::from_utf8_lossy(&order_body(i)).into_owned();
                format!(
                    r#"{{"specversion":"1.0","id":"{id}","source":"urn:bench","type":"order.created","data":{data}}}"#
                )
                .into_bytes()
            }
        }
    }

    /// Fills `$2` events of source `$1` starting at number `$3`, arrived over the last
    /// [`FILL_DAYS`] days (monotonic keys in arrival order, random keys at random times). In
    /// the current layout random keys, which have no broker time, are also kept in
    /// `event_keys`, in the generation current when they arrived.
    fn fill_sql(self, layout: Layout) -> &'static str {
        match (self, layout) {
            (Keys::Random, Layout::Partitioned) => {
                "WITH filled AS ( \
                 INSERT INTO events (source, external_id, payload, received_at) \
                 SELECT $1, 'ce:urn:bench:' || gen_random_uuid(), \
                        jsonb_build_object('order', n, 'customer', 'customer-' || n % 997, \
                                           'amount_cents', 100 + n % 10000, 'currency', 'EUR'), \
                        now() - make_interval(days => $4) * random() \
                 FROM generate_series($3::bigint, $3::bigint + $2::bigint - 1) AS n \
                 WHERE $5::bigint > 0 \
                 RETURNING source, external_id, received_at) \
                 INSERT INTO event_keys (generation, source, external_id) \
                 SELECT CASE WHEN f.received_at >= s.keys_rotated_at THEN s.keys_generation \
                             ELSE 1 - s.keys_generation END, f.source, f.external_id \
                 FROM filled f, event_storage s"
            }
            (Keys::Monotonic, _) => {
                "INSERT INTO events (source, external_id, payload, received_at) \
                 SELECT $1, (1700000000000 + n) || '-0', \
                        jsonb_build_object('order', n, 'customer', 'customer-' || n % 997, \
                                           'amount_cents', 100 + n % 10000, 'currency', 'EUR'), \
                        now() - make_interval(days => $4) \
                          + make_interval(days => $4) * (n::float8 / $5::float8) \
                 FROM generate_series($3::bigint, $3::bigint + $2::bigint - 1) AS n"
            }
            (Keys::Random, Layout::Previous) => {
                "INSERT INTO events (source, external_id, payload, received_at) \
                 SELECT $1, 'ce:urn:bench:' || gen_random_uuid(), \
                        jsonb_build_object('order', n, 'customer', 'customer-' || n % 997, \
                                           'amount_cents', 100 + n % 10000, 'currency', 'EUR'), \
                        now() - make_interval(days => $4) * random() \
                 FROM generate_series($3::bigint, $3::bigint + $2::bigint - 1) AS n \
                 WHERE $5::bigint > 0" // (the same parameters as the monotonic fill)
            }
        }
    }
}

/// A random UUIDv4 in its text form.
fn uuid_v4() -> String {
    let hex = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
    format!(
        "{}-{}-4{}-{}{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        ["8", "9", "a", "b"][fastrand::usize(..4)],
        &hex[17..20],
        &hex[20..32]
    )
}

/// The previous release's batch statement (before partitioning: one unique B-tree).
const PREVIOUS_RELEASE_INGEST: &str = r#"
WITH input AS (
    SELECT * FROM unnest($3::text[], $4::text[], $5::text[])
                  WITH ORDINALITY AS t(external_id, idempotency_key, payload, ord)
), new_events AS (
    INSERT INTO events (source, external_id, payload)
    SELECT $1, external_id, payload::jsonb FROM input ORDER BY ord
    ON CONFLICT (source, external_id) DO NOTHING
    RETURNING id, external_id, payload
)
INSERT INTO todos (queue, idempotency_key, event_id, payload)
SELECT $2, input.idempotency_key, new_events.id, new_events.payload
FROM new_events JOIN input USING (external_id)
ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'claimed') DO NOTHING
"#;

/// The WAL the server wrote (its position: exact), its full-page images (`pg_stat_wal`) and the
/// pages the database read from outside the shared buffers (`pg_stat_database`). The server is
/// the whole cluster: only the growth row's database is written while it runs. The two
/// statistics are what backends reported: each reports at most once a second, so up to a
/// second of one run may be counted in the next.
struct ServerCounters {
    bytes: i64,
    full_page_images: i64,
    pages_read: i64,
}

impl ServerCounters {
    async fn now(database: &PhaseDatabase) -> Result<Self> {
        let (bytes, full_page_images, pages_read) = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, w.wal_fpi, \
                    d.blks_read \
             FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = current_database()",
        )
        .fetch_one(database.store.pool())
        .await?;
        Ok(Self {
            bytes,
            full_page_images,
            pages_read,
        })
    }

    /// Prints the WAL `run` wrote and the pages it read from the operating system per message
    /// (what a random key costs beyond its CPU: the first change to a page after a checkpoint
    /// writes the whole page to the WAL, a page not in the shared buffers is read).
    async fn print_since(self, database: &PhaseDatabase, run: Measurement) -> Result<Measurement> {
        let now = Self::now(database).await?;
        let per_message = |delta: i64| delta as f64 / run.messages.max(1) as f64;
        println!(
            "  {}: WAL {:.0} bytes/msg, {:.2} full-page images/msg, {:.2} pages read/msg",
            run.name,
            per_message(now.bytes - self.bytes),
            per_message(now.full_page_images - self.full_page_images),
            per_message(now.pages_read - self.pages_read)
        );
        Ok(run)
    }
}

/// One run of a growth round: the worker with keys of a kind, or the raw loop with keys of a
/// kind, with a broker time (`true`) or without.
#[derive(Debug, Clone, Copy)]
enum GrowthRun {
    Worker(Keys),
    Raw(Keys, bool),
}

/// Which layout a database has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    Partitioned,
    Previous,
}

impl Bench {
    /// Refuses, before anything is measured, a growth row the disk cannot hold: a full disk
    /// stops every process on the machine, not only the bench.
    pub(crate) fn ensure_disk_for_growth(&self) -> Result<()> {
        let rows = self.args.growth.growth_rows;
        if rows == 0 {
            return Ok(());
        }
        let dir = self.fx.postgres.data_dir();
        let stat = nix::sys::statvfs::statvfs(&dir)?;
        let free = stat.blocks_available() * stat.fragment_size();
        let needed = rows * DISK_PER_EVENT + DISK_FOR_WAL;
        let gib = |bytes: u64| bytes as f64 / f64::from(1 << 30);
        ensure!(
            free >= needed,
            "--growth-rows {rows} needs about {:.0} GiB free where PostgreSQL keeps its data \
             ({}); {:.1} GiB are: free some or lower --growth-rows (0 skips the growth row)",
            gib(needed),
            dir.display(),
            gib(free)
        );
        Ok(())
    }

    /// The growth rows (a table of their own) and their verdict.
    pub(crate) async fn growth(&mut self) -> Result<()> {
        let rows = self.args.growth.growth_rows;
        if rows == 0 {
            println!("growth row: skipped (--growth-rows 0)");
            return Ok(());
        }
        let mut table = Table::default();
        for layout in [Layout::Partitioned, Layout::Previous] {
            let empty = self.growth_database(layout, 0).await?;
            self.growth_rounds(layout, &empty, 0, &mut table).await?;
            self.drop_database(empty).await?;
            let full = self.growth_database(layout, rows).await?;
            self.growth_rounds(layout, &full, rows, &mut table).await?;
            self.drop_database(full).await?;
        }
        println!();
        print_table(&table);
        println!();
        println!(
            "growth: {} events (half random, half monotonic keys); the ratios of the median of \
             {} rounds, then of the first round (right after the fill's checkpoint, nothing \
             cached)",
            existing(rows),
            self.args.repeats
        );
        // Random keys with a broker time (SQS MessageIds) are looked for from that time on;
        // without one (a CloudEvents id, a RabbitMQ message-id) in the two generations of
        // `event_keys`.
        for (row, target) in [
            ("growth worker stream ids", false),
            ("growth worker random ids", true),
            ("growth raw stream ids", false),
            ("growth raw random ids with broker time", true),
            ("growth raw random ids", false),
            ("growth previous layout stream ids", false),
            ("growth previous layout random ids", false),
        ] {
            let ratio = |state: &str| {
                let empty = table.row(&format!("{row} {}", state_name(0, state)));
                let full = table.row(&format!("{row} {}", state_name(rows, state)));
                Some(full.ok()?.ratio_to(empty.ok()?))
            };
            if let (Some(warm), Some(first)) = (ratio(""), ratio(FIRST_ROUND)) {
                println!(
                    "{row} {} / empty: {:>10}%  first round {:>5}%{}",
                    existing(rows),
                    warm.show(1, 100.0),
                    first.show(1, 100.0),
                    if target {
                        format!("  target >= 90%    {}", verdict(warm.median >= 0.9))
                    } else {
                        String::new()
                    }
                );
            }
        }
        Ok(())
    }

    /// A fresh database of `layout` holding `rows` events, half of each key kind, under the
    /// sources of the growth adapters; prints the fill's time and bytes per event.
    async fn growth_database(&mut self, layout: Layout, rows: u64) -> Result<PhaseDatabase> {
        let database = match layout {
            Layout::Partitioned => self.fresh_database(4).await?,
            Layout::Previous => self.fresh_database_before(9, 4).await?,
        };
        let pool = database.store.pool();
        if layout == Layout::Partitioned {
            // Half-way through the current generation of the keys without a broker time.
            sqlx::query(
                "UPDATE event_storage SET keys_rotated_at = now() - make_interval(days => $1) / 2",
            )
            .bind(FILL_DAYS)
            .execute(pool)
            .await?;
        }
        if rows == 0 {
            return Ok(database);
        }
        if layout == Layout::Partitioned {
            sqlx::query(
                "SELECT switchboard_add_event_partition(now() - make_interval(days => d)) \
                 FROM generate_series(0, $1) AS d",
            )
            .bind(FILL_DAYS)
            .execute(pool)
            .await?;
        }
        let started = Instant::now();
        let mut fills = tokio::task::JoinSet::new();
        for keys in Keys::ALL {
            let (url, half) = (database.url.clone(), rows / 2);
            fills.spawn(async move {
                // Minutes per statement: no statement timeout.
                let mut conn = PgConnection::connect(&url).await?;
                let mut first = 0;
                while first < half {
                    let chunk = FILL_CHUNK.min(half - first);
                    sqlx::query(keys.fill_sql(layout))
                        .bind(keys.source())
                        .bind(i64::try_from(chunk)?)
                        .bind(i64::try_from(first)?)
                        .bind(FILL_DAYS)
                        .bind(i64::try_from(half)?)
                        .execute(&mut conn)
                        .await?;
                    first += chunk;
                }
                anyhow::Ok(())
            });
        }
        while let Some(filled) = fills.join_next().await {
            filled??;
        }
        let mut conn = PgConnection::connect(&database.url).await?;
        sqlx::query("VACUUM ANALYZE").execute(&mut conn).await?;
        sqlx::query("CHECKPOINT").execute(&mut conn).await?;
        let pool = database.store.pool();
        let bytes: i64 = sqlx::query_scalar(match layout {
            Layout::Partitioned => {
                "SELECT sum(pg_total_relation_size(name::regclass))::bigint FROM event_partitions"
            }
            Layout::Previous => "SELECT pg_total_relation_size('events')",
        })
        .fetch_one(pool)
        .await?;
        println!(
            "growth: filled {} events ({layout:?} layout) in {:.0} s: {:.0} bytes per event \
             (heap, index, TOAST)",
            existing(rows),
            started.elapsed().as_secs_f64(),
            bytes as f64 / rows as f64
        );
        Ok(database)
    }

    /// The growth runs on `database`, which holds `rows` filled events: a first round right
    /// after the fill (nothing cached, a checkpoint just taken), then `--repeats` rounds. Each
    /// round of an empty database starts from empty tables. Each run goes into `table` (and
    /// is printed) as it is measured.
    async fn growth_rounds(
        &mut self,
        layout: Layout,
        database: &PhaseDatabase,
        rows: u64,
        table: &mut Table,
    ) -> Result<()> {
        for round in 0..=self.args.repeats {
            if rows == 0 && round > 0 {
                let tables = match layout {
                    Layout::Partitioned => "events, event_keys, todos",
                    Layout::Previous => "events, todos",
                };
                sqlx::query(&format!("TRUNCATE {tables} CASCADE"))
                    .execute(database.store.pool())
                    .await?;
            }
            let state = state_name(rows, if round == 0 { FIRST_ROUND } else { "" });
            for run in self.growth_runs(layout, database, &state, round).await? {
                table.add(run);
            }
        }
        Ok(())
    }

    /// One round of growth runs on `database`: the worker per key kind (current layout), and
    /// the raw loop with the layout's own statement for random and monotonic keys.
    async fn growth_runs(
        &mut self,
        layout: Layout,
        database: &PhaseDatabase,
        state: &str,
        round: usize,
    ) -> Result<Vec<Measurement>> {
        let partitioned = layout == Layout::Partitioned;
        let mut plan = Vec::new();
        for keys in Keys::ALL {
            if partitioned {
                plan.push(GrowthRun::Worker(keys));
            }
            plan.push(GrowthRun::Raw(keys, true));
        }
        if partitioned {
            plan.push(GrowthRun::Raw(Keys::Random, false));
        }
        let mut runs = Vec::new();
        for planned in plan {
            let before = ServerCounters::now(database).await?;
            let run = match planned {
                GrowthRun::Worker(keys) => self.growth_worker(database, keys, state).await?,
                GrowthRun::Raw(keys, timed) => {
                    self.growth_raw(layout, database, keys, timed, state, round)
                        .await?
                }
            };
            runs.push(before.print_since(database, run).await?);
        }
        Ok(runs)
    }

    /// The worker draining `--entries` messages of `keys` into `database`.
    async fn growth_worker(
        &mut self,
        database: &PhaseDatabase,
        keys: Keys,
        state: &str,
    ) -> Result<Measurement> {
        let entries = self.args.entries;
        // The adapter whose source the filled events are under; its stream is deleted after
        // each run, so the next starts from an empty one.
        let name = keys.adapter().to_owned();
        let before_todos = queue_todos(database, &name).await?;
        let bodies = (0..entries).map(|i| keys.body(i, &keys.external_id(i)));
        Mode::Stream.preload(&self.fx, &name, bodies)?;
        let before = self.cpu_snapshot();
        let started = Instant::now();
        let worker = self.start_worker_with(
            database,
            Mode::Stream,
            &name,
            self.args.batch_size,
            keys.payload(),
            &[],
        )?;
        let measurement = self
            .measure_worker(
                worker,
                &name,
                format!("growth worker {} {state}", keys.label()),
                entries,
                (before, started),
            )
            .await?;
        let (todos, distinct) = queue_todos(database, &name).await?;
        let expected = i64::try_from(entries)?;
        let (todos, distinct) = (todos - before_todos.0, distinct - before_todos.1);
        ensure!(
            todos == expected && distinct == expected,
            "{name}: {todos} new todos, {distinct} new keys, expected {expected}"
        );
        Mode::Stream.ensure_drained(&self.fx, &name)?;
        redis::cmd("DEL")
            .arg(&name)
            .query::<u64>(&mut self.fx.redis.connection()?)?;
        Ok(measurement)
    }

    /// The bench writing `--entries` messages of `keys` (`timed`: with their broker time, as
    /// SQS MessageIds and stream ids come) in batches with the layout's own statement, under
    /// the filled source, one connection: the same client for both layouts.
    async fn growth_raw(
        &mut self,
        layout: Layout,
        database: &PhaseDatabase,
        keys: Keys,
        timed: bool,
        state: &str,
        round: usize,
    ) -> Result<Measurement> {
        let (entries, batch_size) = (self.args.entries, self.args.batch_size);
        let source = keys.source();
        let run = format!("{}-{round}", self.databases_created);
        let queue = format!("raw-{}-{timed}-{run}", keys.adapter());
        let lookup = if timed {
            Lookup::Since(now_ms())
        } else {
            Lookup::Untimed
        };
        // Keys of the filled kind (random ones land anywhere in the filled index, monotonic ones
        // after it), fresh in every run.
        let events: Vec<NewEvent> = (0..entries)
            .map(|i| {
                let external_id = match keys {
                    Keys::Monotonic => format!("1900000000000-{run}-{i}"),
                    Keys::Random => keys.external_id(i),
                };
                NewEvent {
                    idempotency_key: format!("{source}:{external_id}"),
                    external_id,
                    payload: String::from_utf8_lossy(&order_body(i)).into_owned(),
                    headers: "{}".to_owned(),
                    traceparent: None,
                    tracestate: None,
                    lookup,
                }
            })
            .collect();
        let pool = database.store.pool();
        let before = self.cpu_snapshot();
        let started = Instant::now();
        for batch in events.chunks(batch_size) {
            match layout {
                Layout::Partitioned => {
                    database
                        .store
                        .ingest_batch(&IngestBatch {
                            source: &source,
                            queue: &queue,
                            dedup: Dedup::NativeId,
                            positions: &[],
                            events: batch,
                        })
                        .await?;
                }
                Layout::Previous => {
                    let column =
                        |f: fn(&NewEvent) -> &str| batch.iter().map(f).collect::<Vec<&str>>();
                    sqlx::query(PREVIOUS_RELEASE_INGEST)
                        .bind(&source)
                        .bind(&queue)
                        .bind(column(|e| &e.external_id))
                        .bind(column(|e| &e.idempotency_key))
                        .bind(column(|e| &e.payload))
                        .execute(pool)
                        .await?;
                }
            }
        }
        let elapsed = started.elapsed();
        let cpu: CpuSpent = self.cpu_since(before, None);
        let todos: i64 = sqlx::query_scalar("SELECT count(*) FROM todos WHERE queue = $1")
            .bind(&queue)
            .fetch_one(pool)
            .await?;
        ensure!(
            todos == i64::try_from(entries)?,
            "{queue}: {todos} todos, expected {entries}"
        );
        let prefix = match layout {
            Layout::Partitioned => "growth raw",
            Layout::Previous => "growth previous layout",
        };
        let time = if timed && keys == Keys::Random && layout == Layout::Partitioned {
            " with broker time"
        } else {
            ""
        };
        Ok(Measurement {
            name: format!("{prefix} {}{time} {state}", keys.label()),
            messages: entries,
            elapsed,
            cpu,
            peak_rss_kib: None,
            store: None,
        })
    }
}

/// The suffix of the first round's rows.
const FIRST_ROUND: &str = ", first round";

/// The state a row's name ends with: `empty` or `50M existing`, then `suffix`.
fn state_name(rows: u64, suffix: &str) -> String {
    let state = if rows == 0 {
        "empty".to_owned()
    } else {
        existing(rows)
    };
    format!("{state}{suffix}")
}

/// The todos of `queue` and their distinct keys.
async fn queue_todos(database: &PhaseDatabase, queue: &str) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT idempotency_key) FROM todos WHERE queue = $1",
    )
    .bind(queue)
    .fetch_one(database.store.pool())
    .await?)
}

/// The time now, Unix ms.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        })
}

/// `50M existing`, `2M existing`, …
fn existing(rows: u64) -> String {
    if rows >= 1_000_000 && rows.is_multiple_of(1_000_000) {
        format!("{}M existing", rows / 1_000_000)
    } else {
        format!("{rows} existing")
    }
}
