//! NATS JetStream in the bench: a stream per phase on a real nats-server; the raw limit is
//! concurrent fetch(batch) + confirmed-ack loops on a durable pull consumer (the same
//! acknowledgements the worker sends, the last of each batch confirmed), without a database.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use futures::StreamExt as _;
use switchboard_tests::brokers::NatsBroker;
use switchboard_tests::brokers::nats::NatsServer;
use tokio::task::JoinSet;

use crate::broker::{BenchBroker, RawLoops};
use crate::order_body;

/// The worker's consumer (the default of `spec.source.nats.consumer`).
const WORKER_CONSUMER: &str = "switchboard";
/// How long a raw loop waits for the server to confirm one batch of acks.
const ACK_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, clap::Args)]
pub struct NatsArgs {
    /// Messages published to a JetStream stream per NATS phase (0: no NATS phases).
    #[arg(long, default_value_t = 100_000)]
    nats_messages: usize,
    /// The NATS worker's delivery.batchSize (one fetch); the raw database limit it is compared
    /// with is measured in batches of the same size.
    #[arg(long, default_value_t = 1000)]
    nats_batch_size: usize,
    /// Concurrent fetch+ack loops tried for the raw NATS limit (the worker has one fetch and
    /// up to four batches being stored at a time).
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    nats_loops: Vec<usize>,
    /// A pause after each batch of the raw loops, in ms (0: none): at about the worker's pace
    /// (batch size / its msg/s), it shows what nats-server costs per message at that pace.
    #[arg(long, default_value_t = 0)]
    nats_raw_pause_ms: u64,
}

/// nats-server, started for its rounds unless `--nats-messages` is 0.
pub struct NatsBench {
    args: NatsArgs,
    server: Option<NatsServer>,
    streams_created: usize,
}

impl NatsBench {
    pub fn new(args: NatsArgs) -> Self {
        Self {
            args,
            server: None,
            streams_created: 0,
        }
    }

    fn server(&self) -> Result<&NatsServer> {
        self.server.as_ref().context("nats-server is not running")
    }
}

impl BenchBroker for NatsBench {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn messages(&self) -> usize {
        self.args.nats_messages
    }

    fn batch_size(&self) -> usize {
        self.args.nats_batch_size
    }

    fn raw_loops(&self) -> Vec<RawLoops> {
        self.args
            .nats_loops
            .iter()
            .copied()
            .map(RawLoops::workers)
            .collect()
    }

    fn target(&self) -> f64 {
        0.7
    }

    async fn start_server(&mut self) -> Result<()> {
        self.server = Some(NatsServer::start().await?);
        Ok(())
    }

    fn stop_server(&mut self) {
        self.server = None;
    }

    fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().and_then(NatsServer::pid)
    }

    /// A fresh stream `NATS-BENCH-N` holding `nats-bench-N.>`, `messages` published to it.
    async fn fresh_queue(&mut self, messages: usize) -> Result<String> {
        self.streams_created += 1;
        let name = format!("nats-bench-{}", self.streams_created);
        let server = self.server()?;
        let stream = NatsBroker::stream(&name);
        server
            .create_stream(&stream, &[format!("{name}.>")])
            .await?;
        server
            .publish(
                &NatsBroker::subject(&name),
                (0..messages).map(order_body).collect(),
            )
            .await?;
        let held = server
            .jetstream()
            .get_stream(&stream)
            .await?
            .info()
            .await?
            .state
            .messages;
        ensure!(
            held == u64::try_from(messages)?,
            "{stream}: {held} of {messages} messages stored after publishing"
        );
        Ok(name)
    }

    async fn drain_raw(&self, queue: &str, loops: RawLoops) -> Result<(usize, String)> {
        let loops = loops.count;
        let server = self.server()?;
        let stream = server
            .jetstream()
            .get_stream(NatsBroker::stream(queue))
            .await?;
        let consumer: PullConsumer = stream
            .create_consumer(pull::Config {
                durable_name: Some("raw".to_owned()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                // As the worker's consumer: the server's 1,000 is less than the loops hold.
                max_ack_pending: -1,
                ..Default::default()
            })
            .await?;
        let acked = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        for _ in 0..loops {
            let (client, consumer, acked) = (server.client(), consumer.clone(), Arc::clone(&acked));
            let (batch, pause) = (
                self.args.nats_batch_size,
                Duration::from_millis(self.args.nats_raw_pause_ms),
            );
            tasks.spawn(
                async move { fetch_ack_loop(&client, &consumer, (batch, pause), &acked).await },
            );
        }
        while let Some(result) = tasks.join_next().await {
            result??;
        }
        Ok((
            acked.load(Ordering::Relaxed),
            match self.args.nats_raw_pause_ms {
                0 => format!(
                    "raw nats fetch({})+confirmed ack x{loops}",
                    self.args.nats_batch_size
                ),
                pause => format!(
                    "raw nats fetch({})+confirmed ack x{loops} paused {pause} ms",
                    self.args.nats_batch_size
                ),
            },
        ))
    }

    fn worker_source(&self, queue: &str) -> (String, Vec<(&'static str, String)>) {
        let url = self
            .server
            .as_ref()
            .map(NatsServer::url)
            .unwrap_or_default();
        (
            format!(
                "nats: {{stream: {}, consumer: {WORKER_CONSUMER}}}",
                NatsBroker::stream(queue)
            ),
            vec![("NATS_URL", url)],
        )
    }

    async fn unacknowledged(&self, queue: &str) -> Result<u64> {
        let server = self.server()?;
        let stream = NatsBroker::stream(queue);
        Ok(
            match server.consumer_info(&stream, WORKER_CONSUMER).await? {
                Some(info) => info.num_pending + info.num_ack_pending as u64,
                None => {
                    server
                        .jetstream()
                        .get_stream(&stream)
                        .await?
                        .info()
                        .await?
                        .state
                        .messages
                }
            },
        )
    }

    /// Fails if the phase dead-lettered anything or left messages un-acknowledged; then
    /// deletes the stream and its dead-letter stream.
    async fn drop_queue(&self, queue: &str) -> Result<()> {
        let server = self.server()?;
        let stream = NatsBroker::stream(queue);
        let js = server.jetstream();
        let dead_letters = format!("{stream}_DLQ");
        if let Some(letters) = server.stream_messages(&dead_letters).await? {
            ensure!(
                letters.is_empty(),
                "{dead_letters} holds {} letters",
                letters.len()
            );
            js.delete_stream(&dead_letters).await?;
        }
        for consumer in ["raw", WORKER_CONSUMER] {
            if let Some(info) = server.consumer_info(&stream, consumer).await? {
                ensure!(
                    info.num_pending == 0 && info.num_ack_pending == 0,
                    "{stream}/{consumer} still holds messages: {info:?}"
                );
            }
        }
        js.delete_stream(&stream).await?;
        Ok(())
    }
}

/// fetch(batch) + the acks the worker sends (all but the last as they are, the last confirmed
/// by the server, which confirms them all) until a fetch comes back empty; `pause` after each
/// batch.
async fn fetch_ack_loop(
    client: &async_nats::Client,
    consumer: &PullConsumer,
    (batch, pause): (usize, Duration),
    acked: &AtomicUsize,
) -> Result<()> {
    loop {
        let mut fetched = consumer.fetch().max_messages(batch).messages().await?;
        let mut replies = Vec::with_capacity(batch);
        while let Some(message) = fetched.next().await {
            let message = message.map_err(|err| anyhow::anyhow!("fetch: {err}"))?;
            replies.push(message.message.reply.context("no ack subject")?);
        }
        let Some(last) = replies.pop() else {
            return Ok(());
        };
        for reply in &replies {
            client.publish(reply.clone(), AckKind::Ack.into()).await?;
        }
        tokio::time::timeout(ACK_TIMEOUT, client.request(last, AckKind::Ack.into()))
            .await
            .context("the acks were not confirmed in time")??;
        acked.fetch_add(replies.len() + 1, Ordering::Relaxed);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}
