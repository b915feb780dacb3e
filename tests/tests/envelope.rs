//! `spec.payload.envelope` end to end, for every broker: the real worker binary, a real
//! PostgreSQL and the real broker server. A producer that publishes one event twice gets two
//! broker message ids; the envelope's own id still makes one todo, whatever the first todo's
//! status. A broker joins with its line in `envelope_suite!` at the end (`with_headers` when
//! its `BrokerFixture::produce_with_headers` sends headers).

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use switchboard_tests::brokers::envelope::EnvelopeBroker;
use switchboard_tests::brokers::{
    AmqpClassicBroker, AmqpQuorumBroker, KafkaBroker, NatsBroker, RedisListBroker,
    RedisStreamBroker, SqsBroker,
};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::WorkerProcess;
use switchboard_tests::{Fixture, source_manifest};

const LONG: Duration = Duration::from_secs(120);

/// A stored todo: its key, its payload and its event's headers.
#[derive(Debug)]
struct Todo {
    key: String,
    payload: Value,
    headers: Value,
}

/// PostgreSQL, the broker, queue `name` and a worker reading it into todo queue `name` under
/// `payload.envelope`.
struct Adapter<B> {
    fx: Fixture,
    broker: B,
    name: &'static str,
    worker: WorkerProcess,
}

impl<B: EnvelopeBroker> Adapter<B> {
    async fn start(name: &'static str, envelope: &str) -> Result<Self> {
        let mut fx = Fixture::start().await?;
        let (broker, env) = B::start(&fx).await?;
        fx.extra_env = env;
        let source = broker.create(&fx, name).await?;
        let delivery = format!("{}, batchSize: 50", broker.delivery());
        let manifest = fx.manifest(
            &format!("{name}.yaml"),
            &source_manifest(name, &source, &delivery, &format!("envelope: {envelope}")),
        )?;
        let worker = fx.worker(&manifest, "w1")?;
        Ok(Self {
            fx,
            broker,
            name,
            worker,
        })
    }

    async fn produce(&self, bodies: &[&str]) -> Result<()> {
        let bodies = bodies.iter().map(|b| b.as_bytes().to_vec()).collect();
        self.broker.produce(&self.fx, self.name, bodies).await
    }

    /// Waits until the worker counted `handled` messages as stored, duplicate or dead-lettered
    /// and the broker holds nothing un-acknowledged.
    async fn wait_handled(&self, handled: f64) -> Result<()> {
        wait_for(
            LONG,
            &format!("{handled} messages handled and acknowledged"),
            || async {
                let counted = self.metric("switchboard_messages_stored_total")?
                    + self.metric("switchboard_messages_duplicate_total")?
                    + self.dead_lettered()?;
                Ok(counted >= handled
                    && self.broker.unacknowledged(&self.fx, self.name).await? == 0)
            },
        )
        .await
        .map_err(|err| err.context(self.worker.log_tail()))
    }

    fn metric(&self, family: &str) -> Result<f64> {
        let adapter = format!(r#"adapter="test/{}""#, self.name);
        self.worker.metric(&format!("{family}{{{adapter}}}"))
    }

    fn dead_lettered(&self) -> Result<f64> {
        let prefix = format!(
            r#"switchboard_messages_dead_lettered_total{{adapter="test/{}",reason="envelope"}}"#,
            self.name
        );
        self.worker.metric(&prefix)
    }

    async fn todos(&self) -> Result<Vec<Todo>> {
        let rows: Vec<(String, Value, Value)> = sqlx::query_as(
            "SELECT t.idempotency_key, t.payload, e.headers FROM todos t \
             JOIN events e ON e.id = t.event_id WHERE t.queue = $1",
        )
        .bind(self.name)
        .fetch_all(self.fx.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(key, payload, headers)| Todo {
                key,
                payload,
                headers,
            })
            .collect())
    }

