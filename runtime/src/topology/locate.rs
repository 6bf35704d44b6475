//! Turns a TOML parse error into an error naming the key and its table.

use crate::error::Error;

/// The table a byte offset of `text` lies in: `run`, `sync.timeouts`, `process[actor]`,
/// `process[actor].env` (array-of-tables entries are named by their `name`/`id`, else by
/// their index).
fn table_at(text: &str, offset: usize) -> String {
    let mut header: Option<(&str, bool)> = None; // (name, is_array)
    let mut entry: Option<(&str, usize, usize)> = None; // the last [[array]]: name, index, body
    let mut counts: std::collections::HashMap<&str, usize> = Default::default();
    let mut pos = 0;
    for line in text.split_inclusive('\n') {
        if pos > offset {
            break;
        }
        let t = line.trim();
        if let Some(inner) = t.strip_prefix("[[").and_then(|r| r.split("]]").next()) {
            let name = inner.trim();
            let n = counts.entry(name).or_insert(0);
            entry = Some((name, *n, pos + line.len()));
            *n += 1;
            header = Some((name, true));
        } else if let Some(inner) = t.strip_prefix('[').and_then(|r| r.split(']').next()) {
            header = Some((inner.trim(), false));
        }
        pos += line.len();
    }
    let Some((name, is_array)) = header else {
        return String::new();
    };
    // a table inside the last entry of an array of tables (`[process.env]` after
    // `[[process]]`) is named through that entry
    let (array, index, body, rest) = match entry {
        Some((array, index, body)) if is_array => (array, index, body, ""),
        Some((array, index, body)) => match name.strip_prefix(array) {
            Some(rest) if rest.starts_with('.') => (array, index, body, rest),
            _ => return name.to_string(),
        },
        None => return name.to_string(),
    };
    // Name the entry by its `name = "..."` (or `id = "..."`) line, when it has one.
    let label = text[body.min(text.len())..]
        .lines()
        .take_while(|l| !l.trim_start().starts_with('['))
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            let k = k.trim();
            (k == "name" || k == "id").then(|| v.trim().trim_matches('"').to_string())
        })
        .filter(|l| !l.is_empty());
    match label {
        Some(l) => format!("{array}[{l}]{rest}"),
        None => format!("{array}[#{}]{rest}", index + 1),
    }
}

/// The first backquoted word of `message` after `prefix` (`unknown field `x``).
fn quoted_after<'m>(message: &'m str, prefix: &str) -> Option<&'m str> {
    let rest = &message[message.find(prefix)? + prefix.len()..];
    let rest = rest.strip_prefix('`')?;
    Some(&rest[..rest.find('`')?])
}

/// An [`Error::Topology`] for a TOML error in `text`, naming the key (with its table) and,
/// when `lines`, the line.
pub(crate) fn parse_error(text: &str, err: &toml::de::Error, lines: bool) -> Error {
    let message = err.message().trim().to_string();
    let span = err.span();
    // An empty span at the start, or one over the whole document, blames a top-level key.
    let table = match &span {
        Some(s) if !(s.start == 0 && (s.end == 0 || s.end >= text.trim_end().len())) => {
            table_at(text, s.start)
        }
        _ => String::new(),
    };
    let field = quoted_after(&message, "unknown field ")
        .or_else(|| quoted_after(&message, "missing field "))
        .map(str::to_string)
        .or_else(|| {
            // Otherwise the key written on the line the error points at.
            let s = span.as_ref()?;
            let start = text[..s.start.min(text.len())]
                .rfind('\n')
                .map_or(0, |i| i + 1);
            let line = text[start..].lines().next()?;
            let (k, _) = line.split_once('=')?;
            Some(k.trim().to_string())
        });
    // An unknown top-level table points at its own header: the table is the key.
    let field =
        field.filter(|f| table.rsplit('.').next() != Some(f.as_str()) || table.contains('['));
    let key = match (table.is_empty(), field) {
        (true, Some(f)) => f,
        (false, Some(f)) => format!("{table}.{f}"),
        (false, None) => table,
        (true, None) => "<file>".into(),
    };
    let line = span
        .filter(|_| lines)
        .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1)
        .map_or_else(String::new, |l| format!(" (line {l})"));
    Error::Topology {
        key,
        reason: format!("{message}{line}"),
    }
}
