//! `switchboard-worker send --file MANIFEST [--attr k=v] < body`: one message into the adapter's
//! source (the gateway seed's `send_chunk`), for tests, demos and redrive, for every broker.
//! Every message carries a fresh `chunk_id` attribute besides the `--attr` ones (as a stream
//! field, an attribute or a header; a Redis list or pub/sub message is its body alone).

use std::path::PathBuf;

use switchboard_api::QueueAdapter;

use crate::WorkerError;
use crate::brokers::{self, Plugin, Use};

/// Options of `switchboard-worker send`.
#[derive(Debug, Clone)]
pub struct SendOptions {
    pub file: PathBuf,
    /// Message attributes (`--attr k=v`).
    pub attributes: Vec<(String, String)>,
}

/// A fresh random UUID (version 4), the seed's `chunk_id`.
fn chunk_id() -> String {
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        fastrand::u32(..),
        fastrand::u16(..),
        fastrand::u16(..0x1000),
        0x8000 | fastrand::u16(..0x4000),
        fastrand::u64(..1 << 48)
    )
}

/// Sends `body` to the source of the adapter in `options.file`; returns the message id.
pub async fn send(options: SendOptions, body: Vec<u8>) -> Result<String, WorkerError> {
    let adapter = super::read_adapter(&options.file)?;
    let attributes: Vec<(String, Vec<u8>)> = std::iter::once(("chunk_id".to_owned(), chunk_id()))
        .chain(options.attributes)
        .map(|(name, value)| (name, value.into_bytes()))
        .collect();
    let message = Message {
        adapter: &adapter,
        body: &body,
        headers: &attributes,
    };
    brokers::with_plugin(&adapter.spec.source, message)
        .await
        .unwrap_or(Err(WorkerError::NoSource))
}

/// One message for the plugin of the adapter's broker to send.
struct Message<'a> {
    adapter: &'a QueueAdapter,
    body: &'a [u8],
    headers: &'a [(String, Vec<u8>)],
}

impl Use for Message<'_> {
    type Output = Result<String, WorkerError>;

    async fn with<P: Plugin>(self, plugin: &P) -> Self::Output {
        plugin.send(self.adapter, self.body, self.headers).await
    }
}
