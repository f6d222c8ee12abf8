//! Policies, one file each: what a policy weighs (a scorer's load metric,
//! whether the rank's penalty multiplies it, and for prefix-aware policies
//! a per-request term over the prompt's cached prefix) and how it picks.
//!
//! A policy is a constant [`Policy`] in its own file; [`PolicyKind::policy`]
//! maps the configured name to it. What the policy reads per request is
//! declared there: [`Policy::prefix`] says whether the prompt is looked up
//! in the prefix index at all, and whether recent placements count as
//! cached (siblings).

mod cache_aware;
mod least_load;
mod least_tokens;
mod lmetric;
mod picker;
mod power_of_two;
mod round_robin;
mod scorer;

pub use picker::{Candidates, Picker};
pub use scorer::{Metric, Scorer};

pub use crate::config::PolicyKind;
use crate::config::{CacheAware, LoadWeights};

/// A policy's parts: its scorer's metric, its picker and its per-request term.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub kind: PolicyKind,
    /// What the scorer counts as a rank's load.
    pub metric: Metric,
    /// Whether the rank's penalty multiplies its cost.
    pub penalized: bool,
    pub picker: Picker,
    /// The per-request term over the prompt's cached prefix, for the
    /// policies that weigh it; `None`: the prompt is never looked up.
    pub prefix: Option<PrefixTerm>,
}

/// One rank, as a per-request prefix term sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankTerms {
    /// The scorer's cost of the rank (infinity when not routable).
    pub cost: f64,
    /// The prompt tokens the rank would have to prefill.
    pub uncached: f64,
    /// The rank's penalty.
    pub penalty: f64,
}

/// A per-request cost over the prompt's cached prefix.
#[derive(Debug, Clone, Copy)]
pub struct PrefixTerm {
    /// Whether recent placements on event-fed ranks, not yet confirmed by
    /// KV events, count as cached (a prompt's siblings land together).
    pub siblings: bool,
    /// Whether the balance guard (`routing.cache_balance_*`) drops
    /// the term when the ranks' loads spread too far.
    pub guarded: bool,
    /// A rank's cost for this request.
    pub cost: fn(&RankTerms, &CacheAware) -> f64,
}

impl Policy {
    /// The scorer of this policy with the configured request weights.
    pub fn scorer(&self, weights: LoadWeights) -> Scorer {
        Scorer { metric: self.metric, penalized: self.penalized, weights }
    }
}

impl PolicyKind {
    /// The policy of this name.
    pub fn policy(self) -> &'static Policy {
        match self {
            PolicyKind::RoundRobin => &round_robin::POLICY,
            PolicyKind::LeastLoad => &least_load::POLICY,
            PolicyKind::LeastTokens => &least_tokens::POLICY,
            PolicyKind::PowerOfTwo => &power_of_two::POLICY,
            PolicyKind::CacheAware => &cache_aware::POLICY,
            PolicyKind::LMetric => &lmetric::POLICY,
        }
    }

    /// Whether this policy weighs each request's prompt against what each
    /// rank has cached (the prompt's prefix is looked up).
    pub fn uses_prefix(self) -> bool {
        self.policy().prefix.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_maps_to_its_own_policy() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.policy().kind, kind, "{}", kind.as_str());
        }
    }

    #[test]
    fn only_the_prefix_aware_policies_look_the_prompt_up() {
        let aware: Vec<&str> = PolicyKind::ALL.into_iter().filter(|k| k.uses_prefix()).map(|k| k.as_str()).collect();
        assert_eq!(aware, ["cache_aware", "lmetric"]);
    }
}
