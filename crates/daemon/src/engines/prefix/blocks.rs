//! One rank's blocks, per medium: the engine's block hash -> dpcoord's key
//! and an insertion stamp (for the oldest-first cap). Each medium's map is
//! sharded (`sharded.rs`), so it grows and is swept a shard at a time.

use super::sharded::{Sharded, Taken};
use crate::engines::kv::Medium;

/// `log2` of the shards of one medium's map: at the default cap of 2^20
/// blocks a shard holds about 16,000, rehashed or swept in well under a
/// millisecond.
const SHARD_BITS: u32 = 6;

#[derive(Debug, Clone, Copy)]
pub struct Handle {
    key: u64,
    stamp: u64,
}

/// The keys of a rank's GPU blocks taken out by [`RankBlocks::take`],
/// holding the maps' memory until the last is read.
pub struct GpuKeys(Taken<Handle>);

impl Iterator for GpuKeys {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        self.0.next().map(|(_, h)| h.key)
    }
}

pub struct RankBlocks {
    media: [Sharded<Handle>; 4],
    next_stamp: u64,
}

impl Default for RankBlocks {
    fn default() -> Self {
        RankBlocks { media: std::array::from_fn(|_| Sharded::new(SHARD_BITS)), next_stamp: 0 }
    }
}

impl RankBlocks {
    pub fn len(&self, medium: Medium) -> usize {
        self.media[medium.index()].len()
    }

    pub fn total(&self) -> usize {
        self.media.iter().map(Sharded::len).sum()
    }

    /// The key of the engine's block `hash`: on `medium` first, else on any
    /// medium (a block offloaded to CPU may continue a GPU parent).
    pub fn key_of(&self, medium: Medium, hash: u64) -> Option<u64> {
        let first = self.media[medium.index()].get(hash);
        first.or_else(|| self.media.iter().find_map(|m| m.get(hash))).map(|h| h.key)
    }

    /// Indexes `hash` as `key`; the key it replaces, if any.
    pub fn insert(&mut self, medium: Medium, hash: u64, key: u64) -> Option<u64> {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.media[medium.index()].insert(hash, Handle { key, stamp }).map(|old| old.key).filter(|&k| k != key)
    }

    /// Removes `hash` from `medium`; its key, if it was there.
    pub fn remove(&mut self, medium: Medium, hash: u64) -> Option<u64> {
        self.media[medium.index()].remove(hash).map(|h| h.key)
    }

    /// Takes the GPU blocks out, to clear their holder bits a slice at a
    /// time, and forgets the others.
    pub fn take(&mut self) -> GpuKeys {
        let gpu = self.media[Medium::Gpu.index()].take();
        self.clear();
        GpuKeys(gpu)
    }

    /// Forgets every block, and the memory the maps held.
    pub fn clear(&mut self) {
        let stamp = self.next_stamp;
        *self = RankBlocks { next_stamp: stamp, ..RankBlocks::default() };
    }

    /// The stamp below which blocks go so that the `keep` newest stay.
    /// Stamps are distinct and below `next_stamp`, so at most `keep` blocks
    /// have one at or above it.
    pub fn threshold(&self, keep: usize) -> u64 {
        self.next_stamp.saturating_sub(keep as u64)
    }

    /// Steps of a sweep: one per shard of each medium.
    pub fn sweep_steps(&self) -> usize {
        self.media.iter().map(Sharded::shard_count).sum()
    }

    /// Sweep step `step`: drops the blocks of one shard stamped below
    /// `threshold`, calling `on_gpu_evicted` with the key of each GPU block
    /// dropped. Returns how many went.
    pub fn sweep(&mut self, step: usize, threshold: u64, mut on_gpu_evicted: impl FnMut(u64)) -> usize {
        let per = 1 << SHARD_BITS;
        let medium = step / per;
        let Some(map) = self.media.get_mut(medium) else { return 0 };
        map.retain_shard(step % per, |_, h| {
            let stays = h.stamp >= threshold;
            if !stays && medium == Medium::Gpu.index() {
                on_gpu_evicted(h.key);
            }
            stays
        })
    }
}
