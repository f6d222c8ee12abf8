//! Session affinity table: session key -> rank, bounded in size (least
//! recently used evicted first) and in time (entries idle for `ttl` are
//! forgotten).
//!
//! Keys are stored as 64-bit hashes under a per-process random key, so an
//! entry costs the same whatever the key's length and memory stays bounded
//! by `capacity` alone. Two keys that collide share a rank, which only
//! affects placement, never correctness.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use lru::LruCache;

use crate::config::Sessions;

#[derive(Debug)]
pub struct SessionTable {
    map: LruCache<u64, (u32, Instant)>,
    hasher: RandomState,
    ttl: Duration,
}

impl SessionTable {
    pub fn new(cfg: &Sessions) -> Self {
        let cap = NonZeroUsize::new(cfg.capacity).unwrap_or(NonZeroUsize::MIN);
        SessionTable { map: LruCache::new(cap), hasher: RandomState::new(), ttl: cfg.ttl }
    }

    /// New capacity (the least recently used go first when it shrinks) and TTL.
    pub fn reconfigure(&mut self, cfg: &Sessions) {
        self.map.resize(NonZeroUsize::new(cfg.capacity).unwrap_or(NonZeroUsize::MIN));
        self.ttl = cfg.ttl;
    }

    /// The session's rank, if it has a live one. Changes nothing.
    pub fn peek(&self, key: &str, now: Instant) -> Option<u32> {
        let live = |&&(_, used): &&(u32, Instant)| now.saturating_duration_since(used) < self.ttl;
        self.map.peek(&self.hasher.hash_one(key)).filter(live).map(|&(r, _)| r)
    }

    /// Binds the session to `rank` as of `now` (most recently used).
    pub fn assign(&mut self, key: &str, rank: u32, now: Instant) {
        self.map.put(self.hasher.hash_one(key), (rank, now));
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_by_capacity_and_ttl() {
        let cfg = Sessions { capacity: 2, ttl: Duration::from_secs(10), max_load_ratio: 2.0 };
        let mut t = SessionTable::new(&cfg);
        let t0 = Instant::now();
        t.assign("a", 1, t0);
        t.assign("b", 2, t0);
        t.assign("a", 3, t0); // a is now the most recent
        t.assign("c", 0, t0); // evicts b
        assert_eq!((t.peek("a", t0), t.peek("b", t0), t.peek("c", t0)), (Some(3), None, Some(0)));
        assert_eq!(t.len(), 2);
        assert_eq!(t.peek("a", t0 + Duration::from_secs(10)), None);
        // Shrinking keeps the most recently used; a shorter TTL applies at once.
        t.reconfigure(&Sessions { capacity: 1, ttl: Duration::from_secs(5), ..cfg });
        assert_eq!((t.len(), t.peek("c", t0), t.peek("a", t0)), (1, Some(0), None));
        assert_eq!(t.peek("c", t0 + Duration::from_secs(5)), None);
    }
}
