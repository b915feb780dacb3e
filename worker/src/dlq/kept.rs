//! Dead letters kept in PostgreSQL's `dead_letters` table (the broker's dead-letter destination
//! refused them for good), listed, shown, redriven and purged with the broker's own, for every
//! broker.
//!
//! A kept letter is redriven store-then-ack like the broker's: its body and headers are sent to
//! the source by the broker's plugin ([`Plugin::resend`](crate::brokers::Plugin::resend)) with
//! the idempotency key of its original in
//! [`IDEMPOTENCY_KEY_HEADER`](crate::transport::IDEMPOTENCY_KEY_HEADER), and its row is deleted
//! only once the broker confirmed the copy. A redrive killed in between leaves the row: run
//! again, it sends a second copy with the same key, which the worker stores as the same todo.

use switchboard_api::QueueAdapter;
use switchboard_store::{KeptLetterRow, Store, StoreError};

use crate::WorkerError;
use crate::brokers::{self, Plugin, Use};
use crate::transport::TransportError;
use crate::transport::reader::{Cursor, DeadLetterReader, Page, StoredLetter, headers_from_json};

/// What a kept letter's handle starts with (broker handles never do): `postgresql:{id}:{key}`.
const KEPT: &str = "postgresql:";
/// What a kept letter's id starts with.
const KEPT_ID: &str = "db-";
/// What the cursors of [`WithKept`] start with: in the broker's letters, in the kept ones.
const BROKER_CURSOR: &str = "broker:";
const KEPT_CURSOR: &str = "kept:";

/// A broker's dead-letter reader (if `switchboard-worker dlq` has one for it) with the letters
/// PostgreSQL keeps for the same adapter (if `DATABASE_URL` is set).
pub struct WithKept<R> {
    pub broker: Option<R>,
    pub kept: Option<KeptLetters>,
}

/// The `dead_letters` rows of one source (`{kind}:{adapter}`), and its adapter, whose source
/// they are redriven to.
pub struct KeptLetters {
    store: Store,
    source: String,
    adapter: QueueAdapter,
}

impl KeptLetters {
    pub async fn connect(
        url: &str,
        source: String,
        adapter: &QueueAdapter,
    ) -> Result<Self, TransportError> {
        let store = Store::connect(url, 1, "switchboard-dlq")
            .await
            .map_err(database)?;
        Ok(Self {
            store,
            source,
            adapter: adapter.clone(),
        })
    }

    /// Sends `letter` to the source, waits for the broker's confirmation, then deletes its row.
    async fn redrive(&self, letter: &StoredLetter) -> Result<(), TransportError> {
        let (id, key) = kept_parts(letter)?;
        let resend = Resend {
            adapter: &self.adapter,
            letter,
            key,
        };
        brokers::with_plugin(&self.adapter.spec.source, resend)
            .await
            .unwrap_or(Err(WorkerError::NoSource))
            .map_err(sending)?;
        self.store
            .delete_kept_dead_letters(&self.source, &[id])
            .await
            .map_err(database)?;
        Ok(())
    }
}

/// A kept letter to put back on the source by its broker's plugin.
struct Resend<'a> {
    adapter: &'a QueueAdapter,
    letter: &'a StoredLetter,
    key: &'a str,
}

impl Use for Resend<'_> {
    type Output = Result<(), WorkerError>;

    async fn with<P: Plugin>(self, plugin: &P) -> Self::Output {
        plugin.resend(self.adapter, self.letter, self.key).await
    }
}

/// A failed send as the redrive reports it.
fn sending(err: WorkerError) -> TransportError {
    match err {
        WorkerError::Transport(err) => err,
        WorkerError::MissingEnv(name) => {
            TransportError::fatal(name, "is not set: the letter cannot be sent back", None)
        }
        other => TransportError::fatal("spec.source", other.to_string(), None),
    }
}

