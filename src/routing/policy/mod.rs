//! Policies: a scorer (per-rank cost) and a picker (which rank wins).

pub mod picker;
pub mod scorer;

/// The user routing policy.
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
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 4] =
        [PolicyKind::RoundRobin, PolicyKind::LeastLoad, PolicyKind::LeastTokens, PolicyKind::PowerOfTwo];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::LeastTokens => "least_tokens",
            PolicyKind::PowerOfTwo => "power_of_two",
        }
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|p| p.as_str() == s)
    }
}
