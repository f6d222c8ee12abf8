//! `power_of_two`: the cheaper, by `(request load + 1) * (1 + penalty)`,
//! of two distinct seeded random routable ranks.

use super::{Metric, Picker, Policy, PolicyKind};

pub(super) const POLICY: Policy = Policy {
    kind: PolicyKind::PowerOfTwo,
    metric: Metric::Requests,
    penalized: true,
    picker: Picker::TwoChoices,
    prefix: None,
};
