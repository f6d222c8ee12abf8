//! Decision: the cost of one placement, in process.
//!
//! `Coordinator::place` (the user dispatcher's decision, before any wire or
//! metrics work) with `n = 1` for 8, 64, 256 and 1024 ranks (all up, uneven
//! loads) per policy; and the whole query path at 8 ranks
//! (`Coordinator::on_query`: decode, decide, account, encode, metrics) with
//! its decode and encode steps alone. Timed in chunks with `Instant`; the
//! median chunk is reported, which shrugs off preemption on a busy machine.
//! Between chunks (untimed) every rank acknowledges its placements and the
//! dispatcher ticks now and then, so ledgers stay bounded as in a daemon.

use std::hint::black_box;
use std::time::{Duration, Instant};

use dpcoord_daemon::config::{Config, PolicyKind};
use dpcoord_daemon::engines::{EngineEvent, LoadReport};
use dpcoord_daemon::observability::metrics::Metrics;
use dpcoord_daemon::routing::Coordinator;
use dpcoord_daemon::wire::{self, Channel, QueryLimits, RouteRequest, SourceKind, Target};

use crate::report::{num, ratio, Report, Table};
use crate::support::{route_query, stats_update};
use crate::Mode;

pub const SIZES: [u32; 4] = [8, 64, 256, 1024];
const PROMPT_TOKENS: u64 = 512;

/// A config with `dp` ranks that stay up for the whole bench.
pub fn config(dp: u32, policy: PolicyKind) -> Config {
    let mut c = Config::default();
    c.settings.engines.dp_size = dp;
    c.settings.engines.stale_after = Duration::from_secs(600);
    c.settings.engines.down_after = Duration::from_secs(1200);
    c.settings.routing.policy = policy;
    c
}

/// An uneven but steady load: what rank `r` reports besides `received`.
pub fn counts(rank: u32, received: u64) -> [u64; 5] {
    [u64::from(rank % 3), u64::from(rank % 5 + 1), received, 0, 0]
}

/// Chunk size and time budget per measurement.
#[derive(Clone, Copy)]
pub struct Budget {
    pub chunk: usize,
    pub time: Duration,
}

impl Budget {
    pub fn of(mode: Mode) -> Budget {
        match mode {
            Mode::Full => Budget { chunk: 1024, time: Duration::from_millis(250) },
            Mode::Smoke => Budget { chunk: 64, time: Duration::from_millis(1) },
        }
    }

    /// Median nanoseconds per call of `work` (which makes `chunk` calls on
    /// `state`), running `between` untimed after every chunk (with the
    /// chunk's number); at least 3 chunks.
    pub fn median_ns<S>(
        self,
        state: &mut S,
        mut work: impl FnMut(&mut S, usize),
        mut between: impl FnMut(&mut S, usize),
    ) -> f64 {
        let mut per_call = Vec::new();
        let started = Instant::now();
        while per_call.len() < 3 || started.elapsed() < self.time {
            let t = Instant::now();
            work(state, self.chunk);
            per_call.push(t.elapsed().as_nanos() as f64 / self.chunk as f64);
            between(state, per_call.len());
        }
        per_call.sort_by(f64::total_cmp);
        per_call[per_call.len() / 2]
    }
}

/// A coordinator with every rank up.
struct Fleet {
    coord: Coordinator,
    seq: u64,
}

impl Fleet {
    fn new(cfg: &Config, now: Instant) -> Fleet {
        let dp = cfg.settings.engines.dp_size;
        let mut f = Fleet { coord: Coordinator::new(&cfg.settings, Metrics::new(dp), now), seq: 0 };
        f.report(now);
        f
    }

    /// Every rank reports, acknowledging all placements so far.
    fn report(&mut self, now: Instant) {
        self.seq += 1;
        for r in self.coord.state_view(now).ranks {
            let counts = counts(r.rank, r.routed);
            let [waiting, running, ..] = counts;
            let report = LoadReport::new(r.rank, 1, self.seq)
                .counts(counts)
                .tokens([waiting * PROMPT_TOKENS, running * PROMPT_TOKENS]);
            self.coord.on_event(EngineEvent::Load(report), now);
        }
    }
}

/// Median ns of one `Coordinator::place` placement.
fn placement_ns(budget: Budget, dp: u32, policy: PolicyKind) -> f64 {
    let cfg = config(dp, policy);
    let req = RouteRequest {
        n: 1,
        prompt_tokens: Some(PROMPT_TOKENS),
        target: Target::Policy,
        session: None,
        prompt: None,
        explain: false,
        among: None,
        fallbacks: 0,
        shed_waiting: None,
    };
    let mut out = Vec::with_capacity(1);
    budget.median_ns(
        &mut Fleet::new(&cfg, Instant::now()),
        |f, chunk| {
            let now = Instant::now();
            for _ in 0..chunk {
                f.coord.place(black_box(&req), now, &mut out).expect("a rank is up");
                black_box(&out);
            }
        },
        |f, i| {
            let now = Instant::now();
            f.report(now);
            if i % 16 == 0 {
                f.coord.tick(now);
            }
        },
    )
}

/// The baseline of `least_load`'s placement: the bare minimum scan over the
/// same costs (each rank's `(load + 1) * (1 + penalty)`, read from the state
/// view of a fleet like the one placed on), median ns per scan.
fn min_scan_ns(budget: Budget, dp: u32) -> f64 {
    let cfg = config(dp, PolicyKind::LeastLoad);
    let now = Instant::now();
    let fleet = Fleet::new(&cfg, now);
    let costs: Vec<f64> =
        fleet.coord.state_view(now).ranks.iter().map(|r| (r.load + 1.0) * (1.0 + r.penalty)).collect();
    budget.median_ns(
        &mut (),
        |_, chunk| {
            for _ in 0..chunk {
                let mut best = (f64::INFINITY, 0);
                for (r, &c) in black_box(&costs).iter().enumerate() {
                    if c < best.0 {
                        best = (c, r);
                    }
                }
                black_box(best);
            }
        },
        |_, _| {},
    )
}

