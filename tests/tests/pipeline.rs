//! The pipeline's settle order, driven by a fake transport against a real PostgreSQL: dead
//! letters are written (and confirmed) before anything of their batch is acknowledged, the
//! acknowledgement covers everything settled once, in receive order; stale receipts are
//! dropped, fatal errors stop the loop, slow batches get their lease extended. No wedge: dead
//! letters the broker refuses are kept in PostgreSQL, rows PostgreSQL refuses are found by
//! splitting the batch, a read-only database is waited out, a stalled loop fails liveness.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use switchboard_api::source::Messaging;

use anyhow::{Result, ensure};
use switchboard_api::{DeliveryGuarantee, Envelope, PayloadFormat};
use switchboard_store::Dedup;
use switchboard_tests::Fixture;
use switchboard_tests::wait::wait_for;
use switchboard_worker::health::Health;
use switchboard_worker::metrics::Metrics;
use switchboard_worker::pipeline::{Pipeline, PipelineError, PipelineSettings};
use switchboard_worker::transport::{
    Acked, DeadLetter, IDEMPOTENCY_KEY_HEADER, Message, QueueHealth, QueueProbe, Transport,
    TransportError,
};
use tokio_util::sync::CancellationToken;

/// What the fake transport was asked to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    DeadLetters(Vec<u32>),
    Ack(Vec<u32>),
    Extend(Vec<u32>),
}

/// A scripted failure of the next call of a kind.
#[derive(Debug)]
enum Failure {
    Transient,
    Stale,
    Fatal,
    /// The dead-letter destination refuses these letters (indexes) for good, takes the others.
    Refused(Vec<usize>),
}

/// What the fake dead-letter destination answers when it refuses letters.
const REFUSAL: &str = "scripted: the letter is larger than the destination takes";

impl Failure {
    fn error(&self) -> TransportError {
        match self {
            Failure::Transient => TransportError::protocol("scripted outage"),
            Failure::Stale => TransportError::stale("scripted stale receipts", None),
            Failure::Fatal => TransportError::fatal("spec.source.fake.queue", "scripted", None),
            Failure::Refused(letters) => {
                TransportError::dead_letters_refused(letters.clone(), REFUSAL, None)
            }
        }
    }
}

#[derive(Debug, Default)]
struct Script {
    batches: VecDeque<Vec<Message<u32>>>,
    calls: Vec<Call>,
    fail_dead_letters: VecDeque<Failure>,
    fail_acks: VecDeque<Failure>,
    fail_receive: Option<Failure>,
    /// Receipts the next ack reports as stale.
    stale_in_ack: Vec<u32>,
    /// What the queue probe reports as waiting (backlog).
    backlog: u64,
}

#[derive(Debug, Clone)]
struct FakeTransport {
    script: Arc<Mutex<Script>>,
    lease: Option<Duration>,
}

struct ScriptedProbe(Arc<Mutex<Script>>);

impl QueueProbe for ScriptedProbe {
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let backlog = self.0.lock().expect("script").backlog;
        Ok(QueueHealth {
            backlog: Some(backlog),
            ..QueueHealth::default()
        })
    }
}

fn receipts(messages: &[&Message<u32>]) -> Vec<u32> {
    messages.iter().map(|m| m.receipt).collect()
}

impl Transport for FakeTransport {
    type Receipt = u32;
    type Probe = ScriptedProbe;

    fn source(&self) -> &str {
        "fake:test/pipeline"
    }

