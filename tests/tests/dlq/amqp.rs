//! RabbitMQ in the dead-letter contract suite: a quorum source queue, whose dead-letter queue
//! `<queue>.dlq` the worker declares (quorum, like its source), read by `basic.get` and given
//! back; and what only this reader has to prove: listings give every letter back, however
//! often they run, and a redrive whose copy cannot be routed removes nothing.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context as _, Result, ensure};
use nix::sys::signal::Signal;
use switchboard_tests::Fixture;
use switchboard_tests::brokers::AmqpQuorumBroker;
use switchboard_tests::brokers::rabbitmq::{QueueType, RabbitMq, header, queue_arguments, text};
use switchboard_tests::wait::wait_for;

use super::{
    Case, FLAT_KIB, LONG, MAX_DELIVERIES, RSS_CAP_KIB, body_of, case_manifest, dead_lettered_at,
    dlq, dlq_command, dlq_ok, list_json, list_ten, measured, now_ms, path_text, poison_bodies,
};

/// A quorum queue `name` on a RabbitMQ node of its own; the worker declares `<name>.dlq`.
pub(crate) struct AmqpCase {
    fx: Fixture,
    pub(crate) server: RabbitMq,
    name: String,
}

impl AmqpCase {
    fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.name)
    }
}

impl Case for AmqpCase {
    async fn start(name: &str) -> Result<Self> {
        let mut fx = Fixture::start().await?;
        let server = RabbitMq::start()?;
        fx.extra_env.push(("AMQP_URL".to_owned(), server.url()));
        server
            .declare(name, queue_arguments(QueueType::Quorum, &[]))
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
        let source = format!("amqp: {{queue: {}}}", self.name);
        case_manifest(&self.fx, &self.name, &source, fixed)
    }

    /// Each message with a `message-id` of its own, as a producer would set.
    async fn send(&self, bodies: &[Vec<u8>]) -> Result<()> {
        let messages = bodies
            .iter()
            .map(|body| (body.clone(), AmqpQuorumBroker::properties()));
        self.server.publish(&self.name, messages).await
    }

    /// Read `MAX_DELIVERIES` times (or more) by consumers that close their connection without
    /// acknowledging: the quorum queue counts each in `x-delivery-count`.
    async fn send_overdue(&self, bodies: &[Vec<u8>]) -> Result<()> {
        self.send(bodies).await?;
        let mut deliveries: HashMap<Vec<u8>, u32> = HashMap::new();
        let deadline = std::time::Instant::now() + LONG;
        while deliveries.len() < bodies.len()
            || deliveries.values().any(|count| *count < MAX_DELIVERIES)
        {
            ensure!(
                std::time::Instant::now() < deadline,
                "deliveries: {deliveries:?}"
            );
            for (body, _) in self.server.peek(&self.name).await? {
                *deliveries.entry(body).or_default() += 1;
            }
        }
        Ok(())
    }

    /// Ready and held letters alike.
    async fn dead_letters(&self) -> Result<u64> {
        Ok(self
            .server
            .counted(&self.dead_letter_queue(), "messages")
            .await?
            .unwrap_or(0))
    }

    /// Until RabbitMQ has put back what a command that ended held.
    async fn settle(&self) -> Result<()> {
        let queue = self.dead_letter_queue();
        wait_for(LONG, "no dead letter is held", || async {
            let held = self
                .server
                .counted(&queue, "messages_unacknowledged")
                .await?;
            Ok(held.unwrap_or(0) == 0)
        })
        .await
    }

    fn queue(&self) -> &str {
        &self.name
    }
}

/// Listings of the same letters in the tests below.
const LISTINGS: usize = 25;

