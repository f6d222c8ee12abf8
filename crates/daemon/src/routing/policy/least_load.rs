//! `least_load`: the lowest `(request load + 1) * (1 + penalty)`, equal
//! costs rotating from the cursor.

use super::{Metric, Picker, Policy, PolicyKind};

pub(super) const POLICY: Policy = Policy {
    kind: PolicyKind::LeastLoad,
    metric: Metric::Requests,
    penalized: true,
    picker: Picker::Least,
    prefix: None,
};
