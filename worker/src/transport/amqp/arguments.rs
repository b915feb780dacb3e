//! Reading a queue's arguments over AMQP 0-9-1. A passive declare returns only the counts,
//! never the arguments. A non-passive declare of an existing queue with other arguments fails
//! with 406 PRECONDITION_FAILED naming the first argument that differs and its current value
//! (`inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received none but current
//! is the value '3' of type 'long'`). So [`read`] declares the queue with the arguments learnt
//! so far, each on a channel of its own (a refused declare closes it), adding the current value
//! of each argument named, until the declare succeeds (a no-op: every argument equals the
//! queue's, so the argument wanted is absent) or names the argument wanted. What it cannot
//! see: an argument set by a **policy** (policies are not queue arguments; only the management
//! API shows them), and queues the user may not configure (a declare needs the configure
//! permission).

use lapin::Connection;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};

use super::classify::{self, Addressed, Names};
use super::connection::{call, open_channel};
use crate::transport::TransportError;

/// At most this many arguments are learnt before the check gives up.
const MAX_ROUNDS: usize = 16;

/// What [`read`] found of an argument.
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    /// The queue's value of the argument (`None`: the queue has no such argument).
    Value(Option<AMQPValue>),
    /// The user may not declare the queue (403): nothing can be read.
    Forbidden,
    /// The refusals could not be read back (an unknown type, too many arguments).
    Unreadable,
}

/// An argument a refused declare named, with the queue's current value.
#[derive(Debug, Clone, PartialEq)]
pub enum Inequivalent {
    /// A queue argument (`x-…`) and its current value (`None`: the queue has none).
    Argument(String, Option<AMQPValue>),
    /// A declare flag (`durable`, `exclusive`, `auto_delete`) and its current value.
    Flag(String, bool),
}

/// What a 406 reply text says differs, if it is an equivalence failure this can echo back.
pub fn inequivalent(text: &str) -> Option<Inequivalent> {
    let rest = &text[text.find("inequivalent arg '")? + "inequivalent arg '".len()..];
    let name = &rest[..rest.find('\'')?];
    let current = &rest[rest.find("but current is ")? + "but current is ".len()..];
    if matches!(name, "durable" | "exclusive" | "auto_delete") {
        let value = current.trim_matches(|c: char| c == '\'' || c.is_whitespace());
        return Some(Inequivalent::Flag(name.to_owned(), value == "true"));
    }
    if current.starts_with("none") {
        return Some(Inequivalent::Argument(name.to_owned(), None));
    }
    let value = current.strip_prefix("the value '")?;
    let (value, kind) = value.rsplit_once("' of type '")?;
    let kind = kind.trim_end_matches(['\'', ' ']);
    let number = || value.parse::<i64>().ok();
    let value = match kind {
        "long" => AMQPValue::LongLongInt(number()?),
        "signedint" => AMQPValue::LongInt(i32::try_from(number()?).ok()?),
        "short" => AMQPValue::ShortInt(i16::try_from(number()?).ok()?),
        "byte" => AMQPValue::ShortShortInt(i8::try_from(number()?).ok()?),
        "unsignedint" => AMQPValue::LongUInt(u32::try_from(number()?).ok()?),
        "unsignedshort" => AMQPValue::ShortUInt(u16::try_from(number()?).ok()?),
        "unsignedbyte" => AMQPValue::ShortShortUInt(u8::try_from(number()?).ok()?),
        "bool" => AMQPValue::Boolean(value == "true"),
        "longstr" => AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
        _ => return None,
    };
    Some(Inequivalent::Argument(name.to_owned(), Some(value)))
}

/// An integer argument's value.
pub fn integer(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(i64::from(*v)),
        _ => None,
    }
}

/// What one declare with the arguments learnt so far said.
enum Round {
    /// It succeeded: every argument equals the queue's.
    Equivalent,
    /// The user may not declare the queue (403): nothing can be checked.
    Forbidden,
    /// It was refused (406); what it named, if this can echo it back.
    Inequivalent(Option<Inequivalent>),
}