    /// Fails unless the todos' keys end with `keys` (after `{kind}:test/{name}:`), sorted.
    /// Returns the todos in the order of their keys.
    async fn assert_keys(&self, keys: &[&str]) -> Result<Vec<Todo>> {
        let mut todos = self.todos().await?;
        todos.sort_by(|a, b| a.key.cmp(&b.key));
        let found: Vec<&str> = todos.iter().map(|t| t.key.as_str()).collect();
        let expected: Vec<String> = keys
            .iter()
            .map(|key| format!(":test/{}:{key}", self.name))
            .collect();
        ensure!(
            found.len() == expected.len()
                && found
                    .iter()
                    .zip(&expected)
                    .all(|(f, e)| f.ends_with(e.as_str())),
            "todo keys {found:?}, expected …{expected:?}"
        );
        Ok(todos)
    }

    async fn assert_no_dead_letter(&self) -> Result<()> {
        let letters = self.broker.dead_letters(&self.fx, self.name).await?;
        ensure!(
            letters.is_empty(),
            "nothing may be dead-lettered: {letters:?}"
        );
        Ok(())
    }

    /// Marks every todo done, then has `again` delivered once more: the envelope's id is a
    /// native id, so even with no live todo left it creates none.
    async fn assert_done_event_is_not_stored_again(&self, again: &str) -> Result<()> {
        sqlx::query("UPDATE todos SET status = 'done' WHERE queue = $1")
            .bind(self.name)
            .execute(self.fx.pool())
            .await?;
        let before = self.metric("switchboard_messages_duplicate_total")?;
        let todos = self.fx.todo_count(self.name).await?;
        self.produce(&[again]).await?;
        wait_for(LONG, "the redelivery is counted as a duplicate", || async {
            Ok(
                self.metric("switchboard_messages_duplicate_total")? > before
                    && self.broker.unacknowledged(&self.fx, self.name).await? == 0,
            )
        })
        .await
        .map_err(|err| err.context(self.worker.log_tail()))?;
        let after = self.fx.todo_count(self.name).await?;
        ensure!(after == todos, "{todos} todos before, {after} after");
        Ok(())
    }
}

const SOURCE: &str = "urn:shop:orders";

/// A structured-mode CloudEvent; `time` varies between a producer's retries.
fn structured(id: &str, time: &str) -> String {
    format!(
        r#"{{"specversion":"1.0","id":"{id}","source":"{SOURCE}","type":"order.created","subject":"7","time":"{time}","datacontenttype":"application/json","data":{{"order":"{id}","total":12.50}}}}"#
    )
}

/// Acceptance 1, structured mode: the same CloudEvent published twice (re-serialised by the
/// producer's retry, so not even the body is the same) is one todo keyed by source and id.
async fn structured_cloudevent_twice<B: EnvelopeBroker>() -> Result<()> {
    let adapter = Adapter::<B>::start("structured", "cloudevents").await?;
    let first = structured("A-1", "2026-12-01T10:00:00Z");
    let retry = structured("A-1", "2026-12-01T10:00:05Z");
    let other = structured("A-2", "2026-12-01T10:00:01Z");
    adapter.produce(&[&first, &retry, &other]).await?;
    adapter.wait_handled(3.0).await?;
    let todos = adapter
        .assert_keys(&[&format!("ce:{SOURCE}:A-1"), &format!("ce:{SOURCE}:A-2")])
        .await?;
    ensure!(
        todos[0].payload == json!({"order": "A-1", "total": 12.50}),
        "the payload is the event's data: {}",
        todos[0].payload
    );
    let headers = &todos[0].headers;
    for (header, value) in [
        ("ce-type", "order.created"),
        ("ce-source", SOURCE),
        ("ce-subject", "7"),
        ("ce-specversion", "1.0"),
    ] {
        ensure!(headers[header] == value, "header {header}: {headers}");
    }
    // Whichever copy came first (a standard queue does not keep order).
    let time = headers["ce-time"].as_str().unwrap_or_default();
    ensure!(time.starts_with("2026-12-01T10:00:0"), "ce-time: {headers}");
    ensure!(adapter.metric("switchboard_messages_duplicate_total")? == 1.0);
    adapter.assert_no_dead_letter().await?;
    adapter.assert_done_event_is_not_stored_again(&first).await
}

