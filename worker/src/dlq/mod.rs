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

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use switchboard_api::QueueAdapter;

use self::kept::{KeptLetters, NoBrokerReader, WithKept};
use crate::brokers::{self, Letters, Plugin, Use};
use crate::payload::PoisonReason;
use crate::transport::TransportError;
pub use crate::transport::reader::{DeadLetterReader, StoredLetter};
use crate::{WorkerError, read_adapter};

/// Why a `dlq` command failed.
#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("no dead letter with id {0} in {1}")]
    NotFound(String, String),
    #[error(
        "`switchboard-worker dlq` does not read the dead letters of {0} at the broker yet (Redis streams and lists, and SQS, it does); set DATABASE_URL to read those kept in PostgreSQL"
    )]
    Unsupported(&'static str),
    #[error(
        "refusing to purge {count} dead letters without confirmation: pass --yes (standard input is not a terminal to ask on)"
    )]
    NotConfirmed { count: usize },
    #[error("{0}")]
    Usage(String),
    #[error(
        "{failed} of {selected} dead letters could not be redriven (see above); run the command again"
    )]
    Incomplete { failed: usize, selected: usize },
    #[error("cannot write the output")]
    Output(#[source] std::io::Error),
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
    /// One JSON object per line, the body as `body` (UTF-8) or `body_base64`.
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
    List {
        #[command(flatten)]
        target: Target,
        /// Only letters dead-lettered for this reason.
        #[arg(long, value_parser = poison_reason())]
        reason: Option<String>,
        /// Only letters dead-lettered within this long (`1h`, `2d`).
        #[arg(long, value_parser = humantime::parse_duration)]
        since: Option<Duration>,
        /// At most this many letters.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        #[arg(short = 'o', long, value_enum, default_value = "table")]
        output: ListFormat,
    },
    /// Show one dead letter: its context, headers, every attempt and the body.
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
    /// Delete dead letters (all, or those older than --older-than); asks first on a terminal.
    Purge {
        #[command(flatten)]
        target: Target,
        /// Only letters dead-lettered longer ago than this (`14d`).
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<Duration>,
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
            KeptLetters::connect(&url, name)
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
            redrive(&mut reader, selection, rate, dry_run).await
        }
        DlqCommand::Purge {
            older_than, yes, ..
        } => purge(&mut reader, older_than, yes).await,
    };
    result.map_err(WorkerError::from)
}

fn stdout_line(line: &str) -> Result<(), DlqError> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").map_err(DlqError::Output)
}

async fn list<R: DeadLetterReader>(
    reader: &mut R,
    reason: Option<&str>,
    since: Option<Duration>,
    limit: usize,
    format: ListFormat,
) -> Result<(), DlqError> {
    let letters = reader.letters(usize::MAX).await?;
    let result = async {
        let shown: Vec<&StoredLetter> = letters
            .iter()
            .filter(|letter| reason.is_none_or(|wanted| letter.reason.as_deref() == Some(wanted)))
            .filter(|letter| since.is_none_or(|since| age(letter).is_some_and(|age| age <= since)))
            .take(limit)
            .collect();
        match format {
            ListFormat::Json => {
                for letter in &shown {
                    stdout_line(&output::json(letter).to_string())?;
                }
            }
            ListFormat::Table => {
                stdout_line(&output::table(&shown))?;
                eprintln!(
                    "{} of {} dead letters in {}",
                    shown.len(),
                    letters.len(),
                    reader.destination()
                );
            }
        }
        Ok(())
    }
    .await;
    reader.release(&letters).await?;
    result
}

async fn show<R: DeadLetterReader>(
    reader: &mut R,
    id: &str,
    format: ShowFormat,
) -> Result<(), DlqError> {
    let letters = reader.letters(usize::MAX).await?;
    let result = match letters.iter().find(|letter| letter.id == id) {
        None => Err(DlqError::NotFound(id.to_owned(), reader.destination())),
        Some(letter) => {
            let mut out = std::io::stdout().lock();
            match format {
                ShowFormat::Json => writeln!(out, "{}", output::json(letter)),
                ShowFormat::Raw => out.write_all(&letter.body),
                ShowFormat::Text => out.write_all(&output::text(letter)),
            }
            .and_then(|()| out.flush())
            .map_err(DlqError::Output)
        }
    };
    reader.release(&letters).await?;
    result
}

/// What `dlq redrive` puts back.
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

/// A progress line on standard error, redrawn in place, when it is a terminal.
struct Progress {
    total: usize,
    shown: bool,
}

