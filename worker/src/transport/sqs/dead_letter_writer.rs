//! Writing dead letters to the dead-letter queue: `SendMessageBatch` calls within SQS's
//! limits (ten letters, the queue's `MaximumMessageSize` per call), and the letters SQS
//! refuses for good found and handed back (the pipeline keeps them in PostgreSQL).

use super::Sqs;
use super::classify::{self, Addressed, ServiceFault};
use super::dead_letter::{self, Letter, WriteContext};
use super::queues::Queues;
use super::receive::Receipt;
use crate::transport::{DeadLetter, TransportError};

/// What one dead-letter call did.
#[derive(Debug)]
enum Sent {
    /// Written, but for the letters SQS refused for good (indexes into the letters built).
    Written { refused: Vec<(usize, ServiceFault)> },
    /// SQS refused the whole call for what one of its letters carries.
    AllRefused(ServiceFault),
}

/// Letters (by index) SQS refused for good, and why.
type Refused = Vec<(usize, ServiceFault)>;

/// Splits `built` into the letters that fit `max` bytes and those refused as too large: a
/// letter over the queue's limit even without its context can never be written.
fn by_size(built: &[Letter], max: usize) -> (Vec<usize>, Refused) {
    let (fitting, too_large): (Vec<usize>, Vec<usize>) =
        (0..built.len()).partition(|&index| built[index].size() <= max);
    let refused = too_large
        .into_iter()
        .map(|index| {
            let fault = ServiceFault {
                code: "MessageTooLong".to_owned(),
                status: None,
                message: format!(
                    "{} bytes; the dead-letter queue takes at most {max} (MaximumMessageSize)",
                    built[index].size()
                ),
            };
            (index, fault)
        })
        .collect();
    (fitting, refused)
}

/// The error handing `refused` back, if any letter was.
fn refusal(mut refused: Refused) -> Result<(), TransportError> {
    let Some((_, first)) = refused.first() else {
        return Ok(());
    };
    let context = format!(
        "SQS refused {} dead letters for good (the dead-letter queue can never take them as they are; first: {} {})",
        refused.len(),
        first.code,
        first.message
    );
    let mut letters: Vec<usize> = refused.iter().map(|(index, _)| *index).collect();
    letters.sort_unstable();
    let (_, fault) = refused.swap_remove(0);
    Err(TransportError::dead_letters_refused(
        letters,
        context,
        Some(Box::new(fault)),
    ))
}

impl Sqs {
    /// Writes `letters` to the dead-letter queue; those SQS refuses for good are handed back
    /// once every other one is written.
    pub(super) async fn write_letters(
        &self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        let queues = self.queues()?;
        let last_seen = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        let context = WriteContext {
            origin: &queues.url,
            consumer: &self.settings.consumer,
            last_seen: &last_seen,
            fifo: queues.dead_letter_fifo,
            max_message_bytes: queues.dead_letter_max_bytes,
        };
        let built: Vec<Letter> = letters
            .iter()
            .map(|letter| dead_letter::letter(letter, context))
            .collect();
        let max = queues.dead_letter_max_bytes;
        let (fitting, mut refused) = by_size(&built, max);
        let sizes: Vec<usize> = fitting.iter().map(|&index| built[index].size()).collect();
        for range in dead_letter::batches(&sizes, max) {
            let indexes = &fitting[range];
            refused.extend(self.send_finding_refused(queues, &built, indexes).await?);
        }
        refusal(refused)
    }

    /// Sends the letters `indexes` (into `built`) in one call; when SQS refuses the whole call
    /// for one letter, letter by letter to find it. Returns the letters refused for good.
    async fn send_finding_refused(
        &self,
        queues: &Queues,
        built: &[Letter],
        indexes: &[usize],
    ) -> Result<Refused, TransportError> {
        let mut refused = Vec::new();
        match self.send_dead_letters(queues, built, indexes).await? {
            Sent::Written { refused: some } => refused.extend(some),
            Sent::AllRefused(fault) if indexes.len() == 1 => refused.push((indexes[0], fault)),
            // One letter SQS refuses fails the whole call: find it, letter by letter.
            Sent::AllRefused(_) => {
                for &index in indexes {
                    match self.send_dead_letters(queues, built, &[index]).await? {
                        Sent::Written { refused: some } => refused.extend(some),
                        Sent::AllRefused(fault) => refused.push((index, fault)),
                    }
                }
            }
        }
        Ok(refused)
    }

    /// One `SendMessageBatch` of the dead letters `indexes` (into `built`). Entries SQS fails
    /// as the sender's fault (the letter itself: its size, characters, attributes) are
    /// returned as refused; a call SQS refuses as a whole for what it carries is
    /// [`Sent::AllRefused`]. Anything else is an error: the pipeline writes the batch again
    /// (a duplicate dead letter is acceptable, a lost one is not).
    async fn send_dead_letters(
        &self,
        queues: &Queues,
        built: &[Letter],
        indexes: &[usize],
    ) -> Result<Sent, TransportError> {
        let entries = indexes
            .iter()
            .enumerate()
            .map(|(id, &index)| built[index].entry(id))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| {
                TransportError::protocol(format!("cannot build a dead letter: {err}"))
            })?;
        let output = match self
            .client
            .send_message_batch()
            .queue_url(&queues.dead_letter_url)
            .set_entries(Some(entries))
            .send()
            .await
        {
            Ok(output) => output,
            Err(err) => {
                return match classify::refused_message(&err) {
                    Some(fault) => Ok(Sent::AllRefused(fault)),
                    None => Err(self
                        .errors
                        .error("SendMessageBatch", Addressed::DeadLetter, err)),
                };
            }
        };
        let mut refused = Vec::new();
        let mut failed_now = Vec::new();
        for failed in output.failed() {
            let fault = ServiceFault {
                code: failed.code().to_owned(),
                status: None,
                message: classify::redact(failed.message().unwrap_or("")),
            };
            let index = failed
                .id()
                .parse::<usize>()
                .ok()
                .and_then(|id| indexes.get(id));
            match index {
                Some(&index)
                    if failed.sender_fault()
                        || classify::is_refused_message_code(failed.code()) =>
                {
                    refused.push((index, fault));
                }
                _ => failed_now.push(fault),
            }
        }
        if let Some(fault) = failed_now.into_iter().next() {
            return Err(TransportError::transient(
                "SQS SendMessageBatch to the dead-letter queue failed for some of its entries",
                fault,
            ));
        }
        Ok(Sent::Written { refused })
    }
}
