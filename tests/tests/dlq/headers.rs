//! Issue 29 acceptance 1, for the brokers whose messages carry headers beyond SQS and the
//! gateway (their ten attributes are tested in `dlq.rs` and `dlq/gateway.rs`): a letter whose
//! original carried the most headers the worker accepts and the broker allows is redriven with
//! every one of them, and a letter whose redriven copy (its headers plus the idempotency key
//! the redrive adds) would exceed the broker's limit is kept, counted failed, the limit named.
//!
//! The limits (docs/brokers/*.md say the same):
//! - **Redis stream**: an entry's fields have no count limit; each is a bulk string of at most
//!   `proto-max-bulk-len` (512 MB), a command at most `client-query-buffer-limit` (1 GB). The
//!   worker takes every field but `bodyField` as a header and keeps no cap. 1,000 fields of
//!   1,000 bytes (1 MB); a copy adds one field of about 60 bytes, so no copy reaches a limit a
//!   letter did not: there is no "copy too large" test for Redis.
//! - **Redis lists and pub/sub** carry no headers: a record or a message is its body, and a
//!   list letter is its body pushed back as it was (no envelope): nothing to test.
//! - **NATS JetStream**: a stream refuses a message whose header block is longer than 65,535
//!   bytes (nats-server `stream.go`: `len(hdr) > math.MaxUint16`, error 10097 "header size
//!   exceeds maximum allowed of 64k"), well inside `max_payload` (1 MiB by default, header block
//!   and body together); `max_control_line` (4 KiB) bounds the `HPUB` line only (subject,
//!   reply, sizes), not the headers. No count limit. 60 headers of 1,000 bytes (60.5 kB),
//!   leaving room for the dead letter's `Switchboard-*` context; the copy too large is a letter
//!   whose header block is exactly 65,535 bytes.
//! - **RabbitMQ** (3.10): the content header frame (every property, the headers table among
//!   them) must fit one frame of `frame_max` (131,072 bytes by default; 8 of them the frame's
//!   own); no count limit. 100 headers of 1,000 bytes (101 KB), leaving room for the dead
//!   letter's `x-switchboard-*` context; the copy too large is a letter whose header frame is
//!   300 bytes short of `frame_max` and whose 255-byte `message-id` makes a longer key.
//! - **Kafka**: a record batch (key, value and headers) is at most the topic's
//!   `max.message.bytes` (the brokers' `message.max.bytes`, 1,048,588 by default), a produced
//!   record at most the producer's `message.max.bytes` (librdkafka's 1,000,000, which the
//!   worker keeps); no count limit. 900 headers of 1,000 bytes (0.9 MB), leaving room in
//!   1,000,000 bytes for the dead letter's `x-dlq-*` context; the copy too large is a 150 kB
//!   letter redriven to a topic whose `max.message.bytes` is 100,000.

use anyhow::{Context as _, Result, ensure};
use async_nats::jetstream::stream;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use switchboard_tests::brokers::kafka::Record;
use switchboard_tests::brokers::nats::NatsBroker;
use switchboard_tests::wait::wait_for;

use super::kafka_case::KafkaCase;
use super::{
    Case, LONG, NatsCase, StreamCase, amqp_case::AmqpCase, dlq, list_json, path_text,
    ten_attributes_redriven,
};

/// Headers of 1,000 bytes (Kafka: 900 of them; RabbitMQ: 100; NATS: 60; Redis: 1,000).
const VALUE_BYTES: usize = 1_000;

/// `count` headers `h000`… whose values are `VALUE_BYTES` of printable text, each its own.
fn many_headers(count: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|n| {
            let mut value = format!("value {n:04} ").into_bytes();
            value.resize(VALUE_BYTES, b'x');
            (format!("h{n:03}"), value)
        })
        .collect()
}

