//! Kafka dead letters: the contract suite's case (a real Kafka node, `<topic>.dlq` of two
//! partitions), and what only Kafka's reader does: a letter removed out of partition order is
//! marked removed, and goes with its prefix once the letters before it are gone; list and show
//! over 200,000 letters; a letter redriven twice keeps its binary key and headers and arrives.

use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use switchboard_tests::brokers::kafka::{KafkaServer, Record};
use switchboard_tests::todos_lock::{TodosLock, wait_blocked_on_lock};
use switchboard_tests::wait::wait_for;
use switchboard_tests::{Fixture, source_manifest};

use super::{
    Case, LONG, MAX_DELIVERIES, case_manifest, dlq_ok, list_json, manifest_settings, path_text,
    poison_bodies,
};

/// Partitions of the source topic and of its dead-letter topic.
const PARTITIONS: i32 = 2;

/// A topic `{name}` and its dead-letter topic `{name}.dlq` on a Kafka node of its own.
pub(crate) struct KafkaCase {
    fx: Fixture,
    pub(crate) server: KafkaServer,
    name: String,
}

impl KafkaCase {
    fn dead_letter_topic(&self) -> String {
        format!("{}.dlq", self.name)
    }
}

impl Case for KafkaCase {
    async fn start(name: &str) -> Result<Self> {
        let fx = Fixture::start().await?;
        let server = KafkaServer::start()?;
        server.create_topic(name, PARTITIONS).await?;
        server
            .create_topic(&format!("{name}.dlq"), PARTITIONS)
            .await?;
        Ok(Self {
            fx,
            server,
            name: name.to_owned(),
        })
    }

    fn fx(&self) -> &Fixture {
        &self.fx
    }

    fn manifest(&self, fixed: bool) -> Result<PathBuf> {
        let source = format!(
            "kafka: {{bootstrapServers: \"{}\", topics: [{}], sessionTimeoutSeconds: 6}}",
            self.server.bootstrap(),
            self.name
        );
        case_manifest(&self.fx, &self.name, &source, fixed)
    }

    async fn send(&self, bodies: &[Vec<u8>]) -> Result<()> {
        self.server.produce(&self.name, bodies.to_vec()).await
    }

    /// Kafka has no delivery count: the worker keeps its own. Each of `MAX_DELIVERIES` workers
    /// receives the records and dies storing them (behind a lock on the todos table), so the
    /// next worker receives each for the fourth time.
    async fn send_overdue(&self, bodies: &[Vec<u8>]) -> Result<()> {
        // One partition: each dying worker must hold every record, and its store blocks.
        self.server
            .produce_keyed(&self.name, b"overdue", bodies.to_vec())
            .await?;
        let strict = self.manifest(false)?;
        let lock = TodosLock::take(&self.fx.env.database_url).await?;
        for delivery in 0..MAX_DELIVERIES {
            let consumer = format!("dying-{delivery}");
            let worker = self.fx.worker(&strict, &consumer)?;
            // Every record in hand, then blocked.
            let received = format!(
                r#"switchboard_messages_received_total{{adapter="test/{}"}}"#,
                self.name
            );
            wait_for(LONG, "every overdue record received", || async {
                Ok(worker.metric(&received).unwrap_or(0.0) >= bodies.len() as f64)
            })
            .await
            .with_context(|| worker.log_tail())?;
            wait_blocked_on_lock(&self.fx, &worker).await?;
            worker.kill()?;
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(switchboard_worker::database_application_name(&consumer))
            .execute(self.fx.pool())
            .await?;
            self.fx.wait_disconnected(&consumer).await?;
        }
        lock.release().await
    }

    /// Records in the dead-letter topic less the removal markers (each marks one of them), by
    /// the topics' watermarks: cheap enough to watch a paced redrive with.
    async fn dead_letters(&self) -> Result<u64> {
        let topic = self.dead_letter_topic();
        let records = self.server.depth(&topic).await?;
        let markers = self.server.depth(&format!("{topic}.removed")).await?;
        Ok(records.saturating_sub(markers))
    }

    fn queue(&self) -> &str {
        &self.name
    }
}

