//! How dead letters are printed: a table and a text page for people, JSON for scripts.

use super::{StoredLetter, age};
use crate::payload::{fields_json, insert_body};
use crate::transport::rfc3339_ms;

/// A short age: `42s`, `17m`, `5h`, `3d`.
pub fn short_age(letter: &StoredLetter) -> String {
    let Some(age) = age(letter) else {
        return "?".to_owned();
    };
    let seconds = age.as_secs();
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..86_400 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86_400),
    }
}

/// At most `max` characters of `text` on one line, with `…` when cut.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        return flat;
    }
    let cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    format!("{cut}…")
}

/// `bytes` safe to print on a terminal: UTF-8 text as it is, line breaks and tabs kept, other
/// control characters as `\u{1b}`, bytes that are not UTF-8 as `\xff` (a letter's body or
/// header could otherwise move the cursor or recolour the terminal; `-o raw` prints the bytes).
fn printable(bytes: &[u8]) -> String {
    let mut text = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\n' | '\t' => text.push(c),
                c if c.is_control() => text.extend(c.escape_unicode()),
                c => text.push(c),
            }
        }
        for byte in chunk.invalid() {
            text.push_str(&format!("\\x{byte:02x}"));
        }
    }
    text
}

/// One letter as a JSON object: its context, the body as `body` (UTF-8) or `body_base64`, the
/// original headers (`{"name": "text" | {"base64": …}}`) and the attempts.
pub fn json(letter: &StoredLetter) -> serde_json::Value {
    let mut object = serde_json::json!({
        "id": letter.id,
        "dead_lettered_at": letter.dead_lettered_at_ms.map(rfc3339_ms),
        "age_seconds": age(letter).map(|age| age.as_secs()),
        "reason": letter.reason,
        "delivery_count": letter.delivery_count,
        "last_error": letter.last_error,
        "size": letter.body.len(),
        "origin": letter.origin,
        "original_id": letter.original_id,
        "headers": serde_json::from_str::<serde_json::Value>(&fields_json(&letter.headers))
            .unwrap_or_default(),
        "attempts": letter.attempts,
    });
    insert_body(&mut object, &letter.body);
    object
}

/// The `dlq list` table.
pub fn table(letters: &[&StoredLetter]) -> String {
    let rows: Vec<[String; 6]> = letters
        .iter()
        .map(|letter| {
            [
                letter.id.clone(),
                short_age(letter),
                letter.reason.clone().unwrap_or_else(|| "?".to_owned()),
                letter
                    .delivery_count
                    .map_or_else(|| "?".to_owned(), |count| count.to_string()),
                letter.body.len().to_string(),
                one_line(letter.last_error.as_deref().unwrap_or(""), 60),
            ]
        })
        .collect();
    let header = ["ID", "AGE", "REASON", "DELIVERIES", "SIZE", "LAST ERROR"].map(str::to_owned);
    let mut widths = header.clone().map(|h| h.chars().count());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    std::iter::once(&header)
        .chain(&rows)
        .map(|row| {
            let cells: Vec<String> = row
                .iter()
                .zip(widths)
                .map(|(cell, width)| format!("{cell:<width$}"))
                .collect();
            cells.join("  ").trim_end().to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `dlq show` page: context, headers, attempts, then the body (pretty when it is JSON,
/// else [`printable`]).
pub fn text(letter: &StoredLetter) -> Vec<u8> {
    let mut page = String::new();
    let mut line = |name: &str, value: &str| {
        page.push_str(&format!("{name:<15}{}\n", printable(value.as_bytes())));
    };
    line("id:", &letter.id);
    let at = letter
        .dead_lettered_at_ms
        .map_or_else(|| "unknown".to_owned(), rfc3339_ms);
    line(
        "dead-lettered:",
        &format!("{at} ({} ago)", short_age(letter)),
    );
    line("reason:", letter.reason.as_deref().unwrap_or("unknown"));
    line(
        "deliveries:",
        &letter
            .delivery_count
            .map_or_else(|| "unknown".to_owned(), |count| count.to_string()),
    );
    line("last error:", letter.last_error.as_deref().unwrap_or(""));
    line("origin:", &letter.origin);
    line("size:", &format!("{} bytes", letter.body.len()));
    page.push_str("headers:\n");
    for (name, value) in &letter.headers {
        page.push_str(&format!(
            "  {}: {}\n",
            printable(name.as_bytes()),
            printable(value)
        ));
    }
    match &letter.attempts {
        None => page.push_str("attempts:      not recorded\n"),
        Some(attempts) => {
            page.push_str(&format!(
                "attempts:      {} recorded of {} deliveries\n",
                attempts.recent.len(),
                attempts.total
            ));
            for attempt in &attempts.recent {
                page.push_str(&format!(
                    "  #{:<3} {}  {}  {}{}\n",
                    attempt.delivery,
                    attempt.at,
                    attempt.consumer,
                    attempt.outcome,
                    attempt
                        .error
                        .as_deref()
                        .map(|error| format!(": {}", one_line(error, 200)))
                        .unwrap_or_default()
                ));
            }
        }
    }
    page.push_str("body:\n");
    let mut bytes = page.into_bytes();
    match serde_json::from_slice::<serde_json::Value>(&letter.body) {
        Ok(json) => {
            let pretty = serde_json::to_string_pretty(&json).unwrap_or_default();
            bytes.extend_from_slice(pretty.as_bytes());
        }
        Err(_) => bytes.extend_from_slice(printable(&letter.body).as_bytes()),
    }
    bytes.push(b'\n');
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_escapes_what_would_drive_the_terminal_and_keeps_the_text() {
        assert_eq!(printable(b"caf\xc3\xa9\n\ttab"), "caf\u{e9}\n\ttab");
        assert_eq!(printable(b"\x1b[31mred"), "\\u{1b}[31mred");
        assert_eq!(printable(b"a\xffb\r"), "a\\xffb\\u{d}");
    }
}
