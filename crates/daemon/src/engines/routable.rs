//! Which ranks can take a placement: shared by the user side and the health
//! channel, so that neither depends on the other.

use std::fmt;

use super::table::{EngineTable, Status};

/// Where a placement must go, if the query says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The policy decides.
    Policy,
    /// An explicit `rank` pin (already checked to be `< dp_size`).
    Pinned(u32),
    /// `bootstrap_room % dp_size`, for PD disaggregation.
    Room(u64),
}

impl Target {
    /// The rank a pinned or room target resolves to; `None` for the policy.
    pub fn fixed_rank(self, dp_size: u32) -> Option<u32> {
        match self {
            Target::Policy => None,
            Target::Pinned(r) => Some(r),
            Target::Room(room) => Some((room % u64::from(dp_size.max(1))) as u32),
        }
    }
}

/// A set of ranks (`0..1024`, `engines.dp_size`'s bound): those a
/// route's `among` lets the policy pick from. Fixed size, so a query
/// allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankSet([u64; 16]);

impl RankSet {
    /// Adds `rank` (below 1024; the decoder checks `dp_size` first).
    pub fn insert(&mut self, rank: u32) {
        if let Some(w) = self.0.get_mut(rank as usize / 64) {
            *w |= 1 << (rank % 64);
        }
    }

    pub fn contains(&self, rank: u32) -> bool {
        self.0.get(rank as usize / 64).is_some_and(|w| w & (1 << (rank % 64)) != 0)
    }
}

/// Why no rank could be given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unroutable {
    /// A pinned or room rank that cannot take traffic now (`status` is
    /// `None` when the rank no longer exists: the table shrank).
    Rank { rank: u32, target: Target, status: Option<Status> },
    /// No rank of `dp_size` is up or stale.
    NoEngine { dp_size: u32 },
    /// No rank of a route's `among` is up or stale.
    NoneAmong { dp_size: u32 },
    /// Every candidate rank has at least `shed_waiting` requests queued
    /// (its engine's waiting plus dpcoord's pending); `least` is the
    /// shortest queue.
    Saturated { shed_waiting: u64, least: u64 },
}

impl fmt::Display for Unroutable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Unroutable::Rank { rank, target, status } => {
                match target {
                    Target::Room(room) => write!(f, "bootstrap_room {room} maps to rank {rank}, which")?,
                    _ => write!(f, "rank {rank}")?,
                }
                let status = status.map_or("gone (dp_size shrank)", Status::as_str);
                write!(f, " is {status}, not routable; try again later or drop the pin")
            }
            Unroutable::NoEngine { dp_size } => write!(
                f,
                "no routable rank: none of the {dp_size} ranks is up or stale; check that engines publish stats"
            ),
            Unroutable::NoneAmong { dp_size } => {
                write!(f, "no routable rank among the ranks asked for (of {dp_size}): none is up or stale")
            }
            Unroutable::Saturated { shed_waiting, least } => write!(
                f,
                "every candidate rank has at least shed_waiting = {shed_waiting} requests queued (the shortest \
                 queue is {least}): shed, nothing placed; try again later"
            ),
        }
    }
}

/// The rank a pin or room names, if it can take traffic.
pub fn check_fixed(engines: &EngineTable, rank: u32, target: Target) -> Result<u32, Unroutable> {
    if engines.is_routable(rank) {
        return Ok(rank);
    }
    let status = (rank < engines.dp_size()).then(|| engines.get(rank).status);
    Err(Unroutable::Rank { rank, target, status })
}

/// The first routable rank at or after `start` (wrapping).
pub fn next_routable(engines: &EngineTable, start: u32) -> Result<u32, Unroutable> {
    let dp = engines.dp_size();
    (0..dp)
        .map(|i| (start.wrapping_add(i)) % dp)
        .find(|&r| engines.is_routable(r))
        .ok_or(Unroutable::NoEngine { dp_size: dp })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::testing::table_with_up;

    #[test]
    fn next_routable_skips_unroutable_and_wraps() {
        let t = table_with_up(5, &[1, 3]);
        assert_eq!(next_routable(&t, 0), Ok(1));
        assert_eq!(next_routable(&t, 2), Ok(3));
        assert_eq!(next_routable(&t, 4), Ok(1));
        assert_eq!(next_routable(&table_with_up(3, &[]), 0), Err(Unroutable::NoEngine { dp_size: 3 }));
    }

    #[test]
    fn pins_and_rooms_say_why_they_cannot_be_served() {
        let t = table_with_up(4, &[0]);
        assert_eq!(check_fixed(&t, 0, Target::Pinned(0)), Ok(0));
        let e = check_fixed(&t, 2, Target::Room(6)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bootstrap_room 6 maps to rank 2, which is unknown, not routable; try again later or drop the pin"
        );
        let gone = check_fixed(&t, 9, Target::Pinned(9)).unwrap_err();
        assert_eq!(gone.to_string(), "rank 9 is gone (dp_size shrank), not routable; try again later or drop the pin");
    }
}
