//! `switchboard-worker dlq`: list, show, redrive and purge an adapter's dead letters, from the
//! same manifest file and environment (`REDIS_URL`, `AWS_*`, …) the worker runs with, so the
//! same command works locally and in the pod (`kubectl exec`).
//!
//! Each transport implements one small [`DeadLetterReader`]; the commands here filter, print
//! and pace what the readers find. Redrive is itself store-then-ack: a reader publishes a letter
//! to the source, waits for the broker's confirmation, and only then removes it from the
//! dead-letter destination. A crash in between leaves at worst a duplicate, which the
//! idempotency key collapses (the copy carries its original key in
//! [`IDEMPOTENCY_KEY_HEADER`](crate::transport::IDEMPOTENCY_KEY_HEADER) where the broker has
//! native ids).

mod kept;
mod output;
mod purge;
mod redrive;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use switchboard_api::QueueAdapter;

use self::kept::{KeptLetters, NoBrokerReader, WithKept};
use crate::brokers::{self, Letters, Plugin, Use};
use crate::payload::PoisonReason;
use crate::transport::TransportError;
pub use crate::transport::reader::{DeadLetterReader, Page, StoredLetter};
use crate::{WorkerError, read_adapter};

/// Why a `dlq` command failed.
#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("no dead letter with id {0} in {1}")]
    NotFound(String, String),
    #[error(
        "`switchboard-worker dlq` does not read the dead letters of {0} at the broker yet (Redis streams, lists and pub/sub, SQS, NATS JetStream, RabbitMQ, Kafka, and the gateway with `spec.source.gateway.deadLetter.queue`, it does); set DATABASE_URL to read those kept in PostgreSQL"
    )]
    Unsupported(&'static str),
    #[error(
        "refusing to purge {count} dead letters without confirmation: pass --yes (standard input is not a terminal to ask on)"
    )]
    NotConfirmed { count: usize },
    #[error("{0}")]
    Usage(String),
    #[error("{failed} dead letters could not be redriven (see above); run the command again")]
    Incomplete { failed: usize },
    #[error("cannot write the output")]
    Output(#[source] std::io::Error),
    /// Stopped between two letters by a signal (exit code `128 + signal`).
    #[error("stopped by signal {signal}; run the command again to redrive the rest")]
    Stopped { signal: i32 },
}

/// The manifest the commands read, as the worker runs it.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The QueueAdapter manifest (the YAML you `kubectl apply`, and the worker runs).
    #[arg(long)]
    pub file: PathBuf,
}

/// `dlq list -o …`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ListFormat {
    /// A table for people.
    Table,
    /// One JSON object per letter and line, the body as `body` (UTF-8) or `body_base64`, then
    /// one `{"summary": {listed, matching, total, truncated, destination}}` line.
    Json,
}

/// `dlq show -o …`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ShowFormat {
    /// Context, headers, every attempt, then the body (pretty when it is JSON).
    Text,
    /// One JSON object, as `list -o json` prints it.
    Json,
    /// The body only, byte-for-byte.
    Raw,
}

/// Letters dead-lettered per second, at most (`--rate 10` or `--rate 10/s`).
fn per_second(text: &str) -> Result<f64, String> {
    let number = text.strip_suffix("/s").unwrap_or(text);
    match number.parse::<f64>() {
        Ok(rate) if rate > 0.0 && rate.is_finite() => Ok(rate),
        _ => Err("expected a positive number of letters per second, e.g. 10 or 10/s".to_owned()),
    }
}

/// A reason a letter was dead-lettered for, one of [`PoisonReason::ALL`] (a typo would select
/// nothing and say nothing).
fn poison_reason() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(PoisonReason::ALL.map(PoisonReason::as_str))
}

