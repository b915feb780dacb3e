//! Talking to RabbitMQ at all: the URL's check, connections, channels, and the deadline every
//! broker call runs under.

use lapin::options::QueueDeclareOptions;
use lapin::types::{FieldTable, FrameSize};
use lapin::uri::AMQPUri;
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

/// The smallest frame AMQP allows (RabbitMQ's `frame_max` floor), for a connection that only
/// declares queues: lapin buffers 32 frames each way, zeroed, which is 8 MiB per connection at
/// RabbitMQ's default `frame_max` of 128 KiB and 256 KiB at this one.
const SMALL_FRAME: FrameSize = 4096;

/// Opens a connection to `url` named `name`.
pub async fn connect(names: &Names, url: &str, name: &str) -> Result<Connection, TransportError> {
    open(names, url, name, None).await
}

/// [`connect`] with frames of at most [`SMALL_FRAME`] bytes, for the probe's passive declares.
pub async fn connect_small(
    names: &Names,
    url: &str,
    name: &str,
) -> Result<Connection, TransportError> {
    open(names, url, name, Some(SMALL_FRAME)).await
}

async fn open(
    names: &Names,
    url: &str,
    name: &str,
    frame_max: Option<FrameSize>,
) -> Result<Connection, TransportError> {
    let mut uri: AMQPUri = url.parse().map_err(|_| invalid_url())?;
    if let Some(most) = frame_max {
        uri.query.frame_max = Some(uri.query.frame_max.map_or(most, |set| set.min(most)));
    }
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    call(
        names,
        "connect",
        Addressed::Connection,
        Connection::connect_uri(uri, properties),
    )
    .await
}

fn invalid_url() -> TransportError {
    TransportError::fatal(URL_SETTING, "is not a valid amqp:// or amqps:// URL", None)
}

/// Checks the URL's form without echoing it (it may hold a password).
pub fn check_url(url: &str) -> Result<(), TransportError> {
    url.parse::<AMQPUri>().map(drop).map_err(|_| invalid_url())
}
