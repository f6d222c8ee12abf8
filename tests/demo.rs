//! `dpcoord demo` end to end: the real binary, its live table without a TTY,
//! its /metrics while it runs, the summary, and Ctrl-C (SIGINT).
mod common;

use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use common::{http_raw, lines_of, wait_or_kill};

/// Longest any one wait may take.
const DEADLINE: Duration = Duration::from_secs(20);
const HEADER: &str = "rank  status  placements  waiting  running  pending  penalty  probes";

/// A running demo whose stdout lines arrive on a channel.
struct Demo {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Demo {
    fn start(seconds: &str) -> Demo {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
            .args(["demo", "--seconds", seconds])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn dpcoord demo");
        let lines = lines_of(child.stdout.take().unwrap());
        Demo { child, lines, seen: Vec::new() }
    }

    /// Reads lines until one satisfies `f`; returns it.
    fn until(&mut self, what: &str, f: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let left = DEADLINE.checked_sub(start.elapsed()).unwrap_or_else(|| panic!("timed out waiting for {what}"));
            let line = self.lines.recv_timeout(left).unwrap_or_else(|_| panic!("no {what} in {:?}", self.seen));
            self.seen.push(line.clone());
            if f(&line) {
                return line;
            }
        }
    }

    /// Waits for the exit code, then returns all of stdout.
    fn finish(mut self) -> (Option<i32>, String) {
        let status = wait_or_kill(&mut self.child, DEADLINE, "dpcoord demo");
        self.seen.extend(self.lines.iter());
        (status.code(), self.seen.join("\n"))
    }
}

/// The number after `label` in the summary, e.g. `completed requests: 12`.
fn after<'a>(text: &'a str, label: &str) -> Vec<&'a str> {
    let line = text.lines().find_map(|l| l.trim_start().strip_prefix(label)).unwrap_or_else(|| panic!("{label}"));
    line.split_whitespace().collect()
}

#[test]
fn demo_shows_the_table_serves_metrics_and_summarizes() {
    let mut demo = Demo::start("3");
    let intro = demo.until("the metrics address", |l| l.starts_with("metrics: http://"));
    let addr = intro["metrics: http://".len()..].split("/metrics").next().unwrap().to_owned();
    demo.until("a table", |l| l.starts_with("completed "));
    let metrics = http_raw(addr.parse().unwrap(), "GET", "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(metrics.contains("dpcoord_routed_total{class=\"health\",dp_rank=\"0\"}"), "{metrics}");
    let (code, out) = demo.finish();
    assert_eq!(code, Some(0), "{out}");
    assert!(!out.contains('\x1b'), "no cursor movement without a TTY");
    let progress: Vec<&str> = out.lines().filter(|l| l.starts_with('[') && l.contains(" s  epoch ")).collect();
    assert_eq!(progress.len(), out.lines().filter(|l| *l == HEADER).count(), "{out}");
    assert!(progress.last().unwrap().starts_with(&format!("[{}]   3.0/3 s  epoch ", "#".repeat(30))), "{out}");
    let last_table: Vec<&str> = out.rsplit(HEADER).next().unwrap().lines().skip(1).take(8).collect();
    assert!(last_table.iter().all(|l| l.split_whitespace().nth(1) == Some("up")), "{last_table:?}");

    let placements: Vec<u64> =
        after(&out, "user placements per rank:")[..8].iter().map(|n| n.parse().unwrap()).collect();
    let (lo, hi) = (placements.iter().min().unwrap(), placements.iter().max().unwrap());
    assert!(hi - lo <= 1, "round_robin over 8 up ranks spreads placements evenly: {placements:?}");
    let completed: u64 = after(&out, "completed requests:")[0].parse().unwrap();
    let in_flight: u64 = after(&out, "completed requests:")[1].trim_start_matches('(').parse().unwrap();
    assert_eq!(placements.iter().sum::<u64>(), completed + in_flight, "each request placed exactly once");
    let probes = after(&out, "health probes:");
    let total: u64 = probes[0].parse().unwrap();
    let per_rank: u64 = probes[7..15].iter().map(|n| n.trim_end_matches(';').parse::<u64>().unwrap()).sum();
    assert_eq!(total, per_rank);
    assert!(out.contains(&format!("metrics were served at http://{addr}/metrics")), "{out}");
}

#[test]
fn ctrl_c_stops_the_demo_early_with_a_summary() {
    let mut demo = Demo::start("600");
    demo.until("a table", |l| l == HEADER);
    let started = Instant::now();
    let pid = demo.child.id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let (code, out) = demo.finish();
    assert_eq!(code, Some(0), "{out}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(out.contains("summary after "), "{out}");
    assert!(out.contains("completed requests:"), "{out}");
}