    fn endpoint(&self) -> String {
        "fake-broker:1".to_owned()
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    async fn receive(
        &mut self,
        _max: usize,
        block: bool,
    ) -> Result<Vec<Message<u32>>, TransportError> {
        let next = {
            let mut script = self.script.lock().expect("script");
            if let Some(failure) = script.fail_receive.take() {
                return Err(failure.error());
            }
            script.batches.pop_front()
        };
        match next {
            Some(batch) => Ok(batch),
            None => {
                if block {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(Vec::new())
            }
        }
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, u32>],
    ) -> Result<(), TransportError> {
        let mut script = self.script.lock().expect("script");
        let failure = script.fail_dead_letters.pop_front();
        let refused = match &failure {
            Some(Failure::Refused(refused)) => refused.clone(),
            Some(failure) => return Err(failure.error()),
            None => Vec::new(),
        };
        let written = letters
            .iter()
            .enumerate()
            .filter(|(index, _)| !refused.contains(index))
            .map(|(_, l)| l.message.receipt)
            .collect();
        script.calls.push(Call::DeadLetters(written));
        failure.map_or(Ok(()), |failure| Err(failure.error()))
    }

    async fn ack(&mut self, messages: &[&Message<u32>]) -> Result<Acked, TransportError> {
        let mut script = self.script.lock().expect("script");
        if let Some(failure) = script.fail_acks.pop_front() {
            return Err(failure.error());
        }
        script.calls.push(Call::Ack(receipts(messages)));
        let stale = std::mem::take(&mut script.stale_in_ack);
        Ok(Acked {
            stale: messages
                .iter()
                .enumerate()
                .filter(|(_, m)| stale.contains(&m.receipt))
                .map(|(index, _)| index)
                .collect(),
            retry: Vec::new(),
        })
    }

    fn lease(&self) -> Option<Duration> {
        self.lease
    }

    async fn extend_lease(&mut self, messages: &[&Message<u32>]) -> Result<(), TransportError> {
        let mut script = self.script.lock().expect("script");
        script.calls.push(Call::Extend(receipts(messages)));
        Ok(())
    }

    async fn maintain(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    fn maintenance_interval(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn probe(&self) -> ScriptedProbe {
        ScriptedProbe(self.script.clone())
    }
}

/// Message `receipt` with body `body`.
fn message(receipt: u32, body: &[u8]) -> Message<u32> {
    Message {
        receipt,
        external_id: format!("m{receipt}"),
        idempotency_key: format!("fake:test/pipeline:m{receipt}"),
        body: body.to_vec(),
        headers: Vec::new(),
        delivery_count: 1,
        enqueued_at_ms: None,
        position: None,
        undecodable: None,
    }
}

/// A batch of `count` good messages starting at `first`.
fn good(first: u32, count: u32) -> Vec<Message<u32>> {
    (first..first + count)
        .map(|i| message(i, format!(r#"{{"n":{i}}}"#).as_bytes()))
        .collect()
}

struct Running {
    script: Arc<Mutex<Script>>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), PipelineError>>,
}

impl Running {
    fn calls(&self) -> Vec<Call> {
        self.script.lock().expect("script").calls.clone()
    }

    fn acked(&self) -> Vec<u32> {
        self.calls()
            .into_iter()
            .flat_map(|call| match call {
                Call::Ack(receipts) => receipts,
                _ => Vec::new(),
            })
            .collect()
    }

    async fn stop(self) -> Result<Result<(), PipelineError>> {
        self.cancel.cancel();
        Ok(self.task.await?)
    }
}

/// Runs the pipeline on this thread (the worker's runtime is single-threaded, and the loop's
/// future is not `Send`); call inside [`local`].
fn start(fx: &Fixture, script: Script, lease: Option<Duration>) -> Running {
    let script = Arc::new(Mutex::new(script));
    let transport = FakeTransport {
        script: script.clone(),
        lease,
    };
    let metrics = Arc::new(Metrics::new(
        "test/pipeline",
        DeliveryGuarantee::AtLeastOnce,
        Metrics::registry(),
    ));
    let cancel = CancellationToken::new();
    let health = Arc::new(Health::new());
    let settings = PipelineSettings {
        adapter: "test/pipeline".to_owned(),
        worker: "pipeline-0".to_owned(),
        queue: "pipeline".to_owned(),
        batch_size: 100,
        max_deliveries: 3,
        format: PayloadFormat::Json,
        max_bytes: 1024,
        envelope: Envelope::None,
        abort_after_commits: None,
        dead_letter_retention: Duration::from_secs(14 * 86_400),
        messaging: Messaging {
            system: "test",
            destination: "pipeline".to_owned(),
            consumer_group: None,
        },
    };
    let pipeline = Pipeline::new(
        transport,
        fx.store.clone(),
        settings,
        metrics.clone(),
        health.clone(),
        cancel.clone(),
    );
    Running {
        script,
        metrics,
        health,
        cancel,
        task: tokio::task::spawn_local(pipeline.run()),
    }
}

const DEADLINE: Duration = Duration::from_secs(30);

/// Runs a test body where [`start`] can spawn the pipeline.
async fn local<F: std::future::Future<Output = Result<()>>>(body: F) -> Result<()> {
    tokio::task::LocalSet::new().run_until(body).await
}

#[tokio::test]
async fn dead_letters_are_written_before_their_batch_is_acknowledged_in_receive_order() -> Result<()>
{
    local(async {
        let fx = Fixture::start().await?;
        let mut batch = good(1, 3);
        batch.insert(1, message(100, b"{not json"));
        let mut overdue = message(101, b"{}");
        overdue.delivery_count = 4;
        batch.push(overdue);
        let mut undecodable = message(102, b"\xff");
        undecodable.undecodable = Some("field name is not UTF-8".to_owned());
        batch.push(undecodable);
        batch.extend(good(4, 2));
        let script = Script {
            batches: VecDeque::from([batch]),
            // The first write fails: nothing may be acknowledged until it is retried and succeeds.
            fail_dead_letters: VecDeque::from([Failure::Transient]),
            ..Script::default()
        };
        let running = start(&fx, script, None);
        wait_for(DEADLINE, "the batch is acknowledged", || async {
            Ok(!running.acked().is_empty())
        })
        .await?;
        let calls = running.calls();
        ensure!(
            calls
                == vec![
                    Call::DeadLetters(vec![100, 101, 102]),
                    Call::Ack(vec![1, 100, 2, 3, 101, 102, 4, 5]),
                ],
            "one confirmed dead-letter write, then one acknowledgement of everything in receive order: {calls:?}"
        );
        ensure!(fx.todo_count("pipeline").await? == 5);
        running.stop().await??;
        Ok(())
    })
    .await
}

#[tokio::test]
async fn batches_are_acknowledged_one_by_one_in_the_order_they_were_received() -> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        let batches: VecDeque<_> = (0..6).map(|b| good(b * 10, 10)).collect();
        let running = start(
            &fx,
            Script {
                batches,
                ..Script::default()
            },
            None,
        );
        wait_for(DEADLINE, "every batch is acknowledged", || async {
            Ok(running.acked().len() == 60)
        })
        .await?;
        let acked = running.acked();
        ensure!(
            acked == (0..60).collect::<Vec<u32>>(),
            "acknowledged in receive order: {acked:?}"
        );
        running.stop().await??;
        fx.assert_exactly_once("pipeline", 60).await
    })
    .await
}

#[tokio::test]
async fn stale_receipts_are_counted_and_dropped_and_the_loop_goes_on() -> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        let script = Script {
            batches: VecDeque::from([good(0, 5), good(5, 5), good(10, 5)]),
            stale_in_ack: vec![7, 8],
            // A whole acknowledgement call refused as stale: dropped, never retried.
            fail_acks: VecDeque::from([Failure::Stale]),
            ..Script::default()
        };
        let running = start(&fx, script, None);
        wait_for(DEADLINE, "the later batches are acknowledged", || async {
            Ok(running.acked().contains(&14))
        })
        .await?;
        wait_for(DEADLINE, "stale receipts are counted", || async {
            Ok(running.metrics.stale_receipts.get() == 7)
        })
        .await
        .map_err(|err| err.context(format!("calls: {:?}", running.calls())))?;
        ensure!(running.metrics.acked.get() == 8, "15 stored, 7 stale");
        running.stop().await??;
        fx.assert_exactly_once("pipeline", 15).await
    })
    .await
}

