//! One classification of SQS failures, used by every call: what an error code (or the lack of
//! a response) means for the worker — back off, drop a stale receipt, or exit naming a setting.
//!
//! Service error messages are never passed on verbatim: SQS quotes receipt handles in some of
//! them (`ReceiptHandleIsInvalid`), so long tokens are redacted first.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};

use crate::transport::TransportError;

/// The setting to fix when SQS rejects the credentials.
pub const CREDENTIALS_SETTING: &str =
    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (spec.source.sqs.accessKeyIdSecretRef)";
/// The setting naming the dead-letter queue.
pub const DEAD_LETTER_SETTING: &str = "spec.delivery.deadLetter.queueUrl";
/// How long a queue may be missing, once `prepare` found it, before that is fatal: a queue
/// deleted and created again under the worker is waited for (AWS asks for 60 s between
/// deleting a queue and creating one of the same name).
pub const QUEUE_MISSING_DEADLINE: Duration = Duration::from_secs(120);

/// Whether the worker's queue was found, and since when calls have found it missing: a queue
/// deleted after `prepare` found it may be created again and is waited for until
/// [`QUEUE_MISSING_DEADLINE`]; one never found is a setting to fix. Clones share the clock.
#[derive(Debug, Clone, Default)]
pub struct QueueAbsence {
    found: bool,
    since: Arc<Mutex<Option<Instant>>>,
}

impl QueueAbsence {
    /// `prepare` found the queue.
    pub fn found(&mut self) {
        self.found = true;
    }

    /// A call reached the queue: a later absence counts from zero again.
    pub fn reached(&self) {
        *self.since.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// A call found `queue` missing: transient while it has been missing for less than
    /// [`QUEUE_MISSING_DEADLINE`] since `prepare` found it, else fatal naming `setting`.
    /// `call` prefixes the message, `absent` says what "missing" means where it was asked.
    pub fn error(
        &self,
        setting: &str,
        call: &str,
        queue: &str,
        absent: &str,
        source: Box<dyn std::error::Error + Send + Sync>,
    ) -> TransportError {
        match self.missing_for() {
            Some(missing) if missing < QUEUE_MISSING_DEADLINE => TransportError::transient(
                format!(
                    "{call}: queue {queue} no longer exists (for {} s); waiting up to {} s for it to be created again",
                    missing.as_secs(),
                    QUEUE_MISSING_DEADLINE.as_secs()
                ),
                Boxed(source),
            ),
            missing => TransportError::fatal(
                setting,
                format!(
                    "{call}: queue {queue} {absent}{}",
                    missing
                        .map(|m| format!("; missing for {} s", m.as_secs()))
                        .unwrap_or_default()
                ),
                Some(source),
            ),
        }
    }

    /// A call found the queue missing: for how long it has been, counted from the first such
    /// call; `None` when `prepare` never found it.
    fn missing_for(&self) -> Option<Duration> {
        self.found.then(|| {
            self.since
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert_with(Instant::now)
                .elapsed()
        })
    }
}

/// What an SQS error code means, whatever the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Back off and retry: throttling, a server error, a timeout, no connection.
    Transient,
    /// The receipt handle can never be used again (expired, or the message was received again).
    Stale,
    /// The queue the call addressed does not exist (or its URL is malformed).
    QueueMissing,
    /// The credentials are missing, wrong, expired or not allowed to do this.
    Credentials,
}

/// Codes meaning the queue does not exist (the AWS JSON and query-compatible spellings).
const QUEUE_MISSING: &[&str] = &[
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "NonExistentQueue",
    "InvalidAddress",
];

/// Codes meaning the credentials cannot work.
const CREDENTIALS: &[&str] = &[
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "UnrecognizedClientException",
    "AccessDenied",
    "AccessDeniedException",
    "InvalidAccessKeyId",
    "ExpiredToken",
    "MissingAuthenticationToken",
    "IncompleteSignature",
    "InvalidSecurity",
    "KmsAccessDenied",
    "KMS.AccessDeniedException",
];