/// `switchboard-worker dlq …`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DlqCommand {
    /// List dead letters (oldest first): id, age, reason, delivery count, last error, size.
    ///
    /// Reads a page at a time and stops once `--limit` letters matched (and one more shows the
    /// listing was cut), whatever the dead-letter queue's size.
    List {
        #[command(flatten)]
        target: Target,
        /// Only letters dead-lettered for this reason.
        #[arg(long, value_parser = poison_reason())]
        reason: Option<String>,
        /// Only letters dead-lettered within this long (`1h`, `2d`) before the command started;
        /// not those whose age is unknown.
        #[arg(long, value_parser = ago)]
        since: Option<Moment>,
        /// At most this many letters.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        #[arg(short = 'o', long, value_enum, default_value = "table")]
        output: ListFormat,
    },
    /// Show one dead letter: its context, headers, every attempt and the body.
    ///
    /// Redis streams, NATS, Kafka (`PARTITION:OFFSET`) and letters kept in PostgreSQL (`db-N`)
    /// look the letter up by its id. SQS, Redis lists and RabbitMQ cannot: they read the queue
    /// page by page until they find it (the time grows with the letters before it, the memory
    /// does not).
    Show {
        #[command(flatten)]
        target: Target,
        /// The letter's id, as `dlq list` prints it.
        id: String,
        #[arg(short = 'o', long, value_enum, default_value = "text")]
        output: ShowFormat,
    },
    /// Put dead letters back on the source (publish, wait for the broker, then remove).
    Redrive {
        #[command(flatten)]
        target: Target,
        /// The letters to redrive, by id.
        ids: Vec<String>,
        /// Every letter.
        #[arg(long, conflicts_with_all = ["ids", "reason"])]
        all: bool,
        /// Every letter dead-lettered for this reason.
        #[arg(long, conflicts_with = "ids", value_parser = poison_reason())]
        reason: Option<String>,
        /// At most this many letters per second (`10` or `10/s`).
        #[arg(long, value_parser = per_second)]
        rate: Option<f64>,
        /// Say what would be redriven, change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete dead letters (by id, reason or age; all if none is given); asks first on a
    /// terminal.
    Purge {
        #[command(flatten)]
        target: Target,
        /// The letters to delete, by id.
        ids: Vec<String>,
        /// Only letters dead-lettered for this reason.
        #[arg(long, conflicts_with = "ids", value_parser = poison_reason())]
        reason: Option<String>,
        /// Only letters dead-lettered longer ago than this (`14d`) when the command started. A
        /// letter whose age is unknown (listed as `?`: one SQS's RedrivePolicy moved) is never
        /// deleted by age.
        #[arg(long, value_parser = ago)]
        older_than: Option<Moment>,
        /// Say what would be deleted, delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
}

impl DlqCommand {
    fn target(&self) -> &Target {
        match self {
            DlqCommand::List { target, .. }
            | DlqCommand::Show { target, .. }
            | DlqCommand::Redrive { target, .. }
            | DlqCommand::Purge { target, .. } => target,
        }
    }
}

/// Runs one `dlq` command against the dead-letter destination of the manifest's adapter, and the
/// letters PostgreSQL's `dead_letters` table keeps for it (those the destination refused; read
/// when `DATABASE_URL` is set, which brokers without a reader here require).
pub async fn run(command: DlqCommand) -> Result<(), WorkerError> {
    let adapter = read_adapter(&command.target().file)?;
    let source = &adapter.spec.source;
    let broker = source.broker().ok_or(WorkerError::NoSource)?;
    let name = format!("{}:{}", broker.kind(), adapter.adapter_name());
    let kept = match std::env::var("DATABASE_URL") {
        Ok(url) => Some(
            KeptLetters::connect(&url, name, &adapter)
                .await
                .map_err(DlqError::from)?,
        ),
        Err(_) => None,
    };
    let session = Session {
        adapter: &adapter,
        kept,
        command,
    };
    brokers::with_plugin(source, session)
        .await
        .unwrap_or(Err(WorkerError::NoSource))
}

/// One `dlq` command over the letters kept in PostgreSQL and those the adapter's broker's
/// plugin reads at the broker, if it has a reader.
struct Session<'a> {
    adapter: &'a QueueAdapter,
    kept: Option<KeptLetters>,
    command: DlqCommand,
}

impl Use for Session<'_> {
    type Output = Result<(), WorkerError>;

    async fn with<P: Plugin>(self, plugin: &P) -> Self::Output {
        plugin.read_letters(self.adapter, self).await
    }
}

impl Letters for Session<'_> {
    async fn read<R: DeadLetterReader>(self, reader: R) -> Result<(), WorkerError> {
        let letters = WithKept {
            broker: Some(reader),
            kept: self.kept,
        };
        execute(letters, self.command).await
    }

    async fn unread(self, broker: &'static str) -> Result<(), WorkerError> {
        if self.kept.is_none() {
            return Err(DlqError::Unsupported(broker).into());
        }
        eprintln!(
            "note: `switchboard-worker dlq` does not read the dead letters of {broker} at the broker yet; \
             these are the letters kept in PostgreSQL's dead_letters table"
        );
        let letters = WithKept {
            broker: None::<NoBrokerReader>,
            kept: self.kept,
        };
        execute(letters, self.command).await
    }
}

/// The current time (Unix ms).
fn now_ms() -> u64 {
    crate::health::now_ms()
}

/// A moment `--since` or `--older-than` names, fixed when the command line is read: every letter
/// of one command is compared with the same moment. (An age measured as each letter is read
/// would let letters cross the line during a long walk, and a purge delete more than it
/// counted and confirmed.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moment {
    unix_ms: u64,
}

