//! Scorers: one comparable cost per rank, from what the engine reported
//! plus dpcoord's own outstanding placements (the ledger).
//!
//! * requests: `weight_waiting*waiting + weight_running*running + weight_pending*pending`
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

/// What a scorer counts as load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Metric {
    /// Weighted request counts.
    Requests(LoadWeights),
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
            Metric::Requests(w) => {
                w.waiting * e.counts.waiting as f64 + w.running * e.counts.running as f64 + w.pending * l.pending as f64
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
