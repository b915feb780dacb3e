//! RabbitMQ in the bench: quorum queues of a real node (Debian's rabbitmq-server 3.10); the raw
//! limit is `basic.consume` with prefetch = the batch size and one `basic.ack multiple=true` per
//! batch, on concurrent channels — what the worker does, without the database. The same loop
//! with amqprs runs beside lapin's (`--amqp-clients`): the AMQP client comparison of
//! docs/PERFORMANCE.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use futures::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use switchboard_tests::brokers::rabbitmq::{QueueType, RabbitMq, queue_arguments};
use switchboard_tests::wait::wait_for;
use tokio::task::JoinSet;

use crate::broker::{BenchBroker, RawClient, RawLoops};
use crate::measure::{CpuSpent, Measurement};
use crate::order_body;
use crate::raw::KeyTime;
use crate::table::{Row, Stat, Table};

/// How long a raw loop gathers a batch after its first delivery (the worker's window).
const GATHER: Duration = Duration::from_millis(50);
/// A raw loop waiting this long for a delivery gives up (the queue is drained long before).
const IDLE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, clap::Args)]
pub struct AmqpArgs {
    /// Messages published to a quorum queue of RabbitMQ per AMQP phase (0: no AMQP phases).
    #[arg(long, default_value_t = 100_000)]
    amqp_messages: usize,
    /// The AMQP worker's delivery.batchSize (the raw loop's prefetch; the worker's is this times
    /// its batches in flight), 500 like the other brokers' rows.
    #[arg(long, default_value_t = 500)]
    amqp_batch_size: usize,
    /// Concurrent consume + ack(multiple) channels tried for the raw AMQP limit (1 = the
    /// worker's one consumer).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    amqp_loops: Vec<usize>,
    /// The AMQP client libraries whose raw loops are measured: the worker's (lapin) is the raw
    /// limit of the verdicts; amqprs's row is the comparison.
    #[arg(long, value_delimiter = ',', default_value = "lapin,amqprs")]
    amqp_clients: Vec<AmqpClient>,
}

/// An AMQP 0-9-1 client library.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum AmqpClient {
    Lapin,
    Amqprs,
}

impl AmqpClient {
    fn raw(self) -> RawClient {
        match self {
            AmqpClient::Lapin => RawClient::Workers,
            AmqpClient::Amqprs => RawClient::Amqprs,
        }
    }
}

/// A RabbitMQ node, started for its rounds unless `--amqp-messages` is 0.
pub struct AmqpBench {
    args: AmqpArgs,
    server: Option<RabbitMq>,
    queues_created: usize,
}

impl AmqpBench {
    pub fn new(args: AmqpArgs) -> Self {
        Self {
            args,
            server: None,
            queues_created: 0,
        }
    }

    /// The raw loop of each AMQP client measured: client and server CPU per message and rate,
    /// medians (min–max), and amqprs's client CPU over lapin's.
    pub fn print_client_comparison(&self, table: &Table) {
        let rows: Vec<(&str, Option<&Row>)> = ["amqp", "amqprs"]
            .into_iter()
            .map(|client| (client, table.best(&format!("raw {client} "))))
            .collect();
        for (client, row) in &rows {
            let Some(row) = row else { continue };
            let per_message =
                |side: fn(&CpuSpent) -> Duration| row.stat(|m| m.micros_per_message(side(&m.cpu)));
            println!(
                "amqp client {:<6} raw loop: client {} µs/msg, RabbitMQ {} µs/msg, {} msg/s",
                if *client == "amqp" { "lapin" } else { client },
                per_message(|cpu| cpu.client).show(1, 1.0),
                per_message(|cpu| cpu.broker).show(1, 1.0),
                row.rate().show(0, 1.0)
            );
        }
        if let [(_, Some(lapin)), (_, Some(amqprs))] = rows.as_slice() {
            let client = |m: &Measurement| m.micros_per_message(m.cpu.client);
            let ratio = Stat::of(
                amqprs
                    .runs
                    .iter()
                    .zip(&lapin.runs)
                    .map(|(a, l)| client(a) / client(l))
                    .collect(),
            );
            println!(
                "amqp client amqprs / lapin, client CPU per message: {}%",
                ratio.show(1, 100.0)
            );
        }
    }