/// Acceptance 1, binary mode: attributes in `ce-*` headers (stream fields, SQS message
/// attributes), the body is the data. A binary event without `ce-id` is dead-lettered naming
/// `id`, its body byte-identical.
async fn binary_cloudevent_twice<B: EnvelopeBroker>() -> Result<()> {
    let adapter = Adapter::<B>::start("binary", "cloudevents").await?;
    let headers = |id: &'static str| {
        vec![
            ("ce-specversion", "1.0"),
            ("ce-id", id),
            ("ce-source", SOURCE),
            ("ce-type", "order.created"),
            ("content-type", "application/json"),
        ]
    };
    let body = br#"{"order": "B-1"}"#;
    let (fx, name) = (&adapter.fx, adapter.name);
    adapter
        .broker
        .produce_with_headers(fx, name, body.to_vec(), &headers("B-1"))
        .await?;
    adapter
        .broker
        .produce_with_headers(fx, name, body.to_vec(), &headers("B-1"))
        .await?;
    let lacking_id = b" {\"order\": \"no id\"}\n";
    let no_id: Vec<(&str, &str)> = headers("")
        .into_iter()
        .filter(|(name, _)| *name != "ce-id")
        .collect();
    adapter
        .broker
        .produce_with_headers(fx, name, lacking_id.to_vec(), &no_id)
        .await?;
    adapter.wait_handled(3.0).await?;
    let todos = adapter.assert_keys(&[&format!("ce:{SOURCE}:B-1")]).await?;
    ensure!(
        todos[0].payload == json!({"order": "B-1"}),
        "{}",
        todos[0].payload
    );
    ensure!(
        todos[0].headers["ce-type"] == "order.created"
            && todos[0].headers["content-type"] == "application/json",
        "{}",
        todos[0].headers
    );
    ensure!(adapter.metric("switchboard_messages_duplicate_total")? == 1.0);
    let letters = adapter.broker.dead_letters(fx, name).await?;
    ensure!(
        letters == vec![(lacking_id.to_vec(), "envelope".to_owned())],
        "{letters:?}"
    );
    let errors = adapter.broker.dead_letter_errors(fx, name).await?;
    ensure!(
        errors == ["CloudEvent (binary mode) lacks the required attribute `id`"],
        "{errors:?}"
    );
    Ok(())
}

/// An SNS notification as an SQS queue subscribed to a topic without raw delivery receives it.
const NOTIFICATION: &str = r#"{
  "Type" : "Notification",
  "MessageId" : "5f1c2a8e-3b7d-4f0e-9c61-2d8a7b4e9f03",
  "TopicArn" : "arn:aws:sns:us-east-1:000000000000:orders",
  "Message" : "{\"order\":\"S-1\",\"total\":3}",
  "Timestamp" : "2026-12-01T10:00:00.000Z",
  "SignatureVersion" : "1",
  "Signature" : "EXAMPLEw6JRN...",
  "SigningCertURL" : "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-example.pem",
  "UnsubscribeURL" : "https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe&SubscriptionArn=x",
  "MessageAttributes" : {"tenant" : {"Type" : "String", "Value" : "acme"}}
}"#;

/// Acceptance 2: an SNS notification delivered twice (redelivered, or fanned out twice to the
/// queue) is one todo whose payload is the inner message.
async fn sns_notification_twice<B: EnvelopeBroker>() -> Result<()> {
    let adapter = Adapter::<B>::start("sns", "sns").await?;
    adapter.produce(&[NOTIFICATION, NOTIFICATION]).await?;
    adapter.wait_handled(2.0).await?;
    let todos = adapter
        .assert_keys(&["sns:5f1c2a8e-3b7d-4f0e-9c61-2d8a7b4e9f03"])
        .await?;
    ensure!(
        todos[0].payload == json!({"order": "S-1", "total": 3}),
        "the payload is the inner message: {}",
        todos[0].payload
    );
    let headers = &todos[0].headers;
    for (header, value) in [
        ("tenant", "acme"),
        ("sns-TopicArn", "arn:aws:sns:us-east-1:000000000000:orders"),
        ("sns-Timestamp", "2026-12-01T10:00:00.000Z"),
        ("sns-SignatureVersion", "1"),
        ("sns-Signature", "EXAMPLEw6JRN..."),
    ] {
        ensure!(headers[header] == value, "header {header}: {headers}");
    }
    ensure!(adapter.metric("switchboard_messages_duplicate_total")? == 1.0);
    adapter.assert_no_dead_letter().await?;
    adapter
        .assert_done_event_is_not_stored_again(NOTIFICATION)
        .await
}