/// Classifies an error code (with its message, which tells an invalid receipt handle from
/// another invalid parameter). Unknown codes are transient: the worker retries, and the log
/// line names the code.
pub fn verdict_for_code(code: &str, message: Option<&str>) -> Verdict {
    if QUEUE_MISSING.contains(&code) {
        return Verdict::QueueMissing;
    }
    if CREDENTIALS.contains(&code) {
        return Verdict::Credentials;
    }
    if is_stale_code(code, message) {
        return Verdict::Stale;
    }
    Verdict::Transient
}

/// Whether a (per-entry or whole-call) error code says the receipt handle is no longer valid.
pub fn is_stale_code(code: &str, message: Option<&str>) -> bool {
    code.ends_with("ReceiptHandleIsInvalid")
        || code.ends_with("MessageNotInflight")
        || (code.ends_with("InvalidParameterValue")
            && message.is_some_and(|m| m.to_ascii_lowercase().contains("receipt")))
}

/// Codes by which SQS refuses a message itself (its size, body characters, attributes): sending
/// the same message again can never succeed.
const REFUSED_MESSAGE: &[&str] = &[
    "InvalidParameterValue",
    "InvalidMessageContents",
    "MessageTooLong",
    "BatchRequestTooLong",
    "InvalidAttributeName",
    "InvalidAttributeValue",
    "UnsupportedOperation",
    "InvalidParameterCombination",
];

/// Whether a (per-entry or whole-call) error code says SQS refuses the message itself, for good.
pub fn is_refused_message_code(code: &str) -> bool {
    REFUSED_MESSAGE
        .iter()
        .any(|refused| code.ends_with(refused))
}

/// The fault of a send SQS refused as a whole because of what it carries (see
/// [`is_refused_message_code`]); `None` for every other failure.
pub fn refused_message<E>(err: &SdkError<E, HttpResponse>) -> Option<ServiceFault>
where
    E: ProvideErrorMetadata,
{
    let SdkError::ServiceError(_) = err else {
        return None;
    };
    let code = err.code()?;
    is_refused_message_code(code).then(|| ServiceFault {
        code: code.to_owned(),
        status: err.raw_response().map(|raw| raw.status().as_u16()),
        message: redact(err.message().unwrap_or("")),
    })
}

/// Which queue a call addressed, to name the setting when it does not exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressed {
    Source,
    DeadLetter,
}

/// The settings the classification names, and what to say about them.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `spec.source.sqs.queueUrl`, or `spec.source.sqs.queueName` when the queue is named.
    pub source_setting: &'static str,
    /// What the worker addresses: the source queue's URL (or name) and the region.
    pub source_queue: String,
    pub region: String,
    pub dead_letter_queue: String,
    /// Whether `prepare` found the source queue, and since when it has been missing.
    pub source_absence: QueueAbsence,
}

/// An SQS service error with its code and a redacted message, in place of the SDK's error
/// (whose message may quote a receipt handle).
#[derive(Debug, thiserror::Error)]
#[error("{code}{}: {message}", status.map(|s| format!(" (HTTP {s})")).unwrap_or_default())]
pub struct ServiceFault {
    pub code: String,
    pub status: Option<u16>,
    pub message: String,
}

/// An SQS call failed without a service error code (no connection, a timeout, a response that
/// does not parse).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CallFault(String);

/// What happened, without anything secret, as the source of a [`TransportError`].
pub fn fault<E>(err: &SdkError<E, HttpResponse>) -> Box<dyn std::error::Error + Send + Sync>
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let status = err.raw_response().map(|raw| raw.status().as_u16());
    match err {
        SdkError::ServiceError(_) => Box::new(ServiceFault {
            code: err.code().unwrap_or("unknown").to_owned(),
            status,
            message: redact(err.message().unwrap_or("")),
        }),
        _ => {
            // Dispatch failures, timeouts and unparseable responses carry no message from
            // SQS, only the transport's own (connection refused, timed out, …).
            let mut text = err.to_string();
            let mut source = std::error::Error::source(err);
            while let Some(cause) = source {
                text.push_str(": ");
                text.push_str(&cause.to_string());
                source = cause.source();
            }
            if let Some(status) = status {
                text.push_str(&format!(" (HTTP {status})"));
            }
            Box::new(CallFault(redact(&text)))
        }
    }
}

