//! One-line config errors that say where: `file:line:column: in [table]: ...`.

use transport_core::{Error, ErrorKind};

/// Turns a TOML parse or type error into one `Config` error line naming the
/// origin, the position and the table the position is in.
pub(crate) fn describe(e: &toml::de::Error, text: &str, origin: &str) -> Error {
    let message = e.message().trim().replace('\n', " ");
    let err = match e.span() {
        Some(span) => {
            let (line, col) = line_col(text, span.start);
            let key = &text[span.clone()];
            let table = table_at(text, span.start);
            let mut where_ = String::new();
            if let Some(t) = table {
                where_.push_str(&format!("in [{t}]: "));
            }
            let key = key.trim();
            let key_note = if !key.is_empty() && key.len() <= 60 && !key.contains('\n') && !message.contains(key) {
                format!(" (at `{key}`)")
            } else {
                String::new()
            };
            Error::new(ErrorKind::Config, format!("{origin}:{line}:{col}: {where_}{message}{key_note}"))
        }
        None => Error::new(ErrorKind::Config, format!("{origin}: {message}")),
    };
    err
}

/// Adds the origin (a file name) and, where the failing key is written in
/// `text`, its line to a validation error whose message starts with a
/// dotted key path (`policy.retry.max_attempts: must be ...`), giving
/// `file.toml:5: policy.retry.max_attempts: must be ...`.
pub fn locate(e: Error, text: &str, origin: &str) -> Error {
    let msg = e.message().to_owned();
    let path = msg.split(':').next().unwrap_or("").trim();
    let line = find_key_line(text, path);
    let loc = match line {
        Some(l) => format!("{origin}:{l}"),
        None => origin.to_owned(),
    };
    Error::new(e.kind(), format!("{loc}: {msg}"))
}

/// 1-based line and column of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// The `[table]` header in force at `offset`, if any.
fn table_at(text: &str, offset: usize) -> Option<String> {
    let before = &text[..offset.min(text.len())];
    // The header on the error's own line counts only if the error is in it.
    before.lines().rev().find_map(header_of)
}

fn header_of(line: &str) -> Option<String> {
    let l = line.trim();
    let inner = l
        .strip_prefix("[[")
        .and_then(|r| r.split("]]").next())
        .or_else(|| l.strip_prefix('[').and_then(|r| r.split(']').next()))?;
    Some(inner.split('.').map(|p| p.trim().trim_matches('"')).collect::<Vec<_>>().join("."))
}

/// The 1-based line where the dotted `path` (`policy.retry.max_attempts`)
/// is set, if it is written as `key = ...` under its table header or as a
/// dotted key.
fn find_key_line(text: &str, path: &str) -> Option<usize> {
    if path.is_empty() || path.contains(' ') {
        return None;
    }
    let mut table = String::new();
    for (i, line) in text.lines().enumerate() {
        if let Some(h) = header_of(line) {
            table = h;
            continue;
        }
        let Some((key, _)) = line.split_once('=') else { continue };
        let key: String = key.split('.').map(|p| p.trim().trim_matches('"')).collect::<Vec<_>>().join(".");
        if key.is_empty() || key.starts_with('#') {
            continue;
        }
        let full = if table.is_empty() { key } else { format!("{table}.{key}") };
        if full == path {
            return Some(i + 1);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_and_tables() {
        let text = "[backend]\nkind = \"tcp\"\n\n[policy.retry]\nmax_attempts = 0\n";
        assert_eq!(line_col(text, 0), (1, 1));
        assert_eq!(table_at(text, text.find("max_attempts").unwrap()).as_deref(), Some("policy.retry"));
        assert_eq!(find_key_line(text, "policy.retry.max_attempts"), Some(5));
        assert_eq!(find_key_line(text, "backend.kind"), Some(2));
        assert_eq!(find_key_line(text, "policy.retry.jitter"), None);
    }
}
