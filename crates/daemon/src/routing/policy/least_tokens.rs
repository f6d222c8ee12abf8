//! `least_tokens`: the lowest `(token load + 1) * (1 + penalty)`, equal
//! costs rotating from the cursor.

use super::{Metric, Picker, Policy, PolicyKind};

pub(super) const POLICY: Policy = Policy {
    kind: PolicyKind::LeastTokens,
    metric: Metric::Tokens,
    penalized: true,
    picker: Picker::Least,
    prefix: None,
};
