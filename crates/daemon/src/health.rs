//! The health channel: probes get ranks and report outcomes here.
//!
//! **Isolation by type.** This module sees the engine table only through a
//! [`HealthHandle`] (read the table; record a probe's outcome) and keeps its
//! own cursor. The user dispatcher, the placement ledgers and sessions are
//! private to `crate::routing`, so this module cannot even name them:
//!
//! ```compile_fail,E0603
//! // The user side is private to `routing`: no path reaches it from here.
//! use dpcoord_daemon::routing::user::UserDispatcher;
//! ```
//!
//! ```compile_fail,E0603
//! use dpcoord_daemon::routing::ledger::Ledger;
//! ```
//!
//! What a health result may influence, exactly: a failed `health_report`
//! adds `penalty.health_failure` to the rank's health score (halving every
//! `health_half_life_ms`), which enters the rank's penalty on the next tick.
//! The penalty multiplies the cost under `least_load`, `least_tokens` and
//! `power_of_two`, so it moves their placements and, under those policies,
//! the session overload check; `round_robin` ignores it. A health result never changes
//! liveness, the epoch, the user cursor, `routed`, `pending` or sessions.

use std::time::Instant;

use crate::engines::routable::{check_fixed, next_routable};
use crate::engines::{HealthHandle, Status, Unroutable};
use crate::wire::Probe;

/// What a probe did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// `health_route` got this rank.
    Routed(u32),
    /// `health_report` was recorded.
    Recorded,
}

/// The health channel's own round-robin position.
#[derive(Debug, Default)]
pub struct HealthDispatcher {
    cursor: u32,
}

impl HealthDispatcher {
    /// Serves one probe. Only a `health_route` left to the policy advances
    /// the cursor; a refusal changes nothing.
    pub fn serve(&mut self, probe: Probe, mut engines: HealthHandle<'_>, now: Instant) -> Result<Served, Unroutable> {
        match probe {
            Probe::Route(target) => {
                let table = engines.engines();
                if let Some(rank) = target.fixed_rank(table.dp_size()) {
                    // A probe may go to a stalled rank: it is how the rank
                    // is found working again.
                    if rank < table.dp_size() && table.get(rank).status == Status::Stalled {
                        return Ok(Served::Routed(rank));
                    }
                    return check_fixed(table, rank, target).map(Served::Routed);
                }
                let rank = next_routable(table, self.cursor)?;
                self.cursor = (rank + 1) % table.dp_size();
                Ok(Served::Routed(rank))
            }
            Probe::Report { rank, ok } => {
                engines.record(rank, ok, now);
                Ok(Served::Recorded)
            }
        }
    }

    /// Keeps the cursor within `dp_size` ranks.
    pub fn resize(&mut self, dp_size: u32) {
        self.cursor = self.cursor.checked_rem(dp_size).unwrap_or(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::testing::table_with_up;
    use crate::engines::{EngineTable, Target};

    fn route(h: &mut HealthDispatcher, t: &mut EngineTable, target: Target) -> Result<u32, Unroutable> {
        match h.serve(Probe::Route(target), t.health_handle(), Instant::now())? {
            Served::Routed(rank) => Ok(rank),
            Served::Recorded => unreachable!("a route probe routes"),
        }
    }

    #[test]
    fn own_rotation_over_routable_ranks_pins_do_not_advance() {
        let mut t = table_with_up(4, &[0, 2, 3]);
        let mut h = HealthDispatcher::default();
        let got: Vec<u32> = (0..4).map(|_| route(&mut h, &mut t, Target::Policy).unwrap()).collect();
        assert_eq!(got, [0, 2, 3, 0]);
        assert_eq!(route(&mut h, &mut t, Target::Pinned(3)), Ok(3));
        assert_eq!(route(&mut h, &mut t, Target::Room(6)), Ok(2));
        assert_eq!(route(&mut h, &mut t, Target::Policy), Ok(2));
        assert!(matches!(route(&mut h, &mut t, Target::Pinned(1)), Err(Unroutable::Rank { rank: 1, .. })));
        assert!(matches!(route(&mut h, &mut t, Target::Room(5)), Err(Unroutable::Rank { rank: 1, .. })));
        let mut empty = table_with_up(4, &[]);
        assert_eq!(route(&mut h, &mut empty, Target::Policy), Err(Unroutable::NoEngine { dp_size: 4 }));
    }

    #[test]
    fn a_failed_report_raises_only_that_ranks_penalty_on_the_next_tick() {
        let mut t = table_with_up(2, &[0, 1]);
        let mut h = HealthDispatcher::default();
        let now = Instant::now();
        let epoch = t.epoch();
        assert_eq!(h.serve(Probe::Report { rank: 1, ok: false }, t.health_handle(), now), Ok(Served::Recorded));
        assert_eq!(t.get(1).penalty, 0.0);
        t.tick(now);
        assert_eq!((t.get(0).penalty, t.get(1).penalty), (0.0, 1.0));
        // Liveness and the epoch are not a health result's to change.
        assert_eq!((t.get(1).status.is_routable(), t.epoch()), (true, epoch));
    }
}
