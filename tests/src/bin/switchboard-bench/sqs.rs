//! SQS in the bench: standard queues of a real ElasticMQ server; the raw limit is concurrent
//! ReceiveMessage(10) + DeleteMessageBatch loops.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result, ensure};
use aws_sdk_sqs::Client as SqsClient;
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageSystemAttributeName, SendMessageBatchRequestEntry,
};
use switchboard_tests::brokers::sqs::{ElasticMq, sqs_error};
use tokio::task::JoinSet;

use crate::broker::{BenchBroker, RawLoops};
use crate::order_body;

/// Concurrent SendMessageBatch calls producing the messages before a phase (not timed).
const PRODUCERS: usize = 8;

/// The most entries one SQS batch call takes, and the most messages one receive returns.
const BATCH_LIMIT: usize = 10;

#[derive(Debug, Clone, clap::Args)]
pub struct SqsArgs {
    /// Messages sent to a standard SQS queue of ElasticMQ per SQS phase (0: no SQS phases).
    #[arg(long, default_value_t = 100_000)]
    sqs_messages: usize,
    /// The SQS worker's delivery.batchSize (gathered from batchSize/10 concurrent receives).
    #[arg(long, default_value_t = 100)]
    sqs_batch_size: usize,
    /// Concurrent ReceiveMessage(10)+DeleteMessageBatch loops tried for the raw SQS limit
    /// (10 = the worker's concurrent receives at batchSize 100).
    #[arg(long, value_delimiter = ',', default_value = "10")]
    sqs_loops: Vec<usize>,
}

/// ElasticMQ, started for its rounds unless `--sqs-messages` is 0.
pub struct SqsBench {
    args: SqsArgs,
    server: Option<ElasticMq>,
    queues_created: usize,
}

impl SqsBench {
    pub fn new(args: SqsArgs) -> Self {
        Self {
            args,
            server: None,
            queues_created: 0,
        }
    }

    fn server(&self) -> Result<&ElasticMq> {
        self.server.as_ref().context("ElasticMQ is not running")
    }

    fn url(&self, queue: &str) -> Result<String> {
        Ok(format!(
            "{}/000000000000/{queue}",
            self.server()?.endpoint()
        ))
    }
}