    fn server(&self) -> Result<&RabbitMq> {
        self.server.as_ref().context("RabbitMQ is not running")
    }
}

impl BenchBroker for AmqpBench {
    fn kind(&self) -> &'static str {
        "amqp"
    }

    fn messages(&self) -> usize {
        self.args.amqp_messages
    }

    fn batch_size(&self) -> usize {
        self.args.amqp_batch_size
    }

    fn raw_loops(&self) -> Vec<RawLoops> {
        let clients = &self.args.amqp_clients;
        clients
            .iter()
            .flat_map(|client| {
                self.args.amqp_loops.iter().map(|&count| RawLoops {
                    count,
                    client: client.raw(),
                })
            })
            .collect()
    }

    fn target(&self) -> f64 {
        0.7
    }

    /// A RabbitMQ `message-id` has no broker time (a producer's retry repeats it later).
    fn key_time(&self) -> KeyTime {
        KeyTime::Untimed
    }

    async fn start_server(&mut self) -> Result<()> {
        self.server = Some(RabbitMq::start()?);
        Ok(())
    }

    fn stop_server(&mut self) {
        self.server = None;
    }

    fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().and_then(RabbitMq::pid)
    }

    /// A fresh quorum queue `amqp-bench-N` and its dead-letter queue `amqp-bench-N.dlq`.
    async fn fresh_queue(&mut self, messages: usize) -> Result<String> {
        self.queues_created += 1;
        let name = format!("amqp-bench-{}", self.queues_created);
        let server = self.server()?;
        for queue in [name.clone(), format!("{name}.dlq")] {
            server
                .declare(&queue, queue_arguments(QueueType::Quorum, &[]))
                .await?;
        }
        let bodies = (0..messages).map(|i| {
            let properties =
                BasicProperties::default().with_message_id(format!("order-{i}").into());
            (order_body(i), properties)
        });
        server.publish(&name, bodies).await?;
        let expected = u64::try_from(messages)?;
        wait_for(
            Duration::from_secs(30),
            &format!("{name} holds {messages} messages"),
            || async { Ok(server.messages(&name).await? == expected) },
        )
        .await?;
        Ok(name)
    }

    async fn drain_raw(&self, queue: &str, loops: RawLoops) -> Result<(usize, String)> {
        let server = self.server()?;
        let (url, port) = (server.url(), server.amqp_port());
        let total = self.messages();
        let acked = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        for _ in 0..loops.count {
            let (url, queue, acked) = (url.clone(), queue.to_owned(), Arc::clone(&acked));
            let batch = self.batch_size();
            match loops.client {
                RawClient::Workers => tasks.spawn(async move {
                    consume_ack_loop(&url, &queue, batch, total, &acked).await
                }),
                RawClient::Amqprs => tasks.spawn(async move {
                    amqprs_consume_ack_loop(port, &queue, batch, total, &acked).await
                }),
            };
        }
        while let Some(result) = tasks.join_next().await {
            result??;
        }
        let client = match loops.client {
            RawClient::Workers => "amqp",
            RawClient::Amqprs => "amqprs",
        };
        Ok((
            acked.load(Ordering::Relaxed),
            format!(
                "raw {client} consume+ack(multiple) prefetch {} x{}",
                self.batch_size(),
                loops.count
            ),
        ))
    }

    fn worker_source(&self, queue: &str) -> (String, Vec<(&'static str, String)>) {
        let url = self.server.as_ref().map(RabbitMq::url).unwrap_or_default();
        (format!("amqp: {{queue: {queue}}}"), vec![("AMQP_URL", url)])
    }

    async fn unacknowledged(&self, queue: &str) -> Result<u64> {
        self.server()?.messages(queue).await
    }

    async fn drop_queue(&self, queue: &str) -> Result<()> {
        let server = self.server()?;
        for queue in [queue.to_owned(), format!("{queue}.dlq")] {
            let left = server.messages(&queue).await?;
            ensure!(
                left == 0,
                "queue {queue} is not empty after the phase: {left}"
            );
            server.delete(&queue).await?;
        }
        Ok(())
    }
}

