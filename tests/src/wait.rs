//! Waiting on a condition with a deadline, instead of sleeping and hoping.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

const POLL: Duration = Duration::from_millis(25);

/// Polls `condition` until it holds or `timeout` passes.
pub fn wait_until(
    timeout: Duration,
    what: &str,
    mut condition: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting until {what}");
        }
        std::thread::sleep(POLL);
    }
}

/// Async variant: polls `condition` until it returns `Ok(true)` or `timeout` passes.
pub async fn wait_for<F, Fut>(timeout: Duration, what: &str, mut condition: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match condition().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(err) => last_error = Some(err),
        }
        if Instant::now() >= deadline {
            match last_error {
                Some(err) => {
                    bail!("timed out after {timeout:?} waiting until {what} (last error: {err:#})")
                }
                None => bail!("timed out after {timeout:?} waiting until {what}"),
            }
        }
        tokio::time::sleep(POLL).await;
    }
}