/// Every listing reads the letters and gives them back: after 25 listings of the quorum
/// dead-letter queue the worker declared, every letter is there, unchanged, under the same id,
/// in the same order (and after a listing cut by `--limit`, in another order);
/// each listing counted as one delivery (RabbitMQ 3.10 sets no delivery limit); a redrive whose
/// copy cannot be routed (the source queue is gone) fails naming the setting and removes
/// nothing; redriven into the queue again, the copies count their deliveries afresh (a copy
/// carrying the dead-letter queue's count would be dead-lettered again at once) and make one
/// todo each.
#[tokio::test]
async fn twenty_five_listings_lose_nothing_and_an_unroutable_redrive_removes_nothing() -> Result<()>
{
    let case = AmqpCase::start("listed").await?;
    let strict = case.manifest(false)?;
    let file = path_text(&strict)?.to_owned();
    let sent = poison_bodies("listed")[..5].to_vec();
    case.send(&sent).await?;
    let mut worker = case.fx().worker(&strict, "strict")?;
    wait_for(LONG, "five letters", || async {
        Ok(case.dead_letters().await? == 5)
    })
    .await
    .with_context(|| worker.log_tail())?;
    worker.signal(Signal::SIGTERM)?;
    worker.wait_exit(std::time::Duration::from_secs(30))?;
    let queues = case
        .server
        .ctl(&[
            "list_queues",
            "--quiet",
            "--no-table-headers",
            "name",
            "type",
        ])
        .await?;
    ensure!(
        queues.lines().any(|line| line == "listed.dlq\tquorum"),
        "the worker declared a quorum dead-letter queue: {queues}"
    );

    let letters = |listed: &[serde_json::Value]| -> Result<Vec<(String, Vec<u8>)>> {
        listed
            .iter()
            .map(|letter| {
                Ok((
                    letter["id"].as_str().context("id")?.to_owned(),
                    body_of(letter)?,
                ))
            })
            .collect()
    };
    let first = letters(&list_json(&case, &file)?)?;
    ensure!(first.len() == 5, "five letters: {first:?}");
    for listing in 2..=LISTINGS {
        let again = letters(&list_json(&case, &file)?)?;
        ensure!(again == first, "listing {listing}: {again:?}");
    }
    // Read that often, a letter is pointed out (RabbitMQ 4.0 to 4.2 would drop it at 20).
    let worn = dlq(&case, &["list", "--file", &file])?;
    let stderr = String::from_utf8_lossy(&worn.stderr);
    ensure!(
        worn.status.success() && stderr.contains("given back") && stderr.contains("delivery-limit"),
        "{stderr}"
    );
    // A listing cut short gives back the letters it read behind the others (RabbitMQ 3.10's
    // quorum queue): the order changes, the letters do not.
    dlq_ok(
        &case,
        &["list", "--file", &file, "-o", "json", "--limit", "2"],
    )?;
    let mut after_cut = letters(&list_json(&case, &file)?)?;
    after_cut.sort();
    let mut sorted = first.clone();
    sorted.sort();
    ensure!(after_cut == sorted, "after a cut listing: {after_cut:?}");
    // Letters named last to first: looking up the first starts the reading over after the
    // last was found, and still finds it.
    let (last, head) = (&first[4].0, &first[0].0);
    let preview = String::from_utf8(dlq_ok(
        &case,
        &["redrive", "--file", &file, "--dry-run", last, head],
    )?)?;
    ensure!(
        preview.contains(&format!("would redrive {last}"))
            && preview.contains(&format!("would redrive {head}")),
        "{preview}"
    );
    case.settle().await?;
    ensure!(case.dead_letters().await? == 5, "every letter is kept");
    let counts: Vec<String> = case
        .server
        .peek(&case.dead_letter_queue())
        .await?
        .iter()
        .map(|(_, properties)| header(properties, "x-delivery-count").unwrap_or_default())
        .collect();
    ensure!(
        counts.len() == 5
            && counts
                .iter()
                .all(|count| count.parse::<usize>().is_ok_and(|n| n >= LISTINGS)),
        "each listing was a delivery of each letter: {counts:?}"
    );

    case.server.delete(&case.name).await?;
    let unroutable = dlq(&case, &["redrive", "--file", &file, "--all"])?;
    let stderr = String::from_utf8_lossy(&unroutable.stderr);
    ensure!(
        !unroutable.status.success() && stderr.contains("spec.source.amqp.queue"),
        "{:?} {stderr}",
        unroutable.status
    );
    case.settle().await?;
    ensure!(case.dead_letters().await? == 5, "nothing was removed");

    case.server
        .declare(&case.name, queue_arguments(QueueType::Quorum, &[]))
        .await?;
    let _fixed = case.fx().worker(&case.manifest(true)?, "fixed")?;
    let summary = String::from_utf8(dlq_ok(&case, &["redrive", "--file", &file, "--all"])?)?;
    ensure!(summary.contains("5 redriven"), "{summary}");
    wait_for(LONG, "a todo per letter", || async {
        Ok(case.fx().todo_count(case.queue()).await? == 5)
    })
    .await?;
    ensure!(case.dead_letters().await? == 0, "the destination is empty");
    case.fx().assert_exactly_once(case.queue(), 5).await
}

