//! Building the SQS client: region, endpoint, timeouts; and what can be read from queue URLs.

use std::time::Duration;

use aws_config::environment::EnvironmentVariableRegionProvider;
use aws_config::meta::region::ProvideRegion;
use aws_config::profile::ProfileFileRegionProvider;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use switchboard_api::SqsSource;

use crate::transport::TransportError;

/// Connecting to SQS never takes longer than this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// One attempt of a call other than a long poll.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// A call other than a long poll, its retries included.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How much longer than its `WaitTimeSeconds` a long poll may take before it counts as hung.
const LONG_POLL_MARGIN: Duration = Duration::from_secs(10);

/// Timeouts of every call but `ReceiveMessage`: a hung server is a transient failure, not a
/// hang.
pub fn call_timeouts() -> TimeoutConfig {
    TimeoutConfig::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .operation_attempt_timeout(ATTEMPT_TIMEOUT)
        .operation_timeout(OPERATION_TIMEOUT)
        .build()
}

/// Timeouts of a `ReceiveMessage` that waits up to `wait_seconds`.
pub fn receive_timeouts(wait_seconds: u32) -> TimeoutConfig {
    let attempt = Duration::from_secs(u64::from(wait_seconds)) + LONG_POLL_MARGIN;
    TimeoutConfig::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .operation_attempt_timeout(attempt)
        .operation_timeout(attempt + LONG_POLL_MARGIN)
        .build()
}

/// Where the region came from, to name the setting when it is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionOrigin {
    Spec,
    Environment,
    QueueUrl,
    Profile,
}

impl RegionOrigin {
    pub fn setting(self) -> &'static str {
        match self {
            RegionOrigin::Spec | RegionOrigin::QueueUrl => "spec.source.sqs.region",
            RegionOrigin::Environment => "AWS_REGION",
            RegionOrigin::Profile => "AWS_PROFILE (region in ~/.aws/config)",
        }
    }
}

/// The region: `spec.region`, else `AWS_REGION`/`AWS_DEFAULT_REGION`, else the one in the
/// queue URL's host, else the shared AWS config file's. No instance-metadata lookup: a pod
/// on EKS gets `AWS_REGION` from IRSA.
pub async fn resolve_region(spec: &SqsSource) -> Result<(Region, RegionOrigin), TransportError> {
    let from_spec = spec.region.clone().filter(|r| !r.is_empty());
    let (region, origin) = if let Some(region) = from_spec {
        (region, RegionOrigin::Spec)
    } else if let Some(region) = EnvironmentVariableRegionProvider::new().region().await {
        (region.as_ref().to_owned(), RegionOrigin::Environment)
    } else if let Some(region) = spec.queue_url.as_deref().and_then(region_from_queue_url) {
        (region, RegionOrigin::QueueUrl)
    } else if let Some(region) = ProfileFileRegionProvider::new().region().await {
        (region.as_ref().to_owned(), RegionOrigin::Profile)
    } else {
        return Err(TransportError::fatal(
            "spec.source.sqs.region",
            "no AWS region: set spec.source.sqs.region or AWS_REGION, or use a queueUrl of the form https://sqs.<region>.amazonaws.com/<account>/<queue>",
            None,
        ));
    };
    if region.is_empty()
        || !region
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err(TransportError::fatal(
            origin.setting(),
            format!("{region:?} is not an AWS region name (like eu-west-1)"),
            None,
        ));
    }
    Ok((Region::new(region), origin))
}

/// The AWS configuration for the worker: the default credential chain (the `AWS_*`
/// variables the operator sets from the Secret refs, else IRSA web identity, ECS/EC2 roles),
/// the resolved region, `spec.endpoint`, and bounded timeouts. No network yet.
pub async fn load_config(spec: &SqsSource, region: Region) -> Result<SdkConfig, TransportError> {
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .region(region)
        .timeout_config(call_timeouts());
    if let Some(endpoint) = spec.endpoint.as_deref().filter(|e| !e.is_empty()) {
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(TransportError::fatal(
                "spec.source.sqs.endpoint",
                format!("{endpoint:?} is not an http:// or https:// URL"),
                None,
            ));
        }
        loader = loader.endpoint_url(endpoint);
    }
    Ok(loader.load().await)
}