#[tokio::test]
async fn fatal_transport_error_stops_the_loop_with_the_setting_named() -> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        let script = Script {
            fail_receive: Some(Failure::Fatal),
            ..Script::default()
        };
        let running = start(&fx, script, None);
        let result = tokio::time::timeout(DEADLINE, running.task).await??;
        let err = result.expect_err("a fatal error ends the loop");
        ensure!(
            err.to_string().contains("spec.source.fake.queue"),
            "the error names the setting: {err}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn lease_of_a_batch_stuck_in_the_database_is_extended_until_it_is_stored() -> Result<()> {
    local(async {
        use sqlx::Connection as _;
        let fx = Fixture::start().await?;
        let mut lock = sqlx::PgConnection::connect(&fx.postgres.url()).await?;
        sqlx::query("BEGIN").execute(&mut lock).await?;
        sqlx::query("LOCK TABLE todos IN ACCESS EXCLUSIVE MODE")
            .execute(&mut lock)
            .await?;
        let script = Script {
            batches: VecDeque::from([good(0, 3)]),
            ..Script::default()
        };
        let running = start(&fx, script, Some(Duration::from_millis(400)));
        wait_for(DEADLINE, "the lease is extended twice", || async {
            Ok(running
                .calls()
                .iter()
                .filter(|call| **call == Call::Extend(vec![0, 1, 2]))
                .count()
                >= 2)
        })
        .await?;
        ensure!(
            running.acked().is_empty(),
            "nothing acknowledged before the commit"
        );
        sqlx::query("ROLLBACK").execute(&mut lock).await?;
        wait_for(DEADLINE, "the batch is acknowledged", || async {
            Ok(running.acked() == vec![0, 1, 2])
        })
        .await?;
        ensure!(running.metrics.leases_extended.get() >= 6);
        running.stop().await??;
        fx.assert_exactly_once("pipeline", 3).await
    })
    .await
}