/// The verdict on a failed SDK call.
pub fn verdict<E>(err: &SdkError<E, HttpResponse>) -> Verdict
where
    E: ProvideErrorMetadata,
{
    match err {
        SdkError::ServiceError(_) => {
            let status = err.raw_response().map(|raw| raw.status().as_u16());
            match err.code() {
                Some(code) => match verdict_for_code(code, err.message()) {
                    // A 403 without a known code is a permission problem all the same.
                    Verdict::Transient if status == Some(403) => Verdict::Credentials,
                    verdict => verdict,
                },
                None if status == Some(403) => Verdict::Credentials,
                None => Verdict::Transient,
            }
        }
        // Construction failures (a request the SDK cannot build), dispatch failures (no
        // connection, no credentials resolved for this attempt), timeouts and unparseable
        // responses: retried. Misconfiguration is caught in `prepare`.
        _ => Verdict::Transient,
    }
}

impl Settings {
    /// The source queue does not exist: a setting to fix, unless `prepare` found it (then it
    /// was deleted, and is waited for until [`QUEUE_MISSING_DEADLINE`]).
    fn source_missing(
        &self,
        call: &str,
        source: Box<dyn std::error::Error + Send + Sync>,
    ) -> TransportError {
        self.source_absence.error(
            self.source_setting,
            &format!("SQS {call}"),
            &self.source_queue,
            &format!(
                "does not exist in region {} (or its URL is malformed)",
                self.region
            ),
            source,
        )
    }

    /// The one mapping from a failed call to what the worker does about it.
    pub fn error<E>(
        &self,
        call: &str,
        addressed: Addressed,
        err: SdkError<E, HttpResponse>,
    ) -> TransportError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let source = fault(&err);
        match verdict(&err) {
            Verdict::Transient => {
                TransportError::transient(format!("SQS {call} failed"), Boxed(source))
            }
            Verdict::Stale => TransportError::stale(
                format!("SQS {call}: the receipt handle is no longer valid"),
                Some(source),
            ),
            Verdict::QueueMissing => match addressed {
                Addressed::Source => self.source_missing(call, source),
                Addressed::DeadLetter => TransportError::fatal(
                    DEAD_LETTER_SETTING,
                    format!(
                        "SQS {call}: dead-letter queue {} does not exist in region {}; create it or set {DEAD_LETTER_SETTING} (default: the source queue's name with -dlq, before .fifo)",
                        self.dead_letter_queue, self.region
                    ),
                    Some(source),
                ),
            },
            Verdict::Credentials => TransportError::fatal(
                CREDENTIALS_SETTING,
                format!("SQS {call}: the credentials were refused or are not allowed to do this"),
                Some(source),
            ),
        }
    }
}