/// Every rank acknowledges what the coordinator placed on it; ticks when due.
fn acknowledge(c: &mut Coordinator, seq: u64, buf: &mut Vec<u8>) {
    let now = Instant::now();
    for r in c.state_view(now).ranks {
        stats_update(buf, r.rank, seq, counts(r.rank, r.routed));
        c.on_source(SourceKind::Stats, Some(&[&buf[..]][..]), now);
    }
    if now >= c.next_tick() {
        c.tick(now);
    }
}

/// Median ns of one route query through `Coordinator::on_query` at `dp` ranks.
fn query_ns(budget: Budget, dp: u32, policy: PolicyKind) -> f64 {
    let cfg = config(dp, policy);
    let mut coord = Coordinator::new(&cfg.settings, Metrics::new(dp), Instant::now());
    let mut buf = Vec::new();
    acknowledge(&mut coord, 1, &mut buf);
    let query = route_query();
    let mut out = Vec::with_capacity(256);
    coord.on_query(Channel::Route, &query, Instant::now(), &mut out);
    let reply: serde_json::Value = rmp_serde::from_slice(&out).expect("a MessagePack reply");
    assert_eq!(reply["ok"], serde_json::Value::Bool(true), "on_query answered {reply}");
    budget.median_ns(
        &mut coord,
        |c, chunk| {
            for _ in 0..chunk {
                c.on_query(Channel::Route, black_box(&query), Instant::now(), &mut out);
                black_box(&out);
            }
        },
        |c, i| acknowledge(c, i as u64 + 1, &mut buf),
    )
}

/// Median ns of decoding the route query, and of encoding its answer.
fn wire_ns(budget: Budget) -> (f64, f64) {
    let query = route_query();
    let limits = QueryLimits {
        dp_size: 8,
        max_dp_size: 8,
        max_batch: 1024,
        max_message_bytes: 65536,
        max_prompt_tokens: 262_144,
    };
    let mut tokens = Vec::new();
    let decode = budget.median_ns(
        &mut (),
        |_, chunk| {
            for _ in 0..chunk {
                black_box(wire::decode_route_query(black_box(&query), &limits, &mut tokens).is_ok());
            }
        },
        |_, _| {},
    );
    let mut out = Vec::with_capacity(256);
    let encode = budget.median_ns(
        &mut (),
        |_, chunk| {
            for r in 0..chunk as u32 {
                wire::encode_ranks(&mut out, Some(wire::Id::UInt(1)), &[r % 8], 1, None, None);
                black_box(&out);
            }
        },
        |_, _| {},
    );
    (decode, encode)
}

pub fn run(mode: Mode, report: &mut Report) {
    let budget = Budget::of(mode);
    let mut header = vec!["policy".to_string()];
    header.extend(SIZES.iter().map(|dp| format!("{dp} ranks")));
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut t = Table::new("decision: one placement, Coordinator::place n=1, median ns", &header);
    let mut worst = [(0.0_f64, ""); SIZES.len()];
    let mut least_load = [0.0; SIZES.len()];
    for policy in PolicyKind::ALL {
        let mut row = vec![policy.as_str().to_string()];
        for (i, &dp) in SIZES.iter().enumerate() {
            let ns = placement_ns(budget, dp, policy);
            if ns > worst[i].0 {
                worst[i] = (ns, policy.as_str());
            }
            if policy == PolicyKind::LeastLoad {
                least_load[i] = ns;
            }
            row.push(num(ns, 0));
        }
        t.row(row);
    }
    let scans: Vec<f64> = SIZES.iter().map(|&dp| min_scan_ns(budget, dp)).collect();
    let mut row = vec!["baseline: a bare minimum scan of least_load's costs".to_string()];
    row.extend(scans.iter().map(|&ns| num(ns, 0)));
    t.row(row);
    let mut row = vec!["least_load / the bare scan".to_string()];
    row.extend(least_load.iter().zip(&scans).map(|(&ll, &scan)| ratio(ll, scan)));
    t.row(row);
    t.print();

    let mut q = Table::new("decision: whole query path at 8 ranks, median ns per query", &["step", "ns"]);
    for policy in PolicyKind::ALL {
        q.row(vec![format!("Coordinator::on_query, {}", policy.as_str()), num(query_ns(budget, 8, policy), 0)]);
    }
    let (decode, encode) = wire_ns(budget);
    q.row(vec!["  of which: wire::decode_route_query".into(), num(decode, 0)]);
    q.row(vec!["  of which: wire::encode_ranks".into(), num(encode, 0)]);
    q.print();

    let (at8, at1024) = (worst[0], worst[SIZES.len() - 1]);
    report.target(
        "decision: placement at 8 ranks (worst policy)",
        "<= 150 ns",
        format!("{:.0} ns ({})", at8.0, at8.1),
        at8.0 <= 150.0,
    );
    report.target(
        "decision: placement at 1024 ranks (worst policy)",
        "<= 2000 ns",
        format!("{:.0} ns ({})", at1024.0, at1024.1),
        at1024.0 <= 2000.0,
    );
    let (ll, scan) = (least_load[SIZES.len() - 1], scans[SIZES.len() - 1]);
    report.target(
        "decision: least_load at 1024 ranks against a bare minimum scan",
        "<= 2x",
        format!("{} ({ll:.0} ns / {scan:.0} ns)", ratio(ll, scan)),
        ll <= 2.0 * scan,
    );
}
