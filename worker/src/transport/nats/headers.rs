//! A delivery's headers as the worker stores them. The patched client (`vendor/async-nats`)
//! hands over the raw header block of a frame it cannot parse; the worker reads that block as
//! bytes: names must be UTF-8, values may be any bytes (stored encoded, as Kafka's are). A block
//! the worker cannot read either makes the message undecodable: dead-lettered with the block in
//! base64 ([`RAW_HEADERS`]).

/// The header of the dead letter holding the raw header block, in base64.
pub const RAW_HEADERS: &str = "Switchboard-Raw-Headers-Base64";

/// The headers of a block (`NATS/1.0[ status]\r\nName: value\r\n…`) as (name, value bytes), in
/// the order received; `Err` says why there are none. Read as the client reads a block: a value
/// is trimmed and continued by the lines that begin with whitespace.
pub fn read_block(block: &[u8]) -> Result<Vec<(String, Vec<u8>)>, &'static str> {
    let mut lines = block
        .split(|&byte| byte == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .peekable();
    if !lines
        .next()
        .is_some_and(|line| line.starts_with(b"NATS/1.0"))
    {
        return Err("its header block does not begin with NATS/1.0");
    }
    let mut fields = Vec::new();
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let colon = line
            .iter()
            .position(|&byte| byte == b':')
            .ok_or("a line of its header block has no ':'")?;
        let name = std::str::from_utf8(&line[..colon])
            .map_err(|_| "a header name is not UTF-8")?
            .trim_ascii();
        let mut value = line[colon + 1..].trim_ascii_start().to_vec();
        while let Some(more) =
            lines.next_if(|line| line.first().is_some_and(u8::is_ascii_whitespace))
        {
            value.extend_from_slice(more);
        }
        value.truncate(value.trim_ascii_end().len());
        fields.push((name.to_owned(), value));
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(name: &str, value: &[u8]) -> (String, Vec<u8>) {
        (name.to_owned(), value.to_vec())
    }

    #[test]
    fn values_are_bytes_trimmed_and_continued() {
        assert_eq!(
            read_block(
                b"NATS/1.0\r\ntrace: \xff\xfe binary \r\nlong: a\r\n  b\r\nmy name:v\r\n\r\n"
            ),
            Ok(vec![
                field("trace", b"\xff\xfe binary"),
                field("long", b"a  b"),
                field("my name", b"v"),
            ])
        );
        assert_eq!(read_block(b"NATS/1.0\r\n\r\n"), Ok(vec![]));
    }

    #[test]
    fn a_block_without_names_is_refused_with_the_reason() {
        assert_eq!(
            read_block(b"HTTP/1.1\r\na: b\r\n\r\n"),
            Err("its header block does not begin with NATS/1.0")
        );
        assert_eq!(
            read_block(b"NATS/1.0\r\nno colon here\r\n\r\n"),
            Err("a line of its header block has no ':'")
        );
        assert_eq!(
            read_block(b"NATS/1.0\r\nna\xffme: v\r\n\r\n"),
            Err("a header name is not UTF-8")
        );
    }
}
