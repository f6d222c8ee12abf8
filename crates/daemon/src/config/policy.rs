//! The user routing policy's name, as configured (`routing.policy`); what
//! each one weighs is `routing::policy`'s.

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
    /// * (1 + penalty)`: the prefix term is per request (`routing/user/`).
    CacheAware,
    /// The lowest `(uncached prompt tokens + 1) * (requests in flight + 1)
    /// * (1 + penalty)` (LMetric): the baseline prefix-aware scorer of the
    /// field, which `cache_aware` is measured against.
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

    /// Whether this policy weighs each request's prompt against what each rank
    /// has cached (it needs the prompt's prefix looked up).
    pub fn uses_prefix(self) -> bool {
        matches!(self, PolicyKind::CacheAware | PolicyKind::LMetric)
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|p| p.as_str() == s)
    }
}