/// A letter purged out of partition order is marked removed, not listed, not shown, not
/// counted; once the letters before it are purged too, Kafka deletes the whole prefix and the
/// marker goes with it.
#[tokio::test]
async fn a_letter_removed_out_of_order_is_marked_then_deleted_with_its_prefix() -> Result<()> {
    let case = KafkaCase::start("marked").await?;
    let strict = case.manifest(false)?;
    let file = path_text(&strict)?.to_owned();
    let _worker = case.fx().worker(&strict, "strict")?;
    case.send(&poison_bodies("marked")[..6]).await?;
    wait_for(LONG, "six letters", || async {
        Ok(case.dead_letters().await? == 6)
    })
    .await?;
    let letters = list_json(&case, &file)?;
    ensure!(letters.len() == 6, "{letters:?}");
    let ids: Vec<&str> = letters
        .iter()
        .map(|letter| letter["id"].as_str().context("id"))
        .collect::<Result<_>>()?;
    // The first letter of a partition that holds two, and the next one there.
    let partition = |id: &str| {
        id.split_once(':')
            .map(|(partition, _)| partition.to_owned())
    };
    let (first, later) = ids
        .iter()
        .enumerate()
        .find_map(|(index, id)| {
            let later = ids[index + 1..]
                .iter()
                .find(|other| partition(other) == partition(id))?;
            Some((*id, *later))
        })
        .context("two letters in one partition")?;
    let purged = String::from_utf8(dlq_ok(&case, &["purge", "--file", &file, later, "--yes"])?)?;
    ensure!(purged.contains("1 dead letters deleted"), "{purged}");
    let markers = case
        .server
        .read_all(&format!("{}.removed", case.dead_letter_topic()))
        .await?;
    ensure!(markers.len() == 1, "one marker: {markers:?}");
    let left = list_json(&case, &file)?;
    ensure!(
        left.len() == 5 && left.iter().all(|letter| letter["id"] != *later),
        "{later} is not listed: {left:?}"
    );
    let shown = super::dlq(&case, &["show", "--file", &file, later])?;
    ensure!(shown.status.code() == Some(1), "{later} is not shown");
    let summary = String::from_utf8(dlq_ok(
        &case,
        &["list", "--file", &file, "-o", "json", "--limit", "1"],
    )?)?;
    ensure!(
        summary.contains("\"total\":5"),
        "the count leaves it out: {summary}"
    );
    let first = String::from_utf8(dlq_ok(&case, &["purge", "--file", &file, first, "--yes"])?)?;
    ensure!(first.contains("1 dead letters deleted"), "{first}");
    ensure!(
        case.dead_letters().await? == 4,
        "both gone from the partition"
    );
    let markers = case
        .server
        .read_all(&format!("{}.removed", case.dead_letter_topic()))
        .await?;
    ensure!(
        markers.is_empty(),
        "the marker went with its letter: {markers:?}"
    );
    ensure!(list_json(&case, &file)?.len() == 4, "four listed");
    Ok(())
}

/// Acceptance 2 for Kafka: with 200,000 letters in the dead-letter topic, `list --limit 10`
/// and `show PARTITION:OFFSET` hold no more than over an empty topic but a page, and at most
/// [`super::RSS_CAP_KIB`] of memory of their own (figures printed).
#[tokio::test]
async fn list_and_show_of_200k_kafka_letters_stay_flat_and_under_40_mib() -> Result<()> {
    let case = KafkaCase::start("many").await?;
    let manifest = case.manifest(false)?;
    let file = path_text(&manifest)?.to_owned();
    let empty = super::list_ten(&case, &file)?;
    ensure!(empty.output.status.success(), "{:?}", empty.output);
    let body = |n: usize| format!(r#"{{"letter":{n},"padding":"{}"}}"#, "x".repeat(64));
    let letter = |n: usize| Record {
        key: None,
        value: Some(body(n).into_bytes()),
        headers: [
            ("x-dlq-reason", "invalid_json".to_owned()),
            ("x-dlq-error", "not JSON under format: json".to_owned()),
            ("x-dlq-delivery-count", "1".to_owned()),
            ("x-dlq-attempts", r#"{"total":1,"recent":[]}"#.to_owned()),
            ("x-dlq-original-topic", "many".to_owned()),
            ("x-dlq-original-partition", "0".to_owned()),
            ("x-dlq-original-offset", n.to_string()),
            ("kind", "bulk".to_owned()),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), Some(value.into_bytes())))
        .collect(),
    };
    // One partition, so that the offset of letter n is n.
    let topic = case.dead_letter_topic();
    case.server.delete_topics(&[topic.as_str()]).await?;
    wait_for(LONG, "the dead-letter topic is gone", || async {
        Ok(case.server.create_topic(&topic, 1).await.is_ok())
    })
    .await?;
    for chunk in (0..super::MANY).collect::<Vec<_>>().chunks(20_000) {
        let records = chunk.iter().map(|n| letter(*n)).collect();
        case.server.produce_records(&topic, records).await?;
    }
    let list = super::list_ten(&case, &file)?;
    let listed = super::ten_and_cut(&list)?;
    ensure!(listed[0]["id"] == "0:0", "the oldest first: {}", listed[0]);
    let middle = format!("0:{}", super::MANY / 2);
    let show = super::measured(super::dlq_command(
        &case,
        &["show", "--file", &file, &middle, "-o", "raw"],
    )?)?;
    ensure!(show.output.status.success(), "{:?}", show.output);
    ensure!(
        show.output.stdout == body(super::MANY / 2).as_bytes(),
        "the letter shown: {}",
        String::from_utf8_lossy(&show.output.stdout)
    );
    for (command, run) in [("list --limit 10", &list), ("show ID", &show)] {
        ensure!(
            run.elapsed <= std::time::Duration::from_secs(1),
            "dlq {command} took {:?}",
            run.elapsed
        );
    }
    super::flat_with_size("Kafka", &empty, &list, &show)
}