/// The row id and the idempotency key in a kept letter's handle.
fn kept_parts(letter: &StoredLetter) -> Result<(i64, &str), TransportError> {
    letter
        .handle
        .strip_prefix(KEPT)
        .and_then(|rest| rest.split_once(':'))
        .and_then(|(id, key)| Some((id.parse().ok()?, key)))
        .ok_or_else(|| TransportError::protocol(format!("{} is not a kept letter", letter.id)))
}

fn database(err: StoreError) -> TransportError {
    TransportError::database("cannot read PostgreSQL's dead_letters table", err)
}

fn letter(row: KeptLetterRow) -> StoredLetter {
    StoredLetter {
        id: format!("{KEPT_ID}{}", row.id),
        dead_lettered_at_ms: Some(row.dead_lettered_at_ms),
        reason: Some(row.reason),
        delivery_count: Some(row.delivery_count),
        last_error: Some(row.error),
        body: row.body,
        headers: headers_from_json(&row.headers),
        attempts: serde_json::from_str(&row.attempts).ok(),
        origin: format!(
            "kept in PostgreSQL's dead_letters table (the broker refused it: {})",
            row.refused_because
        ),
        original_id: Some(row.external_id),
        handle: format!("{KEPT}{}:{}", row.id, row.idempotency_key),
    }
}

fn is_kept(letter: &StoredLetter) -> bool {
    letter.handle.starts_with(KEPT)
}

impl<R: DeadLetterReader> DeadLetterReader for WithKept<R> {
    fn destination(&self) -> String {
        let broker = self.broker.as_ref().map(R::destination);
        let kept = self
            .kept
            .as_ref()
            .map(|_| "PostgreSQL's dead_letters table".to_owned());
        let both: Vec<String> = broker.into_iter().chain(kept).collect();
        both.join(" and ")
    }

    fn source(&self) -> String {
        self.broker
            .as_ref()
            .map_or_else(|| "the source".to_owned(), R::source)
    }

    fn caveats(&self) -> Vec<String> {
        self.broker.as_ref().map(R::caveats).unwrap_or_default()
    }

    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        let broker = match &mut self.broker {
            Some(broker) => broker.count().await?,
            None => Some(0),
        };
        let kept = match &self.kept {
            Some(kept) => kept
                .store
                .kept_dead_letter_count(&kept.source)
                .await
                .map_err(database)?,
            None => 0,
        };
        Ok(broker.map(|broker| broker + kept))
    }

    /// The broker's letters first, then the kept ones (keyset on their id): a cursor says
    /// which (`broker:…`, `kept:ID`).
    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError> {
        let kept_after = match (after.map(|cursor| cursor.0.as_str()), &mut self.broker) {
            (Some(cursor), _) if cursor.starts_with(KEPT_CURSOR) => {
                cursor[KEPT_CURSOR.len()..].parse::<i64>().unwrap_or(0)
            }
            (cursor, Some(broker)) => {
                let inner = cursor
                    .and_then(|cursor| cursor.strip_prefix(BROKER_CURSOR))
                    .map(|inner| Cursor(inner.to_owned()));
                let Page { letters, next } = broker.page(inner.as_ref(), limit).await?;
                let next = match next {
                    Some(next) => Some(Cursor(format!("{BROKER_CURSOR}{}", next.0))),
                    None => self
                        .kept
                        .as_ref()
                        .map(|_| Cursor(format!("{KEPT_CURSOR}0"))),
                };
                return Ok(Page { letters, next });
            }
            (_, None) => 0,
        };
        let Some(kept) = &self.kept else {
            return Ok(Page::default());
        };
        let rows = kept
            .store
            .kept_dead_letters(&kept.source, kept_after, limit)
            .await
            .map_err(database)?;
        let next = (rows.len() >= limit)
            .then(|| {
                rows.last()
                    .map(|row| Cursor(format!("{KEPT_CURSOR}{}", row.id)))
            })
            .flatten();
        Ok(Page {
            letters: rows.into_iter().map(letter).collect(),
            next,
        })
    }

    /// A kept letter (`db-ID`) by one query; a broker letter as its reader finds it.
    async fn letter(&mut self, id: &str) -> Result<Option<StoredLetter>, TransportError> {
        if let Some(number) = id.strip_prefix(KEPT_ID).and_then(|n| n.parse::<i64>().ok()) {
            let Some(kept) = &self.kept else {
                return Ok(None);
            };
            let rows = kept
                .store
                .kept_dead_letters(&kept.source, number - 1, 1)
                .await
                .map_err(database)?;
            return Ok(rows.into_iter().find(|row| row.id == number).map(letter));
        }
        match &mut self.broker {
            Some(broker) => broker.letter(id).await,
            None => Ok(None),
        }
    }

    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        match (&mut self.broker, &self.kept) {
            (_, Some(kept)) if is_kept(letter) => kept.redrive(letter).await,
            (Some(broker), _) => broker.redrive(letter).await,
            (None, _) => Err(TransportError::protocol(format!(
                "{} is not a letter this command read",
                letter.id
            ))),
        }
    }

    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        let (kept, theirs): (Vec<StoredLetter>, Vec<StoredLetter>) =
            letters.iter().cloned().partition(is_kept);
        if let Some(broker) = &mut self.broker
            && !theirs.is_empty()
        {
            broker.remove(&theirs).await?;
        }
        if let Some(store) = &self.kept
            && !kept.is_empty()
        {
            let ids: Vec<i64> = kept
                .iter()
                .filter_map(|letter| kept_parts(letter).ok().map(|(id, _)| id))
                .collect();
            store
                .store
                .delete_kept_dead_letters(&store.source, &ids)
                .await
                .map_err(database)?;
        }
        Ok(())
    }

    async fn release(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        let theirs: Vec<StoredLetter> = letters.iter().filter(|l| !is_kept(l)).cloned().collect();
        match &mut self.broker {
            Some(broker) if !theirs.is_empty() => broker.release(&theirs).await,
            _ => Ok(()),
        }
    }
}

