//! `dlq redrive`: letters put back on the source one at a time (each copied, confirmed, then
//! removed), at `--rate` if given, with progress an operator can watch and a stop on SIGTERM or
//! SIGINT between two letters that says what moved.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use super::{
    DeadLetterReader, DlqError, PAGE, Selection, StoredLetter, letters_by_id, stdout_line, walk,
};

/// How often progress is printed as a plain line when standard error is not a terminal
/// (`kubectl exec` without `-t`, CI): a line is due after this, and printed after the letter in
/// hand, so lines come at least every 5 s.
const PLAIN_EVERY: Duration = Duration::from_secs(4);
/// How often the bar is redrawn on a terminal.
const BAR_EVERY: Duration = Duration::from_millis(100);

/// Progress on standard error: a bar with the rate and time left, redrawn in place on a
/// terminal; a plain line every [`PLAIN_EVERY`] otherwise.
struct Progress {
    /// The letters to redrive, where known.
    total: Option<usize>,
    terminal: bool,
    started: Instant,
    printed: Instant,
}

impl Progress {
    fn new(total: Option<usize>) -> Self {
        let now = Instant::now();
        Self {
            total,
            terminal: std::io::stderr().is_terminal(),
            started: now,
            printed: now,
        }
    }

    /// `done` letters of `total` in `elapsed`, the rate and the time left at that rate.
    fn line(&self, done: usize, elapsed: Duration) -> String {
        let elapsed = elapsed.as_secs_f64();
        let rate = if elapsed > 0.0 {
            done as f64 / elapsed
        } else {
            0.0
        };
        let Some(total) = self.total else {
            return format!("{done} ({rate:.1}/s)");
        };
        let left = if rate > 0.0 {
            let seconds = total.saturating_sub(done) as f64 / rate;
            humantime::format_duration(Duration::from_secs(seconds.ceil() as u64)).to_string()
        } else {
            "?".to_owned()
        };
        format!("{done}/{total} ({rate:.1}/s, {left} left)")
    }

    fn update(&mut self, done: usize) {
        let every = if self.terminal {
            BAR_EVERY
        } else {
            PLAIN_EVERY
        };
        let finished = self.total.is_some_and(|total| done >= total);
        if self.printed.elapsed() < every && !finished {
            return;
        }
        self.printed = Instant::now();
        if self.terminal {
            let width = 30;
            let filled = self
                .total
                .map_or(0, |total| (done * width / total.max(1)).min(width));
            eprint!(
                "\r[{}{}] {}",
                "#".repeat(filled),
                " ".repeat(width - filled),
                self.line(done, self.started.elapsed())
            );
        } else if !finished {
            eprintln!("redrive: {}", self.line(done, self.started.elapsed()));
        }
    }

    fn finish(&self) {
        if self.terminal {
            eprintln!();
        }
    }
}

/// The signal that asked the redrive to stop (0 while none has).
struct Stop {
    token: CancellationToken,
    signal: Arc<AtomicI32>,
}

impl Stop {
    /// Listens for SIGTERM and SIGINT from now on.
    fn install() -> Result<Self, DlqError> {
        let mut terminate = signal(SignalKind::terminate()).map_err(DlqError::Output)?;
        let mut interrupt = signal(SignalKind::interrupt()).map_err(DlqError::Output)?;
        let stop = Self {
            token: CancellationToken::new(),
            signal: Arc::new(AtomicI32::new(0)),
        };
        let (token, received) = (stop.token.clone(), stop.signal.clone());
        tokio::spawn(async move {
            let number = tokio::select! {
                _ = terminate.recv() => libc_signal::TERM,
                _ = interrupt.recv() => libc_signal::INT,
            };
            received.store(number, Ordering::Relaxed);
            token.cancel();
        });
        Ok(stop)
    }

    fn received(&self) -> Option<i32> {
        Some(self.signal.load(Ordering::Relaxed)).filter(|&number| number != 0)
    }
}

/// Signal numbers (Linux), for the exit code `128 + n` a shell expects.
mod libc_signal {
    pub const INT: i32 = 2;
    pub const TERM: i32 = 15;
}

