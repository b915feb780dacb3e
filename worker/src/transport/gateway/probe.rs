//! Queue health through the gateway: `GET /stats` (available, in flight, dead letters) on the
//! transport's own client (its tokens and circuit breaker), and the age of the oldest message
//! this worker holds.

use serde::Deserialize;

use super::GatewayTransport;
use super::calls::{CALL_TIMEOUT, Call, Gateway as Calls};
use crate::health::now_ms;
use crate::transport::sqs::in_flight::InFlight;
use crate::transport::{QueueHealth, QueueProbe, TransportError};

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    #[serde(default)]
    pub available_messages: Option<u64>,
    #[serde(default)]
    pub in_flight_messages: Option<u64>,
    #[serde(default)]
    dead_letter_messages: Option<u64>,
}

/// `GET /stats` of the queue.
pub async fn stats(calls: &Calls) -> Result<Stats, TransportError> {
    let call = Call {
        name: "stats",
        method: &::http::Method::GET,
        path: "/stats",
        timeout: CALL_TIMEOUT,
    };
    let query: Vec<(&str, String)> = calls
        .project()
        .map(|project| ("project", project.to_owned()))
        .into_iter()
        .collect();
    calls.call(call, &query, None).await
}

/// Reads the queue's stats through the same gateway client (its tokens and circuit breaker).
#[derive(Debug, Clone)]
pub struct GatewayProbe {
    calls: Calls,
    held: InFlight,
}

impl GatewayTransport {
    /// The probe of this transport's queue.
    pub(super) fn new_probe(&self) -> GatewayProbe {
        GatewayProbe {
            calls: self.calls.clone(),
            held: self.held.clone(),
        }
    }
}

impl QueueProbe for GatewayProbe {
    /// Backlog = `availableMessages`, pending = `inFlightMessages`, dead letters =
    /// `deadLetterMessages`; the oldest pending age is that of the oldest message this worker
    /// holds (the gateway's stats give only an average delay).
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let stats = stats(&self.calls).await?;
        Ok(QueueHealth {
            backlog: stats.available_messages,
            pending: stats.in_flight_messages,
            oldest_pending_age: Some(self.held.oldest_age(now_ms())),
            dead_letters: stats.dead_letter_messages,
            oldest_dead_letter_age: None,
        })
    }
}
