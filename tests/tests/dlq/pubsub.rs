//! `switchboard-worker dlq` for Redis pub/sub: its dead letters are a list, read as list mode's;
//! a redrive publishes a letter and removes it in one script, only if a subscriber received it.
//! The suite runs for it (`dlq::redis_pubsub::*`): pub/sub has no redelivery, so nothing is ever
//! delivered too often, and its second kind of letters is too large for the strict manifest.
//! These tests add what only pub/sub has: a redrive with no subscriber, a pattern subscription.

use std::process::Stdio;

use anyhow::{Context, Result, ensure};
use switchboard_tests::wait::wait_for;
use switchboard_tests::{Fixture, adapter_manifest};

use super::{
    Case, LONG, ListCase, PUBSUB_STRICT_MAX_BYTES, body_of, dlq, dlq_ok, list_json,
    manifest_settings, path_text, poison_bodies,
};

/// A pub/sub adapter on channel `name`: its dead letters are a list, `<name>.dlq`, as list
/// mode's (the same fixture and counts).
pub(super) struct PubSubCase(ListCase);

impl PubSubCase {
    fn subscribers(&self) -> Result<i64> {
        let mut conn = self.fx().redis.connection()?;
        let (_, count): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(self.queue())
            .query(&mut conn)?;
        Ok(count)
    }

    async fn wait_subscribed(&self) -> Result<()> {
        wait_for(LONG, "a worker is subscribed", || async {
            Ok(self.subscribers()? >= 1)
        })
        .await
    }
}

impl Case for PubSubCase {
    async fn start(name: &str) -> Result<Self> {
        Ok(Self(ListCase::start(name).await?))
    }

    fn fx(&self) -> &Fixture {
        self.0.fx()
    }

    /// The strict manifest also takes at most [`PUBSUB_STRICT_MAX_BYTES`] a body.
    fn manifest(&self, fixed: bool) -> Result<std::path::PathBuf> {
        let (delivery, payload) = manifest_settings(fixed);
        let payload = match fixed {
            true => payload.to_owned(),
            false => format!("{payload}, maxBytes: {PUBSUB_STRICT_MAX_BYTES}"),
        };
        let name = self.queue();
        self.fx().manifest(
            &format!("{name}-{fixed}.yaml"),
            &adapter_manifest(
                name,
                &format!("mode: pubsub, channel: {name}"),
                &delivery,
                &payload,
            ),
        )
    }

    /// Publishes `bodies` once a worker is subscribed (a channel keeps nothing for later).
    async fn send(&self, bodies: &[Vec<u8>]) -> Result<()> {
        self.wait_subscribed().await?;
        let mut conn = self.fx().redis.connection()?;
        let mut pipe = redis::pipe();
        for body in bodies {
            pipe.cmd("PUBLISH").arg(self.queue()).arg(body).ignore();
        }
        pipe.query::<()>(&mut conn)?;
        Ok(())
    }

    /// Pub/sub never redelivers: `bodies` are sent as they are, and the strict worker
    /// dead-letters them for being larger than its `maxBytes`.
    async fn send_overdue(&self, bodies: &[Vec<u8>]) -> Result<()> {
        ensure!(
            bodies
                .iter()
                .all(|body| body.len() > PUBSUB_STRICT_MAX_BYTES),
            "an overdue body is too small to be dead-lettered as oversize"
        );
        self.send(bodies).await
    }

    const OVERDUE_REASON: &'static str = "oversize";
    const SUBSCRIBES: bool = true;

    async fn ready(&self) -> Result<()> {
        self.wait_subscribed().await
    }

    async fn dead_letters(&self) -> Result<u64> {
        self.0.dead_letters().await
    }

    fn queue(&self) -> &str {
        self.0.queue()
    }
}

/// Ten poison messages dead-lettered by a strict worker, which is then stopped: no subscriber
/// is left. Returns the manifest's path and the bodies.
async fn dead_letter_ten(case: &PubSubCase) -> Result<(String, Vec<Vec<u8>>)> {
    let strict = case.manifest(false)?;
    let mut worker = case.fx().worker(&strict, "strict")?;
    let sent = poison_bodies(case.queue());
    case.send(&sent).await?;
    wait_for(LONG, "every message is dead-lettered", || async {
        Ok(case.dead_letters().await? == sent.len() as u64)
    })
    .await
    .with_context(|| worker.log_tail())?;
    worker.signal(nix::sys::signal::Signal::SIGTERM)?;
    worker.wait_exit(std::time::Duration::from_secs(30))?;
    Ok((path_text(&strict)?.to_owned(), sent))
}