/// Dead-letters the one message of `case` (poison, sent with `headers`), checks that the
/// listing shows every header, and has [`ten_attributes_redriven`] redrive it and check the
/// todo: the original's key (`{scope}:{original id}`), every header, no letter left,
/// `1 redriven`.
async fn most_headers_redriven<C: Case>(
    case: &C,
    scope: &str,
    headers: &[(String, Vec<u8>)],
) -> Result<()> {
    let manifest = case.manifest(false)?;
    let file = path_text(&manifest)?.to_owned();
    let worker = case.fx().worker(&manifest, "strict")?;
    wait_for(LONG, "the letter", || async {
        Ok(case.dead_letters().await? == 1)
    })
    .await
    .with_context(|| worker.log_tail())?;
    drop(worker);
    let letters = list_json(case, &file)?;
    let [letter] = letters.as_slice() else {
        anyhow::bail!("one letter: {} listed", letters.len());
    };
    for (name, value) in headers {
        ensure!(
            letter["headers"][name].as_str() == Some(std::str::from_utf8(value)?),
            "the letter lists header {name}"
        );
    }
    // RabbitMQ takes back what the listing held a moment after it ends.
    case.settle().await?;
    let original = letter["original_id"].as_str().context("an original id")?;
    let key = format!("{scope}:{original}");
    ten_attributes_redriven(case, &file, &key, headers).await
}

