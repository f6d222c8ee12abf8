//! Scorers: one comparable cost per rank, from what the engine reported
//! plus dpcoord's own outstanding placements (the ledger).
//!
//! * requests: `kv*weight_waiting*waiting + weight_running*running + kv*weight_pending*pending`,
//!   `kv` the rank's [`kv_pressure`] (1 without a reported KV usage)
//! * tokens: `waiting_tokens + running_tokens + pending prompt tokens`; for a
//!   rank that reports no token load (vLLM), `(waiting + running) * mean
//!   prompt` stands for its engine's part (the mean prompt length of recent
//!   placements on every rank), so a deep queue weighs what it holds
//! * in flight: `waiting + running + pending` (the LMetric policy's count)
//!
//! `cost = (load + 1) * (1 + penalty)`, or `load + 1` for an unpenalized
//! scorer; a rank that is not routable costs infinity.

use crate::config::LoadWeights;
use crate::engines::EngineState;
use crate::routing::ledger::Ledger;

/// KV usage up to which a queue costs its plain weight.
const KV_FREE: f64 = 0.5;
/// How fast the weight of a queued request grows past [`KV_FREE`]: 4x when full.
const KV_RAMP: f64 = 6.0;

/// The factor on a rank's queued requests (waiting, and pending on their way
/// to the queue) for its KV usage: `1 + 6 * max(0, kv_usage - 0.5)`, 1 up to
/// half full and 4 when full, 1 without a report. vLLM 0.33's DP balancer
/// adds `waiting * 6.0 * max(0.0, kv_cache_usage - 0.5)` to `waiting +
/// running` (`vllm/v1/engine/core_client.py`,
/// `DPLBAsyncMPClient.get_core_engine_for_request`): a queue on a KV-bound
/// rank drains only as running requests free memory.
pub fn kv_pressure(kv_usage: Option<f64>) -> f64 {
    kv_usage.map_or(1.0, |u| 1.0 + KV_RAMP * (u - KV_FREE).max(0.0))
}

/// What a scorer counts as load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Metric {
    /// Request counts, weighted by `routing.weights`.
    Requests,
    /// Tokens: the engine's token load (or its requests at the rank's mean
    /// prompt length, when it reports none) plus pending prompt tokens.
    Tokens,
    /// Requests in flight: waiting, running and pending, unweighted.
    InFlight,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scorer {
    pub metric: Metric,
    /// Whether the rank's penalty multiplies its cost.
    pub penalized: bool,
    /// The weights of [`Metric::Requests`].
    pub weights: LoadWeights,
}

impl Scorer {
    /// The load estimate of one rank; `prompt_mean` is the mean prompt length
    /// of recent placements, what a queued request is worth in tokens where
    /// the engine reports no token load.
    pub fn load(&self, e: &EngineState, l: &Ledger, prompt_mean: f64) -> f64 {
        match self.metric {
            Metric::Tokens => {
                let engine = match e.tokens {
                    Some(t) => t.total() as f64,
                    None => (e.counts.waiting as f64 + e.counts.running as f64) * prompt_mean,
                };
                engine + l.pending_tokens as f64
            }
            Metric::InFlight => e.counts.waiting as f64 + e.counts.running as f64 + l.pending as f64,
            Metric::Requests => {
                let w = self.weights;
                // At `kv == 1` each product is the unweighted one, bit for bit.
                let kv = kv_pressure(e.kv_usage);
                kv * w.waiting * e.counts.waiting as f64
                    + w.running * e.counts.running as f64
                    + kv * w.pending * l.pending as f64
            }
        }
    }

    /// What pickers compare; lower is better.
    pub fn cost(&self, e: &EngineState, l: &Ledger, prompt_mean: f64) -> f64 {
        if !e.status.is_routable() {
            return f64::INFINITY;
        }
        let load = self.load(e, l, prompt_mean) + 1.0;
        if self.penalized {
            load * (1.0 + e.penalty)
        } else {
            load
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::config::LoadWeights;
    use crate::engines::testing::settings;
    use crate::engines::{EngineTable, LoadReport};

    const W: LoadWeights = LoadWeights { waiting: 4.0, running: 1.0, pending: 4.0 };

    /// Rank 0 after one report of `waiting`, `running` and `kv_usage`.
    fn table(waiting: u64, running: u64, kv_usage: Option<f64>) -> EngineTable {
        let mut t = EngineTable::new(&settings(1));
        let u = LoadReport { kv_usage, ..LoadReport::new(0, 1, 1).counts([waiting, running, 0, 0, 0]) };
        t.apply(&u, Instant::now()).unwrap();
        t
    }

    fn ledger(pending: u64) -> Ledger {
        let mut l = Ledger::default();
        l.place(pending, 1, Instant::now());
        l
    }

    fn requests(waiting: u64, running: u64, pending: u64, kv_usage: Option<f64>) -> f64 {
        let scorer = Scorer { metric: Metric::Requests, penalized: true, weights: W };
        scorer.load(table(waiting, running, kv_usage).get(0), &ledger(pending), 0.0)
    }

    #[test]
    fn the_pressure_ramps_from_half_full_to_four_times_when_full() {
        let got = [None, Some(0.0), Some(0.5), Some(0.625), Some(0.75), Some(0.875), Some(1.0)].map(kv_pressure);
        assert_eq!(got, [1.0, 1.0, 1.0, 1.75, 2.5, 3.25, 4.0]);
    }

    #[test]
    fn pressure_weighs_waiting_and_pending_but_not_running() {
        // 4*2 + 4 + 4*3 = 24 with room; 3.25*4*2 + 4 + 3.25*4*3 = 69 at 7/8 full.
        assert_eq!(requests(2, 4, 3, None), 24.0);
        assert_eq!(requests(2, 4, 3, Some(0.5)), 24.0);
        assert_eq!(requests(2, 4, 3, Some(0.875)), 69.0);
        assert_eq!(requests(2, 4, 3, Some(1.0)), 84.0);
        assert_eq!(requests(0, 4, 0, Some(1.0)), 4.0);
    }

    #[test]
    fn without_a_usage_the_load_is_the_weighted_sum_bit_for_bit() {
        let w = LoadWeights { waiting: 0.1, running: 0.7, pending: 0.3 };
        let scorer = Scorer { metric: Metric::Requests, penalized: false, weights: w };
        let (waiting, running, pending) = (12_345_678_901, 98_765_432_109, 5);
        for kv in [None, Some(0.25), Some(0.5)] {
            let got = scorer.load(table(waiting, running, kv).get(0), &ledger(pending), 0.0);
            let want = w.waiting * waiting as f64 + w.running * running as f64 + w.pending * pending as f64;
            assert_eq!(got.to_bits(), want.to_bits(), "kv_usage {kv:?}");
        }
    }

    #[test]
    fn the_token_and_in_flight_metrics_ignore_the_usage() {
        let cost =
            |metric, kv| Scorer { metric, penalized: true, weights: W }.cost(table(2, 4, kv).get(0), &ledger(3), 10.0);
        assert_eq!([cost(Metric::Tokens, None), cost(Metric::Tokens, Some(1.0))], [64.0, 64.0]);
        assert_eq!([cost(Metric::InFlight, None), cost(Metric::InFlight, Some(1.0))], [10.0, 10.0]);
    }
}
