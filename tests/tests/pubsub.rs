//! Redis pub/sub mode (at-most-once), end to end against real redis-server and PostgreSQL.

use std::time::Duration;

use anyhow::{Result, ensure};
use nix::sys::signal::Signal;
use switchboard_tests::wait::wait_for;
use switchboard_tests::{Fixture, adapter_manifest};

const LONG: Duration = Duration::from_secs(120);

fn subscribers(fx: &Fixture, channel: &str) -> Result<i64> {
    let mut conn = fx.redis.connection()?;
    let reply: (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query(&mut conn)?;
    Ok(reply.1)
}

fn publish(fx: &Fixture, channel: &str, range: std::ops::Range<usize>) -> Result<()> {
    let mut conn = fx.redis.connection()?;
    let mut pipe = redis::pipe();
    for i in range {
        pipe.cmd("PUBLISH")
            .arg(channel)
            .arg(format!(r#"{{"event":{i}}}"#))
            .ignore();
    }
    pipe.query::<()>(&mut conn)?;
    Ok(())
}

#[tokio::test]
async fn pubsub_stores_what_is_published_while_subscribed_and_resubscribes_after_a_redis_restart()
-> Result<()> {
    let mut fx = Fixture::start().await?;
    let manifest = fx.manifest(
        "events.yaml",
        &adapter_manifest(
            "events",
            "mode: pubsub, channel: events",
            "batchSize: 500",
            "",
        ),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "the worker is subscribed", || async {
        Ok(subscribers(&fx, "events")? == 1)
    })
    .await?;
    ensure!(
        worker.log().contains("AT-MOST-ONCE"),
        "the startup log must state the guarantee"
    );
    let (_, metrics) = worker.http_get("/metrics")?;
    // The info metric under its name, and under its old name for one release.
    for name in [
        "switchboard_delivery_guarantee_info",
        "switchboard_delivery_guarantee",
    ] {
        let series = format!(r#"{name}{{adapter="test/events",guarantee="at_most_once"}} 1"#);
        ensure!(
            metrics.contains(&series),
            "metrics lack {series}:\n{metrics}"
        );
    }

    for chunk in 0..5 {
        publish(&fx, "events", chunk * 1000..(chunk + 1) * 1000)?;
    }
    wait_for(LONG, "5,000 todos", || async {
        Ok(fx.todo_count("events").await? == 5_000)
    })
    .await?;
    ensure!(fx.distinct_keys("events").await? == 5_000);

    fx.redis.restart_empty()?;
    wait_for(LONG, "the worker re-subscribes by itself", || async {
        Ok(subscribers(&fx, "events")? == 1)
    })
    .await?;
    publish(&fx, "events", 5_000..5_100)?;
    wait_for(
        LONG,
        "messages published after the restart are stored",
        || async { Ok(fx.todo_count("events").await? == 5_100) },
    )
    .await?;
    ensure!(worker.metric(r#"switchboard_broker_reconnects_total{adapter="test/events"}"#)? >= 1.0);
    Ok(())
}

#[tokio::test]
async fn pubsub_sigterm_exits_zero_promptly() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.manifest(
        "quiet.yaml",
        &adapter_manifest("quiet", "mode: pubsub, channel: quiet", "", ""),
    )?;
    let mut worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "the worker is subscribed", || async {
        Ok(subscribers(&fx, "quiet")? == 1)
    })
    .await?;
    publish(&fx, "quiet", 0..100)?;
    wait_for(LONG, "messages stored", || async {
        Ok(fx.todo_count("quiet").await? == 100)
    })
    .await?;
    worker.signal(Signal::SIGTERM)?;
    let status = worker.wait_exit(Duration::from_secs(5))?;
    ensure!(status.success(), "{status:?}");
    Ok(())
}

/// Pub/sub carries trace context the only way a bare message can, a CloudEvent's
/// distributed-tracing extension: the todo keeps it and the batch span, exported to a real
/// OpenTelemetry Collector, links to the producer's span.
#[tokio::test]
async fn pubsub_cloud_event_trace_context_reaches_the_todo_and_the_batch_span_links_to_it()
-> Result<()> {
    let mut fx = Fixture::start().await?;
    let collector = switchboard_tests::otel::Collector::start(&fx)?;
    fx.extra_env.extend([
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
            collector.http_endpoint(),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "100".to_owned()),
    ]);
    let manifest = fx.manifest(
        "traced.yaml",
        &adapter_manifest(
            "traced",
            "mode: pubsub, channel: traced",
            "batchSize: 10",
            "envelope: cloudevents",
        ),
    )?;
    let worker = fx.worker(&manifest, "w1")?;
    wait_for(LONG, "the worker is subscribed", || async {
        Ok(subscribers(&fx, "traced")? == 1)
    })
    .await?;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let event = serde_json::json!({
        "specversion": "1.0", "id": "e-1", "source": "urn:test", "type": "t",
        "traceparent": traceparent, "data": {"event": 1},
    });
    let mut conn = fx.redis.connection()?;
    redis::cmd("PUBLISH")
        .arg("traced")
        .arg(event.to_string())
        .query::<i64>(&mut conn)?;
    wait_for(LONG, "the todo", || async {
        let stored: Option<String> =
            sqlx::query_scalar("SELECT traceparent FROM todos WHERE queue = 'traced' LIMIT 1")
                .fetch_optional(fx.pool())
                .await?
                .flatten();
        Ok(stored.as_deref() == Some(traceparent))
    })
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    collector
        .wait_for_spans(LONG, "the linked batch span", |spans| {
            spans.iter().any(|span| {
                span.name == "process traced"
                    && span.attribute_str("messaging.system") == Some("redis")
                    && span.links.iter().any(|link| {
                        link.trace_id == "0af7651916cd43dd8448eb211c80319c"
                            && link.span_id == "b7ad6b7169203331"
                    })
            })
        })
        .await?;
    Ok(())
}
