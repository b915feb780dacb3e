//! One adapter's gateway client: its calls, token provider and circuit breaker, with their
//! metrics.

use std::sync::Arc;

use prometheus_client::registry::Registry;
use switchboard_api::GatewaySource;

use super::breaker::CircuitBreaker;
use super::calls::{AuthCounters, Gateway as Calls};
use super::http::{HttpClient, extra_ca};
use super::token::{TokenProvider, TokenSource};
use crate::metrics::{adapter_counter, adapter_gauge};
use crate::transport::TransportError;

/// The calls, the token provider and the circuit breaker of one adapter's gateway.
pub fn connect(
    spec: &GatewaySource,
    adapter: &str,
    registry: &mut Registry,
) -> Result<Calls, TransportError> {
    let http = HttpClient::new(extra_ca(spec.tls.is_some())?.as_deref())?;
    let source = TokenSource::from_spec(&spec.auth)?;
    let tokens = TokenProvider::new(
        source,
        http.clone(),
        adapter_counter(
            registry,
            "gateway_token_requests",
            "Requests to the OAuth2 token endpoint",
            adapter,
        ),
        adapter_counter(
            registry,
            "gateway_token_refreshes_forced",
            "Token requests made because the gateway refused the current token (401)",
            adapter,
        ),
    );
    let breaker = CircuitBreaker::new(
        adapter_gauge(
            registry,
            "gateway_circuit_state",
            "The gateway's circuit breaker: 0 closed, 1 open, 2 half-open",
            adapter,
        ),
        adapter_counter(
            registry,
            "gateway_circuit_opened",
            "Times the gateway's circuit breaker opened",
            adapter,
        ),
    );
    Ok(Calls::new(
        spec,
        http,
        Arc::new(tokens),
        Arc::new(breaker),
        AuthCounters {
            unauthorized: adapter_counter(
                registry,
                "gateway_unauthorized",
                "Gateway answers 401 (each followed by a retry, unless it is an auth failure)",
                adapter,
            ),
            failures: adapter_counter(
                registry,
                "gateway_auth_failures",
                "Gateway calls that failed with 401 after their retry with a new token",
                adapter,
            ),
        },
    ))
}