#[tokio::test]
async fn one_id_twice_in_a_batch_is_stored_once_and_counted_as_a_duplicate() -> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        // An SQS standard queue may deliver a message twice at once; under an envelope, a
        // producer's retry has the first copy's id.
        let mut again = message(2, br#"{"n":1}"#);
        again.external_id = "m1".to_owned();
        again.idempotency_key = "fake:test/pipeline:m1".to_owned();
        let batch = vec![message(1, br#"{"n":1}"#), again, message(3, br#"{"n":3}"#)];
        let running = start(
            &fx,
            Script {
                batches: VecDeque::from([batch]),
                ..Script::default()
            },
            None,
        );
        wait_for(DEADLINE, "the batch is acknowledged", || async {
            Ok(running.acked() == vec![1, 2, 3])
        })
        .await?;
        ensure!(fx.todo_count("pipeline").await? == 2);
        let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
            .fetch_one(fx.pool())
            .await?;
        ensure!(events == 2, "one event per id, found {events}");
        let (stored, duplicates) = (running.metrics.stored.get(), running.metrics.duplicates.get());
        ensure!(
            (stored, duplicates) == (2, 1),
            "the second copy is a duplicate, not a second store: stored {stored}, duplicates {duplicates}"
        );
        running.stop().await??;
        Ok(())
    })
    .await
}

/// The rows of PostgreSQL's dead-letter table: (external id, body, reason, delivery count,
/// what the broker answered).
async fn kept(fx: &Fixture) -> Result<Vec<(String, Vec<u8>, String, i64, String)>> {
    Ok(sqlx::query_as(
        "SELECT external_id, body, reason, delivery_count, refused_because FROM dead_letters \
         WHERE source = 'fake:test/pipeline' ORDER BY id",
    )
    .fetch_all(fx.pool())
    .await?)
}

#[tokio::test]
async fn refused_dead_letters_are_kept_in_postgresql_once_and_their_originals_acknowledged()
-> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        let batch = || {
            let mut batch = good(1, 2);
            batch.push(message(100, b"{not json"));
            let mut binary = message(101, b"\x00\xffraw\xfe");
            binary.undecodable = Some("a header value is not UTF-8".to_owned());
            binary.headers = vec![("trace".to_owned(), vec![0xff, 0x00])];
            batch.push(binary);
            batch.extend(good(3, 1));
            batch
        };
        // The second letter (101) is refused for good, twice: once, then at its redelivery
        // to a new worker process (a crash after the row was written and before the
        // acknowledgement; the worker that wrote it would not write it again).
        let mut again = batch();
        for message in &mut again {
            message.receipt += 1000;
            message.delivery_count = 2;
        }
        let script = |batch| Script {
            batches: VecDeque::from([batch]),
            fail_dead_letters: VecDeque::from([Failure::Refused(vec![1])]),
            ..Script::default()
        };
        let running = start(&fx, script(batch()), None);
        wait_for(DEADLINE, "the first delivery is acknowledged", || async {
            Ok(running.acked().len() == 5)
        })
        .await?;
        let calls = running.calls();
        let first_kept = running.metrics.kept_in_database.get();
        running.stop().await??;
        let running = start(&fx, script(again), None);
        wait_for(DEADLINE, "the redelivery is acknowledged", || async {
            Ok(running.acked().len() == 5)
        })
        .await?;
        ensure!(
            calls[..2]
                == [
                    Call::DeadLetters(vec![100]),
                    Call::Ack(vec![1, 2, 100, 101, 3]),
                ],
            "the refused letter's original is acknowledged with its batch: {calls:?}"
        );
        let rows = kept(&fx).await?;
        ensure!(
            rows == vec![(
                "m101".to_owned(),
                b"\x00\xffraw\xfe".to_vec(),
                "undecodable".to_owned(),
                1,
                REFUSAL.to_owned()
            )],
            "one row, the body byte-identical, kept once across the redelivery: {rows:?}"
        );
        let (headers, attempts): (serde_json::Value, serde_json::Value) =
            sqlx::query_as("SELECT headers, attempts FROM dead_letters WHERE external_id = 'm101'")
                .fetch_one(fx.pool())
                .await?;
        ensure!(
            headers["trace"]["base64"] == "/wA=",
            "headers kept: {headers}"
        );
        ensure!(attempts["total"] == 1, "attempts kept: {attempts}");
        ensure!(
            first_kept + running.metrics.kept_in_database.get() == 2,
            "counted at each refusal"
        );
        running.stop().await??;
        fx.assert_exactly_once("pipeline", 3).await
    })
    .await
}

