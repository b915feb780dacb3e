//! NATS JetStream beyond the contract suite, end to end: the real worker binary against real
//! PostgreSQL and a real nats-server with JetStream.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use async_nats::jetstream::consumer::{AckPolicy, pull};
use switchboard_tests::brokers::NatsBroker;
use switchboard_tests::brokers::nats::NatsServer;
use switchboard_tests::todos_lock::{TodosLock, wait_blocked_on_lock};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{RETENTION_WARNING, WorkerProcess};
use switchboard_tests::{Fixture, source_manifest};

const LONG: Duration = Duration::from_secs(120);
/// A misconfigured worker exits within this.
const FATAL_EXIT: Duration = Duration::from_secs(30);
const CONSUMER: &str = "switchboard";

fn bodies(range: std::ops::Range<usize>) -> Vec<Vec<u8>> {
    range
        .map(|i| format!(r#"{{"order":{i}}}"#).into_bytes())
        .collect()
}

/// PostgreSQL, a nats-server with stream `NAME` (subjects `name.>`), and the manifest of
/// adapter `test/{name}` reading it with `nats_extra` (flow-mapping entries after the stream
/// and consumer) and `delivery`.
struct Setup {
    fx: Fixture,
    server: NatsServer,
    name: &'static str,
    manifest: std::path::PathBuf,
}

impl Setup {
    async fn start(name: &'static str, nats_extra: &str, delivery: &str) -> Result<Self> {
        let mut fx = Fixture::start().await?;
        let server = NatsServer::start().await?;
        fx.extra_env = vec![("NATS_URL".to_owned(), server.url())];
        let stream = NatsBroker::stream(name);
        server
            .create_stream(&stream, &[format!("{name}.>")])
            .await?;
        let source = format!("nats: {{stream: {stream}, consumer: {CONSUMER}{nats_extra}}}");
        let manifest = fx.manifest(
            &format!("{name}.yaml"),
            &source_manifest(name, &source, delivery, "format: json"),
        )?;
        Ok(Self {
            fx,
            server,
            name,
            manifest,
        })
    }

    fn stream(&self) -> String {
        NatsBroker::stream(self.name)
    }

    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.server
            .publish(&NatsBroker::subject(self.name), bodies)
            .await
    }

    async fn consumer(&self) -> Result<async_nats::jetstream::consumer::Info> {
        self.server
            .consumer_info(&self.stream(), CONSUMER)
            .await?
            .context("the consumer does not exist")
    }

    /// Waits until `expected` todos exist and the consumer holds nothing un-acknowledged.
    async fn wait_settled(&self, expected: i64, worker: &WorkerProcess) -> Result<()> {
        wait_for(
            LONG,
            &format!("{expected} todos and nothing un-acknowledged"),
            || async {
                let info = self.consumer().await?;
                Ok(self.fx.todo_count(self.name).await? == expected
                    && info.num_pending == 0
                    && info.num_ack_pending == 0)
            },
        )
        .await
        .with_context(|| worker.log_tail())
    }

    fn metric(&self, worker: &WorkerProcess, family: &str) -> Result<f64> {
        worker.metric(&format!(r#"{family}{{adapter="test/{}"}}"#, self.name))
    }
}

#[tokio::test]
async fn batch_stored_slower_than_ack_wait_is_not_redelivered_thanks_to_in_progress_acks()
-> Result<()> {
    const ACK_WAIT: Duration = Duration::from_secs(2);
    let setup = Setup::start("slow", ", ackWaitSeconds: 2", "batchSize: 10").await?;
    let lock = TodosLock::take(&setup.fx.postgres.url()).await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    setup.produce(bodies(0..10)).await?;
    wait_blocked_on_lock(&setup.fx, &worker).await?;
    // Three AckWaits pass while the batch waits on the lock; the lock is the condition, the
    // hold only has to outlast AckWait (and stay under the worker's database timeout).
    let held = Instant::now();
    wait_for(LONG, "three AckWaits with the batch held", || async {
        let info = setup.consumer().await?;
        ensure!(
            info.num_redelivered == 0,
            "the server redelivered messages of the held batch: {info:?}"
        );
        Ok(held.elapsed() >= 3 * ACK_WAIT)
    })
    .await?;
    wait_for(LONG, "the gauges show the held batch", || async {
        Ok(
            setup.metric(&worker, "switchboard_pending_messages")? == 10.0
                && setup.metric(&worker, "switchboard_oldest_pending_age_seconds")? >= 1.0,
        )
    })
    .await
    .with_context(|| worker.log_tail())?;
    lock.release().await?;
    setup.wait_settled(10, &worker).await?;
    setup.fx.assert_exactly_once(setup.name, 10).await?;
    let info = setup.consumer().await?;
    ensure!(info.num_redelivered == 0, "{info:?}");
    ensure!(
        setup.metric(&worker, "switchboard_messages_redelivered_total")? == 0.0,
        "{}",
        worker.log_tail()
    );
    ensure!(
        setup.metric(&worker, "switchboard_leases_extended_total")? >= 10.0,
        "no in-progress ack was sent"
    );
    Ok(())
}

/// Waits for the worker to exit; fails unless it exited non-zero within [`FATAL_EXIT`] with
/// every one of `needles` in its log.
fn assert_fatal_exit(worker: &mut WorkerProcess, needles: &[&str]) -> Result<()> {
    let status = worker.wait_exit(FATAL_EXIT)?;
    let log = worker.log();
    ensure!(
        !status.success() && status.code().is_some(),
        "expected a non-zero exit, got {status:?}\n{log}"
    );
    for needle in needles {
        ensure!(
            log.contains(needle),
            "the log does not name {needle}:\n{log}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn existing_consumer_with_a_conflicting_config_stops_the_worker_naming_the_field()
-> Result<()> {
    let setup = Setup::start("conflict", ", ackWaitSeconds: 2", "maxDeliveries: 5").await?;
    let stream = setup.server.jetstream().get_stream(setup.stream()).await?;
    stream
        .create_consumer(pull::Config {
            durable_name: Some(CONSUMER.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(60),
            max_deliver: 6,
            ..Default::default()
        })
        .await?;
    setup.produce(bodies(0..5)).await?;
    let mut worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    assert_fatal_exit(&mut worker, &["spec.source.nats.ackWaitSeconds", "60"])?;
    let info = setup.consumer().await?;
    ensure!(
        info.config.ack_wait == Duration::from_secs(60),
        "the existing consumer is left as it was: {:?}",
        info.config
    );
    ensure!(setup.fx.todo_count(setup.name).await? == 0);
    Ok(())
}

#[tokio::test]
async fn missing_stream_stops_the_worker_naming_the_setting() -> Result<()> {
    let mut fx = Fixture::start().await?;
    let server = NatsServer::start().await?;
    fx.extra_env = vec![("NATS_URL".to_owned(), server.url())];
    let manifest = fx.manifest(
        "nostream.yaml",
        &source_manifest("nostream", "nats: {stream: NOSUCH}", "", ""),
    )?;
    let mut worker = fx.worker(&manifest, "worker-a")?;
    assert_fatal_exit(&mut worker, &["spec.source.nats.stream", "NOSUCH"])
}

#[tokio::test]
async fn consumer_deleted_under_a_running_worker_is_re_created_without_loss() -> Result<()> {
    let setup = Setup::start("rebind", ", ackWaitSeconds: 2", "batchSize: 20").await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    setup.produce(bodies(0..100)).await?;
    setup.wait_settled(100, &worker).await?;
    // What a server that lost the consumer (the client's known failure after a reconnect)
    // looks like to the worker.
    let stream = setup.server.jetstream().get_stream(setup.stream()).await?;
    stream.delete_consumer(CONSUMER).await?;
    setup.produce(bodies(100..200)).await?;
    wait_for(LONG, "the consumer is re-created", || async {
        Ok(setup
            .server
            .consumer_info(&setup.stream(), CONSUMER)
            .await?
            .is_some())
    })
    .await
    .with_context(|| worker.log_tail())?;
    setup.wait_settled(200, &worker).await?;
    setup.fx.assert_exactly_once(setup.name, 200).await?;
    ensure!(
        setup.metric(&worker, "switchboard_nats_consumer_rebinds_total")? >= 1.0,
        "{}",
        worker.log_tail()
    );
    Ok(())
}

#[tokio::test]
async fn dead_letter_keeps_the_body_and_its_context_and_the_original_is_terminated() -> Result<()> {
    let setup = Setup::start("dlq", ", ackWaitSeconds: 2", "batchSize: 10").await?;
    let poison = b"{\"order\": broken \xe2\x9c\x93".to_vec();
    let mut all = bodies(0..3);
    all.push(poison.clone());
    setup.produce(all).await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    setup.wait_settled(3, &worker).await?;
    let dead_letter_stream = format!("{}_DLQ", setup.stream());
    let letters = setup
        .server
        .stream_messages(&dead_letter_stream)
        .await?
        .context("the worker created the dead-letter stream")?;
    ensure!(letters.len() == 1, "{letters:?}");
    let letter = &letters[0];
    ensure!(
        letter.payload.as_ref() == poison.as_slice(),
        "byte-identical body"
    );
    ensure!(
        letter.subject.as_str() == "DLQ.dlq.dlq.orders",
        "{}",
        letter.subject
    );
    let header = |name: &str| {
        letter
            .headers
            .get(name)
            .map(|value| value.as_str().to_owned())
            .with_context(|| format!("no {name} header: {:?}", letter.headers))
    };
    ensure!(header("Switchboard-Reason")? == "invalid_json");
    ensure!(!header("Switchboard-Error")?.is_empty());
    ensure!(header("Switchboard-Delivery-Count")? == "1");
    ensure!(header("Switchboard-Stream")? == "DLQ");
    ensure!(header("Switchboard-Stream-Seq")? == "4");
    for time in ["Switchboard-First-Seen", "Switchboard-Last-Seen"] {
        let value = header(time)?;
        // RFC 3339 in UTC with milliseconds: 2026-12-01T17:00:00.000Z
        ensure!(
            value.len() == 24 && value.as_bytes()[10] == b'T' && value.ends_with('Z'),
            "{time} is not RFC 3339: {value}"
        );
    }
    let mut handle = setup
        .server
        .jetstream()
        .get_stream(&dead_letter_stream)
        .await?;
    let max_age = handle.info().await?.config.max_age;
    ensure!(
        max_age >= Duration::from_secs(14 * 24 * 3600),
        "dead letters are kept at least 14 days: {max_age:?}"
    );
    let info = setup.consumer().await?;
    ensure!(
        info.num_ack_pending == 0 && info.num_redelivered == 0,
        "the original is terminated, never redelivered: {info:?}"
    );
    wait_for(LONG, "the dead-letter gauge counts the letter", || async {
        Ok(setup.metric(&worker, "switchboard_dead_letter_messages")? == 1.0)
    })
    .await
    .with_context(|| worker.log_tail())
}

/// Issue 27, a re-created source: the stream deleted and created again restarts its sequences
/// at 1; its messages are new ones, stored, never taken for redeliveries of the old stream's.
#[tokio::test]
async fn recreated_stream_stores_its_new_messages_and_says_so_once() -> Result<()> {
    let setup = Setup::start("again", ", ackWaitSeconds: 2", "batchSize: 50").await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    setup.produce(bodies(0..100)).await?;
    setup.wait_settled(100, &worker).await?;
    setup.server.recreate_stream(&setup.stream()).await?;
    setup.produce(bodies(100..400)).await?;
    wait_for(LONG, "the consumer is re-created", || async {
        Ok(setup
            .server
            .consumer_info(&setup.stream(), CONSUMER)
            .await?
            .is_some())
    })
    .await
    .with_context(|| worker.log_tail())?;
    setup.wait_settled(400, &worker).await?;
    setup
        .fx
        .assert_stored_exactly(setup.name, &bodies(0..400))
        .await?;
    let said = worker.log().matches("deleted and created again").count();
    ensure!(said == 1, "said {said} times:\n{}", worker.log_tail());
    Ok(())
}

/// Issue 27, a broker-side limit: a worker killed during each of the first
/// `maxDeliveries + 1` deliveries (the first ones wait on a lock, PostgreSQL hangs; the last
/// one's dead letters wait on a full dead-letter stream). The server keeps delivering: the next
/// worker dead-letters the messages as `max_deliveries` (or stores them); none is left neither
/// stored nor dead-lettered.
#[tokio::test]
async fn worker_killed_during_the_last_delivery_leaves_no_message_behind() -> Result<()> {
    let setup = Setup::start(
        "lastdelivery",
        ", ackWaitSeconds: 2",
        "batchSize: 20, maxDeliveries: 2",
    )
    .await?;
    let dead_letters = format!("{}_DLQ", setup.stream());
    let full = async_nats::jetstream::stream::Config {
        name: dead_letters.clone(),
        subjects: vec![format!("{}.dlq.>", setup.stream())],
        max_messages: 1,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    setup.server.create_stream_with(full.clone()).await?;
    setup
        .server
        .publish(&format!("{}.dlq.filler", setup.stream()), bodies(0..1))
        .await?;
    setup.produce(bodies(0..20)).await?;
    let lock = TodosLock::take(&setup.fx.postgres.url()).await?;
    for attempt in 0..3 {
        let worker = setup
            .fx
            .worker(&setup.manifest, &format!("killed-{attempt}"))?;
        // The kill point is a worker stuck inside a delivery: on the lock, or (the last one)
        // on the full dead-letter stream. Not "all 20 delivered again": redeliveries come when
        // each message's ack wait ends, so the server may hand them out in two pulls, and a
        // worker stuck on the first batch never pulls the second.
        if attempt < 2 {
            wait_blocked_on_lock(&setup.fx, &worker).await?;
        } else {
            wait_for(
                LONG,
                "the dead-letter stream refuses a dead letter",
                || async { Ok(worker.log().contains("did not confirm a dead letter")) },
            )
            .await
            .with_context(|| worker.log_tail())?;
        }
        let delivered = setup.consumer().await?.delivered.consumer_sequence;
        ensure!(
            delivered > 20 * attempt,
            "{delivered} deliveries before kill {attempt}"
        );
        worker.kill()?;
    }
    lock.release().await?;
    setup
        .server
        .jetstream()
        .update_stream(async_nats::jetstream::stream::Config {
            max_messages: -1,
            ..full
        })
        .await?;
    let worker = setup.fx.worker(&setup.manifest, "survivor")?;
    wait_for(LONG, "every message stored or dead-lettered", || async {
        let info = setup.consumer().await?;
        let stored = setup.fx.todo_count(setup.name).await?;
        let letters = setup
            .server
            .stream_messages(&dead_letters)
            .await?
            .unwrap_or_default()
            .len() as i64
            - 1;
        Ok(stored + letters >= 20 && info.num_pending == 0 && info.num_ack_pending == 0)
    })
    .await
    .with_context(|| worker.log_tail())?;
    let info = setup.consumer().await?;
    ensure!(info.config.max_deliver == -1, "{:?}", info.config);
    Ok(())
}

/// Issue 27, a lost consumer under `deliverPolicy: new`: re-created after the highest stored
/// sequence, never at `new`, so the backlog published meanwhile is stored.
#[tokio::test]
async fn consumer_lost_under_deliver_policy_new_resumes_after_the_highest_stored_sequence()
-> Result<()> {
    let setup = Setup::start(
        "lostnew",
        ", ackWaitSeconds: 2, deliverPolicy: new",
        "batchSize: 20",
    )
    .await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    wait_for(LONG, "the consumer exists", || async {
        Ok(setup
            .server
            .consumer_info(&setup.stream(), CONSUMER)
            .await?
            .is_some())
    })
    .await
    .with_context(|| worker.log_tail())?;
    setup.produce(bodies(0..8)).await?;
    setup.wait_settled(8, &worker).await?;
    worker.kill()?;
    let stream = setup.server.jetstream().get_stream(setup.stream()).await?;
    stream.delete_consumer(CONSUMER).await?;
    setup.produce(bodies(8..300)).await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-b")?;
    setup.wait_settled(300, &worker).await?;
    setup
        .fx
        .assert_stored_exactly(setup.name, &bodies(0..300))
        .await
}

/// Issue 27, undecodable per message, at every layer of the frame: upstream `async-nats` drops
/// its connection for a header block or a subject it cannot decode (the message never arrives,
/// those after it on the connection are redelivered). With the patched client no connection
/// is dropped: a header value and a subject that are not UTF-8 are stored base64-encoded; a
/// header block the worker cannot read either is that message's dead letter alone (body
/// byte-identical, raw block in base64, reason `undecodable`); every neighbour is stored.
#[tokio::test]
async fn undecodable_headers_and_subjects_cost_no_connection_and_spare_the_neighbours() -> Result<()>
{
    let setup = Setup::start("rawheader", ", ackWaitSeconds: 2", "batchSize: 20").await?;
    let subject = NatsBroker::subject(setup.name);
    let odd = |n: u8| format!(r#"{{"odd":{n}}}"#).into_bytes();
    setup.produce(bodies(0..30)).await?;
    setup
        .server
        .publish_non_utf8_header(&subject, &odd(1))
        .await?;
    setup.produce(bodies(30..60)).await?;
    let unreadable: &[u8] = b"NATS/1.0\r\nno colon on this line\r\n\r\n";
    setup
        .server
        .publish_raw(subject.as_bytes(), unreadable, &odd(2))
        .await?;
    setup.produce(bodies(60..90)).await?;
    let mut raw_subject = format!("{}.or", setup.name).into_bytes();
    raw_subject.extend_from_slice(b"\xff\xfe");
    setup
        .server
        .publish_raw(&raw_subject, b"NATS/1.0\r\ntenant: acme\r\n\r\n", &odd(3))
        .await?;
    setup.produce(bodies(90..99)).await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    setup.wait_settled(101, &worker).await?;
    let mut expected = bodies(0..99);
    expected.extend([odd(1), odd(3)]);
    setup
        .fx
        .assert_stored_exactly(setup.name, &expected)
        .await?;
    let headers = |body: Vec<u8>| {
        let fx = &setup.fx;
        async move {
            let headers: serde_json::Value = sqlx::query_scalar(
                "SELECT e.headers FROM events e JOIN todos t ON t.event_id = e.id \
                 WHERE t.queue = $1 AND t.payload = $2::jsonb",
            )
            .bind(setup.name)
            .bind(String::from_utf8(body)?)
            .fetch_one(fx.pool())
            .await?;
            anyhow::Ok(headers)
        }
    };
    let first = headers(odd(1)).await?;
    ensure!(
        first["trace"]["base64"] == "//4gYmluYXJ5",
        "the header value is stored base64-encoded: {first}"
    );
    let third = headers(odd(3)).await?;
    use base64::Engine as _;
    ensure!(
        third["Nats-Subject"]["base64"]
            == base64::engine::general_purpose::STANDARD.encode(&raw_subject)
            && third["tenant"] == "acme",
        "the subject is stored base64-encoded, the headers as they are: {third}"
    );
    let letters = setup
        .server
        .stream_messages(&format!("{}_DLQ", setup.stream()))
        .await?
        .unwrap_or_default();
    ensure!(letters.len() == 1, "one dead letter: {letters:?}");
    let letter = &letters[0];
    ensure!(letter.payload.as_ref() == odd(2), "byte-identical body");
    let header = |name: &str| {
        letter
            .headers
            .get(name)
            .map(|value| value.as_str().to_owned())
            .unwrap_or_default()
    };
    ensure!(header("Switchboard-Reason") == "undecodable", "{letter:?}");
    let raw = base64::engine::general_purpose::STANDARD
        .decode(header("Switchboard-Raw-Headers-Base64"))
        .context("raw headers in base64")?;
    ensure!(raw == unreadable, "the raw header block is kept: {raw:?}");
    for family in [
        "switchboard_broker_reconnects_total",
        "switchboard_nats_reconnects_total",
        "switchboard_messages_redelivered_total",
    ] {
        ensure!(
            setup.metric(&worker, family)? == 0.0,
            "{family} is 0: no connection was dropped\n{}",
            worker.log_tail()
        );
    }
    Ok(())
}

/// Issue 27, a dead letter the server can never take (over its max payload): kept in
/// PostgreSQL, the original acknowledged, its batch stored: no wedge.
#[tokio::test]
async fn dead_letter_over_the_max_payload_is_kept_in_postgresql() -> Result<()> {
    let setup = Setup::start("bigletter", ", ackWaitSeconds: 2", "batchSize: 20").await?;
    let max_payload = setup.server.client().server_info().max_payload;
    // Fits as a message; with the dead letter's headers it does not.
    let poison = vec![b'x'; max_payload - 200];
    let mut all = bodies(0..10);
    all.push(poison.clone());
    all.extend(bodies(10..20));
    setup.produce(all).await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    wait_for(
        LONG,
        "the letter kept and everything acknowledged",
        || async {
            let info = setup.consumer().await?;
            Ok(
                !setup.fx.database_dead_letters(setup.name).await?.is_empty()
                    && info.num_pending == 0
                    && info.num_ack_pending == 0,
            )
        },
    )
    .await
    .with_context(|| worker.log_tail())?;
    setup
        .fx
        .assert_stored_exactly(setup.name, &bodies(0..20))
        .await?;
    let kept = setup.fx.database_dead_letters(setup.name).await?;
    ensure!(
        kept.len() == 1 && kept[0].0 == poison,
        "one letter kept, byte-identical"
    );
    Ok(())
}

/// Issue 27, the worker never reads its own dead letters: a filter subject that matches the
/// dead-letter subject stops the worker at start, naming both settings.
#[tokio::test]
async fn filter_subject_matching_the_dead_letter_subject_is_refused_naming_both_settings()
-> Result<()> {
    let setup = Setup::start(
        "eatown",
        ", filterSubject: 'eatown.>'",
        "deadLetter: {subject: eatown.dead}",
    )
    .await?;
    let mut worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    assert_fatal_exit(
        &mut worker,
        &[
            "spec.source.nats.filterSubject",
            "spec.delivery.deadLetter.subject",
        ],
    )
}

/// Issue 27, a wait without a deadline: the connection goes silent (no FIN, no RST: nothing
/// more is forwarded either way) right after each of the first two no-wait pull requests; the
/// worker notices (every wait has a deadline, pings go unanswered), dials again and stores
/// everything. A worker that waited for the pull request's end would wait forever.
#[tokio::test]
async fn connection_cut_after_a_no_wait_pull_does_not_wedge_the_worker() -> Result<()> {
    let mut setup = Setup::start("cutpull", ", ackWaitSeconds: 2", "batchSize: 20").await?;
    let proxy = SilencingProxy::start(setup.server.url(), 2).await?;
    setup.fx.extra_env = vec![("NATS_URL".to_owned(), proxy.url())];
    setup.produce(bodies(0..600)).await?;
    let worker = setup.fx.worker(&setup.manifest, "worker-a")?;
    setup.wait_settled(600, &worker).await?;
    ensure!(
        proxy.cuts() >= 1,
        "no no-wait pull request was cut:\n{}",
        worker.log_tail()
    );
    setup
        .fx
        .assert_stored_exactly(setup.name, &bodies(0..600))
        .await
}

/// A TCP proxy in front of nats-server that silences a client's connection at a no-wait pull
/// request (`"no_wait":true`), the first `cuts` times: neither it nor anything more is
/// forwarded either way, and both sockets stay open (as behind a dropped route) until the
/// proxy is dropped. The answer to that request never comes.
struct SilencingProxy {
    port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl SilencingProxy {
    async fn start(upstream: String, cuts: usize) -> Result<Self> {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let upstream = upstream.trim_start_matches("nats://").to_owned();
        let cut = Arc::new(AtomicUsize::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        let counter = cut.clone();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let counter = counter.clone();
                let stopped = stopped.clone();
                tokio::spawn(async move {
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    let silenced = Arc::new(AtomicBool::new(false));
                    let down_silenced = silenced.clone();
                    let down = async move {
                        let mut buffer = vec![0; 64 * 1024];
                        while let Ok(read) = server_read.read(&mut buffer).await {
                            if read == 0
                                || down_silenced.load(Ordering::Acquire)
                                || client_write.write_all(&buffer[..read]).await.is_err()
                            {
                                break;
                            }
                        }
                        // Holds the sockets open, silent, until the proxy is dropped.
                        stopped.cancelled().await;
                        drop((server_read, client_write));
                    };
                    let up = async move {
                        let mut buffer = vec![0; 64 * 1024];
                        while let Ok(read) = client_read.read(&mut buffer).await {
                            let chunk = &buffer[..read];
                            let holds =
                                |needle: &[u8]| chunk.windows(needle.len()).any(|w| w == needle);
                            let no_wait_pull =
                                holds(b"CONSUMER.MSG.NEXT") && holds(b"\"no_wait\":true");
                            // The pull request is sent, as far as the client can tell, and
                            // neither it nor anything after it is forwarded.
                            if no_wait_pull
                                && counter
                                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                                        (n < cuts).then_some(n + 1)
                                    })
                                    .is_ok()
                            {
                                silenced.store(true, Ordering::Release);
                                break;
                            }
                            if read == 0 || server_write.write_all(chunk).await.is_err() {
                                break;
                            }
                        }
                        (client_read, server_write)
                    };
                    let (held, ()) = tokio::join!(up, down);
                    drop(held);
                });
            }
        });
        Ok(Self {
            port,
            cut,
            stop,
            task,
        })
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn cuts(&self) -> usize {
        self.cut.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for SilencingProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}

const FOUR_DAYS: Duration = Duration::from_secs(4 * 86_400);

/// Creates stream `{STREAM}_DLQ` holding the dead-letter subjects, keeping messages 4 days.
async fn four_day_dead_letter_stream(setup: &Setup) -> Result<String> {
    let dead_letters = format!("{}_DLQ", setup.stream());
    setup
        .server
        .create_stream_with(async_nats::jetstream::stream::Config {
            name: dead_letters.clone(),
            subjects: vec![format!("{}.dlq.>", setup.stream())],
            max_age: FOUR_DAYS,
            ..Default::default()
        })
        .await?;
    Ok(dead_letters)
}

async fn max_age(setup: &Setup, stream: &str) -> Result<Duration> {
    let mut stream = setup.server.jetstream().get_stream(stream).await?;
    Ok(stream.info().await?.config.max_age)
}

#[tokio::test]
async fn existing_dead_letter_stream_kept_four_days_is_raised_to_retention_days() -> Result<()> {
    let setup = Setup::start("brief", "", "batchSize: 10").await?;
    let dead_letters = four_day_dead_letter_stream(&setup).await?;
    let worker = setup.fx.worker(&setup.manifest, "w1")?;
    worker.wait_ready(LONG).await?;
    let kept = max_age(&setup, &dead_letters).await?;
    ensure!(
        kept == Duration::from_secs(14 * 86_400),
        "the dead-letter stream keeps messages {kept:?}, not retentionDays (14 days)\n{}",
        worker.log_tail()
    );
    Ok(())
}

#[tokio::test]
async fn accept_shorter_retention_leaves_a_four_day_dead_letter_stream() -> Result<()> {
    let setup = Setup::start(
        "accepted",
        "",
        "batchSize: 10, deadLetter: {acceptShorterRetention: true}",
    )
    .await?;
    let dead_letters = four_day_dead_letter_stream(&setup).await?;
    let worker = setup.fx.worker(&setup.manifest, "w1")?;
    worker.wait_ready(LONG).await?;
    ensure!(max_age(&setup, &dead_letters).await? == FOUR_DAYS);
    ensure!(
        worker.log().contains("acceptShorterRetention"),
        "no warning about the shorter retention:\n{}",
        worker.log_tail()
    );
    Ok(())
}

#[tokio::test]
async fn oldest_dead_letter_age_gauge_counts_from_the_letter_write() -> Result<()> {
    let setup = Setup::start("aged", ", ackWaitSeconds: 2", "batchSize: 10").await?;
    let mut all = bodies(0..3);
    all.push(b"{\"order\": broken".to_vec());
    setup.produce(all).await?;
    let worker = setup.fx.worker(&setup.manifest, "w1")?;
    setup.wait_settled(3, &worker).await?;
    let age = "switchboard_oldest_dead_letter_age_seconds";
    wait_for(
        LONG,
        "one dead letter counted, its age above zero",
        || async {
            Ok(
                setup.metric(&worker, "switchboard_dead_letter_messages")? == 1.0
                    && setup.metric(&worker, age)? > 0.0,
            )
        },
    )
    .await
    .with_context(|| worker.log_tail())?;
    let seconds = setup.metric(&worker, age)?;
    ensure!(
        seconds < 120.0,
        "the age counts from the letter's write: {seconds} s"
    );
    Ok(())
}

const DAY: Duration = Duration::from_secs(86_400);

/// Issue 30: the stream's `max_age` is compared with the dedup window at start — without a limit
/// (NATS's default) said at info level, longer than the window warned about naming both.
#[tokio::test]
async fn stream_max_age_longer_than_the_dedup_window_is_warned_about_at_start() -> Result<()> {
    let setup = Setup::start("kept", "", "batchSize: 10").await?;
    let unlimited = setup.fx.worker(&setup.manifest, "w1")?;
    unlimited.wait_ready(LONG).await?;
    let log = unlimited.log();
    ensure!(
        log.contains("without a time limit")
            && log.contains(&format!("max_age of stream {}", setup.stream()))
            && !log.contains(RETENTION_WARNING),
        "a stream without max_age is said once at info level, not warned about:\n{log}"
    );
    unlimited.kill()?;

    let js = setup.server.jetstream();
    let mut config = js
        .get_stream(setup.stream())
        .await?
        .info()
        .await?
        .config
        .clone();
    config.max_age = DAY * 2;
    js.update_stream(config).await?;
    setup.fx.store.maintain_events(DAY, 0).await?;
    let bounded = setup.fx.worker(&setup.manifest, "w2")?;
    bounded.wait_ready(LONG).await?;
    bounded.assert_retention_warned("2d", &format!("max_age of stream {}", setup.stream()))?;
    Ok(())
}
