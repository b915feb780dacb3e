//! The trace fixture itself, without the product (a real OpenTelemetry Collector,
//! tests/src/otel.rs, receives a span over OTLP/HTTP and [`Collector::spans`] reads it back
//! from the file exporter's JSON lines, typed, with its link), and what only one broker carries:
//! SQS's X-Ray `AWSTraceHeader`. The contract suite shows the trace path of every broker.

use std::time::Duration;

use anyhow::{Result, ensure};
use switchboard_tests::Fixture;
use switchboard_tests::otel::{AttributeValue, Collector, SpanKind, StatusCode};
use switchboard_tests::servers::http_post_json;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SPAN: &str = "00f067aa0ba902b7";
const LINKED_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const LINKED_SPAN: &str = "b7ad6b7169203331";

/// One OTLP/JSON export: a consumer span with typed attributes, a link, an event, an error
/// status, under resource `service.name = switchboard-test`.
fn export() -> String {
    serde_json::json!({"resourceSpans": [{
        "resource": {"attributes": [
            {"key": "service.name", "value": {"stringValue": "switchboard-test"}},
        ]},
        "scopeSpans": [{
            "scope": {"name": "switchboard-tests"},
            "spans": [{
                "traceId": TRACE,
                "spanId": SPAN,
                "parentSpanId": "",
                "name": "orders process",
                "kind": 5,
                "startTimeUnixNano": "1764842400000000000",
                "endTimeUnixNano": "1764842400100000000",
                "attributes": [
                    {"key": "messaging.system", "value": {"stringValue": "redis"}},
                    {"key": "messaging.batch.message_count", "value": {"intValue": "3"}},
                    {"key": "sampled", "value": {"boolValue": true}},
                    {"key": "ratio", "value": {"doubleValue": 0.5}},
                ],
                "links": [{
                    "traceId": LINKED_TRACE,
                    "spanId": LINKED_SPAN,
                    "traceState": "congo=t61rcWkgMzE",
                    "attributes": [
                        {"key": "messaging.message.id", "value": {"stringValue": "1-0"}},
                    ],
                }],
                "events": [{
                    "timeUnixNano": "1764842400050000000",
                    "name": "exception",
                    "attributes": [
                        {"key": "exception.message", "value": {"stringValue": "boom"}},
                    ],
                }],
                "status": {"code": 2, "message": "boom"},
            }],
        }],
    }]})
    .to_string()
}

#[tokio::test]
async fn collector_receives_an_otlp_http_span_and_reads_it_back_with_its_link() -> Result<()> {
    let fx = Fixture::start().await?;
    let collector = Collector::start(&fx)?;
    ensure!(collector.spans()?.is_empty(), "no span before the export");
    let (status, answer) = http_post_json(collector.http_port(), "/v1/traces", &export())?;
    ensure!(status == 200, "OTLP/HTTP answered {status}: {answer}");
    let spans = collector
        .wait_for_spans(Duration::from_secs(30), "the span is exported", |spans| {
            !spans.is_empty()
        })
        .await?;
    ensure!(spans.len() == 1, "one span: {spans:#?}");
    let span = &spans[0];
    ensure!(span.service_name() == Some("switchboard-test"), "{span:#?}");
    ensure!(span.scope == "switchboard-tests", "{span:#?}");
    ensure!(
        (span.name.as_str(), span.kind) == ("orders process", SpanKind::Consumer),
        "{span:#?}"
    );
    ensure!(
        (span.trace_id.as_str(), span.span_id.as_str()) == (TRACE, SPAN)
            && span.parent_span_id.is_empty(),
        "{span:#?}"
    );
    ensure!(
        (span.status.code, span.status.message.as_str()) == (StatusCode::Error, "boom"),
        "{span:#?}"
    );
    ensure!(span.attribute_str("messaging.system") == Some("redis"));
    let attribute = |key: &str| span.attributes.get(key).cloned();
    ensure!(
        attribute("messaging.batch.message_count") == Some(AttributeValue::Int(3))
            && attribute("sampled") == Some(AttributeValue::Bool(true))
            && attribute("ratio") == Some(AttributeValue::Double(0.5)),
        "typed attributes: {:#?}",
        span.attributes
    );
    let [link] = span.links.as_slice() else {
        anyhow::bail!("one link: {span:#?}");
    };
    ensure!(
        (link.trace_id.as_str(), link.span_id.as_str()) == (LINKED_TRACE, LINKED_SPAN)
            && link.trace_state == "congo=t61rcWkgMzE"
            && link.attributes.get("messaging.message.id")
                == Some(&AttributeValue::String("1-0".into())),
        "{link:#?}"
    );
    let [event] = span.events.as_slice() else {
        anyhow::bail!("one event: {span:#?}");
    };
    ensure!(
        event.name == "exception"
            && event.attributes.get("exception.message")
                == Some(&AttributeValue::String("boom".into())),
        "{event:#?}"
    );
    let text = collector.exported_text()?;
    ensure!(
        text.contains(LINKED_SPAN) && text.contains("t61rcWkgMzE"),
        "the raw export holds the link: {text}"
    );
    ensure!(
        collector.grpc_endpoint().starts_with("http://127.0.0.1:")
            && collector.http_endpoint() == format!("http://127.0.0.1:{}", collector.http_port()),
        "endpoints"
    );
    Ok(())
}

/// X-Ray's trace header as AWS SDKs send it: the `AWSTraceHeader` system attribute.
const AWS_TRACE_HEADER: &str =
    "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1";