/// Redrives the letters `selection` takes, page by page (by id: each looked up); the rest
/// are handed back untouched.
pub(super) async fn redrive<R: DeadLetterReader>(
    reader: &mut R,
    selection: Selection,
    rate: Option<f64>,
    dry_run: bool,
) -> Result<(), DlqError> {
    let by_id = match &selection {
        Selection::Ids(ids) => Some(letters_by_id(reader, ids).await?),
        Selection::All | Selection::Reason(_) => None,
    };
    if dry_run {
        return preview(reader, &selection, by_id).await;
    }
    let total = match (&by_id, &selection) {
        (Some(letters), _) => Some(letters.len()),
        (None, Selection::All) => reader
            .count()
            .await?
            .map(|count| usize::try_from(count).unwrap_or(usize::MAX)),
        (None, _) => None,
    };
    for caveat in reader.caveats() {
        eprintln!("note: {caveat}");
    }
    // Letters dead-lettered after this are not this pass's: a worker still failing them would
    // otherwise have the pass chase its own copies for ever.
    let started_ms = super::now_ms();
    let newer = std::cell::Cell::new(0_usize);
    let takes = |letter: &StoredLetter| {
        let before = letter.dead_lettered_at_ms.is_none_or(|at| at <= started_ms);
        if !before && selection.takes(letter) {
            newer.set(newer.get() + 1);
        }
        before && selection.takes(letter)
    };
    let mut mover = Mover {
        stop: Stop::install()?,
        interval: rate.map(|rate| Duration::from_secs_f64(1.0 / rate)),
        progress: Progress::new(total),
        started: Instant::now(),
        done: 0,
        failed: 0,
    };
    match by_id {
        Some(letters) => {
            mover.redrive(reader, letters).await?;
        }
        None => {
            walk(reader, SQS_SIZED_PAGE, takes, async |reader, letters| {
                mover.redrive(reader, letters).await
            })
            .await?;
        }
    }
    mover.progress.finish();
    let signal = mover.stop.received();
    let left = match signal {
        None => Some(0),
        Some(_) => total.map(|total| total.saturating_sub(mover.done)),
    };
    let summary = Summary {
        redriven: mover.done - mover.failed,
        left,
        failed: mover.failed,
        newer: newer.get(),
        seconds: mover.started.elapsed().as_secs_f64(),
    };
    summary.print(reader, signal)
}

/// Letters per page a redrive reads ahead: few, so that none waits long in hand (SQS hides a
/// letter it hands out for 20 s only).
const SQS_SIZED_PAGE: usize = 10;

/// A redrive in progress: paced, watched, stoppable between two letters.
struct Mover {
    stop: Stop,
    interval: Option<Duration>,
    progress: Progress,
    started: Instant,
    /// Letters tried (redriven or failed).
    done: usize,
    failed: usize,
}

impl Mover {
    /// Redrives `letters` one at a time; returns whether to go on (no signal came). What it
    /// does not get to is handed back.
    async fn redrive<R: DeadLetterReader>(
        &mut self,
        reader: &mut R,
        letters: Vec<StoredLetter>,
    ) -> Result<bool, DlqError> {
        for (index, letter) in letters.iter().enumerate() {
            if let Some(interval) = self.interval {
                let next = self.started + interval.mul_f64(self.done as f64);
                tokio::select! {
                    () = self.stop.token.cancelled() => {}
                    () = tokio::time::sleep_until(next.into()) => {}
                }
            }
            if self.stop.received().is_some() {
                reader.release(&letters[index..]).await?;
                return Ok(false);
            }
            self.done += 1;
            if let Err(err) = reader.redrive(letter).await {
                self.failed += 1;
                eprintln!(
                    "\ncannot redrive {}: {}",
                    letter.id,
                    switchboard_telemetry::ErrorChain(&err)
                );
                if err.is_fatal() {
                    self.progress.finish();
                    reader.release(&letters[index + 1..]).await?;
                    return Err(err.into());
                }
            }
            self.progress.update(self.done);
        }
        Ok(true)
    }
}

/// What a redrive did.
struct Summary {
    redriven: usize,
    /// Letters of the selection not tried, where known.
    left: Option<usize>,
    failed: usize,
    /// Letters of the selection dead-lettered after the redrive started, left for a next run.
    newer: usize,
    seconds: f64,
}

impl Summary {
    fn print<R: DeadLetterReader>(&self, reader: &R, signal: Option<i32>) -> Result<(), DlqError> {
        let Summary {
            redriven,
            left,
            failed,
            newer,
            seconds,
        } = *self;
        let verb = match signal {
            Some(libc_signal::TERM) => "redrive stopped by SIGTERM",
            Some(_) => "redrive stopped by SIGINT",
            None => "redrive",
        };
        let left = left.map_or_else(|| "the rest".to_owned(), |left| left.to_string());
        let since = if newer > 0 {
            format!(", {newer} dead-lettered since it started (left for the next run)")
        } else {
            String::new()
        };
        stdout_line(&format!(
            "{verb}: {redriven} redriven from {} to {}, {left} left, {failed} failed{since}, in {seconds:.1}s",
            reader.destination(),
            reader.source()
        ))?;
        if let Some(signal) = signal {
            return Err(DlqError::Stopped { signal });
        }
        if failed > 0 {
            return Err(DlqError::Incomplete { failed });
        }
        Ok(())
    }
}

