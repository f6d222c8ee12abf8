//! The arms of the scenarios that compare more than `routing.policy`
//! values, in table order: the names `--policy` of `dpcoord sim` accepts
//! beside the policies. Here, below both the arguments (`args`, which
//! check them) and the scenarios that run them.

/// The arms of `sim prefix`.
pub const PREFIX: [&str; 6] =
    ["round_robin", "least_load", "lmetric/events", "cache_aware/approx", "cache_aware/events", "oracle"];

/// The arms of `sim trace`: those of prefix, with the bound for the oracle.
pub const TRACE: [&str; 6] =
    ["round_robin", "least_load", "lmetric/events", "cache_aware/approx", "cache_aware/events", "bound"];

/// The arms of `sim vllm-dp`.
pub const VLLM_DP: [&str; 3] = ["vllm-rule", "least_load", "cache_aware/events"];