/// Letters in the measured listing below (a `show` reads every letter before the one it
/// shows, one `basic.get` each: 200,000 would take minutes).
const MEASURED: usize = 20_000;
/// Letters in the queue of the baseline run: more than `list --limit 10` reads.
const FEW: usize = 20;

/// The cost of get-and-give-back, measured: with 20,000 letters in the quorum dead-letter queue,
/// `list --limit 10` reads 11 and `show` of the middle letter reads 10,001 (figures printed);
/// neither holds more memory than over a queue of a page but a page (the reader keeps a delivery
/// tag per letter passed), and every letter is still there afterwards.
#[tokio::test]
async fn list_and_show_of_20k_letters_hold_no_more_than_a_page_and_keep_every_letter() -> Result<()>
{
    let case = AmqpCase::start("many").await?;
    let manifest = case.manifest(false)?;
    let file = path_text(&manifest)?.to_owned();
    let queue = case.dead_letter_queue();
    case.server
        .declare(&queue, queue_arguments(QueueType::Quorum, &[]))
        .await?;
    let mut headers = lapin::types::FieldTable::default();
    for (name, value) in [
        ("x-switchboard-reason", "invalid_json"),
        ("x-switchboard-last-seen", "2026-12-01T00:00:00.000Z"),
        ("kind", "bulk"),
    ] {
        headers.insert(name.into(), text(value));
    }
    let body = |n: usize| format!(r#"{{"letter":{n},"padding":"{}"}}"#, "x".repeat(64));
    let letters = |range: std::ops::Range<usize>| {
        range.map(|n| {
            let properties = lapin::BasicProperties::default()
                .with_message_id(format!("m-{n}").into())
                .with_headers(headers.clone());
            (body(n).into_bytes(), properties)
        })
    };
    // The baseline lists as many letters as the measured runs do (so the same code has run),
    // over a queue of a page: what grows with the queue's size is what the runs hold beyond it.
    case.server.publish(&queue, letters(0..FEW)).await?;
    let empty = list_ten(&case, &file)?;
    ensure!(empty.output.status.success(), "{:?}", empty.output);
    case.server.publish(&queue, letters(FEW..MEASURED)).await?;

    let list = list_ten(&case, &file)?;
    let listed = String::from_utf8(list.output.stdout.clone())?;
    ensure!(
        list.output.status.success() && listed.lines().count() == 11,
        "ten letters and a summary: {listed}"
    );
    let oldest = serde_json::from_str::<serde_json::Value>(
        std::str::from_utf8(&dlq_ok(
            &case,
            &["list", "--file", &file, "-o", "json", "--limit", "1"],
        )?)?
        .lines()
        .next()
        .context("a letter")?,
    )?;
    ensure!(body_of(&oldest)? == body(0).as_bytes(), "the oldest first");
    let id = letter_id(&format!("m-{}", MEASURED / 2), &body(MEASURED / 2));
    let show = measured(dlq_command(
        &case,
        &["show", "--file", &file, &id, "-o", "raw"],
    )?)?;
    ensure!(
        show.output.status.success() && show.output.stdout == body(MEASURED / 2).as_bytes(),
        "{:?}",
        show.output
    );
    for (command, run) in [("list --limit 10", &list), ("show ID", &show)] {
        println!(
            "{MEASURED} RabbitMQ dead letters: dlq {command}: {:.3} s, peak RSS {} KiB ({} KiB over a queue of {FEW}), anonymous {} KiB",
            run.elapsed.as_secs_f64(),
            run.peak_kib,
            run.peak_kib.saturating_sub(empty.peak_kib),
            run.anon_kib
        );
        ensure!(
            run.peak_kib <= empty.peak_kib + FLAT_KIB && run.anon_kib <= RSS_CAP_KIB,
            "dlq {command} held more than a page"
        );
    }
    case.settle().await?;
    ensure!(
        case.dead_letters().await? == MEASURED as u64,
        "every letter is kept"
    );
    Ok(())
}

/// A letter's id as the reader makes it: its `message-id`, its dead-lettering time (the one the
/// test letters carry) and its body.
fn letter_id(message_id: &str, body: &str) -> String {
    use sha2::Digest as _;
    let mut digest = sha2::Sha256::new();
    digest.update(format!("{message_id}\n2026-12-01T00:00:00.000Z\n{body}"));
    hex::encode(digest.finalize())[..16].to_owned()
}

/// A message RabbitMQ dead-lettered itself into `<queue>.dlq` (a queue of the producer's whose
/// `x-dead-letter-routing-key` names it; here its message expired) carries no `x-switchboard-*`
/// context: it is listed with RabbitMQ's reason and its age is the time RabbitMQ moved it
/// (`x-death`), and it is redriven like the worker's own letters.
#[tokio::test]
async fn a_letter_rabbitmq_moved_itself_is_listed_with_its_reason_and_age_and_redriven()
-> Result<()> {
    let case = AmqpCase::start("moved").await?;
    let strict = case.manifest(false)?;
    let file = path_text(&strict)?.to_owned();
    let queue = case.dead_letter_queue();
    case.server
        .declare(&queue, queue_arguments(QueueType::Quorum, &[]))
        .await?;
    let expiring = [
        ("x-message-ttl", lapin::types::AMQPValue::LongLongInt(1)),
        ("x-dead-letter-exchange", text("")),
        ("x-dead-letter-routing-key", text(&queue)),
    ];
    case.server
        .declare("moved-ttl", queue_arguments(QueueType::Classic, &expiring))
        .await?;
    // `x-death` times are whole seconds.
    let sent_at = now_ms() / 1000 * 1000;
    let properties = AmqpQuorumBroker::properties();
    case.server
        .publish("moved-ttl", [(br#"{"moved": 1}"#.to_vec(), properties)])
        .await?;
    wait_for(LONG, "RabbitMQ moves the expired message", || async {
        Ok(case.dead_letters().await? == 1)
    })
    .await?;
    let listed = list_json(&case, &file)?;
    let [letter] = listed.as_slice() else {
        anyhow::bail!("one letter: {listed:?}");
    };
    let at = dead_lettered_at(letter).context("an age")?;
    ensure!(
        letter["reason"] == "expired" && (sent_at..=now_ms()).contains(&at),
        "RabbitMQ's reason and time: {letter}"
    );
    let _fixed = case.fx().worker(&case.manifest(true)?, "fixed")?;
    let summary = String::from_utf8(dlq_ok(&case, &["redrive", "--file", &file, "--all"])?)?;
    ensure!(summary.contains("1 redriven"), "{summary}");
    wait_for(LONG, "its todo", || async {
        Ok(case.fx().todo_count(case.queue()).await? == 1)
    })
    .await?;
    ensure!(case.dead_letters().await? == 0, "the destination is empty");
    Ok(())
}
