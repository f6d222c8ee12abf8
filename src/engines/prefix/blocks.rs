//! One rank's blocks, per medium: the engine's block hash -> dpcoord's key
//! and an insertion stamp (for the oldest-first cap).

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::engines::kv::Medium;

#[derive(Debug, Clone, Copy)]
struct Handle {
    key: u64,
    stamp: u64,
}

/// The keys of a rank's GPU blocks taken out by [`RankBlocks::take`],
/// holding the map's memory until the last is read.
pub struct GpuKeys(std::collections::hash_map::IntoIter<u64, Handle>);

impl Iterator for GpuKeys {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        self.0.next().map(|(_, h)| h.key)
    }
}

#[derive(Default)]
pub struct RankBlocks {
    media: [HashMap<u64, Handle, RandomState>; 4],
    next_stamp: u64,
}

impl RankBlocks {
    pub fn len(&self, medium: Medium) -> usize {
        self.media[medium.index()].len()
    }

    pub fn total(&self) -> usize {
        self.media.iter().map(HashMap::len).sum()
    }

    /// The key of the engine's block `hash`: on `medium` first, else on any
    /// medium (a block offloaded to CPU may continue a GPU parent).
    pub fn key_of(&self, medium: Medium, hash: u64) -> Option<u64> {
        let first = self.media[medium.index()].get(&hash);
        first.or_else(|| self.media.iter().find_map(|m| m.get(&hash))).map(|h| h.key)
    }

    /// Indexes `hash` as `key`; the key it replaces, if any.
    pub fn insert(&mut self, medium: Medium, hash: u64, key: u64) -> Option<u64> {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.media[medium.index()].insert(hash, Handle { key, stamp }).map(|old| old.key).filter(|&k| k != key)
    }

    /// Removes `hash` from `medium`; its key, if it was there.
    pub fn remove(&mut self, medium: Medium, hash: u64) -> Option<u64> {
        self.media[medium.index()].remove(&hash).map(|h| h.key)
    }

    /// The keys of every GPU block, for clearing their holder bits.
    pub fn drain_gpu_keys(&mut self) -> impl Iterator<Item = u64> + '_ {
        self.media[Medium::Gpu.index()].drain().map(|(_, h)| h.key)
    }

    /// Takes the GPU blocks out, to clear their holder bits a slice at a
    /// time, and forgets the others.
    pub fn take(&mut self) -> GpuKeys {
        let gpu = std::mem::take(&mut self.media[Medium::Gpu.index()]);
        self.clear();
        GpuKeys(gpu.into_iter())
    }

    /// Forgets every block, and the memory the maps held.
    pub fn clear(&mut self) {
        self.media = Default::default();
    }

    /// Keeps the `keep` newest blocks across media and drops the rest,
    /// calling `on_gpu_evicted` with the key of each GPU block dropped.
    /// Returns how many were dropped.
    pub fn evict_older_than_newest(&mut self, keep: usize, mut on_gpu_evicted: impl FnMut(u64)) -> u64 {
        // Stamps are distinct and below `next_stamp`, so at most `keep`
        // blocks have a stamp at or above this threshold.
        let threshold = self.next_stamp.saturating_sub(keep as u64);
        let mut dropped = 0;
        for (i, map) in self.media.iter_mut().enumerate() {
            map.retain(|_, h| {
                let stays = h.stamp >= threshold;
                if !stays {
                    dropped += 1;
                    if i == Medium::Gpu.index() {
                        on_gpu_evicted(h.key);
                    }
                }
                stays
            });
        }
        dropped
    }
}