/// `dlq redrive --all`, whose copy of one letter the broker (or its client) refuses as too
/// large: it exits 1, counts it failed (and `redriven` the others), names `limit`, and leaves
/// the letter in the destination (of `letters` before, `letters - redriven` are left); run
/// again, the same, with nothing redriven.
async fn too_large_is_kept<C: Case>(
    case: &C,
    letters: u64,
    redriven: usize,
    limit: &str,
) -> Result<()> {
    let manifest = case.manifest(true)?;
    let file = path_text(&manifest)?.to_owned();
    ensure!(
        case.dead_letters().await? == letters,
        "the letters are there"
    );
    let mut left = letters;
    for (run, redriven) in [(1, redriven), (2, 0)] {
        let output = dlq(case, &["redrive", "--file", &file, "--all"])?;
        let (stdout, stderr) = (
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
        ensure!(
            output.status.code() == Some(1),
            "run {run} exits 1: {:?}\n{stdout}\n{stderr}",
            output.status
        );
        ensure!(
            stdout.contains(&format!("redrive: {redriven} redriven "))
                && stdout.contains(", 1 failed"),
            "run {run}: {redriven} redriven, 1 failed: {stdout}\n{stderr}"
        );
        ensure!(stderr.contains(limit), "run {run} names {limit}: {stderr}");
        case.settle().await?;
        left -= redriven as u64;
        ensure!(
            case.dead_letters().await? == left,
            "run {run} keeps the letter whose copy is too large"
        );
    }
    Ok(())
}

/// Redis stream: 1,000 fields besides the body.
#[tokio::test]
async fn redis_stream_letter_with_the_most_headers_is_redriven_with_all_of_them() -> Result<()> {
    let case = StreamCase::start("mosthdrs").await?;
    let headers = many_headers(1_000);
    let mut xadd = redis::cmd("XADD");
    xadd.arg(case.queue())
        .arg("*")
        .arg("body")
        .arg("not json, a thousand fields");
    for (name, value) in &headers {
        xadd.arg(name).arg(value);
    }
    xadd.query::<String>(&mut case.fx().redis.connection()?)?;
    most_headers_redriven(&case, "redis:test/mosthdrs", &headers).await
}

/// The header block `NATS/1.0\r\n` + `name: value\r\n` lines + `\r\n`.
fn nats_block(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut block = b"NATS/1.0\r\n".to_vec();
    for (name, value) in headers {
        block.extend_from_slice(format!("{name}: ").as_bytes());
        block.extend_from_slice(value);
        block.extend_from_slice(b"\r\n");
    }
    block.extend_from_slice(b"\r\n");
    block
}

/// NATS: 60 headers (60.5 kB of JetStream's 65,535 header bytes).
#[tokio::test]
async fn nats_letter_with_the_most_headers_is_redriven_with_all_of_them() -> Result<()> {
    let case = NatsCase::start("mosthdrs").await?;
    let headers = many_headers(60);
    case.server
        .publish_raw(
            NatsBroker::subject(case.queue()).as_bytes(),
            &nats_block(&headers),
            b"not json, nine hundred headers",
        )
        .await?;
    most_headers_redriven(&case, "nats:test/mosthdrs", &headers).await
}

/// JetStream's most header bytes in a message (nats-server's `stream.go` refuses a header block
/// longer than `math.MaxUint16`: "header size exceeds maximum allowed of 64k").
const NATS_HEADER_BLOCK_MAX: usize = 65_535;

/// NATS: a letter whose header block is exactly JetStream's 65,535 bytes in the dead-letter
/// stream (put there as another writer could: only the original subject for context), whose
/// copy adds the idempotency key and so would exceed it.
#[tokio::test]
async fn nats_letter_whose_copy_exceeds_the_limit_is_kept_and_counted_failed() -> Result<()> {
    let case = NatsCase::start("toolarge").await?;
    let stream_name = NatsBroker::stream(case.queue());
    case.server
        .create_stream_with(stream::Config {
            name: format!("{stream_name}_DLQ"),
            subjects: vec![format!("{stream_name}.dlq.>")],
            ..Default::default()
        })
        .await?;
    let mut headers = vec![(
        "Switchboard-Subject".to_owned(),
        NatsBroker::subject(case.queue()).into_bytes(),
    )];
    headers.extend(many_headers(60));
    // One more header, `pad: ppp…`, fills the block to exactly the limit.
    let line = "pad: \r\n".len();
    let short = NATS_HEADER_BLOCK_MAX
        .checked_sub(nats_block(&headers).len() + line)
        .context("room for the pad")?;
    headers.push(("pad".to_owned(), vec![b'p'; short]));
    let block = nats_block(&headers);
    ensure!(
        block.len() == NATS_HEADER_BLOCK_MAX,
        "{} bytes",
        block.len()
    );
    case.server
        .publish_raw(
            format!("{stream_name}.dlq.x").as_bytes(),
            &block,
            b"not json, as many headers as JetStream takes",
        )
        .await?;
    too_large_is_kept(&case, 1, 0, "maximum allowed of 64k").await
}

/// RabbitMQ: 100 headers (101 kB of the 128 KiB `frame_max`).
#[tokio::test]
async fn amqp_letter_with_the_most_headers_is_redriven_with_all_of_them() -> Result<()> {
    let case = AmqpCase::start("mosthdrs").await?;
    let headers = many_headers(100);
    let properties = amqp_properties(&headers).with_message_id("most-headers".into());
    case.server
        .publish(
            case.queue(),
            [(b"not json, a hundred headers".to_vec(), properties)],
        )
        .await?;
    most_headers_redriven(&case, "amqp:test/mosthdrs:mosthdrs", &headers).await
}

/// Properties whose headers table holds `headers` as long strings.
fn amqp_properties(headers: &[(String, Vec<u8>)]) -> BasicProperties {
    let mut table = FieldTable::default();
    for (name, value) in headers {
        table.insert(
            name.as_str().into(),
            AMQPValue::LongString(LongString::from(value.clone())),
        );
    }
    BasicProperties::default().with_headers(table)
}

/// RabbitMQ's default `frame_max`, less the 8 bytes of a frame's own: the most a content
/// header frame's payload holds.
const AMQP_HEADER_PAYLOAD_MAX: usize = 131_072 - 8;

/// How far short of `frame_max` the large RabbitMQ letter's content header frame is. Not
/// closer: a letter 20 bytes short could not be read (`basic.get` timed out), and a quorum
/// queue adds `x-delivery-count` (26 bytes) to a letter handed out before (run 2 reads it so).
const AMQP_SHORT: usize = 300;

/// RabbitMQ: a letter put in the dead-letter queue the worker declared (by another writer:
/// no `x-switchboard-*` context) whose content header frame is 300 bytes short of
/// `frame_max`, with the longest `message-id` (255 bytes); its copy adds the idempotency key
/// made from it (318 bytes) and would exceed `frame_max`. The small letters before and after
/// it are redriven (a copy sent over `frame_max` would have RabbitMQ close the connection).
#[tokio::test]
async fn amqp_letter_whose_copy_exceeds_the_limit_is_kept_and_counted_failed() -> Result<()> {
    let case = AmqpCase::start("toolarge").await?;
    let strict = case.manifest(false)?;
    let (case_ref, strict) = (&case, &strict);
    let small = |n: usize| async move {
        let case = case_ref;
        case.send(&[format!("not json, small #{n}").into_bytes()])
            .await?;
        let worker = case.fx().worker(strict, "strict")?;
        wait_for(LONG, "the small letter", || async {
            Ok(case.dead_letters().await? == n as u64 * 2 - 1)
        })
        .await
        .with_context(|| worker.log_tail())
    };
    small(1).await?;
    // The longest message-id (a short string): the copy's key is made from it.
    let message_id = "m".repeat(255);
    // Class, weight, body size (12 bytes), property flags (2), delivery mode (1, set by the
    // publish), the message-id (1 + 255), the table's length (4), and per long-string header:
    // name length (1), name, type (1), value length (4), value.
    let mut headers = many_headers(100);
    let used = 12
        + 2
        + 1
        + 1
        + message_id.len()
        + 4
        + headers
            .iter()
            .map(|(name, value)| 6 + name.len() + value.len())
            .sum::<usize>();
    let pad = AMQP_HEADER_PAYLOAD_MAX - AMQP_SHORT - used - (6 + "pad".len());
    headers.push(("pad".to_owned(), vec![b'p'; pad]));
    let properties = amqp_properties(&headers).with_message_id(message_id.as_str().into());
    case.server
        .publish(
            &format!("{}.dlq", case.queue()),
            [(b"not json, as large as a frame".to_vec(), properties)],
        )
        .await?;
    small(2).await?;
    case.settle().await?;
    too_large_is_kept(&case, 3, 2, "frame_max").await
}

/// Kafka: 900 headers (0.9 MB of the producers' 1,000,000 bytes).
#[tokio::test]
async fn kafka_letter_with_the_most_headers_is_redriven_with_all_of_them() -> Result<()> {
    let case = KafkaCase::start("mosthdrs").await?;
    let headers = many_headers(900);
    case.server
        .produce_records(
            case.queue(),
            vec![Record {
                key: None,
                value: Some(b"not json, nine hundred headers".to_vec()),
                headers: headers
                    .iter()
                    .map(|(name, value)| (name.clone(), Some(value.clone())))
                    .collect(),
            }],
        )
        .await?;
    most_headers_redriven(&case, "kafka:test/mosthdrs", &headers).await
}

/// Kafka: a 150 kB letter in the dead-letter topic (by another writer: only its original
/// topic for context) whose source topic's `max.message.bytes` is 100,000.
#[tokio::test]
async fn kafka_letter_whose_copy_exceeds_the_limit_is_kept_and_counted_failed() -> Result<()> {
    let case = KafkaCase::start("toolarge").await?;
    case.server
        .set_topic_config(case.queue(), "max.message.bytes", "100000")
        .await?;
    let mut headers = vec![(
        "x-dlq-original-topic".to_owned(),
        Some(case.queue().as_bytes().to_vec()),
    )];
    headers.extend(
        many_headers(150)
            .into_iter()
            .map(|(name, value)| (name, Some(value))),
    );
    case.server
        .produce_records(
            &format!("{}.dlq", case.queue()),
            vec![Record {
                key: None,
                value: Some(b"not json, larger than its topic takes".to_vec()),
                headers,
            }],
        )
        .await?;
    too_large_is_kept(&case, 1, 0, "max.message.bytes").await
}