impl Moment {
    /// Whether `letter` was dead-lettered before this moment (`false` when its time is unknown).
    fn letter_is_older(self, letter: &StoredLetter) -> bool {
        letter
            .dead_lettered_at_ms
            .is_some_and(|at| at < self.unix_ms)
    }

    /// Whether `letter` was dead-lettered at this moment or later (`false` when unknown).
    fn letter_is_newer(self, letter: &StoredLetter) -> bool {
        letter
            .dead_lettered_at_ms
            .is_some_and(|at| at >= self.unix_ms)
    }
}

/// The moment a duration (`14d`) before now.
fn ago(text: &str) -> Result<Moment, humantime::DurationError> {
    let duration = humantime::parse_duration(text)?;
    let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    Ok(Moment {
        unix_ms: now_ms().saturating_sub(millis),
    })
}

/// How long ago `letter` was dead-lettered, where known.
fn age(letter: &StoredLetter) -> Option<Duration> {
    letter
        .dead_lettered_at_ms
        .map(|at| Duration::from_millis(now_ms().saturating_sub(at)))
}

async fn execute<R: DeadLetterReader>(
    mut reader: R,
    command: DlqCommand,
) -> Result<(), WorkerError> {
    let result = match command {
        DlqCommand::List {
            reason,
            since,
            limit,
            output,
            ..
        } => list(&mut reader, reason.as_deref(), since, limit, output).await,
        DlqCommand::Show { id, output, .. } => show(&mut reader, &id, output).await,
        DlqCommand::Redrive {
            ids,
            all,
            reason,
            rate,
            dry_run,
            ..
        } => {
            let selection = match (all, reason, ids.is_empty()) {
                (true, _, _) => Selection::All,
                (false, Some(reason), _) => Selection::Reason(reason),
                (false, None, false) => Selection::Ids(ids),
                (false, None, true) => {
                    return Err(DlqError::Usage(
                        "say what to redrive: letter ids, --reason R or --all".to_owned(),
                    )
                    .into());
                }
            };
            redrive::redrive(&mut reader, selection, rate, dry_run).await
        }
        DlqCommand::Purge {
            ids,
            reason,
            older_than,
            dry_run,
            yes,
            ..
        } => {
            let selection = match (reason, ids.is_empty()) {
                (Some(reason), _) => Selection::Reason(reason),
                (None, false) => Selection::Ids(ids),
                (None, true) => Selection::All,
            };
            let purge = purge::Purge {
                selection,
                older_than,
                dry_run,
                yes,
            };
            purge.run(&mut reader).await
        }
    };
    result.map_err(WorkerError::from)
}

fn stdout_line(line: &str) -> Result<(), DlqError> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").map_err(DlqError::Output)
}

/// Letters per page the commands read: what they hold at a time, whatever the destination's
/// size.
const PAGE: usize = 100;

/// Walks the letters of `reader`, oldest first, a page of `size` at a time: each page's
/// letters `takes` selects go to `act` (which hands back what it does not use, and says
/// whether to go on), the rest straight back to the reader.
async fn walk<R: DeadLetterReader>(
    reader: &mut R,
    size: usize,
    takes: impl Fn(&StoredLetter) -> bool,
    mut act: impl AsyncFnMut(&mut R, Vec<StoredLetter>) -> Result<bool, DlqError>,
) -> Result<(), DlqError> {
    let mut after = None;
    loop {
        let Page { letters, next } = reader.page(after.as_ref(), size).await?;
        let (chosen, rest): (Vec<StoredLetter>, Vec<StoredLetter>) =
            letters.into_iter().partition(|letter| takes(letter));
        reader.release(&rest).await?;
        if !act(reader, chosen).await? {
            return Ok(());
        }
        match next {
            Some(cursor) => after = Some(cursor),
            None => return Ok(()),
        }
    }
}

/// The letters `ids`, each looked up by its id; fails naming the first missing one (after
/// handing back those found).
async fn letters_by_id<R: DeadLetterReader>(
    reader: &mut R,
    ids: &[String],
) -> Result<Vec<StoredLetter>, DlqError> {
    let mut found: Vec<StoredLetter> = Vec::with_capacity(ids.len());
    for id in ids {
        if found.iter().any(|letter| &letter.id == id) {
            continue;
        }
        match reader.letter(id).await? {
            Some(letter) => found.push(letter),
            None => {
                reader.release(&found).await?;
                return Err(DlqError::NotFound(id.clone(), reader.destination()));
            }
        }
    }
    Ok(found)
}

