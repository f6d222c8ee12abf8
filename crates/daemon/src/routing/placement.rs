//! A placement: the one fact a routing decision adds to dpcoord's books.
//!
//! A decision (policy, session, pin, room) produces placements; booking
//! one ([`super::user::UserDispatcher::book`]) is the only way user load
//! enters a rank's ledger, the dispatch window and the rank's cost, as an
//! accepted engine report is the only way engine load does. Placements are
//! plain values, so a placement made elsewhere (another dpcoord, a replay)
//! books exactly as one made here.

use std::time::Instant;

/// `count` user requests of `tokens_each` prompt tokens each, put on `rank` at `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub rank: u32,
    pub count: u64,
    pub tokens_each: u64,
    pub at: Instant,
}

/// The ranks of `placements`, one per request, in placement order (a
/// route reply's `ranks`).
pub fn ranks_of(placements: &[Placement], out: &mut Vec<u32>) {
    out.clear();
    for p in placements {
        out.resize(out.len() + p.count as usize, p.rank);
    }
}