impl Progress {
    fn new(total: usize) -> Self {
        Self {
            total,
            shown: std::io::stderr().is_terminal() && total > 0,
        }
    }

    fn update(&self, done: usize) {
        if self.shown {
            let width = 30;
            let filled = done * width / self.total.max(1);
            eprint!(
                "\r[{}{}] {done}/{}",
                "#".repeat(filled),
                " ".repeat(width - filled),
                self.total
            );
        }
    }

    fn finish(&self) {
        if self.shown {
            eprintln!();
        }
    }
}

async fn redrive<R: DeadLetterReader>(
    reader: &mut R,
    selection: Selection,
    rate: Option<f64>,
    dry_run: bool,
) -> Result<(), DlqError> {
    let letters = reader.letters(usize::MAX).await?;
    let (chosen, rest): (Vec<StoredLetter>, Vec<StoredLetter>) = letters
        .into_iter()
        .partition(|letter| selection.takes(letter));
    reader.release(&rest).await?;
    if let Selection::Ids(ids) = &selection
        && let Some(missing) = ids.iter().find(|id| !chosen.iter().any(|l| &l.id == *id))
    {
        reader.release(&chosen).await?;
        return Err(DlqError::NotFound(missing.clone(), reader.destination()));
    }
    let source = reader.source();
    if dry_run {
        for letter in &chosen {
            stdout_line(&format!(
                "would redrive {} ({}) to {source}",
                letter.id,
                letter.reason.as_deref().unwrap_or("unknown reason")
            ))?;
        }
        reader.release(&chosen).await?;
        stdout_line(&format!(
            "dry run: {} dead letters would be redriven from {} to {source}",
            chosen.len(),
            reader.destination()
        ))?;
        return Ok(());
    }
    for caveat in reader.caveats() {
        eprintln!("note: {caveat}");
    }
    let interval = rate.map(|rate| Duration::from_secs_f64(1.0 / rate));
    let progress = Progress::new(chosen.len());
    let started = Instant::now();
    let mut failed = 0;
    for (index, letter) in chosen.iter().enumerate() {
        if let Some(interval) = interval {
            tokio::time::sleep_until((started + interval.mul_f64(index as f64)).into()).await;
        }
        if let Err(err) = reader.redrive(letter).await {
            failed += 1;
            eprintln!(
                "\ncannot redrive {}: {}",
                letter.id,
                switchboard_telemetry::ErrorChain(&err)
            );
            if err.is_fatal() {
                progress.finish();
                return Err(err.into());
            }
        }
        progress.update(index + 1);
    }
    progress.finish();
    stdout_line(&format!(
        "redrive: {} redriven from {} to {source}, {failed} failed, in {:.1}s",
        chosen.len() - failed,
        reader.destination(),
        started.elapsed().as_secs_f64()
    ))?;
    if failed > 0 {
        return Err(DlqError::Incomplete {
            failed,
            selected: chosen.len(),
        });
    }
    Ok(())
}

async fn purge<R: DeadLetterReader>(
    reader: &mut R,
    older_than: Option<Duration>,
    yes: bool,
) -> Result<(), DlqError> {
    let letters = reader.letters(usize::MAX).await?;
    let (doomed, kept): (Vec<StoredLetter>, Vec<StoredLetter>) =
        letters.into_iter().partition(|letter| {
            older_than.is_none_or(|older_than| age(letter).is_some_and(|age| age > older_than))
        });
    reader.release(&kept).await?;
    if doomed.is_empty() {
        stdout_line(&format!(
            "purge: nothing to delete in {}",
            reader.destination()
        ))?;
        return Ok(());
    }
    if !yes {
        let confirmed = std::io::stdin().is_terminal()
            && confirm(&format!(
                "Delete {} dead letters from {} for good? [y/N] ",
                doomed.len(),
                reader.destination()
            ))?;
        if !confirmed {
            reader.release(&doomed).await?;
            if !std::io::stdin().is_terminal() {
                return Err(DlqError::NotConfirmed {
                    count: doomed.len(),
                });
            }
            stdout_line("purge: nothing deleted")?;
            return Ok(());
        }
    }
    reader.remove(&doomed).await?;
    stdout_line(&format!(
        "purge: {} dead letters deleted from {}, {} kept",
        doomed.len(),
        reader.destination(),
        kept.len()
    ))
}

fn confirm(question: &str) -> Result<bool, DlqError> {
    eprint!("{question}");
    std::io::stderr().flush().map_err(DlqError::Output)?;
    let mut answer = String::new();
    std::io::stdin()
        .read_line(&mut answer)
        .map_err(DlqError::Output)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
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
}
