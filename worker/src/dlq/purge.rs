//! `dlq purge`: letters deleted by id (each looked up), or by reason and age page by page: a
//! first pass counts them (and lists them under `--dry-run`) when there is something to
//! confirm, a second deletes them.

use std::io::{IsTerminal, Write};

use super::output::short_age;
use super::{
    DeadLetterReader, DlqError, Moment, PAGE, Selection, StoredLetter, letters_by_id, stdout_line,
    walk,
};

/// `dlq purge`: the letters selected and dead-lettered before `older_than`.
pub(super) struct Purge {
    pub selection: Selection,
    pub older_than: Option<Moment>,
    pub dry_run: bool,
    pub yes: bool,
}

/// How many letters a pass found that the purge takes, and how many it leaves.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    taken: usize,
    kept: usize,
}

impl Purge {
    fn old_enough(&self, letter: &StoredLetter) -> bool {
        self.older_than
            .is_none_or(|older_than| older_than.letter_is_older(letter))
    }

    fn takes(&self, letter: &StoredLetter) -> bool {
        self.selection.takes(letter) && self.old_enough(letter)
    }

    pub(super) async fn run<R: DeadLetterReader>(self, reader: &mut R) -> Result<(), DlqError> {
        if let Selection::Ids(ids) = &self.selection {
            let found = letters_by_id(reader, ids).await?;
            let (doomed, young): (Vec<StoredLetter>, Vec<StoredLetter>) = found
                .into_iter()
                .partition(|letter| self.old_enough(letter));
            reader.release(&young).await?;
            return self.by_id(reader, doomed).await;
        }
        if self.dry_run || !self.yes {
            let tally = self.pass(reader, false).await?;
            if tally.taken == 0 {
                return nothing(reader);
            }
            if self.dry_run {
                return stdout_line(&format!(
                    "purge --dry-run: {} dead letters would be deleted from {}, {} kept; nothing deleted",
                    tally.taken,
                    reader.destination(),
                    tally.kept
                ));
            }
            if !confirmed(reader, tally.taken)? {
                return stdout_line("purge: nothing deleted");
            }
        }
        let tally = self.pass(reader, true).await?;
        if tally.taken == 0 {
            return nothing(reader);
        }
        deleted(reader, tally)
    }

    /// One pass over every letter: those the purge takes are deleted (`delete`), else printed
    /// under `--dry-run`, and counted.
    async fn pass<R: DeadLetterReader>(
        &self,
        reader: &mut R,
        delete: bool,
    ) -> Result<Tally, DlqError> {
        let mut tally = Tally::default();
        walk(
            reader,
            PAGE,
            |_| true,
            async |reader, letters| {
                let (doomed, kept): (Vec<StoredLetter>, Vec<StoredLetter>) =
                    letters.into_iter().partition(|letter| self.takes(letter));
                tally.taken += doomed.len();
                tally.kept += kept.len();
                reader.release(&kept).await?;
                if delete {
                    reader.remove(&doomed).await?;
                } else {
                    if self.dry_run {
                        for letter in &doomed {
                            stdout_line(&would_delete(letter))?;
                        }
                    }
                    reader.release(&doomed).await?;
                }
                Ok(true)
            },
        )
        .await?;
        Ok(tally)
    }

    /// Deletes `doomed`, the letters named by id, once confirmed.
    async fn by_id<R: DeadLetterReader>(
        &self,
        reader: &mut R,
        doomed: Vec<StoredLetter>,
    ) -> Result<(), DlqError> {
        if doomed.is_empty() {
            return nothing(reader);
        }
        if self.dry_run {
            for letter in &doomed {
                stdout_line(&would_delete(letter))?;
            }
            reader.release(&doomed).await?;
            return stdout_line(&format!(
                "purge --dry-run: {} dead letters would be deleted from {}; nothing deleted",
                doomed.len(),
                reader.destination(),
            ));
        }
        if !self.yes {
            let asked = confirmed(reader, doomed.len());
            if !matches!(asked, Ok(true)) {
                reader.release(&doomed).await?;
                return asked.and_then(|_| stdout_line("purge: nothing deleted"));
            }
        }
        reader.remove(&doomed).await?;
        let tally = Tally {
            taken: doomed.len(),
            kept: 0,
        };
        deleted(reader, tally)
    }
}

fn would_delete(letter: &StoredLetter) -> String {
    format!(
        "would delete {} ({}, dead-lettered {} ago)",
        letter.id,
        letter.reason.as_deref().unwrap_or("unknown reason"),
        short_age(letter)
    )
}

fn nothing<R: DeadLetterReader>(reader: &R) -> Result<(), DlqError> {
    stdout_line(&format!(
        "purge: nothing to delete in {}",
        reader.destination()
    ))
}

fn deleted<R: DeadLetterReader>(reader: &R, tally: Tally) -> Result<(), DlqError> {
    stdout_line(&format!(
        "purge: {} dead letters deleted from {}, {} kept",
        tally.taken,
        reader.destination(),
        tally.kept
    ))
}

/// Whether deleting `count` letters is confirmed: asked on a terminal; an error without one
/// (pass `--yes`).
fn confirmed<R: DeadLetterReader>(reader: &R, count: usize) -> Result<bool, DlqError> {
    if !std::io::stdin().is_terminal() {
        return Err(DlqError::NotConfirmed { count });
    }
    confirm(&format!(
        "Delete {count} dead letters from {} for good? [y/N] ",
        reader.destination()
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