/// The queue arguments and declare flags learnt so far.
struct Learnt {
    arguments: FieldTable,
    options: QueueDeclareOptions,
}

impl Learnt {
    /// Takes the queue's current value of what a refused declare named.
    fn learn(&mut self, found: Inequivalent) {
        match found {
            Inequivalent::Argument(name, Some(value)) => {
                self.arguments.insert(name.as_str().into(), value);
            }
            Inequivalent::Argument(name, None) => {
                self.arguments = self
                    .arguments
                    .inner()
                    .iter()
                    .filter(|(key, _)| key.as_str() != name)
                    .map(|(key, value)| (key.clone(), value.clone()))
                    .collect::<std::collections::BTreeMap<_, _>>()
                    .into();
            }
            Inequivalent::Flag(name, value) => match name.as_str() {
                "durable" => self.options.durable = value,
                "exclusive" => self.options.exclusive = value,
                _ => self.options.auto_delete = value,
            },
        }
    }
}

/// The queue's value of argument `name` (see the module doc).
pub async fn read(
    names: &Names,
    connection: &Connection,
    queue: &str,
    name: &str,
) -> Result<Found, TransportError> {
    let mut learnt = Learnt {
        arguments: FieldTable::default(),
        options: QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
    };
    for _ in 0..MAX_ROUNDS {
        let found = match declare(names, connection, queue, &learnt).await? {
            Round::Equivalent => return Ok(Found::Value(None)),
            Round::Forbidden => return Ok(Found::Forbidden),
            Round::Inequivalent(found) => found,
        };
        match found {
            Some(Inequivalent::Argument(named, Some(value))) if named == name => {
                return Ok(Found::Value(Some(value)));
            }
            Some(found) => learnt.learn(found),
            None => break,
        }
    }
    Ok(Found::Unreadable)
}

/// One declare of `queue` with what is `learnt`, on a channel of its own.
async fn declare(
    names: &Names,
    connection: &Connection,
    queue: &str,
    learnt: &Learnt,
) -> Result<Round, TransportError> {
    let channel = open_channel(names, connection).await?;
    let declared = call(
        names,
        "queue declare (argument check)",
        Addressed::Queue,
        async {
            Ok(channel
                .queue_declare(queue.into(), learnt.options, learnt.arguments.clone())
                .await)
        },
    )
    .await?;
    let err = match declared {
        Ok(_) => {
            let _ = channel.close(200, "checked".into()).await;
            return Ok(Round::Equivalent);
        }
        Err(err) => err,
    };
    match (classify::reply_code(&err), &err.kind()) {
        (Some(406), lapin::ErrorKind::ProtocolError(amqp)) => Ok(Round::Inequivalent(
            inequivalent(amqp.get_message().as_str()),
        )),
        (Some(403), _) => Ok(Round::Forbidden),
        _ => Err(names.error("queue declare (argument check)", Addressed::Queue, err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_current_value_of_the_argument_named() {
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'orders' in vhost '/': received none but current is the value '3' of type 'long'";
        assert_eq!(
            inequivalent(text),
            Some(Inequivalent::Argument(
                "x-delivery-limit".into(),
                Some(AMQPValue::LongLongInt(3))
            ))
        );
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'orders' in vhost '/': received none but current is the value 'quorum' of type 'longstr'";
        assert_eq!(
            inequivalent(text),
            Some(Inequivalent::Argument(
                "x-queue-type".into(),
                Some(AMQPValue::LongString("quorum".into()))
            ))
        );
        let text = "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'orders' in vhost '/': received 'true' but current is 'false'";
        assert_eq!(
            inequivalent(text),
            Some(Inequivalent::Flag("durable".into(), false))
        );
        assert_eq!(inequivalent("PRECONDITION_FAILED - something else"), None);
    }
}
