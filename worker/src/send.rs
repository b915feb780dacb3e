//! `switchboard-worker send --file MANIFEST [--attr k=v] < body`: one message into the adapter's
//! source (the gateway seed's `send_chunk`), for tests, demos and redrive. Gateway sources
//! only for now.

use std::path::PathBuf;

use switchboard_api::Source;

use crate::WorkerError;
use crate::transport::gateway;

/// Options of `switchboard-worker send`.
#[derive(Debug, Clone)]
pub struct SendOptions {
    pub file: PathBuf,
    /// Message attributes (`--attr k=v`).
    pub attributes: Vec<(String, String)>,
}

/// Sends `body` to the source of the adapter in `options.file`; returns the message id.
pub async fn send(options: SendOptions, body: Vec<u8>) -> Result<String, WorkerError> {
    let adapter = super::read_adapter(&options.file)?;
    match &adapter.spec.source {
        Source {
            gateway: Some(spec),
            ..
        } => Ok(
            gateway::send_message(spec, &adapter.adapter_name(), &body, &options.attributes)
                .await?,
        ),
        _ => Err(WorkerError::SendUnsupported),
    }
}