/// Acceptance 3: a structured CloudEvent without `id` is dead-lettered naming `id`, its body
/// byte-identical (never the unwrapped form), while the rest of its batch is stored.
async fn cloudevent_without_id_is_dead_lettered<B: EnvelopeBroker>() -> Result<()> {
    let adapter = Adapter::<B>::start("noid", "cloudevents").await?;
    let lacking_id =
        "{ \"specversion\" : \"1.0\",\n  \"source\" : \"urn:shop:orders\", \"data\" : {\"n\": 1} }";
    let good = structured("C-1", "2026-12-01T10:00:00Z");
    adapter.produce(&[lacking_id, &good]).await?;
    adapter.wait_handled(2.0).await?;
    adapter.assert_keys(&[&format!("ce:{SOURCE}:C-1")]).await?;
    let (fx, name) = (&adapter.fx, adapter.name);
    let letters = adapter.broker.dead_letters(fx, name).await?;
    ensure!(
        letters == vec![(lacking_id.as_bytes().to_vec(), "envelope".to_owned())],
        "one dead letter, byte-identical: {letters:?}"
    );
    let errors = adapter.broker.dead_letter_errors(fx, name).await?;
    ensure!(
        errors == ["CloudEvent (structured mode) lacks the required attribute `id`"],
        "{errors:?}"
    );
    ensure!(adapter.dead_lettered()? == 1.0);
    Ok(())
}

