//! `dpcoord demo` end to end: the real binary, its three phases' final
//! tables without a TTY, its /metrics while they run, the comparison of the
//! phases and its verdict, and Ctrl-C (SIGINT).

use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::common::{http_raw, lines_of, run_to_end, wait_or_kill};

/// Longest any one wait may take.
const DEADLINE: Duration = Duration::from_secs(20);
/// The live table's header (then `   hit %` once a rank has looked a prompt up in its cache).
const HEADER: &str = "rank  status  placements  waiting  running  pending  penalty  probes";

/// A running demo whose stdout lines arrive on a channel.
struct Demo {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Demo {
    fn start(seconds: &str) -> Demo {
        Demo::start_with(&["--seconds", seconds])
    }

    /// `dpcoord demo ARGS`.
    fn start_with(args: &[&str]) -> Demo {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
            .arg("demo")
            .args(args)
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

/// The summary row of `label`: 8 placements, then std, busiest, mean, hit %, input tok/s, ttft p99.
fn row(text: &str, label: &str) -> (Vec<u64>, Vec<f64>) {
    let summary = text.split("\nsummary (").nth(1).unwrap_or_else(|| panic!("no summary in {text}"));
    let line =
        summary.lines().find_map(|l| l.strip_prefix(label)).unwrap_or_else(|| panic!("no {label} row in {text}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!((words.len(), words[14]), (15, "ms"), "{line}");
    let placements = words[..8].iter().map(|n| n.parse().unwrap()).collect();
    let numbers = words[8..14].iter().map(|n| n.replace(',', "").parse().unwrap()).collect();
    (placements, numbers)
}

/// The verdict line, recomputed from the summary rows of vLLM's rule and
/// dpcoord as printed: the ratios of their input tok/s and TTFT p99, to
/// two decimals, and who came out ahead on those (none in a run too short
/// for vLLM's rule to complete a request).
fn verdict_of(text: &str) -> String {
    let ((_, vllm), (_, dpcoord)) = (row(text, "vLLM's rule"), row(text, "through dpcoord"));
    if vllm[4] == 0.0 || vllm[5] == 0.0 {
        return "verdict: none, vLLM's rule completed no request to compare with".to_owned();
    }
    let (tps, p99) = (format!("{:.2}", dpcoord[4] / vllm[4]), format!("{:.2}", dpcoord[5] / vllm[5]));
    let (t, p): (f64, f64) = (tps.parse().unwrap(), p99.parse().unwrap());
    let word = |ahead: bool, behind: bool| {
        if ahead {
            "ahead"
        } else if behind {
            "behind"
        } else {
            "even"
        }
    };
    let who = match (word(t > 1.0, t < 1.0), word(p < 1.0, p > 1.0)) {
        ("ahead", "ahead") => "dpcoord ahead on both".to_owned(),
        ("behind", "behind") => "dpcoord behind on both".to_owned(),
        (a, b) => format!("dpcoord not ahead on both ({a} on tok/s, {b} on TTFT p99)"),
    };
    format!("verdict: through dpcoord {tps}x the input tok/s of vLLM's rule, TTFT p99 {p99}x: {who}")
}

/// Each phase's summary row against its end line: every request placed once,
/// 32 in flight at the end. Returns each phase's label and numbers (see [`row`]).
fn placed_once(out: &str) -> Vec<(&'static str, Vec<f64>)> {
    let labels = ["stale snapshot", "vLLM's rule", "through dpcoord"];
    labels
        .into_iter()
        .map(|label| {
            let (placements, numbers) = row(out, label);
            let (completed, in_flight) = ended(out, label);
            assert_eq!(placements.iter().sum::<u64>(), completed + in_flight, "{label}: each request placed once");
            assert_eq!(in_flight, 32, "{label}: a closed loop of 32");
            (label, numbers)
        })
        .collect()
}

/// Each phase's table, in order: its placements per rank, and `(completed,
/// input tok/s)` from its last line, `completed C requests, T input
/// tokens/s, placement std S`.
fn tables(text: &str) -> Vec<(Vec<u64>, (u64, f64))> {
    let tables = text.split(HEADER).skip(1).map(|table| {
        let lines: Vec<&str> = table.lines().skip(1).take(9).collect();
        let placements = lines[..8].iter().map(|l| l.split_whitespace().nth(2).unwrap().parse().unwrap()).collect();
        let words: Vec<&str> = lines[8].strip_prefix("completed ").expect(lines[8]).split_whitespace().collect();
        (placements, (words[0].parse().unwrap(), words[2].replace(',', "").parse().unwrap()))
    });
    tables.collect()
}

/// `(completed, in flight)` from `<phase> ended after S s: C requests completed, F in flight at the end`.
fn ended(text: &str, label: &str) -> (u64, u64) {
    // The phase's own length is wall time (3.0 s, or a tenth more on a loaded machine).
    let line =
        text.lines().find(|l| l.starts_with(&format!("{label} ended after ")) && l.contains(" s: ")).expect(label);
    let words: Vec<&str> = line.split_whitespace().collect();
    let n = words.len();
    (words[n - 9].parse().unwrap(), words[n - 6].parse().unwrap())
}

#[test]
fn demo_shows_three_phases_serves_metrics_and_compares_them() {
    let mut demo = Demo::start("3");
    let intro = demo.until("the metrics address", |l| l.contains("metrics: http://"));
    let addr = intro.split("metrics: http://").nth(1).unwrap().split("/metrics").next().unwrap().to_owned();
    // Each phase's heading comes once its dpcoord serves.
    demo.until("the first phase", |l| l.starts_with("phase 1/3, stale snapshot: "));
    let metrics = http_raw(addr.parse().unwrap(), "GET", "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(metrics.contains("dpcoord_routed_total{class=\"health\",dp_rank=\"0\"}"), "{metrics}");
    demo.until("the last phase", |l| l.starts_with("phase 3/3, through dpcoord (cache_aware): "));
    let metrics = http_raw(addr.parse().unwrap(), "GET", "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200"), "the last phase's daemon serves the same address: {metrics}");
    let (code, out) = demo.finish();
    assert_eq!(code, Some(0), "{out}");
    assert!(!out.contains('\x1b'), "no cursor movement without a TTY");
    // Without a TTY each phase writes its final table only.
    let progress: Vec<&str> = out.lines().filter(|l| l.starts_with('[') && l.contains(" s  epoch ")).collect();
    assert_eq!((progress.len(), out.lines().filter(|l| l.starts_with(HEADER)).count()), (3, 3), "{out}");
    let full = format!("[{}]   3.0/3 s  epoch ", "#".repeat(30));
    assert!(progress.iter().all(|l| l.starts_with(&full)), "each phase ran its 3 s: {out}");
    for phase in [
        "phase 1/3, stale snapshot: ",
        "phase 2/3, vLLM's rule (vLLM 0.33's API servers): ",
        "phase 3/3, through dpcoord (cache_aware): ",
    ] {
        assert!(out.lines().any(|l| l.starts_with(phase)), "{phase} in {out}");
    }
    assert!(out.contains("\npending: placed but not yet in the rank's own stats"), "{out}");
    assert!(out.contains("\npenalty: TTFT above the median"), "{out}");
    let last_table: Vec<&str> = out.rsplit(HEADER).next().unwrap().lines().skip(1).take(8).collect();
    assert!(last_table.iter().all(|l| l.split_whitespace().nth(1) == Some("up")), "{last_table:?}");

    // Wall-clock runs do not repeat exactly: the structure is asserted, not which phase spreads best.
    let tables = tables(&out);
    assert_eq!(tables.len(), 3, "{out}");
    for ((label, numbers), table) in placed_once(&out).into_iter().zip(tables) {
        assert!(numbers[1] >= numbers[2], "{label}: the busiest rank holds at least the mean: {numbers:?}");
        let same = (row(&out, label).0, (ended(&out, label).0, numbers[4]));
        assert_eq!(table, same, "{label}: its final table and the summary agree: {out}");
    }
    let probes = out.lines().find_map(|l| l.strip_prefix("health probes: ")).expect("probes line");
    let words: Vec<&str> = probes.split_whitespace().collect();
    let total: u64 = words[0].parse().unwrap();
    let per_rank: u64 = words[7..15].iter().map(|n| n.trim_end_matches(';').parse::<u64>().unwrap()).sum();
    assert_eq!(total, per_rank);
    assert!(out.contains("\n  they took no user placement\n"), "{out}");
    assert!(out.contains(&format!("metrics were served at http://{addr}/metrics")), "{out}");
    // The last line: dpcoord against vLLM's rule, as the rows above say (whoever came out ahead).
    let last = out.lines().rfind(|l| !l.is_empty()).unwrap();
    assert!(last.starts_with("verdict: through dpcoord "), "{out}");
    assert_eq!(last, verdict_of(&out), "{out}");
}

#[test]
fn ctrl_c_stops_the_demo_early_with_a_summary() {
    let mut demo = Demo::start("600");
    demo.until("the first phase", |l| l.starts_with("phase 1/3, stale snapshot: "));
    let started = Instant::now();
    let pid = demo.child.id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let (code, out) = demo.finish();
    assert_eq!(code, Some(0), "{out}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(out.contains("stale snapshot ended after "), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with(HEADER)).count(), 1, "the stopped phase's table: {out}");
    assert!(!out.contains("vLLM's rule ended after "), "the later phases do not run: {out}");
    assert!(out.contains("\nsummary (8 simulated ranks, 2 frontends, 32 requests in flight):\n"), "{out}");
    row(&out, "stale snapshot");
    let last = out.lines().rfind(|l| !l.is_empty()).unwrap();
    assert_eq!(last, "verdict: none, the demo stopped before vLLM's rule and through dpcoord both ran", "{out}");
}

#[test]
fn frontends_share_the_requests_in_flight_and_are_named_in_the_intro_and_summary() {
    let demo = Demo::start_with(&["--seconds", "1", "--frontends", "4"]);
    let (code, out) = demo.finish();
    assert_eq!(code, Some(0), "{out}");
    assert!(out.starts_with("dpcoord demo: 8 simulated engines, 4 frontends keeping 32 requests in flight "), "{out}");
    assert!(out.contains("\nsummary (8 simulated ranks, 4 frontends, 32 requests in flight):\n"), "{out}");
    placed_once(&out); // 4 frontends, 8 in flight each: still 32 in each phase
    assert!(
        out.contains(
            "\nphase 2/3, vLLM's rule (vLLM 0.33's API servers): each frontend takes the rank with the least\n\
        max(waiting + running in its snapshot, 4 x its own unfinished requests there) and\n\
        counts its pick 4 times until the next snapshot; it knows nothing of prefixes\n"
        ),
        "{out}"
    );
    let out = Demo::start_with(&["--seconds", "1", "--frontends", "1"]).finish().1;
    assert!(out.starts_with("dpcoord demo: 8 simulated engines, 1 frontend keeping 32 requests "), "{out}");
    assert!(out.contains("\nsummary (8 simulated ranks, 1 frontend, 32 requests in flight):\n"), "{out}");
    assert!(out.contains(" 1 x its own unfinished requests there) and\ncounts its pick once until the next"), "{out}");
    assert_eq!(out.lines().rfind(|l| !l.is_empty()).unwrap(), verdict_of(&out), "{out}");
}

#[test]
fn policy_least_load_runs_the_same_traffic_and_says_dpcoord_ignores_prefixes_too() {
    let demo = Demo::start_with(&["--seconds", "1", "--policy", "least_load"]);
    let (code, out) = demo.finish();
    assert_eq!(code, Some(0), "{out}");
    assert!(out.lines().any(|l| l.starts_with("phase 3/3, through dpcoord (least_load): ")), "{out}");
    assert!(out.contains("dpcoord counts every\nplacement and (least_load), like vLLM's rule, ignores prefixes.\n"));
    placed_once(&out);
    assert_eq!(out.lines().rfind(|l| !l.is_empty()).unwrap(), verdict_of(&out), "{out}");
}

#[test]
fn a_frontend_count_outside_1_to_32_is_refused() {
    for n in ["0", "33"] {
        let (code, stderr) = run_to_end(&["demo", "--frontends", n]);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("invalid value '{n}' for '--frontends <N>': {n} is not in 1..=32")),
            "{stderr}"
        );
    }
}