/// A boxed error as a concrete error type (for [`TransportError::transient`]).
#[derive(Debug)]
pub struct Boxed(pub Box<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for Boxed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Boxed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Replaces anything that looks like a receipt handle, a token or an access key id by
/// `<redacted>`: words of 32 or more token characters, and `AKIA…`/`ASIA…` key ids.
pub fn redact(text: &str) -> String {
    let is_token_char = |c: char| c.is_ascii_alphanumeric() || "+/=_-%".contains(c);
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        let key_id = word.len() >= 16 && (word.starts_with("AKIA") || word.starts_with("ASIA"));
        if word.len() >= 32 || key_id {
            out.push_str("<redacted>");
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in text.chars() {
        if is_token_char(c) {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ErrorKind;

    fn missing(settings: &Settings) -> TransportError {
        let fault = ServiceFault {
            code: "QueueDoesNotExist".into(),
            status: Some(400),
            message: "The specified queue does not exist.".into(),
        };
        settings.source_missing("ReceiveMessage", Box::new(fault))
    }

    #[test]
    fn source_queue_deleted_after_prepare_is_waited_for_until_the_deadline() {
        let mut settings = Settings {
            source_setting: "spec.source.sqs.queueUrl",
            source_queue: "http://sqs/000000000000/orders".into(),
            region: "us-east-1".into(),
            dead_letter_queue: "http://sqs/000000000000/orders-dlq".into(),
            source_absence: QueueAbsence::default(),
        };
        // Never found: a setting to fix, at once.
        assert!(matches!(missing(&settings).kind(), ErrorKind::Fatal { .. }));
        settings.source_absence.found();
        let waited = missing(&settings);
        assert!(matches!(waited.kind(), ErrorKind::Transient), "{waited}");
        *settings.source_absence.since.lock().unwrap() =
            Instant::now().checked_sub(QUEUE_MISSING_DEADLINE);
        let gone = missing(&settings);
        assert!(matches!(gone.kind(), ErrorKind::Fatal { .. }), "{gone}");
        assert!(gone.to_string().contains("missing for 120 s"), "{gone}");
        // Reached again (re-created): a later deletion is waited for from zero.
        settings.source_absence.reached();
        assert!(matches!(missing(&settings).kind(), ErrorKind::Transient));
    }

    #[test]
    fn missing_queue_codes_in_both_spellings_mean_the_queue_is_missing() {
        for code in [
            "AWS.SimpleQueueService.NonExistentQueue",
            "QueueDoesNotExist",
        ] {
            assert_eq!(
                verdict_for_code(code, None),
                Verdict::QueueMissing,
                "{code}"
            );
        }
    }

    #[test]
    fn credential_codes_are_credential_problems() {
        for code in [
            "InvalidClientTokenId",
            "SignatureDoesNotMatch",
            "UnrecognizedClientException",
            "AccessDenied",
            "AccessDeniedException",
            "InvalidAccessKeyId",
            "ExpiredToken",
            "MissingAuthenticationToken",
        ] {
            assert_eq!(verdict_for_code(code, None), Verdict::Credentials, "{code}");
        }
    }

    #[test]
    fn invalid_receipt_handles_are_stale_and_other_invalid_parameters_are_not() {
        assert_eq!(
            verdict_for_code("ReceiptHandleIsInvalid", None),
            Verdict::Stale
        );
        assert_eq!(
            verdict_for_code("AWS.SimpleQueueService.MessageNotInflight", None),
            Verdict::Stale
        );
        assert_eq!(
            verdict_for_code(
                "InvalidParameterValue",
                Some("Value x for parameter ReceiptHandle is invalid. Reason: expired.")
            ),
            Verdict::Stale
        );
        assert_eq!(
            verdict_for_code("InvalidParameterValue", Some("VisibilityTimeout too large")),
            Verdict::Transient
        );
    }

    #[test]
    fn refusals_of_the_message_itself_are_told_from_outages() {
        for code in [
            "InvalidParameterValue",
            "AWS.SimpleQueueService.InvalidMessageContents",
            "InvalidAttributeValue",
            "MessageTooLong",
        ] {
            assert!(is_refused_message_code(code), "{code}");
        }
        for code in ["RequestThrottled", "InternalError", "QueueDoesNotExist"] {
            assert!(!is_refused_message_code(code), "{code}");
        }
    }

    #[test]
    fn throttling_and_server_errors_are_transient() {
        for code in [
            "RequestThrottled",
            "ThrottlingException",
            "ServiceUnavailable",
            "InternalError",
            "KmsThrottled",
            "SomethingNew",
        ] {
            assert_eq!(verdict_for_code(code, None), Verdict::Transient, "{code}");
        }
    }

    #[test]
    fn receipt_handles_and_key_ids_are_redacted() {
        let handle = "AQEBzbVv6Jd0b7Yx+5pB/3XlGJ4N5Yhc2w3PqkZ8Qm9f1aVf0s2mD4==";
        let text = format!(
            "The input receipt handle \"{handle}\" is not a valid receipt handle; key AKIAIOSFODNN7EXAMPLE"
        );
        let redacted = redact(&text);
        assert!(!redacted.contains(handle), "{redacted}");
        assert!(!redacted.contains("AKIAIOSFODNN7EXAMPLE"), "{redacted}");
        assert!(
            redacted.starts_with("The input receipt handle \"<redacted>\""),
            "{redacted}"
        );
        assert_eq!(redact("queue orders-dlq.fifo"), "queue orders-dlq.fifo");
    }
}
