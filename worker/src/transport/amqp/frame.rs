//! What fits one AMQP frame. A message's properties (its headers table among them) travel in
//! one content header frame, which AMQP 0-9-1 cannot split: one longer than the connection's
//! negotiated `frame_max` (RabbitMQ's default is 131,072 bytes) makes RabbitMQ close the
//! connection (`FRAME_ERROR`), so it is checked before publishing.

use lapin::BasicProperties;

use crate::transport::TransportError;

/// A frame's own bytes: type, channel, payload size, end marker.
const FRAME_OVERHEAD: usize = 8;
/// A content header's bytes before its properties: class id, weight, body size.
const HEADER_PREFIX: usize = 12;

/// The bytes of the content header frame carrying `properties`.
pub fn header_frame_bytes(properties: &BasicProperties) -> Result<usize, TransportError> {
    let written = lapin::protocol::basic::gen_properties(properties)(Vec::new().into())
        .map_err(|err| TransportError::protocol(format!("cannot encode the properties: {err}")))?;
    Ok(FRAME_OVERHEAD + HEADER_PREFIX + written.write.len())
}

/// Fails, naming `frame_max`, when `properties` (of `what`) do not fit one frame of
/// `frame_max` bytes (0: no limit).
pub fn fits_one_frame(
    properties: &BasicProperties,
    frame_max: u32,
    what: &str,
) -> Result<(), TransportError> {
    let bytes = header_frame_bytes(properties)?;
    let max = usize::try_from(frame_max).unwrap_or(usize::MAX);
    if frame_max == 0 || bytes <= max {
        return Ok(());
    }
    Err(TransportError::protocol(format!(
        "{what}: its properties and headers take {bytes} bytes, more than one frame holds \
         (the connection's frame_max is {frame_max}; RabbitMQ sends no message's properties \
         in two frames)"
    )))
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable, LongString};

    use super::*;

    #[test]
    fn a_headers_table_is_counted_byte_for_byte() {
        let mut table = FieldTable::default();
        table.insert(
            "h".into(),
            AMQPValue::LongString(LongString::from(vec![b'v'; 100])),
        );
        let properties = BasicProperties::default().with_headers(table);
        // Flags (2), table length (4), name (1 + 1), type (1), value length (4), value.
        let bytes = FRAME_OVERHEAD + HEADER_PREFIX + 2 + 4 + 2 + 1 + 4 + 100;
        assert_eq!(header_frame_bytes(&properties).unwrap(), bytes);
        assert!(fits_one_frame(&properties, bytes as u32, "a copy").is_ok());
        let refused = fits_one_frame(&properties, bytes as u32 - 1, "a copy").unwrap_err();
        assert!(refused.to_string().contains("frame_max is"), "{refused}");
        assert!(fits_one_frame(&properties, 0, "a copy").is_ok());
    }
}
