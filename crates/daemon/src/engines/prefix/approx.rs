//! The approximate prefix index: what dpcoord's own placements left in each
//! rank's cache, for engines that publish no KV events (docs/PROTOCOL.md
//! §7). A placement records its prompt's keys on the rank; an entry lives
//! `ttl` after its last placement, to within [`RENEW_GRAIN`] of the TTL:
//! a key placed again sooner than that after its last renewal keeps its
//! time, so a hot prefix costs one hash probe per block, not a renewal
//! (the queue of renewals would otherwise grow by a whole prompt per
//! route). The index holds at most `bytes` (its share of the memory
//! budget), split evenly by the ranks: past its share a rank's oldest keys
//! go, and are counted.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;

use super::holders::Holders;
use crate::config::budget;

/// A key is renewed at most once per this fraction of the TTL.
pub const RENEW_GRAIN: u32 = 64;

#[derive(Default)]
struct Rank {
    /// Key -> when it was last placed here.
    seen: HashMap<u64, Instant, RandomState>,
    /// (time, key) in placement order; an entry whose time is older than
    /// `seen`'s for its key was renewed and is skipped.
    order: VecDeque<(Instant, u64)>,
}

pub struct ApproxIndex {
    holders: Holders,
    ranks: Vec<Rank>,
    ttl: Duration,
    /// The index's bytes, all ranks, and the keys each rank may keep.
    bytes: u64,
    cap: usize,
}

impl ApproxIndex {
    pub fn new(dp_size: u32, ttl: Duration, bytes: u64) -> Self {
        let ranks = (0..dp_size).map(|_| Rank::default()).collect();
        ApproxIndex { holders: Holders::default(), ranks, ttl, bytes, cap: budget::approx_per_rank(bytes, dp_size) }
    }

    /// A new TTL and share; a smaller share is enforced on each rank as it
    /// is next placed on.
    pub fn set_limits(&mut self, ttl: Duration, bytes: u64) {
        (self.ttl, self.bytes) = (ttl, bytes);
        self.cap = budget::approx_per_rank(bytes, self.ranks.len() as u32);
    }

    /// Keys each rank may keep.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Whether no rank holds a key.
    pub fn is_empty(&self) -> bool {
        self.holders.len() == 0
    }

    /// The ranks it keeps keys for.
    #[cfg(test)]
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Keys rank `rank` is taken to hold.
    pub fn len(&self, rank: u32) -> usize {
        self.ranks.get(rank as usize).map_or(0, |r| r.seen.len())
    }

    pub fn resize(&mut self, dp_size: u32) {
        for rank in dp_size..self.ranks.len() as u32 {
            self.clear(rank);
        }
        self.ranks.resize_with(dp_size as usize, Rank::default);
        self.cap = budget::approx_per_rank(self.bytes, dp_size);
    }

    pub fn clear(&mut self, rank: u32) {
        let Some(r) = self.ranks.get_mut(rank as usize) else { return };
        for (key, _) in r.seen.drain() {
            self.holders.unset(key, rank);
        }
        r.order = VecDeque::new();
    }

    /// Rank `rank` was given a prompt with these keys at `now`; how many
    /// older keys its share made room for.
    pub fn record(&mut self, rank: u32, keys: &[u64], now: Instant) -> usize {
        let Some(r) = self.ranks.get_mut(rank as usize) else { return 0 };
        let mut evicted = 0;
        // Renewed at or before this, a key is renewed again (compared as
        // instants: a subtraction per key costs more than the probe).
        let due = now.checked_sub(self.ttl / RENEW_GRAIN);
        for &key in keys {
            match r.seen.entry(key) {
                Entry::Occupied(mut e) => {
                    match due {
                        Some(due) if *e.get() <= due => {}
                        _ => continue,
                    }
                    e.insert(now);
                }
                Entry::Vacant(e) => {
                    e.insert(now);
                    self.holders.set(key, rank);
                }
            }
            r.order.push_back((now, key));
        }
        // Past the share, the oldest go; `order` keeps one live entry per key
        // at most twice over (renewals are compacted away).
        while r.seen.len() > self.cap {
            let Some((t, key)) = r.order.pop_front() else { break };
            if r.seen.get(&key) == Some(&t) {
                r.seen.remove(&key);
                self.holders.unset(key, rank);
                evicted += 1;
            }
        }
        if r.order.len() > 2 * r.seen.len() + 1024 {
            r.order.retain(|(t, key)| r.seen.get(key) == Some(t));
        }
        evicted
    }

