//! Placement policies: pure functions from candidates to a rank.
//!
//! A policy sees the engine table (read-only) and its caller's own cursor;
//! it does no I/O and keeps no hidden state, so it is tested exactly.

use crate::engine::EngineTable;

/// The first routable rank at or after `start` (wrapping), if any.
pub fn round_robin(start: u32, engines: &EngineTable) -> Option<u32> {
    let dp = engines.dp_size();
    (0..dp).map(|i| (start + i) % dp).find(|&r| engines.is_routable(r))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::Config;
    use crate::wire::StatsUpdate;
    use std::time::Instant;

    pub fn table_with_up(dp: u32, up: &[u32]) -> EngineTable {
        let mut c = Config::default();
        c.engines.dp_size = dp;
        let mut t = EngineTable::new(&c);
        for &r in up {
            let u = StatsUpdate {
                rank: r.into(),
                boot: 1,
                seq: 1,
                counts: [0; 5],
                tokens: None,
                kv_usage: None,
                ttft_ms: None,
                tpot_ms: None,
            };
            t.apply(&u, Instant::now()).unwrap();
        }
        t
    }

    #[test]
    fn round_robin_skips_unroutable_and_wraps() {
        let t = table_with_up(5, &[1, 3]);
        assert_eq!(round_robin(0, &t), Some(1));
        assert_eq!(round_robin(2, &t), Some(3));
        assert_eq!(round_robin(4, &t), Some(1));
        assert_eq!(round_robin(0, &table_with_up(3, &[])), None);
    }
}
