//! Policies as two parts: a scorer turns each rank's engine report and
//! ledger into a cost, and a picker chooses among the routable ranks.
//!
//! [`PolicyKind::parts`] is the one place that maps a policy name to its
//! parts. A new policy is a row there (plus, if it needs one, a scorer
//! metric or a picker). Per-request terms (a prefix-cache overlap per rank)
//! join the costs in the per-request [`Candidates`] the picker sees.

mod picker;
mod scorer;

pub use picker::{Candidates, Picker};
pub use scorer::{Metric, Scorer};

use crate::config::LoadWeights;
pub use crate::config::PolicyKind;

/// A policy's parts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub kind: PolicyKind,
    pub scorer: Scorer,
    pub picker: Picker,
}

impl PolicyKind {
    /// The scorer and picker of this policy. Round robin still scores
    /// (without the penalty): sessions compare costs under every policy.
    pub fn parts(self, weights: LoadWeights) -> Policy {
        let requests = Metric::Requests(weights);
        let (metric, penalized, picker) = match self {
            PolicyKind::RoundRobin => (requests, false, Picker::Rotation),
            PolicyKind::LeastLoad => (requests, true, Picker::Least),
            PolicyKind::LeastTokens => (Metric::Tokens, true, Picker::Least),
            PolicyKind::PowerOfTwo => (requests, true, Picker::TwoChoices),
            // Its base cost is least_tokens'; the per-request prefill term is added at the pick.
            PolicyKind::CacheAware => (Metric::Tokens, true, Picker::Least),
            // Its per-request cost is this one times (uncached prompt tokens + 1).
            PolicyKind::LMetric => (Metric::InFlight, true, Picker::Least),
        };
        Policy { kind: self, scorer: Scorer { metric, penalized }, picker }
    }
}
