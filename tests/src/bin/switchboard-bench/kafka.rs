//! Kafka in the bench: topics of three partitions on a real single-node Kafka (KRaft); the raw
//! limit is one consumer-group member polling and committing each batch (what the worker does,
//! minus the database).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};
use switchboard_tests::brokers::kafka::KafkaServer;
use switchboard_tests::brokers::{KAFKA_PARTITIONS, kafka_group};
use switchboard_tests::wait::wait_for;

use crate::broker::{BenchBroker, RawLoops};
use crate::{PHASE_TIMEOUT, order_body};

#[derive(Debug, Clone, clap::Args)]
pub struct KafkaArgs {
    /// Records produced to a Kafka topic (three partitions) per Kafka phase (0: no Kafka phases).
    #[arg(long, default_value_t = 100_000)]
    kafka_messages: usize,
    /// The Kafka worker's delivery.batchSize.
    #[arg(long, default_value_t = 500)]
    kafka_batch_size: usize,
    /// A pause after each batch of the raw loop, in ms (0: none): at about the worker's pace
    /// (500 / its msg/s), it shows what the broker costs per message at that pace.
    #[arg(long, default_value_t = 0)]
    kafka_raw_pause_ms: u64,
}

/// A Kafka node, started for its rounds unless `--kafka-messages` is 0.
pub struct KafkaBench {
    args: KafkaArgs,
    server: Option<KafkaServer>,
    topics_created: usize,
}

impl KafkaBench {
    pub fn new(args: KafkaArgs) -> Self {
        Self {
            args,
            server: None,
            topics_created: 0,
        }
    }

    fn server(&self) -> Result<&KafkaServer> {
        self.server.as_ref().context("Kafka is not running")
    }
}

impl BenchBroker for KafkaBench {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn messages(&self) -> usize {
        self.args.kafka_messages
    }

    fn batch_size(&self) -> usize {
        self.args.kafka_batch_size
    }

    /// One group member: a Kafka consumer reads its partitions on one connection.
    fn raw_loops(&self) -> Vec<RawLoops> {
        vec![RawLoops::workers(1)]
    }

    fn target(&self) -> f64 {
        0.7
    }

    async fn start_server(&mut self) -> Result<()> {
        self.server = Some(KafkaServer::start()?);
        Ok(())
    }

    fn stop_server(&mut self) {
        self.server = None;
    }

    fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().and_then(KafkaServer::pid)
    }

    /// A fresh topic `kafka-bench-N` (three partitions) and `kafka-bench-N.dlq`.
    async fn fresh_queue(&mut self, messages: usize) -> Result<String> {
        self.topics_created += 1;
        let name = format!("kafka-bench-{}", self.topics_created);
        let server = self.server()?;
        server.create_topic(&name, KAFKA_PARTITIONS).await?;
        server.create_topic(&format!("{name}.dlq"), 1).await?;
        for start in (0..messages).step_by(10_000) {
            let bodies = (start..(start + 10_000).min(messages))
                .map(order_body)
                .collect();
            server.produce(&name, bodies).await?;
        }
        // The group's coordinator may not be ready yet on a fresh node (NotCoordinator).
        let expected = u64::try_from(messages)?;
        wait_for(
            Duration::from_secs(30),
            &format!("{name} holds {messages} records for the group"),
            || async { Ok(server.lag(&name, &kafka_group(&name)).await? == expected) },
        )
        .await?;
        Ok(name)
    }

    async fn drain_raw(&self, queue: &str, loops: RawLoops) -> Result<(usize, String)> {
        let loops = loops.count;
        let bootstrap = self.server()?.bootstrap();
        let topic = queue.to_owned();
        let expected = self.messages();
        let pause = self.args.kafka_raw_pause_ms;
        let consumed = tokio::task::spawn_blocking(move || {
            raw_consume_commit(&bootstrap, &topic, expected, Duration::from_millis(pause))
        })
        .await??;
        let name = match pause {
            0 => format!("raw kafka poll+commit x{loops}"),
            pause => format!("raw kafka poll+commit x{loops} paused {pause} ms"),
        };
        Ok((consumed, name))
    }

    fn worker_source(&self, queue: &str) -> (String, Vec<(&'static str, String)>) {
        let bootstrap = self
            .server
            .as_ref()
            .map(KafkaServer::bootstrap)
            .unwrap_or_default();
        (
            format!("kafka: {{bootstrapServers: \"{bootstrap}\", topics: [{queue}]}}"),
            Vec::new(),
        )
    }

    async fn unacknowledged(&self, queue: &str) -> Result<u64> {
        self.server()?.lag(queue, &kafka_group(queue)).await
    }

    async fn drop_queue(&self, queue: &str) -> Result<()> {
        let server = self.server()?;
        let letters = server.read_all(&format!("{queue}.dlq")).await?;
        ensure!(
            letters.is_empty(),
            "{queue}.dlq holds {} dead letters after the phase",
            letters.len()
        );
        server
            .delete_topics(&[queue, &format!("{queue}.dlq")])
            .await
    }
}

/// One group member polls `topic` and commits each batch's offsets (asynchronously, as the
/// worker does), `pause` after each, until `expected` records were read; then one synchronous
/// commit.
fn raw_consume_commit(
    bootstrap: &str,
    topic: &str,
    expected: usize,
    pause: Duration,
) -> Result<usize> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("raw-{topic}"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .create()?;
    consumer.subscribe(&[topic])?;
    let deadline = Instant::now() + PHASE_TIMEOUT;
    let mut consumed = 0;
    let mut next = std::collections::BTreeMap::new();
    while consumed < expected {
        ensure!(
            Instant::now() < deadline,
            "raw kafka: {consumed} of {expected} records in time"
        );
        let mut batch = 0;
        while batch < 500 {
            match consumer.poll(Duration::from_millis(if batch == 0 { 100 } else { 0 })) {
                Some(Ok(record)) => {
                    next.insert(record.partition(), record.offset() + 1);
                    batch += 1;
                }
                Some(Err(err)) => return Err(err.into()),
                None => break,
            }
        }
        if batch > 0 {
            let mut list = TopicPartitionList::new();
            for (partition, offset) in &next {
                list.add_partition_offset(topic, *partition, Offset::Offset(*offset))?;
            }
            consumer.commit(&list, CommitMode::Async)?;
            consumed += batch;
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
    }
    consumer.commit_consumer_state(CommitMode::Sync).ok();
    Ok(consumed)
}
