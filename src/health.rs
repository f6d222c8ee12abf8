//! The health dispatch channel.
//!
//! **Isolation by construction:** everything here takes the engine table and
//! the health channel's own cursor, never the user dispatcher, so a health
//! query cannot move the user round-robin position, `routed`, `pending`,
//! sessions or dispatch counters. `health_report` reaches the engine table's
//! penalty input, which is a fact about the rank, not user bookkeeping.

use std::time::Instant;

use crate::engines::EngineTable;
use crate::routing::policy::picker as policy;
use crate::wire::{ErrorCode, Target, WireError};

/// The health channel's own round-robin position.
#[derive(Debug, Default)]
pub struct HealthDispatcher {
    cursor: u32,
}

/// Checks that a pinned or room rank can take traffic.
pub fn check_fixed(engines: &EngineTable, rank: u32, target: Target) -> Result<u32, WireError> {
    if engines.is_routable(rank) {
        return Ok(rank);
    }
    let why = match target {
        Target::Room(room) => format!("bootstrap_room {room} maps to rank {rank}, which"),
        _ => format!("rank {rank}"),
    };
    let status = engines.get(rank).status.as_str();
    Err(WireError::new(
        ErrorCode::RankUnavailable,
        format!("{why} is {status}, not routable; try again later or drop the pin"),
    ))
}

pub fn no_engine(engines: &EngineTable) -> WireError {
    WireError::new(
        ErrorCode::NoEngineAvailable,
        format!(
            "no routable rank: none of the {} ranks is up or stale; check that engines publish stats",
            engines.dp_size()
        ),
    )
}

impl HealthDispatcher {
    /// Picks the rank for one health probe. Only the policy form advances the cursor.
    pub fn route(&mut self, target: Target, engines: &EngineTable) -> Result<u32, WireError> {
        if let Some(rank) = target.fixed_rank(engines.dp_size()) {
            return check_fixed(engines, rank, target);
        }
        let rank = policy::round_robin(self.cursor, engines).ok_or_else(|| no_engine(engines))?;
        self.cursor = (rank + 1) % engines.dp_size();
        Ok(rank)
    }
}

/// Records a probe's outcome (the rank was range-checked by the decoder).
pub fn report(engines: &mut EngineTable, rank: u32, ok: bool, now: Instant) {
    engines.record_health_report(rank, ok, now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::policy::picker::tests::table_with_up;

    #[test]
    fn own_rotation_over_routable_ranks_pins_do_not_advance() {
        let t = table_with_up(4, &[0, 2, 3]);
        let mut h = HealthDispatcher::default();
        let got: Vec<u32> = (0..4).map(|_| h.route(Target::Policy, &t).unwrap()).collect();
        assert_eq!(got, [0, 2, 3, 0]);
        assert_eq!(h.route(Target::Pinned(3), &t), Ok(3));
        assert_eq!(h.route(Target::Room(6), &t), Ok(2));
        assert_eq!(h.route(Target::Policy, &t), Ok(2));
        assert_eq!(h.route(Target::Pinned(1), &t).unwrap_err().code, ErrorCode::RankUnavailable);
        assert_eq!(h.route(Target::Room(5), &t).unwrap_err().code, ErrorCode::RankUnavailable);
        let empty = table_with_up(4, &[]);
        assert_eq!(h.route(Target::Policy, &empty).unwrap_err().code, ErrorCode::NoEngineAvailable);
    }
}
