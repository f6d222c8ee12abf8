//! `dpcoord sim prefix` end to end at a tiny size: prefix caches per rank,
//! KV events into dpcoord, prompts on the route op. The simulator is one
//! event loop in virtual time and waits for dpcoord to take every stats
//! update and KV batch before each placement, so the rows repeat exactly.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::wait_or_kill;

/// The whitespace-separated cells of the row of `arm` at `fe` frontends in the table of `workload`.
fn row(text: &str, workload: &str, arm: &str, fe: &str) -> Vec<String> {
    let table = text.split("\n\n").find(|t| t.starts_with(workload)).unwrap_or_else(|| panic!("{workload} in {text}"));
    let rows: Vec<Vec<String>> = table
        .lines()
        .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .filter(|c| c.len() > 2 && c[0] == arm && c[1] == fe)
        .collect();
    assert_eq!(rows.len(), 1, "one row for {arm} at {fe} in:\n{table}");
    rows[0].clone()
}

#[test]
fn tiny_prefix_runs_repeat_exactly_and_hits_are_counted() {
    let out = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(["sim", "prefix", "--speed", "0", "--ranks", "2", "--requests", "24", "--prefix-concurrency", "4"])
        .args(["--cache-blocks", "1024", "--workload", "shared-prefix", "--workload", "multi-turn-chat"])
        .args(["--policy", "round_robin", "--policy", "cache_aware/events", "--policy", "oracle", "--out"])
        .arg(out.path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dpcoord sim prefix");
    let status = wait_or_kill(&mut child, Duration::from_secs(60), "dpcoord sim prefix");
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut stdout).unwrap();
    assert_eq!(status.code(), Some(0), "{stdout}");
    // arm, fe, completed, lost, input tok/s, ttft p50/p90/p99 ms, hit %, std, placements per rank.
    let rr = "round_robin 1 24 0 11,844 317.0 335.5 634.0 10.3 0.00 12 12";
    assert_eq!(row(&stdout, "shared-prefix", "round_robin", "1").join(" "), rr);
    // Every arm completes everything; with 48 tenants and 24 requests few prompts repeat.
    for arm in ["round_robin", "cache_aware/events", "oracle"] {
        for fe in ["1", "4"] {
            let r = row(&stdout, "shared-prefix", arm, fe);
            assert_eq!((r[2].as_str(), r[3].as_str()), ("24", "0"), "{arm} {fe}");
            let c = row(&stdout, "multi-turn-chat", arm, fe);
            // Chat: later turns find their history cached; at this size every
            // arm keeps each conversation on one rank, so the rate is the same.
            assert_eq!((c[2].as_str(), c[3].as_str(), c[8].as_str()), ("24", "0", "80.6"), "{arm} {fe}");
        }
    }
    assert!(out.path().join("prefix.svg").exists() && out.path().join("prefix.txt").exists());
}
