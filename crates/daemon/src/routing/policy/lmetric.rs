//! `lmetric`: the lowest `(requests in flight + 1) * (1 + penalty) *
//! (uncached prompt tokens + 1)`, the field's prefix-aware scorer as
//! published (LMetric): the baseline `cache_aware` is measured against.
//! No balance guard and no siblings: it is the scorer as published.

use super::{Metric, Picker, Policy, PolicyKind, PrefixTerm, RankTerms};
use crate::config::CacheAware;

pub(super) const POLICY: Policy = Policy {
    kind: PolicyKind::LMetric,
    metric: Metric::InFlight,
    penalized: true,
    picker: Picker::Least,
    prefix: Some(PrefixTerm { siblings: false, guarded: false, cost }),
};

/// The rank's cost times its uncached prefill plus one.
fn cost(r: &RankTerms, _: &CacheAware) -> f64 {
    r.cost * (r.uncached + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_cost_multiplies_the_uncached_prefill() {
        let c = Config::default().settings.routing.cache;
        let r = RankTerms { cost: 3.0, uncached: 9.0, penalty: 0.5 };
        assert_eq!(cost(&r, &c), 30.0);
        assert_eq!(cost(&RankTerms { uncached: 0.0, ..r }, &c), 3.0);
    }
}
