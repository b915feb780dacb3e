//! Talking to RabbitMQ at all: the URL's check, connections, channels, and the deadline every
//! broker call runs under.

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};

use super::CALL_TIMEOUT;
use super::classify::{self, Addressed, Names, URL_SETTING};
use crate::transport::TransportError;

/// Runs a broker call under [`CALL_TIMEOUT`].
pub async fn call<T>(
    names: &Names,
    what: &str,
    addressed: Addressed,
    future: impl Future<Output = lapin::Result<T>>,
) -> Result<T, TransportError> {
    match tokio::time::timeout(CALL_TIMEOUT, future).await {
        Ok(result) => result.map_err(|err| names.error(what, addressed, err)),
        Err(_) => Err(TransportError::protocol(format!(
            "RabbitMQ {what} timed out after {CALL_TIMEOUT:?}"
        ))),
    }
}

/// Opens a channel on `connection`.
pub async fn open_channel(
    names: &Names,
    connection: &Connection,
) -> Result<Channel, TransportError> {
    call(
        names,
        "channel open",
        Addressed::Connection,
        connection.create_channel(),
    )
    .await
}

/// The passive declare of `queue` on a channel of its own (a missing queue closes it).
pub async fn declare_passive(
    names: &Names,
    connection: &Connection,
    queue: &str,
) -> Result<lapin::Queue, TransportError> {
    let channel = open_channel(names, connection).await?;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = call(
        names,
        "queue declare (passive)",
        Addressed::Queue,
        channel.queue_declare(queue.into(), options, FieldTable::default()),
    )
    .await?;
    let _ = channel.close(200, "probed".into()).await;
    Ok(declared)
}

/// Whether `queue` exists (a passive declare on a channel of its own, which a missing queue
/// closes): a missing queue (404) is no error, anything else is.
pub async fn queue_exists(
    names: &Names,
    connection: &Connection,
    queue: &str,
    addressed: Addressed,
) -> Result<bool, TransportError> {
    const WHAT: &str = "queue declare (passive)";
    let channel = open_channel(names, connection).await?;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = call(names, WHAT, addressed, async {
        Ok(channel
            .queue_declare(queue.into(), options, FieldTable::default())
            .await)
    })
    .await?;
    match declared {
        Ok(_) => {
            let _ = channel.close(200, "probed".into()).await;
            Ok(true)
        }
        Err(err) if classify::reply_code(&err) == Some(404) => Ok(false),
        Err(err) => Err(names.error(WHAT, addressed, err)),
    }
}

/// Opens a connection to `url` named `name`.
pub async fn connect(names: &Names, url: &str, name: &str) -> Result<Connection, TransportError> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    call(
        names,
        "connect",
        Addressed::Connection,
        Connection::connect(url, properties),
    )
    .await
}

/// Checks the URL's form without echoing it (it may hold a password).
pub fn check_url(url: &str) -> Result<(), TransportError> {
    match url.parse::<lapin::uri::AMQPUri>() {
        Ok(_) => Ok(()),
        Err(_) => Err(TransportError::fatal(
            URL_SETTING,
            "is not a valid amqp:// or amqps:// URL",
            None,
        )),
    }
}
