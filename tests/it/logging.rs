//! Logs of the real binary: text by default, `--log-format json` gives one
//! JSON object per line, rank state changes are logged once at info, and no
//! per-query line shows at info.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::{json, Value};

/// Spawns the binary with `RUST_LOG=info` and the given extra flags; returns
/// it, its stderr lines as they come, and its endpoints' directory.
fn spawn_logging(args: &[&str]) -> (Spawned, mpsc::Receiver<String>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (child, rx) = spawn_on_ipc(&dir, &[&["--dp-size", "1"], args].concat(), "info");
    (child, rx, dir)
}

/// Publishes to rank 0 until a line satisfying `is_change` is logged; returns all lines so far.
fn until_state_change(stats: &str, lines: &mpsc::Receiver<String>, is_change: impl Fn(&str) -> bool) -> Vec<String> {
    let ctx = zmq::Context::new();
    let p = ctx.socket(zmq::PUB).unwrap();
    p.set_linger(0).unwrap();
    p.connect(stats).unwrap();
    let (start, mut seen, mut seq) = (Instant::now(), Vec::new(), 0);
    while !seen.iter().any(|l: &String| is_change(l)) {
        assert!(start.elapsed() < DEADLINE, "no state-change log line; got {seen:?}");
        seq += 1;
        p.send(encode(&update(0, 1, seq, [0; 5])), 0).unwrap();
        seen.extend(lines.recv_timeout(Duration::from_millis(20)).ok());
        seen.extend(lines.try_iter());
    }
    seen
}

fn stop_and_collect(child: Spawned, lines: mpsc::Receiver<String>, mut seen: Vec<String>) -> Vec<String> {
    assert_eq!(child.stop().code(), Some(0));
    // The reader thread ends at EOF, which closes the channel.
    seen.extend(lines.iter());
    seen
}

#[test]
fn json_log_format_writes_one_json_object_per_line_with_state_changes() {
    let (child, lines, dir) = spawn_logging(&["--log-format", "json"]);
    let is_change = |l: &str| {
        serde_json::from_str::<Value>(l).is_ok_and(|v| {
            v["level"] == "INFO"
                && v["fields"]["message"] == "rank status changed"
                && v["fields"]["dp_rank"] == 0
                && v["fields"]["from"] == "unknown"
                && v["fields"]["to"] == "up"
        })
    };
    let seen = until_state_change(&ipc(&dir, "stats"), &lines, is_change);
    let all = stop_and_collect(child, lines, seen);
    for line in &all {
        assert!(serde_json::from_str::<Value>(line).is_ok_and(|v| v.is_object()), "not a JSON object: {line}");
    }
    // Logged once, though many updates arrived.
    assert_eq!(all.iter().filter(|l| is_change(l)).count(), 1);
}

#[test]
fn text_logs_by_default_and_no_per_query_lines_at_info() {
    let (child, lines, dir) = spawn_logging(&[]);
    let is_change = |l: &str| l.contains("INFO") && l.contains("rank status changed") && l.contains("to=\"up\"");
    let seen = until_state_change(&ipc(&dir, "stats"), &lines, is_change);
    let ctx = zmq::Context::new();
    let c = Client::connect(&ctx, &ipc(&dir, "route"));
    assert_eq!(c.call(json!({"v": 1, "op": "route"}))["ranks"], json!([0]));
    assert_eq!(c.error_code(json!({"v": 1, "op": "fly"})), "unknown_op");
    let all = stop_and_collect(child, lines, seen);
    assert!(all.iter().all(|l| !l.starts_with('{')), "{all:?}");
    assert_eq!(all.iter().filter(|l| is_change(l)).count(), 1, "{all:?}");
    assert!(!all.iter().any(|l| l.contains("query")), "per-query lines at info: {all:?}");
}
