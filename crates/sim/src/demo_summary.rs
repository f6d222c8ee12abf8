//! What `dpcoord demo` prints as each phase ends, and the closing
//! comparison of the phases with its one-line verdict: dpcoord's phase
//! against vLLM's rule, computed from the numbers the comparison prints.

use std::fmt::Write;
use std::net::SocketAddr;

use super::demo_view::{prefix_aware, Phase, CONCURRENCY, RANKS};
use super::record::{std_dev, Recorder};
use super::report::{ms, thousands};

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
    /// Prompt tokens of the completed requests found in the prefix cache, as a share.
    pub hit: f64,
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
            hit: result.hit_rate(),
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

    /// Input tokens/s and TTFT p99 (ms) as the comparison prints them.
    fn printed(&self) -> (String, String) {
        (thousands(self.input_tps.round() as u64), ms(self.ttft_p99))
    }
}

/// The closing comparison of the phases run, ending with the verdict.
pub fn summary(outcomes: &[Outcome], metrics: SocketAddr, frontends: u32, policy: &str) -> String {
    let mut out = format!(
        "summary ({RANKS} simulated ranks, {}, {CONCURRENCY} requests in flight):\n\
         {:<16}{:<32} {:>5} {:>7} {:>5} {:>5} {:>11} {:>11}\n",
        super::demo_view::frontends(frontends),
        "",
        "user placements per rank",
        "std",
        "busiest",
        "mean",
        "hit %",
        "input tok/s",
        "ttft p99"
    );
    for o in outcomes {
        let per_rank: String = o.placements.iter().map(|p| format!("{p:>4}")).collect();
        let (tps, p99) = o.printed();
        let _ = writeln!(
            out,
            "{:<16}{:<32} {:>5.1} {:>7.1} {:>5.1} {:>5.1} {tps:>11} {p99:>8} ms",
            o.phase.label(),
            per_rank,
            std_dev(&o.placements),
            o.busiest,
            o.mean_held,
            o.hit * 100.0,
        );
    }
    let dpcoord = if prefix_aware(policy) {
        "and, from the engines' KV events, sends each request where its prefix is cached.".to_owned()
    } else {
        format!("and ({policy}), like vLLM's rule, ignores prefixes.")
    };
    let _ = writeln!(
        out,
        "busiest: requests (waiting or running) on the busiest rank, mean: per rank, sampled every\n\
         100 ms; hit %: prompt tokens found in the rank's prefix cache. On a stale snapshot every\n\
         frontend piles onto the same ranks until the next one; vLLM's rule guesses the other\n\
         frontends' picks and spreads each tenant's prompts over every rank; dpcoord counts every\n\
         placement {dpcoord}"
    );
    let probes: Vec<u64> = outcomes.iter().flat_map(|o| o.probes.iter().copied()).collect();
    let per_rank: Vec<u64> =
        (0..RANKS as usize).map(|r| outcomes.iter().map(|o| o.probes.get(r).copied().unwrap_or(0)).sum()).collect();
    let per_rank: Vec<String> = per_rank.iter().map(u64::to_string).collect();
    let _ = writeln!(
        out,
        "health probes: {} on the health channel, per rank {};\n\
         \x20 they took no user placement\n\
         metrics were served at http://{metrics}/metrics (also /state, /healthz, /readyz)\n\
         {}",
        probes.iter().sum::<u64>(),
        per_rank.join(" "),
        verdict(outcomes)
    );
    out
}

/// `a / b` of two printed numbers, to two decimals as printed.
fn ratio(a: &str, b: &str) -> Option<String> {
    let num = |s: &str| s.replace(',', "").parse::<f64>().ok();
    let (a, b) = (num(a)?, num(b)?);
    (b > 0.0).then(|| format!("{:.2}", a / b))
}

