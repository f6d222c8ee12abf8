//! The prefix index: which KV blocks each rank holds, keyed by dpcoord's
//! own chained block keys (`keys`), fed by the engines' KV events.
//!
//! Two maps, chosen for lookup speed and bytes per block:
//! - `holders`: block key -> a bitset of the ranks holding it on GPU (one
//!   word per 64 ranks, the word's number mixed into the map key), so a
//!   prompt's leading-match scan is one probe per block for up to 64 ranks,
//!   and it stops at the first block no rank holds.
//! - per rank and medium, the engine's block hash -> (key, insertion
//!   stamp) (`blocks.rs`), because `BlockRemoved` names blocks by the
//!   engine's hash, which a router cannot recompute.
//!
//! A hybrid model's KV cache groups share both maps, hashes and keys mixed
//! with the group (`groups.rs`); group 0's are the plain ones.
//!
//! A radix tree over token blocks (SGLang's gateway, Dynamo) would share
//! prefix nodes, but every node costs a pointer chase on lookup and more
//! bytes than a map entry; chained keys already make each block's key
//! stand for its whole prefix, so flat maps give the same answers.

mod apply;
mod approx;
mod blocks;
mod groups;
mod holders;
pub mod keys;
mod sharded;
mod sizes;

pub use self::apply::Progress;
pub use self::approx::ApproxIndex;
use self::blocks::RankBlocks;
use self::groups::Groups;
pub use self::groups::MAX_GROUP;
use self::holders::Holders;
use self::sizes::BlockSizes;
pub use self::sizes::MAX_SIZES;
use super::kv::{KvEvent, Medium};

/// What one batch did to a rank's index: events by outcome, and blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// `BlockStored` events indexed.
    pub stored: u64,
    /// `BlockRemoved` events whose every hash was held (and is gone now).
    pub removed: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// `BlockStored` events with blocks held but never matched: their
    /// identity is more than tokens, LoRA name and salt, or they continue
    /// such a block (`Stored::unmatchable`).
    pub unmatchable: u64,
    /// `BlockStored` events whose parent the rank's index does not hold.
    pub unknown_parent: u64,
    /// `BlockRemoved` events naming a hash not held (the held ones still go).
    pub unknown_block: u64,
    /// `BlockStored` events with a wrong token count, or a block size other
    /// than the rank's, or that cannot be keyed (token pairs, a malformed
    /// `group_idx`).
    pub bad_event: u64,
    /// Blocks indexed (unmatchable ones too) and removed (by events, not the cap).
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    /// Blocks dropped by the rank's share of the memory budget, oldest first.
    pub evicted: u64,
}

pub struct PrefixIndex {
    /// Per rank, learned from the first `BlockStored` indexed on it; every
    /// later one must match until the rank's engine restarts or is gone.
    sizes: BlockSizes,
    holders: Holders,
    /// The KV cache groups each rank published: its hit is their least.
    groups: Groups,
    ranks: Vec<RankBlocks>,
    /// Blocks per rank, all media together: the rank's share of the
    /// memory budget (`config/budget.rs`).
    cap: usize,
    keys: Vec<u64>,
}

impl PrefixIndex {
    pub fn new(dp_size: u32, cap: usize) -> Self {
        PrefixIndex {
            sizes: BlockSizes::new(dp_size),
            holders: Holders::default(),
            groups: Groups::new(dp_size),
            ranks: (0..dp_size).map(|_| RankBlocks::default()).collect(),
            cap,
            keys: Vec::new(),
        }
    }

    /// The block size most ranks use: the one prompts are keyed with
    /// first. `None` until a rank stored a block.
    pub fn block_size(&self) -> Option<u32> {
        self.sizes.in_use().first().copied()
    }

    /// Rank `rank`'s own block size; `None` until one of its blocks is
    /// indexed, and again once it is forgotten ([`PrefixIndex::forget`]).
    pub fn rank_block_size(&self, rank: u32) -> Option<u32> {
        self.sizes.of(rank)
    }

    /// The block sizes ranks use, most ranks first, at most [`MAX_SIZES`].
    pub fn block_sizes(&self) -> &[u32] {
        self.sizes.in_use()
    }

    pub fn set_cap(&mut self, cap: usize) {
        self.cap = cap;
    }

    pub fn dp_size(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// Whether rank `rank` holds any block, on any medium.
    pub fn holds_any(&self, rank: u32) -> bool {
        self.ranks.get(rank as usize).is_some_and(|r| r.total() > 0)
    }

    /// Blocks rank `rank` holds on `medium`.
    pub fn blocks(&self, rank: u32, medium: Medium) -> usize {
        self.ranks.get(rank as usize).map_or(0, |r| r.len(medium))
    }

    /// Distinct GPU block keys held by any rank.
    pub fn distinct_keys(&self) -> usize {
        self.holders.len()
    }

    /// Grows or shrinks to `dp_size` ranks; removed ranks' blocks go.
    pub fn resize(&mut self, dp_size: u32) {
        for rank in dp_size..self.ranks.len() as u32 {
            self.forget(rank);
        }
        self.ranks.resize_with(dp_size as usize, RankBlocks::default);
        self.sizes.resize(dp_size);
        self.groups.resize(dp_size);
    }

    /// Applies one batch of events to rank `rank` (in range), whole.
    pub fn apply(&mut self, rank: u32, events: &[KvEvent]) -> Applied {
        let mut at = Progress::default();
        self.apply_some(rank, events, &mut at, usize::MAX);
        at.applied
    }

    /// Empties rank `rank`'s index (every medium); its engine's block size stays.
    pub fn clear(&mut self, rank: u32) {
        let Some(blocks) = self.ranks.get_mut(rank as usize) else { return };
        for key in blocks.take() {
            self.holders.unset(key, rank);
        }
    }

    /// Empties rank `rank`'s index and forgets its block size and KV cache
    /// groups: its engine restarted or is gone, and the next may use others.
    pub fn forget(&mut self, rank: u32) {
        self.clear(rank);
        self.forget_block_size(rank);
    }

    /// Forgets rank `rank`'s block size and KV cache groups (once its index
    /// was emptied).
    pub fn forget_block_size(&mut self, rank: u32) {
        self.sizes.forget(rank);
        self.groups.forget(rank);
    }

    /// For the chain `keys`, how many leading blocks each rank holds on
    /// GPU in every KV cache group it published (the least of the groups):
    /// `out[r]`, for every rank (`out` is resized to the rank count).
    pub fn leading(&self, keys: &[u64], out: &mut Vec<u32>) {
        self.holders.leading(keys, self.ranks.len() as u32, out);
        self.groups.narrow(&self.holders, keys, out);
    }
}

#[cfg(test)]
mod tests;