    /// Forgets entries not placed again within the TTL.
    pub fn expire(&mut self, now: Instant) {
        // Younger than the TTL while after this (before the clock's start: all).
        let Some(cutoff) = now.checked_sub(self.ttl) else { return };
        for (rank, r) in self.ranks.iter_mut().enumerate() {
            while let Some(&(t, key)) = r.order.front() {
                if t > cutoff {
                    break;
                }
                r.order.pop_front();
                if r.seen.get(&key) == Some(&t) {
                    r.seen.remove(&key);
                    self.holders.unset(key, rank as u32);
                }
            }
        }
    }

    /// As `PrefixIndex::leading`.
    pub fn leading(&self, keys: &[u64], out: &mut Vec<u32>) {
        self.holders.leading(keys, self.ranks.len() as u32, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leading(ix: &ApproxIndex, keys: &[u64]) -> Vec<u32> {
        let mut out = Vec::new();
        ix.leading(keys, &mut out);
        out
    }

    #[test]
    fn placements_are_remembered_for_the_ttl_and_renewed_by_placing_again() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut ix = ApproxIndex::new(2, 10 * s, 2 * 100 * budget::APPROX_KEY_BYTES);
        ix.record(0, &[1, 2, 3], t0);
        ix.record(1, &[1], t0 + s);
        assert_eq!(leading(&ix, &[1, 2, 3, 4]), vec![3, 1]);
        ix.record(0, &[1], t0 + 5 * s);
        ix.expire(t0 + 10 * s);
        assert_eq!(leading(&ix, &[1, 2, 3]), vec![1, 1], "2 and 3 expired; 1 was placed again");
        ix.expire(t0 + 15 * s);
        assert_eq!(leading(&ix, &[1]), vec![0, 0]);
        assert_eq!((ix.len(0), ix.len(1)), (0, 0));
    }

    #[test]
    fn a_key_is_renewed_at_most_once_per_grain_of_the_ttl() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(64);
        let grain = ttl / RENEW_GRAIN;
        let mut ix = ApproxIndex::new(1, ttl, 100 * budget::APPROX_KEY_BYTES);
        ix.record(0, &[1, 2], t0);
        // 1 again within the grain keeps its time; 2 just past it is renewed.
        ix.record(0, &[1], t0 + grain - Duration::from_millis(1));
        ix.record(0, &[2], t0 + grain);
        ix.expire(t0 + ttl);
        assert_eq!(leading(&ix, &[1]), vec![0], "1 expired a grain early, at most");
        assert_eq!(leading(&ix, &[2]), vec![1]);
        ix.expire(t0 + grain + ttl);
        assert_eq!(ix.len(0), 0);
    }

    #[test]
    fn the_share_drops_the_oldest_and_resize_forgets_removed_ranks() {
        let t0 = Instant::now();
        let mut ix = ApproxIndex::new(3, Duration::from_secs(60), 3 * 3 * budget::APPROX_KEY_BYTES);
        assert_eq!(ix.cap(), 3);
        assert_eq!(ix.record(2, &[1, 2, 3], t0), 0);
        assert_eq!(ix.record(2, &[1], t0 + Duration::from_secs(1)), 0);
        assert_eq!(ix.record(2, &[9], t0 + Duration::from_secs(2)), 1, "2 went");
        assert_eq!(ix.len(2), 3);
        assert_eq!(leading(&ix, &[1])[2], 1, "1 was renewed");
        assert_eq!(leading(&ix, &[2])[2], 0, "2 was the oldest");
        ix.resize(2);
        assert_eq!(ix.cap(), 4, "two ranks share the bytes of three");
        ix.resize(3);
        assert_eq!(leading(&ix, &[1, 9]), vec![0, 0, 0]);
    }
}