/// One consumer with prefetch `batch`: takes what arrives within [`GATHER`] of a batch's first
/// delivery (up to `batch`), acknowledges it with one `basic.ack multiple=true`, until `total`
/// messages are acknowledged by all loops together.
async fn consume_ack_loop(
    url: &str,
    queue: &str,
    batch: usize,
    total: usize,
    acked: &AtomicUsize,
) -> Result<()> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(
            u16::try_from(batch).unwrap_or(u16::MAX),
            BasicQosOptions::default(),
        )
        .await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    while acked.load(Ordering::Relaxed) < total {
        let first = match tokio::time::timeout(IDLE, consumer.next()).await {
            Ok(Some(delivery)) => delivery?,
            Ok(None) => break,
            // Another loop took the rest.
            Err(_) => break,
        };
        let mut last = first.delivery_tag;
        let mut count = 1;
        let until = tokio::time::Instant::now() + GATHER;
        while count < batch {
            match tokio::time::timeout_at(until, consumer.next()).await {
                Ok(Some(delivery)) => {
                    last = delivery?.delivery_tag;
                    count += 1;
                }
                _ => break,
            }
        }
        channel
            .basic_ack(last, BasicAckOptions { multiple: true })
            .await?;
        acked.fetch_add(count, Ordering::Relaxed);
    }
    let _ = connection.close(200, "drained".into()).await;
    Ok(())
}

/// [`consume_ack_loop`] with amqprs (its consumer is an unbounded channel of deliveries).
async fn amqprs_consume_ack_loop(
    port: u16,
    queue: &str,
    batch: usize,
    total: usize,
    acked: &AtomicUsize,
) -> Result<()> {
    use amqprs::channel::{BasicAckArguments, BasicConsumeArguments, BasicQosArguments};
    use amqprs::connection::{Connection, OpenConnectionArguments};
    let connection = Connection::open(&OpenConnectionArguments::new(
        "127.0.0.1",
        port,
        "guest",
        "guest",
    ))
    .await?;
    let channel = connection.open_channel(None).await?;
    channel
        .basic_qos(BasicQosArguments::new(
            0,
            u16::try_from(batch).unwrap_or(u16::MAX),
            false,
        ))
        .await?;
    let (_, mut deliveries) = channel
        .basic_consume_rx(BasicConsumeArguments::new(queue, ""))
        .await?;
    let tag = |message: amqprs::channel::ConsumerMessage| {
        message
            .deliver
            .map(|deliver| deliver.delivery_tag())
            .context("a consumer message without its basic.deliver")
    };
    while acked.load(Ordering::Relaxed) < total {
        let first = match tokio::time::timeout(IDLE, deliveries.recv()).await {
            Ok(Some(message)) => message,
            // Closed, or another loop took the rest.
            Ok(None) | Err(_) => break,
        };
        let mut last = tag(first)?;
        let mut count = 1;
        let until = tokio::time::Instant::now() + GATHER;
        while count < batch {
            match tokio::time::timeout_at(until, deliveries.recv()).await {
                Ok(Some(message)) => {
                    last = tag(message)?;
                    count += 1;
                }
                _ => break,
            }
        }
        channel
            .basic_ack(BasicAckArguments::new(last, true))
            .await?;
        acked.fetch_add(count, Ordering::Relaxed);
    }
    let _ = connection.close().await;
    Ok(())
}