/// ElasticMQ keeps the `AWSTraceHeader` system attribute of a send and returns it on receive,
/// so the SQS fixture can send trace context the way X-Ray-instrumented producers do.
#[tokio::test]
async fn sqs_fixture_sends_the_aws_trace_header_system_attribute() -> Result<()> {
    use aws_sdk_sqs::types::MessageSystemAttributeName;
    use switchboard_tests::brokers::{BrokerFixture, SqsBroker};
    let fx = Fixture::start().await?;
    let (sqs, _env) = SqsBroker::start(&fx).await?;
    sqs.create(&fx, "traced").await?;
    sqs.produce_with_trace_header("traced", r#"{"order":1}"#, AWS_TRACE_HEADER)
        .await?;
    let messages = sqs.server.receive_all(&sqs.url("traced")).await?;
    let [message] = messages.as_slice() else {
        anyhow::bail!("one message: {messages:?}");
    };
    let header = message
        .attributes()
        .and_then(|system| system.get(&MessageSystemAttributeName::AwsTraceHeader));
    ensure!(
        header.map(String::as_str) == Some(AWS_TRACE_HEADER),
        "AWSTraceHeader: {:?}",
        message.attributes()
    );
    Ok(())
}

/// A Redis list item is a body alone: sending headers fails naming that, and nothing is pushed
/// without them.
#[tokio::test]
async fn redis_list_fixture_refuses_headers_naming_why() -> Result<()> {
    use switchboard_tests::brokers::{BrokerFixture, RedisListBroker};
    let fx = Fixture::start().await?;
    let (list, _env) = RedisListBroker::start(&fx).await?;
    list.create(&fx, "traced").await?;
    let sent = list
        .produce_with_headers(&fx, "traced", b"{}".to_vec(), &[("traceparent", "00-…")])
        .await;
    let error = sent.err().map(|err| err.to_string()).unwrap_or_default();
    ensure!(error.contains("has no headers"), "{error:?}");
    let mut conn = fx.redis.connection()?;
    let pushed: i64 = redis::cmd("LLEN").arg("traced").query(&mut conn)?;
    ensure!(
        pushed == 0,
        "nothing pushed without its headers: {pushed} items"
    );
    Ok(())
}

/// Through the worker: a message whose only trace context is X-Ray's `AWSTraceHeader` system
/// attribute gets a todo whose `traceparent` is the same trace and parent (sampled), and the
/// batch span, exported to the collector, links to that parent.
#[tokio::test]
async fn sqs_aws_trace_header_becomes_the_todos_traceparent_and_the_batch_links_to_it() -> Result<()>
{
    use switchboard_tests::brokers::{BrokerFixture, SqsBroker};
    let mut fx = Fixture::start().await?;
    let (sqs, env) = SqsBroker::start(&fx).await?;
    let collector = Collector::start(&fx)?;
    fx.extra_env = env;
    fx.extra_env.extend([
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
            collector.http_endpoint(),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "100".to_owned()),
    ]);
    let source = sqs.create(&fx, "xray").await?;
    let manifest = fx.manifest(
        "xray.yaml",
        &switchboard_tests::source_manifest("xray", &source, sqs.delivery(), ""),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    sqs.produce_with_trace_header("xray", r#"{"order":1}"#, AWS_TRACE_HEADER)
        .await?;
    let expected = "00-5759e988bd862e3fe1be46a994272793-53995c3f42cd8ad8-01";
    switchboard_tests::wait::wait_for(Duration::from_secs(120), "the todo", || async {
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM todos WHERE queue = 'xray'")
            .fetch_one(fx.pool())
            .await?;
        Ok(count == 1)
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let traceparent: Option<String> =
        sqlx::query_scalar("SELECT traceparent FROM todos WHERE queue = 'xray'")
            .fetch_one(fx.pool())
            .await?;
    ensure!(
        traceparent.as_deref() == Some(expected),
        "todo traceparent {traceparent:?}"
    );
    collector
        .wait_for_spans(Duration::from_secs(60), "the linked batch span", |spans| {
            spans.iter().any(|span| {
                span.attribute_str("messaging.system") == Some("aws_sqs")
                    && span.links.iter().any(|link| {
                        link.trace_id == "5759e988bd862e3fe1be46a994272793"
                            && link.span_id == "53995c3f42cd8ad8"
                    })
            })
        })
        .await?;
    Ok(())
}

/// A trace setting that cannot work stops the worker at once, non-zero, with one line naming
/// it: a protocol other than OTLP/HTTP with protobuf, a CA file that does not exist, an
/// endpoint that is not a URL.
#[tokio::test]
async fn an_unusable_trace_setting_exits_non_zero_naming_it() -> Result<()> {
    let cases = [
        (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "grpc",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            "/nonexistent/ca.pem",
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "not a url",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ),
    ];
    for (variable, value, named) in cases {
        let mut fx = Fixture::start().await?;
        fx.extra_env = vec![(variable.to_owned(), value.to_owned())];
        if variable != "OTEL_EXPORTER_OTLP_ENDPOINT" {
            fx.extra_env.push((
                "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
                "http://127.0.0.1:4318".to_owned(),
            ));
        }
        let manifest = fx.stream_adapter("orders", "", "")?;
        let mut worker = fx.worker(&manifest, "w1")?;
        let status = worker.wait_exit(Duration::from_secs(30))?;
        let log = worker.log();
        ensure!(
            !status.success(),
            "{variable}={value}: exits non-zero\n{log}"
        );
        let lines: Vec<&str> = log.lines().filter(|line| line.contains(named)).collect();
        ensure!(
            lines.len() == 1 && lines[0].starts_with("error: "),
            "{variable}={value}: one line naming {named}\n{log}"
        );
    }
    Ok(())
}
