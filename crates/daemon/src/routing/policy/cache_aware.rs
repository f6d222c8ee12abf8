//! `cache_aware`: the lowest `(token load + 1) * (1 + penalty) + prefill
//! weight * uncached prompt tokens * (1 + penalty)`, unless the balance
//! guard holds (the ranks' token loads spread by more than
//! `balance_abs_tokens` and `balance_rel` times): then token load alone.
//! Recent placements count as cached, so a prompt's siblings land together.

use super::{Metric, Picker, Policy, PolicyKind, PrefixTerm, RankTerms};
use crate::config::CacheAware;

pub(super) const POLICY: Policy = Policy {
    kind: PolicyKind::CacheAware,
    metric: Metric::Tokens,
    penalized: true,
    picker: Picker::Least,
    prefix: Some(PrefixTerm { siblings: true, guarded: true, cost }),
};

/// The rank's cost plus its uncached prefill, weighted and penalized like the load.
fn cost(r: &RankTerms, c: &CacheAware) -> f64 {
    r.cost + c.prefill_weight * r.uncached * (1.0 + r.penalty)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_prefill_adds_to_the_cost_penalized() {
        let c = CacheAware { prefill_weight: 4.0, ..Config::default().settings.routing.cache };
        let r = RankTerms { cost: 11.0, uncached: 3.0, penalty: 0.5 };
        assert_eq!(cost(&r, &c), 11.0 + 4.0 * 3.0 * 1.5);
        assert_eq!(cost(&RankTerms { cost: f64::INFINITY, ..r }, &c), f64::INFINITY);
    }
}
