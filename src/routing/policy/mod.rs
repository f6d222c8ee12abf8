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

/// The user routing policy, by its configured name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// A pure rotation over routable ranks; ignores load and penalties.
    RoundRobin,
    /// The lowest `(requests load + 1) * (1 + penalty)`.
    LeastLoad,
    /// The lowest `(token load + 1) * (1 + penalty)`.
    LeastTokens,
    /// The better of two seeded random routable ranks, by request cost.
    PowerOfTwo,
    /// The lowest `(token load + prefill weight * uncached prompt tokens + 1)
    /// * (1 + penalty)`: the prefix term is per request (`user.rs`).
    CacheAware,
    /// The lowest `(uncached prompt tokens + 1) * (requests in flight + 1)
    /// * (1 + penalty)` (LMetric): the baseline prefix-aware scorer of the
    /// field, which `cache_aware` is measured against.
    LMetric,
}

/// A policy's parts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub kind: PolicyKind,
    pub scorer: Scorer,
    pub picker: Picker,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoad,
        PolicyKind::LeastTokens,
        PolicyKind::PowerOfTwo,
        PolicyKind::CacheAware,
        PolicyKind::LMetric,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::LeastTokens => "least_tokens",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::LMetric => "lmetric",
        }
    }

    /// Whether this policy weighs each request's prompt against what each rank
    /// has cached (it needs the prompt's prefix looked up).
    pub fn uses_prefix(self) -> bool {
        matches!(self, PolicyKind::CacheAware | PolicyKind::LMetric)
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|p| p.as_str() == s)
    }

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
