//! Session affinity table: session key -> rank, bounded in size (least
//! recently used evicted first) and in time (entries idle for `ttl` are
//! forgotten).

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use lru::LruCache;

use crate::config::Sessions;

#[derive(Debug)]
pub struct SessionTable {
    map: LruCache<String, (u32, Instant)>,
    ttl: Duration,
}

impl SessionTable {
    pub fn new(cfg: &Sessions) -> Self {
        let cap = NonZeroUsize::new(cfg.capacity).unwrap_or(NonZeroUsize::MIN);
        SessionTable { map: LruCache::new(cap), ttl: cfg.ttl }
    }

    /// The session's rank, if it has a live one. Changes nothing.
    pub fn peek(&self, key: &str, now: Instant) -> Option<u32> {
        self.map.peek(key).filter(|(_, used)| now.saturating_duration_since(*used) < self.ttl).map(|&(r, _)| r)
    }

    /// Binds the session to `rank` as of `now` (most recently used).
    pub fn assign(&mut self, key: &str, rank: u32, now: Instant) {
        match self.map.get_mut(key) {
            Some(entry) => *entry = (rank, now),
            None => {
                self.map.put(key.to_owned(), (rank, now));
            }
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
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
    }
}
