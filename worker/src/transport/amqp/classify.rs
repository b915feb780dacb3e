//! The one mapping of lapin errors to what the worker does: refused credentials or
//! permissions, a missing queue or exchange and a queue declared differently are fatal and name
//! the setting; everything else (connection refused or lost, a broker shutting down) is
//! transient.

use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};

use crate::transport::TransportError;

/// The environment variable holding the URL (credentials, host, vhost).
pub const URL_SETTING: &str = "AMQP_URL";

/// What a failed call was addressing, which decides the setting a fatal error names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressed {
    /// Connecting and opening channels.
    Connection,
    /// The source queue (passive declare, consume).
    Queue,
    /// Declaring the source queue (`declare` set).
    Declare,
    /// Binding the declared queue to its exchanges.
    Bindings,
    /// The dead-letter exchange or queue.
    DeadLetter,
}

/// What the errors name.
#[derive(Debug, Clone)]
pub struct Names {
    pub queue: String,
    /// `exchange` → `routing key` of dead letters, for messages.
    pub dead_letter: String,
    /// The setting naming the dead-letter target.
    pub dead_letter_setting: &'static str,
}

/// The AMQP reply code of `err`, if the broker sent one.
pub fn reply_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

impl Names {
    /// A mandatory publish RabbitMQ returned as unroutable: nothing is bound where it is sent,
    /// which only a change of the setting fixes.
    pub fn unroutable(
        &self,
        what: &str,
        addressed: Addressed,
        reply_code: u16,
        reply_text: &str,
    ) -> TransportError {
        let (setting, target) = match addressed {
            Addressed::DeadLetter => (self.dead_letter_setting, self.dead_letter.clone()),
            _ => ("spec.source.amqp.queue", format!("queue {:?}", self.queue)),
        };
        TransportError::fatal(
            setting,
            format!(
                "{what}: RabbitMQ returned the message as unroutable ({reply_code} {reply_text}); check that {target} exists"
            ),
            None,
        )
    }

    /// `err` of a call that did `what`.
    pub fn error(&self, what: &str, addressed: Addressed, err: lapin::Error) -> TransportError {
        let (soft, hard) = match err.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
                AMQPErrorKind::Soft(soft) => (Some(soft.clone()), None),
                AMQPErrorKind::Hard(hard) => (None, Some(hard.clone())),
            },
            _ => (None, None),
        };
        let fatal = |setting: &str, context: String| {
            TransportError::fatal(setting, context, Some(Box::new(err.clone())))
        };
        match (soft, hard, addressed) {
            (Some(AMQPSoftError::ACCESSREFUSED), _, _) => fatal(
                URL_SETTING,
                format!(
                    "{what}: access refused; check the user's password and its permissions on the vhost"
                ),
            ),
            (_, Some(AMQPHardError::NOTALLOWED), _) => fatal(
                URL_SETTING,
                format!("{what}: not allowed; check that the vhost exists and the user may use it"),
            ),
            (Some(AMQPSoftError::NOTFOUND), _, Addressed::Queue) => fatal(
                "spec.source.amqp.queue",
                format!(
                    "the queue {:?} does not exist; create it, or set spec.source.amqp.declare to have the worker declare it",
                    self.queue
                ),
            ),
            (Some(AMQPSoftError::NOTFOUND), _, Addressed::Bindings) => fatal(
                "spec.source.amqp.declare.bindings",
                format!(
                    "{what}: an exchange to bind {:?} to does not exist",
                    self.queue
                ),
            ),
            (Some(AMQPSoftError::NOTFOUND), _, Addressed::DeadLetter) => fatal(
                self.dead_letter_setting,
                format!(
                    "{what}: the dead-letter target {} does not exist",
                    self.dead_letter
                ),
            ),
            (Some(AMQPSoftError::PRECONDITIONFAILED), _, Addressed::Declare) => fatal(
                "spec.source.amqp.declare",
                format!(
                    "the queue {:?} exists with other arguments (type, durability) than spec.source.amqp.declare asks for",
                    self.queue
                ),
            ),
            _ => TransportError::transient(format!("RabbitMQ {what} failed"), err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ErrorKind;
    use lapin::protocol::AMQPError;

    fn names() -> Names {
        Names {
            queue: "orders".into(),
            dead_letter: "(default exchange) → orders.dlq".into(),
            dead_letter_setting: "spec.delivery.deadLetter.exchange",
        }
    }

    fn protocol(kind: AMQPErrorKind) -> lapin::Error {
        lapin::ErrorKind::ProtocolError(AMQPError::new(kind, "reply".into())).into()
    }

    fn setting(err: TransportError) -> Option<String> {
        match err.kind() {
            ErrorKind::Fatal { setting } => Some(setting.clone()),
            _ => None,
        }
    }

    #[test]
    fn missing_queue_is_fatal_naming_it() {
        let err = names().error(
            "declaring",
            Addressed::Queue,
            protocol(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)),
        );
        assert!(
            err.to_string().contains("\"orders\" does not exist"),
            "{err}"
        );
        assert_eq!(setting(err).as_deref(), Some("spec.source.amqp.queue"));
    }

    #[test]
    fn refused_access_names_the_url_and_other_failures_are_transient() {
        let refused = protocol(AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED));
        let err = names().error("connecting", Addressed::Connection, refused);
        assert_eq!(setting(err).as_deref(), Some(URL_SETTING));
        let forced = protocol(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED));
        let err = names().error("consuming", Addressed::Queue, forced);
        assert_eq!(err.kind(), &ErrorKind::Transient);
        let io: lapin::Error = std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        let err = names().error("connecting", Addressed::Connection, io);
        assert_eq!(err.kind(), &ErrorKind::Transient);
    }
}
