//! The user routing policy's name, as configured (`routing.policy`); what
//! each one weighs is in its own file under `crates/daemon/src/routing/policy/`.

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
    /// The lowest token cost plus the prompt's uncached prefill, weighted.
    CacheAware,
    /// The lowest `(requests in flight + 1) * (uncached prompt tokens + 1)`
    /// (LMetric), penalized: the field's prefix-aware baseline.
    LMetric,
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

    pub fn parse(s: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|p| p.as_str() == s)
    }
}
