//! How a batch larger than one receive call is gathered, for SQS and for the SQS queues
//! behind an HTTP gateway: a long poll first, alone (concurrent long polls would hold a batch
//! until the last of them timed out); only a full answer (the queue is busy) is followed by
//! concurrent short polls for the rest of the batch.

use std::future::Future;

use futures::future::join_all;

use super::delete_plan::BATCH_LIMIT;
use crate::transport::TransportError;

/// Up to `max` messages from calls of at most [`BATCH_LIMIT`]: `receive_once(count, wait)`
/// asks for `count` messages, waiting up to `wait` seconds (`wait` is `wait_seconds` for the
/// long poll when `block`, else 0). When some concurrent calls fail and others return
/// messages, the messages are delivered (the failed calls' messages, if any were handed out,
/// come back when their visibility expires); a fatal failure always wins.
pub async fn gather<M, F, Fut>(
    max: usize,
    block: bool,
    wait_seconds: u32,
    receive_once: F,
) -> Result<Vec<M>, TransportError>
where
    F: Fn(usize, u32) -> Fut,
    Fut: Future<Output = Result<Vec<M>, TransportError>>,
{
    let max = max.max(1);
    let mut raw = Vec::new();
    let (first, rest) = if block {
        (max.min(BATCH_LIMIT), max.saturating_sub(BATCH_LIMIT))
    } else {
        (0, max)
    };
    if first > 0 {
        raw = receive_once(first, wait_seconds).await?;
        if raw.len() < first {
            return Ok(raw);
        }
    }
    let sizes: Vec<usize> = (0..rest.div_ceil(BATCH_LIMIT))
        .map(|call| (rest - call * BATCH_LIMIT).min(BATCH_LIMIT))
        .collect();
    let calls = sizes.iter().map(|&count| receive_once(count, 0));
    let mut failure: Option<TransportError> = None;
    for result in join_all(calls).await {
        match result {
            Ok(messages) => raw.extend(messages),
            // A fatal failure wins; otherwise the first one is kept.
            Err(err)
                if failure
                    .as_ref()
                    .is_none_or(|f| !f.is_fatal() && err.is_fatal()) =>
            {
                failure = Some(err);
            }
            Err(_) => {}
        }
    }
    match failure {
        Some(err) if raw.is_empty() || err.is_fatal() => Err(err),
        Some(err) => {
            tracing::debug!(error = %switchboard_telemetry::ErrorChain(&err), "one of the concurrent receives failed");
            Ok(raw)
        }
        None => Ok(raw),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_short_long_poll_ends_the_gathering_and_a_full_one_is_followed_by_short_polls() {
        let calls = std::sync::Mutex::new(Vec::new());
        let got = gather(25, true, 20, |count, wait| {
            calls.lock().unwrap().push((count, wait));
            async move { Ok::<_, TransportError>(vec![0u8; count]) }
        })
        .await
        .expect("gathered");
        assert_eq!(got.len(), 25);
        assert_eq!(*calls.lock().unwrap(), vec![(10, 20), (10, 0), (5, 0)]);

        let calls = std::sync::Mutex::new(Vec::new());
        let got = gather(25, true, 20, |count, wait| {
            calls.lock().unwrap().push((count, wait));
            async move { Ok::<_, TransportError>(vec![0u8; count / 2]) }
        })
        .await
        .expect("gathered");
        assert_eq!(got.len(), 5);
        assert_eq!(*calls.lock().unwrap(), vec![(10, 20)]);
    }

    #[tokio::test]
    async fn messages_of_successful_calls_are_kept_unless_another_fails_fatally() {
        let got = gather(15, false, 20, |count, _| async move {
            match count {
                5 => Err(TransportError::protocol("this call failed")),
                _ => Ok(vec![1u8; count]),
            }
        })
        .await
        .expect("a transient failure of one call is not the receive's");
        assert_eq!(got.len(), 10);
        let failed = gather(15, false, 20, |count, _| async move {
            match count {
                5 => Err(TransportError::fatal("spec.x", "no such queue", None)),
                _ => Ok(vec![1u8; count]),
            }
        })
        .await;
        assert!(failed.expect_err("fatal wins").is_fatal());
    }
}