/// One line: dpcoord's phase against vLLM's rule, from the numbers the
/// comparison prints (input tokens/s, TTFT p99), and who came out ahead.
pub fn verdict(outcomes: &[Outcome]) -> String {
    let find = |p: Phase| outcomes.iter().find(|o| o.phase == p);
    let (Some(vllm), Some(dpcoord)) = (find(Phase::Guess), find(Phase::Dpcoord)) else {
        return "verdict: none, the demo stopped before vLLM's rule and through dpcoord both ran".to_owned();
    };
    let ((tps_v, p99_v), (tps_d, p99_d)) = (vllm.printed(), dpcoord.printed());
    let (Some(tps), Some(p99)) = (ratio(&tps_d, &tps_v), ratio(&p99_d, &p99_v)) else {
        return "verdict: none, vLLM's rule completed no request to compare with".to_owned();
    };
    // Judged on the ratios as printed: 1.00x is even.
    let (t, p) = (tps.parse::<f64>().unwrap_or(1.0), p99.parse::<f64>().unwrap_or(1.0));
    let word = |ahead: bool, behind: bool| {
        if ahead {
            "ahead"
        } else if behind {
            "behind"
        } else {
            "even"
        }
    };
    let (on_tps, on_p99) = (word(t > 1.0, t < 1.0), word(p < 1.0, p > 1.0));
    let who = match (on_tps, on_p99) {
        ("ahead", "ahead") => "dpcoord ahead on both".to_owned(),
        ("behind", "behind") => "dpcoord behind on both".to_owned(),
        _ => format!("dpcoord not ahead on both ({on_tps} on tok/s, {on_p99} on TTFT p99)"),
    };
    format!("verdict: through dpcoord {tps}x the input tok/s of vLLM's rule, TTFT p99 {p99}x: {who}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Request;

    fn outcome(phase: Phase, tps: f64, p99_ms: u64) -> Outcome {
        let rec = Recorder::new(RANKS);
        Outcome { input_tps: tps, ttft_p99: p99_ms * 1000, ..Outcome::of(phase, &rec, 1.0) }
    }

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
            cached: 250,
            ..Request::default()
        };
        rec.requests = vec![req(Some(5_000)), req(Some(9_000)), req(None)];
        rec.placements = vec![1, 1, 1, 0, 0, 0, 0, 0];
        rec.probes = vec![2, 1, 1, 1, 1, 1, 1, 1];
        rec.sample(0, vec![0; 8], vec![0; 8]);
        rec.sample(100_000, vec![2, 1, 1, 0, 0, 0, 0, 0], vec![0; 8]);
        let alone = Outcome::of(Phase::Snapshot, &rec, 4.0);
        assert_eq!((alone.completed, alone.in_flight, alone.busiest, alone.mean_held), (2, 1, 1.0, 0.25));
        assert_eq!(alone.hit, 0.25);
        assert_eq!(alone.ended(), "stale snapshot ended after 4.0 s: 2 requests completed, 1 in flight at the end\n");
        let addr = SocketAddr::from(([127, 0, 0, 1], 9570));
        let text = summary(&[alone.clone(), Outcome { phase: Phase::Dpcoord, ..alone }], addr, 2, "cache_aware");
        let want = "summary (8 simulated ranks, 2 frontends, 32 requests in flight):\n\
            \x20               user placements per rank           std busiest  mean hit % input tok/s    ttft p99\n\
            stale snapshot     1   1   1   0   0   0   0   0   0.5     1.0   0.2  25.0         500      9.0 ms\n\
            through dpcoord    1   1   1   0   0   0   0   0   0.5     1.0   0.2  25.0         500      9.0 ms\n";
        assert!(text.starts_with(want), "{text}");
        assert!(text.contains("counts every\nplacement and, from the engines' KV events, sends each request where"));
        assert!(
            text.contains("health probes: 18 on the health channel, per rank 4 2 2 2 2 2 2 2;\n  they took"),
            "{text}"
        );
        assert!(text.ends_with(
            "metrics were served at http://127.0.0.1:9570/metrics (also /state, /healthz, /readyz)\n\
             verdict: none, the demo stopped before vLLM's rule and through dpcoord both ran\n"
        ));
    }

    #[test]
    fn the_verdict_is_the_ratio_of_the_printed_numbers_and_says_who_came_out_ahead() {
        let v = |d: Outcome| verdict(&[outcome(Phase::Guess, 40_123.4, 1800), d]);
        assert_eq!(
            v(outcome(Phase::Dpcoord, 65_000.0, 740)),
            "verdict: through dpcoord 1.62x the input tok/s of vLLM's rule, TTFT p99 0.41x: dpcoord ahead on both"
        );
        assert_eq!(
            v(outcome(Phase::Dpcoord, 39_000.0, 1900)),
            "verdict: through dpcoord 0.97x the input tok/s of vLLM's rule, TTFT p99 1.06x: dpcoord behind on both"
        );
        assert_eq!(
            v(outcome(Phase::Dpcoord, 40_200.0, 1700)),
            "verdict: through dpcoord 1.00x the input tok/s of vLLM's rule, TTFT p99 0.94x: \
             dpcoord not ahead on both (even on tok/s, ahead on TTFT p99)"
        );
        assert_eq!(
            v(outcome(Phase::Dpcoord, 44_000.0, 2000)),
            "verdict: through dpcoord 1.10x the input tok/s of vLLM's rule, TTFT p99 1.11x: \
             dpcoord not ahead on both (ahead on tok/s, behind on TTFT p99)"
        );
        assert_eq!(
            verdict(&[outcome(Phase::Guess, 0.0, 0), outcome(Phase::Dpcoord, 1.0, 1)]),
            "verdict: none, vLLM's rule completed no request to compare with"
        );
    }
}