#[tokio::test]
async fn refused_dead_letters_wait_out_a_read_only_database_and_are_never_acknowledged_without_their_row()
-> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        fx.set_read_only(true).await?;
        let script = Script {
            batches: VecDeque::from([vec![message(1, b"{broken")]]),
            fail_dead_letters: VecDeque::from([Failure::Refused(vec![0])]),
            ..Script::default()
        };
        let running = start(&fx, script, None);
        wait_for(DEADLINE, "the read-only database is noticed", || async {
            Ok(running.health.not_ready_because().contains("read-only"))
        })
        .await?;
        ensure!(
            running.acked().is_empty(),
            "nothing acknowledged without its row"
        );
        fx.set_read_only(false).await?;
        wait_for(DEADLINE, "the original is acknowledged", || async {
            Ok(running.acked() == vec![1])
        })
        .await?;
        ensure!(kept(&fx).await?.len() == 1);
        running.stop().await??;
        Ok(())
    })
    .await
}

#[tokio::test]
async fn read_only_database_is_retried_and_nothing_is_dead_lettered() -> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        fx.set_read_only(true).await?;
        let script = Script {
            batches: VecDeque::from([good(0, 5)]),
            ..Script::default()
        };
        let running = start(&fx, script, None);
        wait_for(
            DEADLINE,
            "readiness says the database is read-only",
            || async {
                let because = running.health.not_ready_because();
                Ok(
                    because.contains("database unavailable since ")
                        && because.contains("read-only"),
                )
            },
        )
        .await?;
        ensure!(running.acked().is_empty() && running.calls().is_empty());
        fx.set_read_only(false).await?;
        wait_for(DEADLINE, "the batch is stored and acknowledged", || async {
            Ok(running.acked() == vec![0, 1, 2, 3, 4])
        })
        .await?;
        ensure!(
            running.calls() == vec![Call::Ack(vec![0, 1, 2, 3, 4])],
            "nothing dead-lettered: {:?}",
            running.calls()
        );
        running.stop().await??;
        fx.assert_exactly_once("pipeline", 5).await
    })
    .await
}

/// A message carrying an idempotency key longer than a btree index row may be (SQLSTATE 54000,
/// program limit exceeded): random text, so that PostgreSQL cannot compress it under the limit.
fn with_oversized_key(receipt: u32) -> Message<u32> {
    let mut rng = fastrand::Rng::with_seed(u64::from(receipt));
    let id: String = (0..12_000).map(|_| rng.alphanumeric()).collect();
    let mut message = message(receipt, br#"{"huge":"key"}"#);
    message.headers = vec![(
        IDEMPOTENCY_KEY_HEADER.to_owned(),
        format!("fake:test/pipeline:{id}").into_bytes(),
    )];
    message
}

#[tokio::test]
async fn row_postgresql_refuses_with_a_program_limit_is_dead_lettered_and_its_neighbours_stored()
-> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        let mut batch = good(0, 6);
        batch.insert(2, with_oversized_key(100));
        batch.insert(5, with_oversized_key(101));
        let script = Script {
            batches: VecDeque::from([batch, good(6, 2)]),
            ..Script::default()
        };
        let running = start(&fx, script, None);
        wait_for(DEADLINE, "both batches are acknowledged", || async {
            Ok(running.acked().len() == 10)
        })
        .await
        .map_err(|err| err.context(format!("calls: {:?}", running.calls())))?;
        let calls = running.calls();
        ensure!(
            calls[0] == Call::DeadLetters(vec![100, 101]),
            "only the offenders are dead-lettered, once: {calls:?}"
        );
        let errors = running
            .metrics
            .encode()
            .lines()
            .find(|line| {
                line.starts_with("switchboard_dependency_errors_total") && line.contains("database")
            })
            .map(str::to_owned)
            .unwrap_or_default();
        ensure!(
            errors.ends_with(" 0"),
            "no retry loop on the database: {errors}"
        );
        running.stop().await??;
        fx.assert_exactly_once("pipeline", 8).await
    })
    .await
}

