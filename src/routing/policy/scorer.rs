//! Load estimates: engine reports plus dpcoord's own placements, turned
//! into one comparable number per rank.
//!
//! * requests: `weight_waiting*waiting + weight_running*running + weight_pending*pending`
//! * tokens (least_tokens): `waiting_tokens + running_tokens + pending prompt tokens`
//!
//! Policies compare `cost = (load + 1) * (1 + penalty)` (round_robin's cost
//! ignores the penalty; it only uses cost for session overload checks).
//! A rank that is not routable costs infinity.

use crate::config::{LoadWeights, PolicyKind};
use crate::engines::{EngineState, RUNNING, WAITING};
use crate::routing::ledger::Ledger;

#[derive(Debug, Clone, Copy)]
pub struct LoadModel {
    pub policy: PolicyKind,
    pub weights: LoadWeights,
}

impl LoadModel {
    /// The policy's load estimate of one rank.
    pub fn load(&self, e: &EngineState, l: &Ledger) -> f64 {
        match self.policy {
            PolicyKind::LeastTokens => {
                let engine = e.tokens.map_or(0, |[waiting, running]| waiting.saturating_add(running));
                engine.saturating_add(l.pending_tokens) as f64
            }
            _ => {
                let w = &self.weights;
                w.waiting * e.counts[WAITING] as f64
                    + w.running * e.counts[RUNNING] as f64
                    + w.pending * l.pending as f64
            }
        }
    }

    /// What placement compares; lower is better.
    pub fn cost(&self, e: &EngineState, l: &Ledger) -> f64 {
        if !e.status.is_routable() {
            return f64::INFINITY;
        }
        let load = self.load(e, l) + 1.0;
        match self.policy {
            PolicyKind::RoundRobin => load,
            _ => load * (1.0 + e.penalty),
        }
    }
}