/// `--dry-run`: what would be redriven, and nothing moved.
async fn preview<R: DeadLetterReader>(
    reader: &mut R,
    selection: &Selection,
    by_id: Option<Vec<StoredLetter>>,
) -> Result<(), DlqError> {
    let source = reader.source();
    let mut count = 0;
    let mut say = async |reader: &mut R, letters: Vec<StoredLetter>| {
        for letter in &letters {
            stdout_line(&format!(
                "would redrive {} ({}) to {source}",
                letter.id,
                letter.reason.as_deref().unwrap_or("unknown reason")
            ))?;
        }
        count += letters.len();
        reader.release(&letters).await?;
        Ok(true)
    };
    match by_id {
        Some(letters) => {
            say(reader, letters).await?;
        }
        None => walk(reader, PAGE, |letter| selection.takes(letter), say).await?,
    }
    stdout_line(&format!(
        "dry run: {count} dead letters would be redriven from {} to {source}",
        reader.destination()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::TransportError;
    use crate::transport::reader::{Cursor, Page};

    /// A dead-letter queue whose every redriven letter a failing worker dead-letters again at
    /// once, as a new letter (ids are numbers, oldest first).
    struct Refailing {
        letters: Vec<StoredLetter>,
        next_id: u64,
        redriven: usize,
    }

    impl Refailing {
        fn letter(id: u64, at: u64) -> StoredLetter {
            StoredLetter {
                id: id.to_string(),
                dead_lettered_at_ms: Some(at),
                reason: Some("poison".to_owned()),
                delivery_count: None,
                last_error: None,
                body: b"{".to_vec(),
                headers: Vec::new(),
                attempts: None,
                origin: String::new(),
                original_id: None,
                handle: id.to_string(),
            }
        }
    }

    impl DeadLetterReader for Refailing {
        fn destination(&self) -> String {
            "dlq".to_owned()
        }
        fn source(&self) -> String {
            "source".to_owned()
        }
        fn caveats(&self) -> Vec<String> {
            Vec::new()
        }
        async fn count(&mut self) -> Result<Option<u64>, TransportError> {
            Ok(Some(self.letters.len() as u64))
        }
        async fn page(
            &mut self,
            after: Option<&Cursor>,
            limit: usize,
        ) -> Result<Page, TransportError> {
            let after: u64 = after.map_or(0, |cursor| cursor.0.parse().unwrap_or(0));
            let letters: Vec<StoredLetter> = self
                .letters
                .iter()
                .filter(|letter| letter.id.parse::<u64>().is_ok_and(|id| id > after))
                .take(limit)
                .cloned()
                .collect();
            let next = letters.last().map(|letter| Cursor(letter.id.clone()));
            Ok(Page { letters, next })
        }
        async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
            self.letters.retain(|kept| kept.id != letter.id);
            self.redriven += 1;
            self.next_id += 1;
            let again = Self::letter(self.next_id, crate::health::now_ms() + 1);
            self.letters.push(again);
            Ok(())
        }
        async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
            self.letters.retain(|kept| !letters.contains(kept));
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_pass_leaves_the_letters_dead_lettered_after_it_started() {
        let at = crate::health::now_ms() - 1_000;
        let mut reader = Refailing {
            letters: (1..=3).map(|id| Refailing::letter(id, at)).collect(),
            next_id: 3,
            redriven: 0,
        };
        redrive(&mut reader, Selection::All, None, false)
            .await
            .expect("the pass ends");
        assert_eq!(reader.redriven, 3, "each letter of the pass once");
        let left: Vec<&str> = reader.letters.iter().map(|l| l.id.as_str()).collect();
        assert_eq!(
            left,
            ["4", "5", "6"],
            "the copies dead-lettered again are left"
        );
    }

    #[test]
    fn progress_says_the_rate_and_the_time_left() {
        let progress = Progress::new(Some(100));
        let ten = Duration::from_secs(10);
        assert_eq!(progress.line(50, ten), "50/100 (5.0/s, 10s left)");
        assert_eq!(progress.line(0, ten), "0/100 (0.0/s, ? left)");
        let unknown = Progress::new(None);
        assert_eq!(unknown.line(50, ten), "50 (5.0/s)");
    }
}
