//! Text helpers for the rooms that report: below the transports and the health of the worker,
//! which both cut error texts to size.

/// At most `max` bytes of `text`, cut at a character boundary, with `…` when cut (error texts
/// kept in dead letters).
pub(crate) fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}
