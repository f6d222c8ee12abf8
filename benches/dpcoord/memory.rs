//! Memory and tick: the daemon's resident memory, and the duration of one
//! tick, at 8, 256 and 1024 ranks with every rank up.
//!
//! RSS is VmRSS (and its peak, VmHWM) of a spawned daemon after every rank
//! came up and it answered some route and state queries. The tick is timed
//! in process (`Coordinator::tick`), with fresh stats and placements before
//! each one, as in a running daemon.

use std::time::{Duration, Instant};

use dpcoord_daemon::config::PolicyKind;
use dpcoord_daemon::observability::metrics::Metrics;
use dpcoord_daemon::routing::Coordinator;
use dpcoord_daemon::wire::{Channel, SourceKind};

use crate::decision::{config, counts};
use crate::report::{num, Report, Table};
use crate::support::{call, req_socket, route_query, stats_update, Daemon, Latencies, Mp};
use crate::Mode;

const SIZES: [u32; 3] = [8, 256, 1024];
const KIB_PER_MIB: f64 = 1024.0;

/// (VmRSS, VmHWM) in KiB of a daemon with `dp` ranks up after `queries`
/// route queries and `settle` of ticks.
fn rss_kib(dp: u32, queries: usize, settle: Duration) -> (u64, u64) {
    let d = Daemon::start(dp, &["--policy", "least_load"]);
    d.bring_up(&[d.publisher(&d.ctx)], dp);
    let client = req_socket(&d.ctx, &d.route);
    let query = route_query();
    for _ in 0..queries {
        call(&client, &query).expect("a route answer");
    }
    let mut state = Vec::new();
    Mp(&mut state).map(2).str("v").uint(1).str("op").str("state");
    let reply = call(&client, &state).expect("a state answer");
    assert_eq!(reply["ranks"].as_array().map(Vec::len), Some(dp as usize));
    std::thread::sleep(settle);
    d.proc().rss_kib()
}

/// Tick durations at `dp` ranks: `ticks` ticks, each after a round of stats
/// from every rank and `per_tick` placements.
fn tick_durations(dp: u32, ticks: usize, per_tick: usize) -> Latencies {
    let cfg = config(dp, PolicyKind::LeastLoad);
    let mut c = Coordinator::new(&cfg.settings, Metrics::new(dp), Instant::now());
    let (query, mut out, mut buf) = (route_query(), Vec::with_capacity(256), Vec::new());
    let mut lat = Latencies::with_capacity(ticks);
    for seq in 1..=ticks as u64 + 1 {
        let now = Instant::now();
        for rank in 0..dp {
            stats_update(&mut buf, rank, seq, counts(rank, 0));
            c.on_source(SourceKind::Stats, Some(&[&buf[..]][..]), now);
        }
        for _ in 0..per_tick {
            c.on_query(Channel::Route, &query, now, &mut out);
        }
        // The first round only brings the ranks up.
        if seq > 1 {
            let t = Instant::now();
            c.tick(t);
            lat.push(t.elapsed());
        }
    }
    lat
}

pub fn run(mode: Mode, report: &mut Report) {
    let (sizes, queries, ticks, settle): (&[u32], _, _, _) = match mode {
        // A few ticks run over the placements before memory is read.
        Mode::Full => (&SIZES, 5000, 300, Duration::from_millis(300)),
        Mode::Smoke => (&SIZES[..1], 10, 3, Duration::ZERO),
    };
    let mut t = Table::new(
        "memory and tick: every rank up, least_load",
        &["ranks", "RSS MiB", "peak RSS MiB", "tick p50 us", "tick p99 us", "tick max us"],
    );
    let mut at_largest = None;
    for &dp in sizes {
        let (rss, peak) = rss_kib(dp, queries, settle);
        let mut ticks = tick_durations(dp, ticks, 64);
        let (p50, p99, max) = (ticks.quantile_us(0.5), ticks.quantile_us(0.99), ticks.quantile_us(1.0));
        t.row(vec![
            dp.to_string(),
            num(rss as f64 / KIB_PER_MIB, 1),
            num(peak as f64 / KIB_PER_MIB, 1),
            num(p50, 1),
            num(p99, 1),
            num(max, 1),
        ]);
        at_largest = Some((dp, rss, p99));
    }
    t.print();
    if let Some((dp, rss, p99)) = at_largest {
        let mib = rss as f64 / KIB_PER_MIB;
        report.target(format!("memory: RSS at {dp} ranks"), "<= 20 MiB", format!("{mib:.1} MiB"), mib <= 20.0);
        report.target(format!("tick: p99 at {dp} ranks"), "<= 1000 us", format!("{p99:.1} us"), p99 <= 1000.0);
    }
}
