//! `dlq redrive`: letters put back on the source one at a time (each copied, confirmed, then
//! removed), at `--rate` if given, with progress an operator can watch and a stop on SIGTERM or
//! SIGINT between two letters that says what moved.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use super::{DeadLetterReader, DlqError, Selection, StoredLetter, stdout_line};

/// How often progress is printed as a plain line when standard error is not a terminal
/// (`kubectl exec` without `-t`, CI).
const PLAIN_EVERY: Duration = Duration::from_secs(5);
/// How often the bar is redrawn on a terminal.
const BAR_EVERY: Duration = Duration::from_millis(100);

/// Progress on standard error: a bar with the rate and time left, redrawn in place on a
/// terminal; a plain line every [`PLAIN_EVERY`] otherwise.
struct Progress {
    total: usize,
    terminal: bool,
    started: Instant,
    printed: Instant,
}

impl Progress {
    fn new(total: usize) -> Self {
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
        let left = if rate > 0.0 {
            let seconds = (self.total - done) as f64 / rate;
            humantime::format_duration(Duration::from_secs(seconds.ceil() as u64)).to_string()
        } else {
            "?".to_owned()
        };
        format!("{done}/{} ({rate:.1}/s, {left} left)", self.total)
    }

    fn update(&mut self, done: usize) {
        let every = if self.terminal {
            BAR_EVERY
        } else {
            PLAIN_EVERY
        };
        if self.printed.elapsed() < every && done < self.total {
            return;
        }
        self.printed = Instant::now();
        if self.terminal {
            let width = 30;
            let filled = done * width / self.total.max(1);
            eprint!(
                "\r[{}{}] {}",
                "#".repeat(filled),
                " ".repeat(width - filled),
                self.line(done, self.started.elapsed())
            );
        } else if done < self.total {
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

/// Redrives the letters `selection` takes; the rest are handed back untouched.
pub(super) async fn redrive<R: DeadLetterReader>(
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
    if dry_run {
        return preview(reader, &chosen).await;
    }
    for caveat in reader.caveats() {
        eprintln!("note: {caveat}");
    }
    let stop = Stop::install()?;
    let interval = rate.map(|rate| Duration::from_secs_f64(1.0 / rate));
    let mut progress = Progress::new(chosen.len());
    let started = Instant::now();
    let (mut done, mut failed) = (0, 0);
    for (index, letter) in chosen.iter().enumerate() {
        if let Some(interval) = interval {
            let next = started + interval.mul_f64(index as f64);
            tokio::select! {
                () = stop.token.cancelled() => {}
                () = tokio::time::sleep_until(next.into()) => {}
            }
        }
        if stop.received().is_some() {
            break;
        }
        done += 1;
        if let Err(err) = reader.redrive(letter).await {
            failed += 1;
            eprintln!(
                "\ncannot redrive {}: {}",
                letter.id,
                switchboard_telemetry::ErrorChain(&err)
            );
            if err.is_fatal() {
                progress.finish();
                reader.release(&chosen[index + 1..]).await?;
                return Err(err.into());
            }
        }
        progress.update(done);
    }
    progress.finish();
    reader.release(&chosen[done..]).await?;
    let summary = Summary {
        redriven: done - failed,
        left: chosen.len() - done,
        failed,
        seconds: started.elapsed().as_secs_f64(),
    };
    summary.print(reader, stop.received())
}

/// What a redrive did.
struct Summary {
    redriven: usize,
    left: usize,
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
        stdout_line(&format!(
            "{verb}: {redriven} redriven from {} to {}, {left} left, {failed} failed, in {seconds:.1}s",
            reader.destination(),
            reader.source()
        ))?;
        if let Some(signal) = signal {
            return Err(DlqError::Stopped { signal });
        }
        if failed > 0 {
            return Err(DlqError::Incomplete {
                failed,
                selected: redriven + left + failed,
            });
        }
        Ok(())
    }
}

/// `--dry-run`: what would be redriven, and nothing moved.
async fn preview<R: DeadLetterReader>(
    reader: &mut R,
    chosen: &[StoredLetter],
) -> Result<(), DlqError> {
    let source = reader.source();
    for letter in chosen {
        stdout_line(&format!(
            "would redrive {} ({}) to {source}",
            letter.id,
            letter.reason.as_deref().unwrap_or("unknown reason")
        ))?;
    }
    reader.release(chosen).await?;
    stdout_line(&format!(
        "dry run: {} dead letters would be redriven from {} to {source}",
        chosen.len(),
        reader.destination()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_says_the_rate_and_the_time_left() {
        let progress = Progress::new(100);
        let ten = Duration::from_secs(10);
        assert_eq!(progress.line(50, ten), "50/100 (5.0/s, 10s left)");
        assert_eq!(progress.line(0, ten), "0/100 (0.0/s, ? left)");
    }
}
