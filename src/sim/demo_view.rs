//! What `dpcoord demo` prints: the intro, the live table with its legend,
//! a line as each phase ends, and the closing comparison of the phases.

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::record::{std_dev, Live, Recorder};
use super::report::{ms, thousands};
use super::stale::StaleRule;
use crate::wire::StateView;

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

    /// What the phase does, above its live table.
    pub fn heading(self, policy: &str) -> String {
        match self {
            Phase::Snapshot => format!(
                "phase 1/3, stale snapshot: each frontend sends every request to the least loaded rank in\n\
                 the engines' counts it got last (every {SNAPSHOT_MS} ms), as DP controllers on load reports do"
            ),
            Phase::Guess => "phase 2/3, vLLM's rule: the same, but each frontend also counts its own picks since the\n\
                 snapshot (twice: a guess at the other frontend's) and rotates its ties"
                .to_owned(),
            Phase::Dpcoord => format!(
                "phase 3/3, through dpcoord ({policy}): each frontend asks dpcoord, which counts every\n\
                 placement, also those the engines have not reported yet (pending)"
            ),
        }
    }
}

/// What the demo runs, printed once at the start.
pub fn intro(metrics: SocketAddr, seconds: u64, frontends: u32) -> String {
    format!(
        "dpcoord demo: {RANKS} simulated engines, {frontends} frontends keeping {CONCURRENCY} requests in flight \
         (each takes\n\
         a {}-{} ms hop to its engine) and a prober on the health channel; three phases of {seconds} s\n\
         each. In phases 1 and 2 the frontends choose the rank and tell dpcoord (a pin); the table\n\
         is dpcoord's view. metrics: http://{metrics}/metrics (also /state, /healthz, /readyz).\n\
         Ctrl-C stops early.\n",
        HOP_MS.0, HOP_MS.1
    )
}

/// Under the live table: what the columns that need it mean.
pub const LEGEND: &str = "\
pending: placed but not yet in the rank's own stats (the hop); dpcoord counts them as load.\n\
penalty: TTFT above the median (ttft/median - 1) plus failures; least_load & co. weigh load\n\
\x20        by 1 + penalty, round_robin ignores it. probes: health probes, never user placements.\n";

