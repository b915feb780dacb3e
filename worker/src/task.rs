//! Tasks that keep the span they were started in: a worker runs one adapter, and every line
//! its tasks log names it (the `adapter` span `run` enters), as do its batches' lines.

use std::future::Future;

use tokio::task::JoinHandle;
use tracing::Instrument as _;

/// [`tokio::spawn`] in the current span.
pub fn spawn<F>(future: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(future.in_current_span())
}

/// [`tokio::task::spawn_blocking`] in the current span.
pub fn spawn_blocking<F, R>(f: F) -> JoinHandle<R>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || span.in_scope(f))
}
