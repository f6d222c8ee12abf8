//! The user routing policy's name, as configured (`routing.policy`); what
//! each one weighs is in its own file under `crates/daemon/src/routing/policy/`.

crate::names! {
    #[names(parse)]
    /// The user routing policy, by its configured name.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum PolicyKind {
        /// A pure rotation over routable ranks; ignores load and penalties.
        RoundRobin => "round_robin",
        /// The lowest `(requests load + 1) * (1 + penalty)`.
        LeastLoad => "least_load",
        /// The lowest `(token load + 1) * (1 + penalty)`.
        LeastTokens => "least_tokens",
        /// The better of two seeded random routable ranks, by request cost.
        PowerOfTwo => "power_of_two",
        /// The lowest token cost plus the prompt's uncached prefill, weighted.
        CacheAware => "cache_aware",
        /// The lowest `(requests in flight + 1) * (uncached prompt tokens + 1)`
        /// (LMetric), penalized: the field's prefix-aware baseline.
        LMetric => "lmetric",
    }
}