/// A letter redriven while the worker still refuses it is dead-lettered again (its copy on the
/// source carries the original's key, binary key and headers byte-identical, and the
/// idempotency key); redriven again after the fix, it arrives as one todo.
#[tokio::test]
async fn a_letter_redriven_twice_keeps_its_key_and_headers_and_arrives() -> Result<()> {
    let case = KafkaCase::start("twice").await?;
    let strict = case.manifest(false)?;
    let file = path_text(&strict)?.to_owned();
    let key = b"k\0ey".to_vec();
    let original = Record {
        key: Some(key.clone()),
        value: Some(b"not json".to_vec()),
        headers: vec![
            ("kind".to_owned(), Some(b"order".to_vec())),
            ("raw".to_owned(), Some(vec![0x01, 0x02, 0x7f])),
        ],
    };
    case.server
        .produce_records("twice", vec![original.clone()])
        .await?;
    let worker = case.fx().worker(&strict, "strict")?;
    wait_for(LONG, "the letter", || async {
        Ok(case.dead_letters().await? == 1)
    })
    .await?;
    let first = list_json(&case, &file)?[0]["id"].clone();
    let summary = String::from_utf8(dlq_ok(&case, &["redrive", "--file", &file, "--all"])?)?;
    ensure!(summary.contains("1 redriven"), "{summary}");
    wait_for(LONG, "the copy dead-lettered again", || async {
        let letters = list_json(&case, &file)?;
        Ok(letters.len() == 1 && letters[0]["id"] != first)
    })
    .await?;
    let key_header = switchboard_worker::transport::IDEMPOTENCY_KEY_HEADER;
    let copies: Vec<Record> = case
        .server
        .read_all("twice")
        .await?
        .into_iter()
        .filter(|record| record.header(key_header).is_some())
        .collect();
    ensure!(copies.len() == 1, "one copy: {copies:?}");
    let copy = &copies[0];
    ensure!(
        copy.key == original.key && copy.value == original.value,
        "{copy:?}"
    );
    ensure!(
        original
            .headers
            .iter()
            .all(|header| copy.headers.contains(header)),
        "the original headers: {copy:?}"
    );
    drop(worker);
    let _fixed = case.fx().worker(&case.manifest(true)?, "fixed")?;
    let summary = String::from_utf8(dlq_ok(&case, &["redrive", "--file", &file, "--all"])?)?;
    ensure!(summary.contains("1 redriven"), "{summary}");
    wait_for(LONG, "one todo", || async {
        Ok(case.fx().todo_count("twice").await? == 1)
    })
    .await?;
    ensure!(case.dead_letters().await? == 0, "the topic holds no letter");
    case.fx().assert_exactly_once("twice", 1).await
}

/// A dead-letter topic that does not exist fails the command in one line naming the setting,
/// and so does an adapter of two topics that names no dead-letter topic.
#[tokio::test]
async fn a_missing_or_ambiguous_dead_letter_topic_fails_naming_the_setting() -> Result<()> {
    let case = KafkaCase::start("missing").await?;
    case.server
        .delete_topics(&[case.dead_letter_topic().as_str()])
        .await?;
    let manifest = case.manifest(false)?;
    let file = path_text(&manifest)?.to_owned();
    let fails_naming_the_setting = |file: &str, what: &str| -> Result<()> {
        let output = super::dlq(&case, &["list", "--file", file])?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(
            output.status.code() == Some(1)
                && stderr.contains("spec.delivery.deadLetter.topic")
                && stderr.contains(what),
            "{:?} {stderr}",
            output.status
        );
        Ok(())
    };
    wait_for(LONG, "the dead-letter topic is gone", || async {
        Ok(fails_naming_the_setting(&file, "does not exist").is_ok())
    })
    .await?;
    let source = format!(
        "kafka: {{bootstrapServers: \"{}\", topics: [missing, other]}}",
        case.server.bootstrap()
    );
    let (delivery, payload) = manifest_settings(false);
    let two = case.fx().manifest(
        "two.yaml",
        &source_manifest("two", &source, &delivery, payload),
    )?;
    fails_naming_the_setting(path_text(&two)?, "one dead-letter topic")
}