/// The live table: dpcoord's view of each rank plus the prober's count.
pub fn render(heading: &str, view: &StateView, live: &Live, elapsed: Duration, total: Duration) -> String {
    let width = 30;
    let done = ((elapsed.as_secs_f64() / total.as_secs_f64().max(1e-9)) * width as f64).round() as usize;
    let bar: String = (0..width).map(|i| if i < done.min(width) { '#' } else { '.' }).collect();
    let mut out = format!(
        "{heading}\n[{bar}] {:>5.1}/{} s  epoch {}\n\
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

/// One phase's numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub phase: Phase,
    pub secs: f64,
    pub placements: Vec<u64>,
    pub completed: u64,
    pub in_flight: u64,
    pub input_tps: f64,
    pub ttft_p99: u64,
    /// Requests the busiest rank held, and every rank on average, over the samples.
    pub busiest: f64,
    pub mean_held: f64,
    pub probes: Vec<u64>,
}

impl Outcome {
    pub fn of(phase: Phase, rec: &Recorder, secs: f64) -> Outcome {
        let result = rec.summarize(phase.label(), "", 0);
        let n = rec.samples.len().max(1) as f64;
        let busiest = rec.samples.iter().map(|s| s.held.iter().copied().max().unwrap_or(0) as f64).sum::<f64>() / n;
        let held = rec.samples.iter().map(|s| s.held.iter().sum::<u64>() as f64).sum::<f64>();
        Outcome {
            phase,
            secs,
            placements: rec.placements.clone(),
            completed: result.completed,
            in_flight: result.lost,
            input_tps: if secs > 0.0 { result.input_tokens as f64 / secs } else { 0.0 },
            ttft_p99: result.ttft_p99,
            busiest,
            mean_held: held / n / rec.placements.len().max(1) as f64,
            probes: rec.probes.clone(),
        }
    }

    /// The line printed as the phase ends.
    pub fn ended(&self) -> String {
        format!(
            "{} ended after {:.1} s: {} requests completed, {} in flight at the end\n",
            self.phase.label(),
            self.secs,
            self.completed,
            self.in_flight
        )
    }
}

/// The closing comparison of the phases run.
pub fn summary(outcomes: &[Outcome], metrics: SocketAddr, frontends: u32) -> String {
    let mut out = format!(
        "summary ({RANKS} simulated ranks, {frontends} frontends, {CONCURRENCY} requests in flight):\n\
         {:<16} {:<32} {:>5} {:>7} {:>5} {:>11} {:>8}\n",
        "", "user placements per rank", "std", "busiest", "mean", "input tok/s", "ttft p99"
    );
    for o in outcomes {
        let per_rank: Vec<String> = o.placements.iter().map(|p| format!("{p:>3}")).collect();
        let _ = writeln!(
            out,
            "{:<16} {:<32} {:>5.1} {:>7.1} {:>5.1} {:>11} {:>5} ms",
            o.phase.label(),
            per_rank.join(" "),
            std_dev(&o.placements),
            o.busiest,
            o.mean_held,
            thousands(o.input_tps.round() as u64),
            ms(o.ttft_p99)
        );
    }
    out.push_str(
        "busiest: requests (waiting or running) on the busiest rank, mean: per rank, sampled every\n\
         100 ms. On a stale snapshot every frontend piles onto the same ranks until the next one;\n\
         vLLM's rule guesses the other frontends' picks; dpcoord counts them.\n",
    );
    let probes: Vec<u64> = outcomes.iter().flat_map(|o| o.probes.iter().copied()).collect();
    let per_rank: Vec<u64> =
        (0..RANKS as usize).map(|r| outcomes.iter().map(|o| o.probes.get(r).copied().unwrap_or(0)).sum()).collect();
    let per_rank: Vec<String> = per_rank.iter().map(u64::to_string).collect();
    let _ = write!(
        out,
        "health probes: {} on the health channel, per rank {};\n\
         \x20 they took no user placement\n\
         metrics were served at http://{metrics}/metrics (also /state, /healthz, /readyz)\n",
        probes.iter().sum::<u64>(),
        per_rank.join(" ")
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::record::Request;

    #[test]
    fn summary_compares_the_phases() {
        let mut rec = Recorder::new(RANKS);
        let req = |done| Request {
            frontend: 0,
            prompt: 1000,
            output: 1,
            issued: 0,
            first_token: done,
            done,
            attempts: 1,
            ..Request::default()
        };
        rec.requests = vec![req(Some(5_000)), req(Some(9_000)), req(None)];
        rec.placements = vec![1, 1, 1, 0, 0, 0, 0, 0];
        rec.probes = vec![2, 1, 1, 1, 1, 1, 1, 1];
        rec.sample(0, vec![0; 8], vec![0; 8]);
        rec.sample(100_000, vec![2, 1, 1, 0, 0, 0, 0, 0], vec![0; 8]);
        let alone = Outcome::of(Phase::Snapshot, &rec, 4.0);
        assert_eq!((alone.completed, alone.in_flight, alone.busiest, alone.mean_held), (2, 1, 1.0, 0.25));
        assert_eq!(alone.ended(), "stale snapshot ended after 4.0 s: 2 requests completed, 1 in flight at the end\n");
        let addr = SocketAddr::from(([127, 0, 0, 1], 9570));
        let text = summary(&[alone.clone(), Outcome { phase: Phase::Dpcoord, ..alone }], addr, 2);
        let want = "summary (8 simulated ranks, 2 frontends, 32 requests in flight):\n\
            \x20                user placements per rank           std busiest  mean input tok/s ttft p99\n\
            stale snapshot     1   1   1   0   0   0   0   0    0.5     1.0   0.2         500   9.0 ms\n\
            through dpcoord    1   1   1   0   0   0   0   0    0.5     1.0   0.2         500   9.0 ms\n";
        assert!(text.starts_with(want), "{text}");
        assert!(
            text.contains("health probes: 18 on the health channel, per rank 4 2 2 2 2 2 2 2;\n  they took"),
            "{text}"
        );
        assert!(
            text.ends_with("metrics were served at http://127.0.0.1:9570/metrics (also /state, /healthz, /readyz)\n")
        );
    }
}