/// `dlq list`: reads pages until `limit` letters matched and one more shows the listing is
/// cut, printing JSON lines as it goes (a table once, from at most `limit` letters).
async fn list<R: DeadLetterReader>(
    reader: &mut R,
    reason: Option<&str>,
    since: Option<Moment>,
    limit: usize,
    format: ListFormat,
) -> Result<(), DlqError> {
    let total = reader.count().await?;
    let takes = |letter: &StoredLetter| {
        reason.is_none_or(|wanted| letter.reason.as_deref() == Some(wanted))
            && since.is_none_or(|since| since.letter_is_newer(letter))
    };
    let (mut listed, mut truncated) = (0, false);
    let mut rows: Vec<StoredLetter> = Vec::new();
    let size = limit.saturating_add(1).min(PAGE);
    walk(reader, size, takes, async |reader, chosen| {
        let mut done = Vec::new();
        for letter in chosen {
            if listed == limit {
                truncated = true;
                done.push(letter);
                continue;
            }
            listed += 1;
            match format {
                ListFormat::Json => {
                    stdout_line(&output::json(&letter).to_string())?;
                    done.push(letter);
                }
                ListFormat::Table => rows.push(letter),
            }
        }
        reader.release(&done).await?;
        Ok(!truncated)
    })
    .await?;
    match format {
        ListFormat::Json => {
            let summary = serde_json::json!({"summary": {
                "listed": listed,
                "truncated": truncated,
                "total": total,
                "destination": reader.destination(),
            }});
            stdout_line(&summary.to_string())?;
        }
        ListFormat::Table => {
            let printed = stdout_line(&output::table(&rows.iter().collect::<Vec<_>>()));
            reader.release(&rows).await?;
            printed?;
            let cut = if truncated {
                " (more match: raise --limit)"
            } else {
                ""
            };
            let total = total.map_or_else(|| "?".to_owned(), |total| total.to_string());
            eprintln!(
                "{listed} of {total} dead letters in {}{cut}",
                reader.destination()
            );
        }
    }
    Ok(())
}

/// `dlq show`: the letter as the reader looks it up by id (see [`DeadLetterReader::letter`]).
async fn show<R: DeadLetterReader>(
    reader: &mut R,
    id: &str,
    format: ShowFormat,
) -> Result<(), DlqError> {
    let Some(letter) = reader.letter(id).await? else {
        return Err(DlqError::NotFound(id.to_owned(), reader.destination()));
    };
    let mut out = std::io::stdout().lock();
    let printed = match format {
        ShowFormat::Json => writeln!(out, "{}", output::json(&letter)),
        ShowFormat::Raw => out.write_all(&letter.body),
        ShowFormat::Text => out.write_all(&output::text(&letter)),
    }
    .and_then(|()| out.flush())
    .map_err(DlqError::Output);
    reader.release(std::slice::from_ref(&letter)).await?;
    printed
}

/// What `dlq redrive` puts back, or `dlq purge` deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Selection {
    All,
    Reason(String),
    Ids(Vec<String>),
}

impl Selection {
    fn takes(&self, letter: &StoredLetter) -> bool {
        match self {
            Selection::All => true,
            Selection::Reason(reason) => letter.reason.as_deref() == Some(reason.as_str()),
            Selection::Ids(ids) => ids.contains(&letter.id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_with_or_without_per_second() {
        assert_eq!(per_second("10"), Ok(10.0));
        assert_eq!(per_second("2.5/s"), Ok(2.5));
        assert!(per_second("0").is_err());
        assert!(per_second("fast").is_err());
    }

    #[test]
    fn ages_name_one_moment_before_the_command_started_and_letters_are_compared_with_it() {
        let before = now_ms();
        let moment = ago("1h").expect("a duration");
        let hour = 3_600_000;
        assert!((before - hour..=now_ms() - hour).contains(&moment.unix_ms));
        let at = |ms: Option<u64>| StoredLetter {
            id: "1".to_owned(),
            dead_lettered_at_ms: ms,
            reason: None,
            delivery_count: None,
            last_error: None,
            body: Vec::new(),
            headers: Vec::new(),
            attempts: None,
            origin: String::new(),
            original_id: None,
            handle: "1".to_owned(),
        };
        let (older, same, unknown) = (
            at(Some(moment.unix_ms - 1)),
            at(Some(moment.unix_ms)),
            at(None),
        );
        assert!(moment.letter_is_older(&older) && !moment.letter_is_newer(&older));
        assert!(!moment.letter_is_older(&same) && moment.letter_is_newer(&same));
        assert!(!moment.letter_is_older(&unknown) && !moment.letter_is_newer(&unknown));
        assert!(ago("soon").is_err());
    }
}
