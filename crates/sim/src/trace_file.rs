//! Request traces as published: JSON Lines, one request a line.
//!
//! - Mooncake (FAST'25, `conversation_trace.jsonl`, `toolagent_trace.jsonl`):
//!   `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (blocks
//!   of 512 tokens, one id per prefix: equal ids, equal prefixes).
//! - Qwen-Bailian (`qwen_traceA_blksz_16.jsonl`...): the same lengths, a
//!   `timestamp` in seconds, `hash_ids` of 16-token blocks, and `chat_id`,
//!   `parent_chat_id` (-1 for a session's first request) and `turn`.
//!
//! A file is read as Bailian when its first row has a `chat_id`; any other
//! field is ignored, so the published files are read unchanged.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Tokens per `hash_ids` block in Mooncake's traces.
pub const MOONCAKE_BLOCK: u32 = 512;
/// Tokens per `hash_ids` block in Bailian's traces.
pub const BAILIAN_BLOCK: u32 = 16;

/// One request of a trace, in the file's own terms.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Row {
    /// Arrival, milliseconds from the trace's start.
    #[serde(rename = "timestamp")]
    pub at_ms: f64,
    pub input_length: u32,
    pub output_length: u32,
    #[serde(default)]
    pub hash_ids: Vec<u64>,
    /// Bailian: this request's id and its session's previous request (-1: none).
    #[serde(default)]
    pub chat_id: Option<i64>,
    #[serde(default)]
    pub parent_chat_id: Option<i64>,
}

/// A parsed trace: its rows in file order and the tokens per `hash_ids` block.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub rows: Vec<Row>,
    pub block: u32,
    /// `mooncake` or `bailian`.
    pub format: &'static str,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {e}")]
    Io { path: String, e: std::io::Error },
    #[error("{path}:{line}: {e}")]
    Row { path: String, line: usize, e: serde_json::Error },
    #[error("{path}: no requests")]
    Empty { path: String },
}

/// Parses a trace's text; `path` only names it in errors. Blank lines are skipped.
pub fn parse(text: &str, path: &str) -> Result<Trace, TraceError> {
    let mut rows: Vec<Row> = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let err = |e| TraceError::Row { path: path.to_owned(), line: i + 1, e };
        rows.push(serde_json::from_str(line).map_err(err)?);
    }
    let Some(first) = rows.first() else { return Err(TraceError::Empty { path: path.to_owned() }) };
    let bailian = first.chat_id.is_some();
    if bailian {
        for r in &mut rows {
            r.at_ms *= 1000.0;
        }
    }
    let (block, format) = if bailian { (BAILIAN_BLOCK, "bailian") } else { (MOONCAKE_BLOCK, "mooncake") };
    Ok(Trace { rows, block, format })
}

/// Reads and parses the trace at `path`.
pub fn read(path: &Path) -> Result<Trace, TraceError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| TraceError::Io { path: name.clone(), e })?;
    parse(&text, &name)
}

/// Mooncake's format: one line per row, `timestamp` in whole milliseconds.
pub fn to_mooncake(rows: &[Row]) -> String {
    #[derive(Serialize)]
    struct Line<'a> {
        timestamp: u64,
        input_length: u32,
        output_length: u32,
        hash_ids: &'a [u64],
    }
    let mut out = String::new();
    for r in rows {
        let line = Line {
            timestamp: r.at_ms.round() as u64,
            input_length: r.input_length,
            output_length: r.output_length,
            hash_ids: &r.hash_ids,
        };
        out.push_str(&serde_json::to_string(&line).unwrap_or_default());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first rows of Mooncake's FAST'25 `conversation_trace.jsonl`, as published.
    const MOONCAKE: &str = r#"{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
{"timestamp": 0, "input_length": 2290, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]}
{"timestamp": 3000, "input_length": 915, "output_length": 355, "hash_ids": [0, 462]}
"#;

    /// Rows in the layout of the Qwen-Bailian trace's README (a `type`
    /// and `turn` the replay does not need, a timestamp in seconds).
    const BAILIAN: &str = r#"{"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 521, "output_length": 132, "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091, 6326]}
{"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 700, "output_length": 80, "type": "text", "turn": 2, "hash_ids": [1089, 1090, 1091, 6326, 13148]}
"#;

    #[test]
    fn mooncake_rows_read_unchanged_in_512_token_blocks() {
        let t = parse(MOONCAKE, "m").unwrap();
        assert_eq!((t.format, t.block, t.rows.len()), ("mooncake", 512, 3));
        let r = &t.rows[2];
        assert_eq!((r.at_ms, r.input_length, r.output_length, &r.hash_ids[..]), (3000.0, 915, 355, &[0, 462][..]));
        assert_eq!((r.chat_id, r.parent_chat_id), (None, None));
        // Written back in the same format, it reads the same.
        assert_eq!(parse(&to_mooncake(&t.rows), "again").unwrap(), t);
    }

    #[test]
    fn bailian_rows_take_seconds_and_sessions() {
        let t = parse(BAILIAN, "b").unwrap();
        assert_eq!((t.format, t.block), ("bailian", 16));
        assert_eq!((t.rows[0].at_ms, t.rows[1].at_ms), (61_114.0, 62_500.0));
        assert_eq!((t.rows[1].chat_id, t.rows[1].parent_chat_id), (Some(160), Some(159)));
    }

    #[test]
    fn a_bad_row_names_its_line_and_an_empty_file_is_refused() {
        let e = parse("\n{\"timestamp\": 1}\n", "f.jsonl").unwrap_err().to_string();
        assert!(e.starts_with("f.jsonl:2: missing field `input_length`"), "{e}");
        assert_eq!(parse("\n\n", "f").unwrap_err().to_string(), "f: no requests");
    }
}
