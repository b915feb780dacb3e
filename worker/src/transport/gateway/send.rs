//! `switchboard-worker send` for gateway sources: one message sent to the adapter's queue
//! through the gateway (the seed's `send_chunk`); `dlq redrive` sends its copies with it.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::json;
use switchboard_api::GatewaySource;

use super::calls::{CALL_TIMEOUT, Call, Gateway as Calls};
use super::connect::connect;
use crate::transport::TransportError;

/// The protocol's answer to a send.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Sent {
    message_id: String,
}

/// Sends one message to the adapter's queue (the seed's `send_chunk`): the body base64,
/// `attributes` with the spec's `project`. Returns its messageId.
pub async fn send_message(
    spec: &GatewaySource,
    adapter: &str,
    body: &[u8],
    attributes: &[(String, String)],
) -> Result<String, TransportError> {
    let calls = connect(spec, adapter, &mut Registry::default())?;
    send(&calls, body, attributes.iter().cloned()).await
}

/// Sends `body` with `attributes` and the project of `calls`, if any, to the queue of `calls`;
/// returns its messageId once the gateway took it.
pub(super) async fn send(
    calls: &Calls,
    body: &[u8],
    attributes: impl IntoIterator<Item = (String, String)>,
) -> Result<String, TransportError> {
    let mut values = serde_json::Map::new();
    if let Some(project) = calls.project() {
        values.insert("project".into(), project.into());
    }
    for (name, value) in attributes {
        values.insert(name, value.into());
    }
    let request = json!({
        "messageBody": STANDARD.encode(body),
        "messageAttributes": {"values": values},
        "delaySeconds": 0,
    });
    let call = Call {
        name: "send",
        method: &::http::Method::POST,
        path: "/",
        timeout: CALL_TIMEOUT,
    };
    let sent: Sent = calls.call(call, &[], Some(&request)).await?;
    Ok(sent.message_id)
}