/// A pub/sub letter is listed and shown like a list letter; a redrive with no subscriber loses
/// nothing (every letter stays, the command fails saying why), and once a worker is subscribed
/// it makes one todo per letter and empties the list, saying first what pub/sub guarantees.
#[tokio::test]
async fn pubsub_letters_are_redriven_only_to_a_subscriber_into_one_todo_each() -> Result<()> {
    let case = PubSubCase::start("events").await?;
    let (file, sent) = dead_letter_ten(&case).await?;
    let letters = list_json(&case, &file)?;
    let mut bodies: Vec<Vec<u8>> = letters.iter().map(body_of).collect::<Result<_>>()?;
    let mut expected = sent.clone();
    bodies.sort();
    expected.sort();
    ensure!(
        bodies == expected,
        "every body, byte-identical: {letters:?}"
    );
    ensure!(
        letters
            .iter()
            .all(|letter| letter["reason"] == "invalid_json")
    );
    let id = letters[0]["id"].as_str().context("id")?;
    let raw = dlq_ok(&case, &["show", "--file", &file, id, "-o", "raw"])?;
    ensure!(raw == body_of(&letters[0])?, "show -o raw prints the body");

    ensure!(case.subscribers()? == 0, "no worker is subscribed");
    let alone = dlq(&case, &["redrive", "--file", &file, "--all"])?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&alone.stdout),
        String::from_utf8_lossy(&alone.stderr),
    );
    ensure!(
        alone.status.code() == Some(1)
            && stdout.contains("0 redriven")
            && stdout.contains("10 failed")
            && stderr.contains("no subscriber on channel events"),
        "{:?}\n{stdout}\n{stderr}",
        alone.status
    );
    ensure!(case.dead_letters().await? == 10, "every letter stays");

    let _worker = case.fx().worker(&case.manifest(true)?, "fixed")?;
    case.wait_subscribed().await?;
    let redriven = dlq(&case, &["redrive", "--file", &file, "--all"])?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&redriven.stdout),
        String::from_utf8_lossy(&redriven.stderr),
    );
    ensure!(
        redriven.status.success() && stdout.contains("10 redriven"),
        "{stdout}\n{stderr}"
    );
    ensure!(
        stderr.contains("at-most-once") && stderr.contains("PUBLISH reached a subscriber"),
        "the command states the guarantee first: {stderr}"
    );
    wait_for(LONG, "a todo per letter", || async {
        Ok(case.fx().todo_count(case.queue()).await? == 10)
    })
    .await?;
    ensure!(case.dead_letters().await? == 0, "the list is empty");
    case.fx().assert_exactly_once(case.queue(), 10).await
}

/// A letter of a pattern subscription goes back to the channel it was published on (its
/// `channel` header), not to the pattern.
#[tokio::test]
async fn pubsub_letter_of_a_pattern_subscription_goes_back_to_its_own_channel() -> Result<()> {
    let fx = Fixture::start().await?;
    let manifest = |fixed: bool| {
        let (delivery, payload) = manifest_settings(fixed);
        let redis = "mode: pubsub, channel: \"orders.*\", pattern: true";
        fx.manifest(
            &format!("pattern-{fixed}.yaml"),
            &adapter_manifest("pattern", redis, &delivery, payload),
        )
    };
    let patterns = || -> Result<i64> {
        Ok(redis::cmd("PUBSUB")
            .arg("NUMPAT")
            .query(&mut fx.redis.connection()?)?)
    };
    let strict = manifest(false)?;
    let mut worker = fx.worker(&strict, "strict")?;
    wait_for(LONG, "the worker is subscribed to the pattern", || async {
        Ok(patterns()? == 1)
    })
    .await?;
    redis::cmd("PUBLISH")
        .arg("orders.eu")
        .arg("not json")
        .query::<()>(&mut fx.redis.connection()?)?;
    wait_for(LONG, "the letter", || async {
        Ok(fx.llen("orders.*.dlq")? == 1)
    })
    .await?;
    worker.signal(nix::sys::signal::Signal::SIGTERM)?;
    worker.wait_exit(std::time::Duration::from_secs(30))?;

    let _worker = fx.worker(&manifest(true)?, "fixed")?;
    wait_for(LONG, "the fixed worker is subscribed", || async {
        Ok(patterns()? == 1)
    })
    .await?;
    let file = path_text(&strict)?;
    let redrive = std::process::Command::new(switchboard_tests::worker::worker_binary()?)
        .args(["dlq", "redrive", "--file", file, "--all"])
        .env("DATABASE_URL", &fx.env.database_url)
        .env("REDIS_URL", &fx.env.redis_url)
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&redrive.stdout);
    ensure!(
        redrive.status.success() && stdout.contains("1 redriven"),
        "{stdout}{}",
        String::from_utf8_lossy(&redrive.stderr)
    );
    wait_for(LONG, "the todo", || async {
        Ok(fx.todo_count("pattern").await? == 1)
    })
    .await?;
    let channels: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT e.headers->>'channel' FROM todos t JOIN events e ON e.id = t.event_id \
         WHERE t.queue = 'pattern'",
    )
    .fetch_all(fx.pool())
    .await?;
    ensure!(
        channels == [Some("orders.eu".to_owned())],
        "published again on orders.eu: {channels:?}"
    );
    ensure!(fx.llen("orders.*.dlq")? == 0, "the list is empty");
    Ok(())
}
