//! What `dpcoord demo` prints as it goes: the intro, each phase's heading
//! and live table with its legend (`demo_summary`: the phases' end lines
//! and the closing comparison).

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::record::{std_dev, Live};
use super::report::thousands;
use super::stale::StaleRule;
use dpcoord_daemon::wire::StateView;

pub const RANKS: u32 = 8;
/// Requests in flight over all frontends (closed loop).
pub const CONCURRENCY: u32 = 32;
/// The hop from a frontend to its engine, in milliseconds.
pub const HOP_MS: (u64, u64) = (20, 50);
/// How often the frontends of the first phase get the engines' counts (vLLM's coordinator: 100 ms).
pub const SNAPSHOT_MS: u64 = 100;

/// The demo's phases: the same cluster and traffic, placed three ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Each frontend picks from the last snapshot as received.
    Snapshot,
    /// Each frontend also counts its own picks since the snapshot (vLLM's rule).
    Guess,
    /// Each placement is asked of dpcoord.
    Dpcoord,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Snapshot, Phase::Guess, Phase::Dpcoord];

    /// How the phase's frontends place requests on their own, if they do.
    pub fn rule(self) -> Option<StaleRule> {
        let every = SNAPSHOT_MS * 1000;
        match self {
            Phase::Snapshot => Some(StaleRule { every, guess: false }),
            Phase::Guess => Some(StaleRule { every, guess: true }),
            Phase::Dpcoord => None,
        }
    }

    /// The row label of the closing comparison.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Snapshot => "stale snapshot",
            Phase::Guess => "vLLM's rule",
            Phase::Dpcoord => "through dpcoord",
        }
    }

    /// What the phase does, above its live table, with `frontends` frontends.
    pub fn heading(self, policy: &str, frontends: u32) -> String {
        match self {
            Phase::Snapshot => format!(
                "phase 1/3, stale snapshot: each frontend sends every request to the least loaded rank in\n\
                 the engines' counts it got last (every {SNAPSHOT_MS} ms), as DP controllers on load reports do"
            ),
            Phase::Guess => format!(
                "phase 2/3, vLLM's rule (vLLM 0.33's API servers): each frontend takes the rank with the least\n\
                 max(waiting + running in its snapshot, {frontends} x its own unfinished requests there) and\n\
                 counts its pick {} until the next snapshot; it knows nothing of prefixes",
                times(frontends)
            ),
            Phase::Dpcoord if prefix_aware(policy) => format!(
                "phase 3/3, through dpcoord ({policy}): each frontend asks dpcoord, which counts every\n\
                 placement (pending: not yet in the engine's stats) and, from the engines' KV events, sends\n\
                 each request where its prefix is cached"
            ),
            Phase::Dpcoord => format!(
                "phase 3/3, through dpcoord ({policy}): each frontend asks dpcoord, which counts every\n\
                 placement, also those the engines have not reported yet (pending)"
            ),
        }
    }
}

/// `n` frontends, in words: 1 frontend, 2 frontends.
pub fn frontends(n: u32) -> String {
    match n {
        1 => "1 frontend".to_owned(),
        n => format!("{n} frontends"),
    }
}

/// `n` times, in words: once, twice, 3 times.
fn times(n: u32) -> String {
    match n {
        1 => "once".to_owned(),
        2 => "twice".to_owned(),
        n => format!("{n} times"),
    }
}

/// Whether the demo's frontends send prompts and its engines publish KV events
/// (`cache_aware`, `lmetric`).
pub(super) fn prefix_aware(policy: &str) -> bool {
    dpcoord_daemon::routing::PolicyKind::parse(policy).is_some_and(|p| p.uses_prefix())
}

/// What every phase sends: shared-prefix prompts (`prompts::Workload::Shared`).
pub const TENANTS: u32 = 48;
pub const PREFIX_TOKENS: u32 = 3072;
pub const QUESTION_TOKENS: u32 = 640;
pub const OUTPUT_TOKENS: u32 = 32;
/// Each rank's prefix cache, in blocks of 16 tokens.
pub const CACHE_BLOCKS: usize = 4096;

/// What the demo runs, printed once at the start.
pub fn intro(metrics: SocketAddr, seconds: u64, count: u32) -> String {
    format!(
        "dpcoord demo: {RANKS} simulated engines, {} keeping {CONCURRENCY} requests in flight \
         (each takes\n\
         a {}-{} ms hop to its engine) and a prober on the health channel; three phases of {seconds} s\n\
         each. Requests come from {TENANTS} tenants, each a {PREFIX_TOKENS}-token system prompt shared by its\n\
         requests, then a {QUESTION_TOKENS}-token question; each engine has a prefix cache ({CACHE_BLOCKS} \
         blocks of 16\n\
         tokens) and skips the cached part of a prompt. In phases 1 and 2 the frontends choose the\n\
         rank and tell dpcoord (a pin); the table is dpcoord's view. Ctrl-C stops early.\n\
         metrics: http://{metrics}/metrics (also /state, /healthz, /readyz)\n",
        frontends(count),
        HOP_MS.0,
        HOP_MS.1
    )
}

/// Under the live table: what the columns that need it mean.
pub const LEGEND: &str = "\
pending: placed but not yet in the rank's own stats (the hop); dpcoord counts them as load.\n\
penalty: TTFT above the median (ttft/median - 1) plus failures; least_load & co. weigh load\n\
\x20        by 1 + penalty, round_robin ignores it. probes: health probes, never user placements.\n";

/// The live table, under the phase's heading: dpcoord's view of each rank
/// plus the prober's count.
pub fn render(view: &StateView, live: &Live, elapsed: Duration, total: Duration) -> String {
    let width = 30;
    let done = ((elapsed.as_secs_f64() / total.as_secs_f64().max(1e-9)) * width as f64).round() as usize;
    let bar: String = (0..width).map(|i| if i < done.min(width) { '#' } else { '.' }).collect();
    let mut out = format!(
        "[{bar}] {:>5.1}/{} s  epoch {}\n\
         rank  status  placements  waiting  running  pending  penalty  probes\n",
        elapsed.as_secs_f64(),
        total.as_secs(),
        view.epoch
    );
    let cache = live.prompt.iter().any(|p| p.load(Ordering::Relaxed) > 0);
    if cache {
        out.insert_str(out.len() - 1, "   hit %");
    }
    for r in &view.ranks {
        let probes = live.probes.get(r.rank as usize).map_or(0, |p| p.load(Ordering::Relaxed));
        let _ = write!(
            out,
            "{:>4}  {:<6}  {:>10}  {:>7}  {:>7}  {:>7}  {:>7.2}  {:>6}",
            r.rank, r.status, r.routed, r.counts.waiting, r.counts.running, r.pending, r.penalty, probes
        );
        match live.hit_rate(r.rank as usize) {
            Some(h) if cache => out.push_str(&format!("  {:>6.1}\n", h * 100.0)),
            _ if cache => out.push_str("       -\n"),
            _ => out.push('\n'),
        }
    }
    let routed: Vec<u64> = view.ranks.iter().map(|r| r.routed).collect();
    let secs = live.now_us.load(Ordering::Relaxed) as f64 / 1e6;
    let tokens = live.input_tokens.load(Ordering::Relaxed) as f64;
    let _ = writeln!(
        out,
        "completed {} requests, {} input tokens/s, placement std {:.2}",
        live.completed.load(Ordering::Relaxed),
        thousands(if secs > 0.0 { (tokens / secs).round() as u64 } else { 0 }),
        std_dev(&routed)
    );
    out.push_str(LEGEND);
    out
}