/// `scheme://host[:port]/path…` → (host, path), without the port.
fn split_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.split_once("://")?.1;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = host.split_once(':').map_or(host, |(h, _)| h);
    Some((host, path))
}

/// The region in an AWS queue URL's host: `sqs.<region>.amazonaws.com` (also `sqs-fips.…`,
/// VPC endpoints `….sqs.<region>.vpce.amazonaws.com`, China `….amazonaws.com.cn`) and the
/// legacy `<region>.queue.amazonaws.com`. `None` for any other host.
pub fn region_from_queue_url(url: &str) -> Option<String> {
    let (host, _) = split_url(url)?;
    let labels: Vec<&str> = host.split('.').collect();
    if !labels.contains(&"amazonaws") {
        return None;
    }
    let region = labels
        .windows(2)
        .find(|pair| matches!(pair[0], "sqs" | "sqs-fips"))
        .map(|pair| pair[1])
        .or_else(|| {
            labels
                .windows(2)
                .find(|pair| pair[1] == "queue")
                .map(|pair| pair[0])
        })?;
    (region.contains('-') && region != "amazonaws").then(|| region.to_owned())
}

/// The default dead-letter queue: the source queue's URL with `-dlq` appended to its name,
/// before `.fifo` for a FIFO queue (`orders.fifo` → `orders-dlq.fifo`).
pub fn default_dead_letter_url(source_url: &str) -> String {
    let url = source_url.trim_end_matches('/');
    match url.strip_suffix(".fifo") {
        Some(stem) => format!("{stem}-dlq.fifo"),
        None => format!("{url}-dlq"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_dead_letter_queue_appends_dlq_to_a_standard_queue() {
        assert_eq!(
            default_dead_letter_url("https://sqs.eu-west-1.amazonaws.com/123456789012/orders"),
            "https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq"
        );
        assert_eq!(
            default_dead_letter_url("http://127.0.0.1:9324/000000000000/q1/"),
            "http://127.0.0.1:9324/000000000000/q1-dlq"
        );
    }

    #[test]
    fn default_dead_letter_queue_of_a_fifo_queue_keeps_the_fifo_suffix() {
        assert_eq!(
            default_dead_letter_url("https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo"),
            "https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq.fifo"
        );
    }

    #[test]
    fn region_is_read_from_aws_queue_urls_only() {
        let cases = [
            (
                "https://sqs.eu-west-1.amazonaws.com/123456789012/orders",
                Some("eu-west-1"),
            ),
            (
                "https://sqs-fips.us-gov-west-1.amazonaws.com/1/q",
                Some("us-gov-west-1"),
            ),
            (
                "https://sqs.cn-north-1.amazonaws.com.cn/1/q",
                Some("cn-north-1"),
            ),
            (
                "https://ap-south-1.queue.amazonaws.com/1/q",
                Some("ap-south-1"),
            ),
            (
                "https://vpce-0a1b-abc.sqs.us-east-2.vpce.amazonaws.com/1/q",
                Some("us-east-2"),
            ),
            ("http://127.0.0.1:9324/000000000000/q1", None),
            ("http://elasticmq:9324/queue/q1", None),
            ("not a url", None),
        ];
        for (url, region) in cases {
            assert_eq!(region_from_queue_url(url).as_deref(), region, "{url}");
        }
    }

    #[test]
    fn long_polls_get_more_time_than_their_wait() {
        let timeouts = receive_timeouts(20);
        assert!(timeouts.operation_attempt_timeout().expect("set") > Duration::from_secs(20));
        assert!(call_timeouts().operation_timeout().is_some());
    }
}
