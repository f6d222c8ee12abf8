//! Facts about engines: what each DP rank reported (as engine events),
//! whether it is routable, and its penalty. Nothing here knows about user
//! placements, and nothing here knows a wire format.

pub mod event;
pub mod kv;
pub mod penalty;
pub mod prefix;
pub mod routable;
mod table;

pub use event::{Counts, EngineEvent, LoadReport, Sequence, TokenLoad};
pub use routable::{RankSet, Target, Unroutable};
pub use table::{Accepted, EngineState, EngineTable, HealthHandle, Reject, StallCause, Status};

/// Fixtures for unit tests across the crate.
#[cfg(test)]
pub(crate) mod testing {
    use std::time::Instant;

    use super::{EngineTable, LoadReport};
    use crate::config::Settings;

    /// Default settings with `dp` ranks.
    pub fn settings(dp: u32) -> Settings {
        let mut s = Settings::default();
        s.engines.dp_size = dp;
        // Unit tests resize freely, as a daemon whose sockets were sized
        // for the most ranks does.
        s.engines.max_dp_size = Some(1024);
        s
    }

    /// A table of `dp` ranks where exactly `up` have reported once.
    pub fn table_with_up(dp: u32, up: &[u32]) -> EngineTable {
        let mut t = EngineTable::new(&settings(dp));
        for &r in up {
            t.apply(&LoadReport::new(r, 1, 1), Instant::now()).unwrap();
        }
        t
    }
}
