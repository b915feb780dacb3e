//! Whatever PostgreSQL's jsonb accepts is stored as JSON, whatever it refuses is dead-lettered
//! with its reason: the real worker binary against real PostgreSQL and Redis.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use switchboard_tests::Fixture;
use switchboard_tests::wait::wait_for;

const LONG: Duration = Duration::from_secs(120);

/// `jsonb_typeof` and text of each stored todo's payload and its event's, by stream entry id.
async fn stored_payloads(fx: &Fixture, queue: &str) -> Result<HashMap<String, [String; 3]>> {
    let rows: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT e.external_id, jsonb_typeof(t.payload), t.payload::text, e.payload::text \
         FROM todos t JOIN events e ON e.id = t.event_id WHERE t.queue = $1",
    )
    .bind(queue)
    .fetch_all(fx.pool())
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, kind, todo, event)| (id, [kind, todo, event]))
        .collect())
}

#[tokio::test]
async fn huge_numbers_and_thousand_deep_arrays_are_stored_as_jsonb_in_both_formats() -> Result<()> {
    let fx = Fixture::start().await?;
    let deep = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
    // jsonb stores numbers as numeric and prints them in full.
    let huge_as_stored = format!("1{}", "0".repeat(400));
    for format in ["json", "auto"] {
        let name = format!("deep-{format}");
        let manifest = fx.stream_adapter(&name, "batchSize: 10", &format!("format: {format}"))?;
        let ids = fx.produce(&name, [b"1e400".to_vec(), deep.clone().into_bytes()])?;
        let _worker = fx.worker(&manifest, &format!("worker-{format}"))?;
        wait_for(
            LONG,
            &format!("2 todos in {name}, nothing pending"),
            || async {
                Ok(fx.todo_count(&name).await? == 2 && fx.pending(&name, "switchboard")? == 0)
            },
        )
        .await?;

        let stored = stored_payloads(&fx, &name).await?;
        let number = stored.get(&ids[0]).context("1e400 stored")?;
        assert_eq!(
            number,
            &[
                "number".to_owned(),
                huge_as_stored.clone(),
                huge_as_stored.clone()
            ],
            "format {format}"
        );
        let array = stored.get(&ids[1]).context("deep array stored")?;
        assert_eq!(
            array,
            &["array".to_owned(), deep.clone(), deep.clone()],
            "format {format}"
        );
        ensure!(
            fx.xlen(&format!("{name}.dlq"))? == 0,
            "format {format}: nothing dead-lettered"
        );
    }
    Ok(())
}

#[tokio::test]
async fn number_postgresql_refuses_is_dead_lettered_with_its_reason_while_the_rest_is_stored()
-> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = fx.stream_adapter("refused", "batchSize: 10", "format: auto")?;
    // Valid JSON, but beyond what PostgreSQL's numeric can hold.
    let ids = fx.produce(
        "refused",
        [
            br#"{"order":1}"#.to_vec(),
            b"1e200000".to_vec(),
            br#"{"order":2}"#.to_vec(),
        ],
    )?;
    let _worker = fx.worker(&manifest, "worker-a")?;
    wait_for(LONG, "2 todos, 1 dead letter, nothing pending", || async {
        Ok(fx.todo_count("refused").await? == 2
            && fx.xlen("refused.dlq")? == 1
            && fx.pending("refused", "switchboard")? == 0)
    })
    .await?;

    let stored = stored_payloads(&fx, "refused").await?;
    ensure!(
        stored.contains_key(&ids[0])
            && stored.contains_key(&ids[2])
            && !stored.contains_key(&ids[1]),
        "the two objects are stored, the number is not: {:?}",
        stored.keys()
    );
    let mut conn = fx.redis.connection()?;
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg("refused.dlq")
        .arg("-")
        .arg("+")
        .query(&mut conn)?;
    let letter = &reply.ids[0];
    let field = |name: &str| -> Result<String> {
        match letter.map.get(name) {
            Some(redis::Value::BulkString(bytes)) => Ok(String::from_utf8_lossy(bytes).into()),
            other => anyhow::bail!("dead letter field {name}: {other:?}"),
        }
    };
    assert_eq!(field("body")?, "1e200000");
    assert_eq!(field("reason")?, "rejected");
    let error = field("last_error")?;
    ensure!(
        error.contains("numeric"),
        "the dead letter carries PostgreSQL's reason: {error}"
    );
    Ok(())
}
