//! Scorers: one comparable cost per rank, from what the engine reported
//! plus dpcoord's own outstanding placements (the ledger).
//!
//! * requests: `weight_waiting*waiting + weight_running*running + weight_pending*pending`
//! * tokens: `waiting_tokens + running_tokens + pending prompt tokens`
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
    /// Tokens: the engine's token load plus pending prompt tokens.
    Tokens,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scorer {
    pub metric: Metric,
    /// Whether the rank's penalty multiplies its cost.
    pub penalized: bool,
}

impl Scorer {
    /// The load estimate of one rank.
    pub fn load(&self, e: &EngineState, l: &Ledger) -> f64 {
        match self.metric {
            Metric::Tokens => {
                let engine = e.tokens.map_or(0, |t| t.total());
                engine.saturating_add(l.pending_tokens) as f64
            }
            Metric::Requests(w) => {
                w.waiting * e.counts.waiting as f64 + w.running * e.counts.running as f64 + w.pending * l.pending as f64
            }
        }
    }

    /// What pickers compare; lower is better.
    pub fn cost(&self, e: &EngineState, l: &Ledger) -> f64 {
        if !e.status.is_routable() {
            return f64::INFINITY;
        }
        let load = self.load(e, l) + 1.0;
        if self.penalized {
            load * (1.0 + e.penalty)
        } else {
            load
        }
    }
}
