//! A hash map from `u64` split into shards: growing it rehashes one shard
//! at a time, never the whole table in one insert (a table of 8 million
//! entries doubling took half a second), and it can be swept shard by
//! shard (the per-rank cap, a step per shard). A key's shard comes from a
//! multiplier drawn per process, so a peer that picks keys cannot pile
//! them into one shard.

use std::collections::hash_map::{self, HashMap};
use std::hash::BuildHasher;
use std::sync::OnceLock;

use foldhash::fast::RandomState;

/// An odd multiplier drawn once per process.
fn multiplier() -> u64 {
    static M: OnceLock<u64> = OnceLock::new();
    *M.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64) | 1)
}

pub struct Sharded<V> {
    /// Empty until the first insert (most maps of most ranks stay empty).
    shards: Vec<HashMap<u64, V, RandomState>>,
    /// `log2` of the shard count.
    bits: u32,
    len: usize,
}

impl<V> Sharded<V> {
    /// A map of `2^bits` shards (1 to 2^16).
    pub const fn new(bits: u32) -> Self {
        Sharded { shards: Vec::new(), bits, len: 0 }
    }

    fn shard(&self, key: u64) -> usize {
        (key.wrapping_mul(multiplier()) >> (64 - self.bits)) as usize
    }

    pub fn shard_count(&self) -> usize {
        1 << self.bits
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn get(&self, key: u64) -> Option<&V> {
        self.shards.get(self.shard(key))?.get(&key)
    }

    pub fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        let s = self.shard(key);
        self.shards.get_mut(s)?.get_mut(&key)
    }

    fn shard_mut(&mut self, key: u64) -> &mut HashMap<u64, V, RandomState> {
        if self.shards.is_empty() {
            self.shards.resize_with(self.shard_count(), HashMap::default);
        }
        let s = self.shard(key);
        &mut self.shards[s]
    }

    /// The value of `key`, inserted as `value` if absent.
    pub fn or_insert(&mut self, key: u64, value: V) -> &mut V {
        let shard = {
            if self.shards.is_empty() {
                self.shards.resize_with(self.shard_count(), HashMap::default);
            }
            let s = self.shard(key);
            &mut self.shards[s]
        };
        match shard.entry(key) {
            hash_map::Entry::Occupied(o) => o.into_mut(),
            hash_map::Entry::Vacant(v) => {
                self.len += 1;
                v.insert(value)
            }
        }
    }

    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let old = self.shard_mut(key).insert(key, value);
        self.len += usize::from(old.is_none());
        old
    }

    pub fn remove(&mut self, key: u64) -> Option<V> {
        let s = self.shard(key);
        let old = self.shards.get_mut(s)?.remove(&key);
        self.len -= usize::from(old.is_some());
        old
    }

    /// Keeps the entries of shard `i` for which `keep` is true; how many went.
    pub fn retain_shard(&mut self, i: usize, mut keep: impl FnMut(u64, &V) -> bool) -> usize {
        let Some(shard) = self.shards.get_mut(i) else { return 0 };
        let before = shard.len();
        shard.retain(|&k, v| keep(k, v));
        let gone = before - shard.len();
        self.len -= gone;
        gone
    }

    /// Empties the map, handing its entries over to be read later.
    pub fn take(&mut self) -> Taken<V> {
        self.len = 0;
        Taken { shards: std::mem::take(&mut self.shards).into_iter(), current: None }
    }
}

/// The entries of a [`Sharded`] map taken out, read one by one.
pub struct Taken<V> {
    shards: std::vec::IntoIter<HashMap<u64, V, RandomState>>,
    current: Option<hash_map::IntoIter<u64, V>>,
}

impl<V> Iterator for Taken<V> {
    type Item = (u64, V);

    fn next(&mut self) -> Option<(u64, V)> {
        loop {
            if let Some(kv) = self.current.as_mut().and_then(Iterator::next) {
                return Some(kv);
            }
            self.current = Some(self.shards.next()?.into_iter());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sharded_map_counts_and_finds_what_a_map_does() {
        let mut m = Sharded::new(4);
        assert_eq!((m.len(), m.get(1)), (0, None));
        for k in 0..1000u64 {
            assert_eq!(m.insert(k * 7, k), None);
        }
        assert_eq!(m.insert(7, 100), Some(1));
        *m.or_insert(7, 0) += 1;
        *m.or_insert(5, 40) += 2;
        assert_eq!((m.len(), m.get(7), m.get(5)), (1001, Some(&101), Some(&42)));
        assert_eq!((m.remove(5), m.remove(5), m.len()), (Some(42), None, 1000));
        let gone: usize = (0..m.shard_count()).map(|i| m.retain_shard(i, |k, _| k % 2 == 0)).sum();
        assert_eq!((gone, m.len()), (500, 500));
        let mut taken: Vec<u64> = m.take().map(|(k, _)| k).collect();
        taken.sort_unstable();
        assert_eq!(taken, (0..1000).step_by(2).map(|k| k * 7).collect::<Vec<_>>());
        assert_eq!((m.len(), m.get(14)), (0, None));
    }
}
