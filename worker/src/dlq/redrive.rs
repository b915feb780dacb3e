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
/// (`kubectl exec` without `-t`, CI).
const PLAIN_EVERY: Duration = Duration::from_secs(5);
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
            walk(
                reader,
                SQS_SIZED_PAGE,
                |letter| selection.takes(letter),
                async |reader, letters| mover.redrive(reader, letters).await,
            )
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
    seconds: f64,
}

impl Summary {
    fn print<R: DeadLetterReader>(&self, reader: &R, signal: Option<i32>) -> Result<(), DlqError> {
        let Summary {
            redriven,
            left,
            failed,
            seconds,
        } = *self;
        let verb = match signal {
            Some(libc_signal::TERM) => "redrive stopped by SIGTERM",
            Some(_) => "redrive stopped by SIGINT",
            None => "redrive",
        };
        let left = left.map_or_else(|| "the rest".to_owned(), |left| left.to_string());
        stdout_line(&format!(
            "{verb}: {redriven} redriven from {} to {}, {left} left, {failed} failed, in {seconds:.1}s",
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