impl BenchBroker for SqsBench {
    fn kind(&self) -> &'static str {
        "sqs"
    }

    fn messages(&self) -> usize {
        self.args.sqs_messages
    }

    fn batch_size(&self) -> usize {
        self.args.sqs_batch_size
    }

    fn raw_loops(&self) -> Vec<RawLoops> {
        self.args
            .sqs_loops
            .iter()
            .copied()
            .map(RawLoops::workers)
            .collect()
    }

    /// ElasticMQ's own CPU is the bound (docs/PERFORMANCE.md), far below the database's.
    fn target(&self) -> f64 {
        0.6
    }

    /// ElasticMQ stands in for SQS: its JVM's CPU per message says nothing of a worker on AWS.
    fn cpu_targets(&self) -> bool {
        false
    }

    async fn start_server(&mut self) -> Result<()> {
        self.server = Some(ElasticMq::start()?);
        Ok(())
    }

    fn stop_server(&mut self) {
        self.server = None;
    }

    fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().and_then(ElasticMq::pid)
    }

    /// A fresh standard queue `sqs-bench-N` and its dead-letter queue `sqs-bench-N-dlq`.
    async fn fresh_queue(&mut self, messages: usize) -> Result<String> {
        self.queues_created += 1;
        let name = format!("sqs-bench-{}", self.queues_created);
        let server = self.server()?;
        let url = server.create_queue(&name, &[]).await?;
        server.create_queue(&format!("{name}-dlq"), &[]).await?;
        produce(&server.client(), &url, messages).await?;
        let counts = server.count(&url).await?;
        ensure!(
            counts.visible == u64::try_from(messages)?,
            "{name}: {} of {messages} messages visible after sending",
            counts.visible
        );
        Ok(name)
    }

    async fn drain_raw(&self, queue: &str, loops: RawLoops) -> Result<(usize, String)> {
        let loops = loops.count;
        let client = self.server()?.client();
        let url = self.url(queue)?;
        let deleted = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        for _ in 0..loops {
            let (client, url, deleted) = (client.clone(), url.clone(), Arc::clone(&deleted));
            tasks.spawn(async move { receive_delete_loop(&client, &url, &deleted).await });
        }
        while let Some(result) = tasks.join_next().await {
            result??;
        }
        Ok((
            deleted.load(Ordering::Relaxed),
            format!("raw sqs receive(10)+delete x{loops}"),
        ))
    }

    fn worker_source(&self, queue: &str) -> (String, Vec<(&'static str, String)>) {
        let endpoint = self.server.as_ref().map(ElasticMq::endpoint);
        let endpoint = endpoint.unwrap_or_default();
        let url = format!("{endpoint}/000000000000/{queue}");
        let env = [
            ("AWS_ACCESS_KEY_ID", "x"),
            ("AWS_SECRET_ACCESS_KEY", "x"),
            ("AWS_REGION", "us-east-1"),
        ];
        (
            format!("sqs: {{queueUrl: \"{url}\", endpoint: \"{endpoint}\", waitTimeSeconds: 1}}"),
            env.map(|(name, value)| (name, value.to_owned())).to_vec(),
        )
    }

    async fn unacknowledged(&self, queue: &str) -> Result<u64> {
        let counts = self.server()?.count(&self.url(queue)?).await?;
        Ok(counts.visible + counts.in_flight + counts.delayed)
    }

    async fn drop_queue(&self, queue: &str) -> Result<()> {
        let server = self.server()?;
        let url = self.url(queue)?;
        for queue in [url.clone(), format!("{url}-dlq")] {
            let counts = server.count(&queue).await?;
            ensure!(
                counts == Default::default(),
                "queue {queue} is not empty after the phase: {counts:?}"
            );
            server
                .client()
                .delete_queue()
                .queue_url(&queue)
                .send()
                .await
                .map_err(|err| sqs_error(&format!("DeleteQueue {queue}"), err))?;
        }
        Ok(())
    }
}

/// Sends `count` `order_body` messages to `url`, ten per SendMessageBatch, from [`PRODUCERS`]
/// concurrent tasks.
async fn produce(client: &SqsClient, url: &str, count: usize) -> Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..PRODUCERS {
        let (client, url, next) = (client.clone(), url.to_owned(), Arc::clone(&next));
        tasks.spawn(async move {
            loop {
                let start = next.fetch_add(BATCH_LIMIT, Ordering::Relaxed);
                if start >= count {
                    return anyhow::Ok(());
                }
                let entries = (start..(start + BATCH_LIMIT).min(count))
                    .map(|i| {
                        SendMessageBatchRequestEntry::builder()
                            .id(i.to_string())
                            .message_body(String::from_utf8_lossy(&order_body(i)))
                            .build()
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let output = client
                    .send_message_batch()
                    .queue_url(&url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map_err(|err| sqs_error("SendMessageBatch", err))?;
                ensure!(
                    output.failed().is_empty(),
                    "SendMessageBatch refused {} entries",
                    output.failed().len()
                );
            }
        });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    Ok(())
}

/// ReceiveMessage(10) + DeleteMessageBatch until a short poll comes back empty (on ElasticMQ a
/// short poll sees the whole queue: empty means every message is deleted or held by another
/// loop, which deletes it).
async fn receive_delete_loop(client: &SqsClient, url: &str, deleted: &AtomicUsize) -> Result<()> {
    loop {
        let output = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(BATCH_LIMIT as i32)
            .wait_time_seconds(0)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|err| sqs_error("ReceiveMessage", err))?;
        let messages = output.messages.unwrap_or_default();
        if messages.is_empty() {
            return Ok(());
        }
        let entries = messages
            .iter()
            .enumerate()
            .map(|(id, message)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(id.to_string())
                    .receipt_handle(message.receipt_handle().unwrap_or_default())
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let output = client
            .delete_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|err| sqs_error("DeleteMessageBatch", err))?;
        ensure!(
            output.failed().is_empty(),
            "DeleteMessageBatch failed {} entries",
            output.failed().len()
        );
        deleted.fetch_add(messages.len(), Ordering::Relaxed);
    }
}
