//! Soak: mixed traffic against the dpcoord binary for minutes, watching
//! memory and route latency.
//!
//! ```text
//! cargo bench --bench soak                    # 30 s
//! cargo bench --bench soak -- --minutes 10    # the documented soak
//! cargo bench --bench soak -- flood           # only phases whose name contains a filter
//! ```
//!
//! Without `--bench` (as `cargo test --all-targets` runs bench targets) it
//! does a smoke run of about two seconds that proves every phase works and
//! judges nothing. Four phases, each against a fresh dpcoord:
//!
//! 1. Route p99 quiet vs under a garbage flood: one closed-loop REQ client
//!    routes while 8 engines publish; then again while three threads send
//!    garbage at full speed on the route, health and stats sockets. Prints
//!    both and the ratio against its documented bound.
//! 2. Soak: 3 paced frontends (plain, batch, session, pinned and token
//!    routes), a health prober, 8 engines (each restarting with a new boot
//!    now and then), and a one-second garbage burst every 10 s (including a
//!    DEALER that never reads). Per interval (a minute in a long run) it
//!    prints dpcoord's RSS and the route p50/p99 seen by the frontends, and
//!    flags RSS above the first interval by 20% (and 4 MiB) or p99 above 3x
//!    the first interval's.
//! 3. Restart: dpcoord stopped (SIGTERM, then SIGKILL) and started again on
//!    the same endpoints while engines publish and retrying frontends route:
//!    the time until every rank is up again, and how many queries were retried.
//! 4. Churn: route p99 of a frontend quiet vs while 4,000 peers from one
//!    other address, refused at `max_peers_per_address`, connect again every
//!    100 ms; the refusals per second and dpcoord's peak RSS.
//!
//! Every query must be answered (a retrying frontend gives up after 10 s and
//! the bench fails); refusals other than the expected are counted and shown.
#![forbid(unsafe_code)]

mod churn;
mod flood;
mod harness;
mod mixed;
mod restart;

use std::time::{Duration, Instant};

use harness::{cores, Mode, DP};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = if args.iter().any(|a| a == "--bench") { Mode::Full } else { Mode::Smoke };
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(|v| v.parse::<f64>().unwrap_or_else(|_| panic!("{flag} wants a number, got {v}")))
    };
    let total = match (value("--minutes"), mode) {
        (Some(m), _) => Duration::from_secs_f64(m * 60.0),
        (None, Mode::Full) => Duration::from_secs(30),
        (None, Mode::Smoke) => Duration::from_millis(900),
    };
    // Phases to run: those whose name contains a positional argument, else all.
    let filters: Vec<&str> = args.iter().filter(|a| !a.starts_with('-')).map(String::as_str).collect();
    let filters: Vec<&str> = filters.into_iter().filter(|f| f.parse::<f64>().is_err()).collect();
    let selected = |phase: &str| filters.is_empty() || filters.iter().any(|f| phase.contains(f));
    let started = Instant::now();
    let build = if cfg!(debug_assertions) { "debug" } else { "release" };
    println!("dpcoord soak ({build} binary, {} cores, dp_size {DP})", cores());
    if selected("flood") {
        flood::flood_ratio(mode);
    }
    if selected("soak") {
        mixed::soak(mode, total);
    }
    if selected("restart") {
        restart::restarts(mode);
    }
    if selected("churn") {
        churn::churn(mode);
    }
    println!("soak took {:.1} s", started.elapsed().as_secs_f64());
}