#[tokio::test]
async fn header_value_name_and_id_holding_nul_are_stored_encoded_not_rejected() -> Result<()> {
    local(async {
        let fx = Fixture::start().await?;
        let mut odd = message(1, br#"{"n":1}"#);
        odd.external_id = "key\0with nul".to_owned();
        odd.idempotency_key = "fake:test/pipeline:key\0with nul".to_owned();
        odd.headers = vec![
            ("trace".to_owned(), b"a\0b".to_vec()),
            ("name\0nul".to_owned(), b"v".to_vec()),
        ];
        let script = Script {
            batches: VecDeque::from([vec![odd, message(2, br#"{"n":2}"#)]]),
            ..Script::default()
        };
        let running = start(&fx, script, None);
        wait_for(DEADLINE, "the batch is acknowledged", || async {
            Ok(running.acked() == vec![1, 2])
        })
        .await?;
        ensure!(
            running
                .calls()
                .iter()
                .all(|c| !matches!(c, Call::DeadLetters(_))),
            "nothing dead-lettered: {:?}",
            running.calls()
        );
        let (id, headers): (String, serde_json::Value) = sqlx::query_as(
            "SELECT external_id, headers FROM events WHERE payload = '{\"n\":1}'::jsonb",
        )
        .fetch_one(fx.pool())
        .await?;
        ensure!(id == "base64:a2V5AHdpdGggbnVs", "the id in base64: {id}");
        ensure!(headers["trace"]["base64"] == "YQBi", "{headers}");
        ensure!(headers["base64:bmFtZQBudWw="] == "v", "{headers}");
        running.stop().await??;
        fx.assert_exactly_once("pipeline", 2).await
    })
    .await
}

#[tokio::test]
async fn liveness_fails_while_work_waits_and_no_batch_completes_then_recovers() -> Result<()> {
    local(async {
        use sqlx::Connection as _;
        let fx = Fixture::start().await?;
        let mut lock = sqlx::PgConnection::connect(&fx.postgres.url()).await?;
        sqlx::query("BEGIN").execute(&mut lock).await?;
        sqlx::query("LOCK TABLE todos IN ACCESS EXCLUSIVE MODE")
            .execute(&mut lock)
            .await?;
        let script = Script {
            batches: VecDeque::from([good(0, 3)]),
            backlog: 3,
            ..Script::default()
        };
        let running = start(&fx, script, None);
        running.health.set_stall_limit(Duration::from_millis(500));
        wait_for(
            DEADLINE,
            "/healthz fails: work waits, nothing completes",
            || async { Ok(!running.health.is_live()) },
        )
        .await?;
        sqlx::query("ROLLBACK").execute(&mut lock).await?;
        running.script.lock().expect("script").backlog = 0;
        wait_for(
            DEADLINE,
            "the batch completes and /healthz passes",
            || async { Ok(running.acked() == vec![0, 1, 2] && running.health.is_live()) },
        )
        .await?;
        running.stop().await??;
        fx.assert_exactly_once("pipeline", 3).await
    })
    .await
}

#[tokio::test]
async fn one_key_or_partition_twice_in_a_delivery_count_is_counted_once_not_an_error() -> Result<()>
{
    // A Kafka fetch restarted while its records were still buffered hands the same records
    // twice: SQLSTATE 21000 (a row affected twice by one statement) retried forever before.
    let fx = Fixture::start().await?;
    let source = "kafka:test/twice";
    let marks = fx
        .store
        .raise_delivery_marks(source, &[("0", 10), ("0", 12), ("1", 3)])
        .await?;
    ensure!(marks == vec![None, None, None], "{marks:?}");
    let marks = fx
        .store
        .raise_delivery_marks(source, &[("0", 11), ("0", 11)])
        .await?;
    ensure!(
        marks == vec![Some(12), Some(12)],
        "raised to the highest: {marks:?}"
    );
    let counts = fx
        .store
        .count_redeliveries(source, &["k1", "k1", "k2"])
        .await?;
    ensure!(counts == vec![2, 2, 2], "{counts:?}");
    Ok(())
}
