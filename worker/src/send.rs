//! `switchboard-worker send --file MANIFEST [--attr k=v] < body`: one message into the adapter's
//! source (the gateway seed's `send_chunk`), for tests, demos and redrive. Gateway and SQS
//! sources: every message carries a fresh `chunk_id` attribute besides the `--attr` ones.

use std::path::PathBuf;

use switchboard_api::Source;

use crate::WorkerError;
use crate::transport::gateway;
use crate::transport::sqs::Sqs;

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
    let mut attributes = vec![("chunk_id".to_owned(), chunk_id())];
    attributes.extend(options.attributes);
    match &adapter.spec.source {
        Source {
            gateway: Some(spec),
            ..
        } => Ok(gateway::send_message(spec, &adapter.adapter_name(), &body, &attributes).await?),
        Source { sqs: Some(_), .. } => Ok(Sqs::for_command(&adapter, "switchboard-worker-send")
            .await?
            .send(&body, &attributes)
            .await?),
        _ => Err(WorkerError::SendUnsupported),
    }
}
