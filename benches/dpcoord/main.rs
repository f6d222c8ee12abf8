//! dpcoord benchmarks: ratios against baselines measured in the same run.
//!
//! `cargo bench --bench dpcoord [-- PART...]` runs the full benchmark (cargo
//! passes `--bench`) and prints one table per part plus a table of targets.
//! Parts: `transport`, `decision`, `ingest`, `memory`, `prefix`, `heavy`,
//! `health_flood`, `gateway`, `gateway_prompt`, `proxy`; a filter selects the
//! parts whose name contains it. Without `--bench` (as `cargo test
//! --all-targets` runs it) every part does a tiny bounded smoke run instead,
//! about a second in all, and no target is judged.
//!
//! The bench binary is also the bare libzmq echo server of the transport
//! part: it re-executes itself with `--echo-server ENDPOINT`, so the echo's
//! CPU time is its own process's. `DPCOORD_BENCH_BIN=PATH` measures another
//! dpcoord build against the same baselines.
#![forbid(unsafe_code)]

mod decision;
mod gateway;
mod gateway_prompt;
mod health_flood;
mod heavy;
mod ingest;
mod memory;
mod prefix;
mod proxy;
mod report;
mod support;
mod transport;

use std::time::Instant;

use report::Report;

/// Full measurements (`--bench`) or a smoke run that only proves each part works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Full,
    Smoke,
}

/// One benchmark part: it prints its table and records its targets.
type Part = fn(Mode, &mut Report);

const PARTS: [(&str, Part); 10] = [
    ("transport", transport::run),
    ("decision", decision::run),
    ("ingest", ingest::run),
    ("memory", memory::run),
    ("prefix", prefix::run),
    ("heavy", heavy::run),
    ("health_flood", health_flood::run),
    ("gateway", gateway::run),
    ("gateway_prompt", gateway_prompt::run),
    ("proxy", proxy::run),
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--echo-server") {
        let endpoint = args.get(i + 1).expect("--echo-server needs an endpoint");
        transport::echo_server(endpoint);
        return;
    }
    let mode = if args.iter().any(|a| a == "--bench") { Mode::Full } else { Mode::Smoke };
    // Flags meant for other harnesses (`cargo test -- --nocapture`) are ignored.
    let filters: Vec<&str> = args.iter().filter(|a| !a.starts_with('-')).map(String::as_str).collect();
    let selected = |part: &str| filters.is_empty() || filters.iter().any(|f| part.contains(f));

    let started = Instant::now();
    let mut report = Report::new(mode);
    println!("{}", support::machine_line());
    for (name, part) in PARTS {
        if selected(name) {
            let t = Instant::now();
            part(mode, &mut report);
            println!("  ({name}: {:.1} s)", t.elapsed().as_secs_f64());
        }
    }
    report.print_targets();
    println!("{}; took {:.1} s", support::load_line(), started.elapsed().as_secs_f64());
}