/// The broker reader of a broker `switchboard-worker dlq` cannot read yet: none.
pub enum NoBrokerReader {}

impl DeadLetterReader for NoBrokerReader {
    fn destination(&self) -> String {
        match *self {}
    }
    fn source(&self) -> String {
        match *self {}
    }
    fn caveats(&self) -> Vec<String> {
        match *self {}
    }
    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        match *self {}
    }
    async fn page(&mut self, _: Option<&Cursor>, _: usize) -> Result<Page, TransportError> {
        match *self {}
    }
    async fn redrive(&mut self, _letter: &StoredLetter) -> Result<(), TransportError> {
        match *self {}
    }
    async fn remove(&mut self, _letters: &[StoredLetter]) -> Result<(), TransportError> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, key: &str) -> KeptLetterRow {
        KeptLetterRow {
            id,
            idempotency_key: key.to_owned(),
            external_id: "1-0".to_owned(),
            body: b"{".to_vec(),
            headers: "{}".to_owned(),
            reason: "invalid_json".to_owned(),
            error: "not JSON".to_owned(),
            delivery_count: 1,
            attempts: "{}".to_owned(),
            refused_because: "WRONGTYPE".to_owned(),
            dead_lettered_at_ms: 0,
        }
    }

    #[test]
    fn a_kept_letter_carries_its_row_and_its_original_key_whole() {
        let kept = letter(row(42, "nats:shop/orders:ORDERS:1:7"));
        assert!(is_kept(&kept));
        assert_eq!(kept.id, "db-42");
        let (id, key) = kept_parts(&kept).expect("a kept letter");
        assert_eq!((id, key), (42, "nats:shop/orders:ORDERS:1:7"));
        let broker = StoredLetter {
            handle: "1764-0".to_owned(),
            ..kept
        };
        assert!(!is_kept(&broker) && kept_parts(&broker).is_err());
    }
}
