//! NATS JetStream beyond the contract suite, end to end: the real worker binary against real
//! PostgreSQL and a real nats-server with JetStream.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use async_nats::jetstream::consumer::{AckPolicy, pull};
use switchboard_tests::brokers::NatsBroker;
use switchboard_tests::brokers::nats::NatsServer;
use switchboard_tests::todos_lock::{TodosLock, wait_blocked_on_lock};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::WorkerProcess;
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