/// Every behaviour as one test per broker, under a module named for the behaviour.
macro_rules! envelope_suite {
    (
        with_headers: [$($h:ident => $hb:ty),* $(,)?],
        body_only: [$($b:ident => $bb:ty),* $(,)?] $(,)?
    ) => {
        mod structured_cloudevent_published_twice_is_one_todo {
            use super::*;
            $(#[tokio::test] async fn $h() -> Result<()> { structured_cloudevent_twice::<$hb>().await })*
            $(#[tokio::test] async fn $b() -> Result<()> { structured_cloudevent_twice::<$bb>().await })*
        }
        mod binary_cloudevent_published_twice_is_one_todo_and_one_without_id_a_dead_letter {
            use super::*;
            $(#[tokio::test] async fn $h() -> Result<()> { binary_cloudevent_twice::<$hb>().await })*
        }
        mod sns_notification_delivered_twice_is_one_todo_of_its_inner_message {
            use super::*;
            $(#[tokio::test] async fn $h() -> Result<()> { sns_notification_twice::<$hb>().await })*
            $(#[tokio::test] async fn $b() -> Result<()> { sns_notification_twice::<$bb>().await })*
        }
        mod cloudevent_without_id_is_dead_lettered_naming_id_byte_identical {
            use super::*;
            $(#[tokio::test] async fn $h() -> Result<()> { cloudevent_without_id_is_dead_lettered::<$hb>().await })*
            $(#[tokio::test] async fn $b() -> Result<()> { cloudevent_without_id_is_dead_lettered::<$bb>().await })*
        }
    };
}

envelope_suite! {
    with_headers: [
        redis_stream => RedisStreamBroker,
        sqs_standard => SqsBroker,
        nats => NatsBroker,
        amqp_quorum => AmqpQuorumBroker,
        amqp_classic => AmqpClassicBroker,
        kafka => KafkaBroker,
    ],
    body_only: [
        redis_list => RedisListBroker,
    ],
}

/// Acceptance 2 with notifications SNS itself wrote (moto's SNS and SQS): the queue's copy of a
/// published notification, and the same notification delivered a second time (as SNS does
/// now and then), are one todo: the `Message`, the attributes, the topic in the headers.
#[tokio::test]
async fn notification_written_by_sns_delivered_twice_is_one_todo() -> Result<()> {
    use switchboard_tests::brokers::moto::Moto;
    let mut fx = Fixture::start().await?;
    let moto = Moto::start(false, &fx.dir.path().join("moto.log"))?;
    let sqs = moto.client("us-east-1");
    let mut urls = Vec::new();
    for queue in ["topic", "topic-dlq"] {
        let created = sqs.create_queue().queue_name(queue).send().await?;
        urls.push(created.queue_url().unwrap_or_default().to_owned());
    }
    let queue_arn = sqs
        .get_queue_attributes()
        .queue_url(&urls[0])
        .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
        .send()
        .await?
        .attributes()
        .and_then(|a| {
            a.get(&aws_sdk_sqs::types::QueueAttributeName::QueueArn)
                .cloned()
        })
        .unwrap_or_default();
    let created = moto.sns(&[("Action", "CreateTopic"), ("Name", "orders")])?;
    let topic = between(&created, "<TopicArn>", "</TopicArn>")?;
    moto.sns(&[
        ("Action", "Subscribe"),
        ("TopicArn", &topic),
        ("Protocol", "sqs"),
        ("Endpoint", &queue_arn),
    ])?;
    moto.sns(&[
        ("Action", "Publish"),
        ("TopicArn", &topic),
        ("Message", r#"{"order":"M-1"}"#),
        ("MessageAttributes.entry.1.Name", "tenant"),
        ("MessageAttributes.entry.1.Value.DataType", "String"),
        ("MessageAttributes.entry.1.Value.StringValue", "acme"),
    ])?;
    // The notification as SNS delivered it, then the same body once more.
    let received = sqs
        .receive_message()
        .queue_url(&urls[0])
        .wait_time_seconds(5)
        .send()
        .await?;
    let delivered = received
        .messages()
        .first()
        .cloned()
        .context("SNS delivered nothing to the queue")?;
    let body = delivered.body().unwrap_or_default().to_owned();
    ensure!(
        body.contains(r#""Type": "Notification""#) || body.contains(r#""Type":"Notification""#),
        "{body}"
    );
    sqs.send_message()
        .queue_url(&urls[0])
        .message_body(&body)
        .send()
        .await?;
    sqs.change_message_visibility()
        .queue_url(&urls[0])
        .receipt_handle(delivered.receipt_handle().unwrap_or_default())
        .visibility_timeout(0)
        .send()
        .await?;

    fx.extra_env = [
        ("AWS_ACCESS_KEY_ID", "x"),
        ("AWS_SECRET_ACCESS_KEY", "x"),
        ("AWS_REGION", "us-east-1"),
    ]
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .to_vec();
    let source = format!(
        "sqs: {{queueUrl: \"{}\", endpoint: \"{}\", waitTimeSeconds: 1}}",
        urls[0],
        moto.endpoint()
    );
    let manifest = fx.manifest(
        "topic.yaml",
        &source_manifest(
            "topic",
            &source,
            "batchSize: 10",
            "format: json, envelope: sns",
        ),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    let duplicates = r#"switchboard_messages_duplicate_total{adapter="test/topic"}"#;
    wait_for(LONG, "one todo and one duplicate", || async {
        Ok(fx.todo_count("topic").await? == 1 && worker.metric(duplicates)? == 1.0)
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let (key, payload, headers): (String, Value, Value) = sqlx::query_as(
        "SELECT t.idempotency_key, t.payload, e.headers FROM todos t JOIN events e ON e.id = t.event_id",
    )
    .fetch_one(fx.pool())
    .await?;
    let message_id = serde_json::from_str::<Value>(&body)?["MessageId"].clone();
    ensure!(
        key == format!(
            "sqs:test/topic:sns:{}",
            message_id.as_str().unwrap_or_default()
        ),
        "{key}"
    );
    ensure!(payload == json!({"order": "M-1"}), "{payload}");
    ensure!(
        headers["tenant"] == "acme" && headers["sns-TopicArn"] == topic.as_str(),
        "{headers}"
    );
    ensure!(
        headers["sns-Signature"].is_string(),
        "the signature is kept: {headers}"
    );
    Ok(())
}

/// The text between `start` and `end` in `text`.
fn between(text: &str, start: &str, end: &str) -> Result<String> {
    let from = text.find(start).map(|i| i + start.len());
    let to = from.and_then(|from| text[from..].find(end).map(|i| from + i));
    match (from, to) {
        (Some(from), Some(to)) => Ok(text[from..to].to_owned()),
        _ => anyhow::bail!("no {start}…{end} in {text}"),
    }
}
