//! `round_robin`: the first routable rank at or after the cursor; load and
//! penalties are ignored. It still scores (request load, unpenalized):
//! sessions compare costs under every policy.

use super::{Metric, Picker, Policy, PolicyKind};

pub(super) const POLICY: Policy = Policy {
    kind: PolicyKind::RoundRobin,
    metric: Metric::Requests,
    penalized: false,
    picker: Picker::Rotation,
    prefix: None,
};
