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
//! with the group (`groups.rs`); group 0's are the plain ones. Each group
//! has its own block size (`sizes.rs`): a prompt is keyed in each size,
//! and a rank's hit is the least over its groups in tokens.
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
pub use self::groups::MAX_GROUP;
use self::groups::{Groups, BEYOND};
use self::holders::Holders;
pub use self::sizes::MAX_SIZES;
use self::sizes::{BlockSizes, Shape};
use super::kv::{KvEvent, Medium};

/// Buffers a lookup across KV cache groups reuses.
#[derive(Default)]
pub struct Scratch {
    /// Per rank, the least over its groups so far, in tokens.
    tokens: Vec<u64>,
    /// A sparse group's keys: the prompt's at the blocks it keeps.
    keys: Vec<u64>,
    shapes: Vec<Shape>,
    /// One size's matches, per rank.
    matched: Vec<u32>,
}

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
    /// than their KV cache group's, or that cannot be keyed (token pairs, a
    /// malformed `group_idx`).
    pub bad_event: u64,
    /// Blocks indexed (unmatchable ones too) and removed (by events, not the cap).
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    /// Blocks dropped by the rank's share of the memory budget, oldest first.
    pub evicted: u64,
}

pub struct PrefixIndex {
    /// Per rank and KV cache group, learned from the first `BlockStored` of
    /// the group indexed on the rank; every later one must match until the
    /// rank's engine restarts or is gone.
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

    /// The block size most ranks use (their group 0's): the one prompts
    /// are keyed with first. `None` until a rank stored a block.
    pub fn block_size(&self) -> Option<u32> {
        self.sizes.in_use().first().copied()
    }

    /// Rank `rank`'s own block size (its KV cache group 0's); `None` until
    /// one of its blocks is indexed, and again once it is forgotten
    /// ([`PrefixIndex::forget`]).
    pub fn rank_block_size(&self, rank: u32) -> Option<u32> {
        self.sizes.of(rank)
    }

    /// The block sizes ranks use, most ranks first (their own sizes first,
    /// then their other KV cache groups'), at most [`MAX_SIZES`].
    pub fn block_sizes(&self) -> &[u32] {
        self.sizes.in_use()
    }

    /// Whether some rank published a KV cache group other than 0: a lookup
    /// takes every group's least ([`PrefixIndex::leading_in`]).
    pub fn has_groups(&self) -> bool {
        self.groups.beyond_zero()
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
    /// GPU in every KV cache group it published (the least of the groups,
    /// each group's blocks taken in `keys`' size): `out[r]`, for every rank
    /// (`out` is resized to the rank count).
    pub fn leading(&self, keys: &[u64], out: &mut Vec<u32>) {
        if self.groups.beyond_zero() {
            self.leading_groups(|_| Some(keys), out, &mut Scratch::default());
        } else {
            self.holders.leading(keys, self.ranks.len() as u32, out);
        }
    }

    /// For a prompt keyed in each block size of `keyed` (`(size, keys)`,
    /// the first the one most ranks use), how many leading blocks of its
    /// own size each rank holds on GPU in every KV cache group it
    /// published: `out[r]` (resized to the rank count). Each group is
    /// matched in its own size's keys; a rank's hit is the least over its
    /// groups in tokens, rounded down to a multiple of its groups' sizes'
    /// LCM (the engine's hits are). A rank with a group of a size not in
    /// `keyed` matches nothing.
    pub fn leading_in(&self, keyed: &[(u32, &[u64])], out: &mut Vec<u32>, scratch: &mut Scratch) {
        let dp = self.ranks.len() as u32;
        let Some(&(_, first)) = keyed.first() else {
            out.clear();
            out.resize(dp as usize, 0);
            return;
        };
        if self.groups.beyond_zero() {
            let find = |size: u32| keyed.iter().find(|k| k.0 == size).map(|k| k.1);
            return self.leading_groups(find, out, scratch);
        }
        // One group per rank: each rank matched in its own size's keys.
        self.holders.leading(first, dp, out);
        for &(size, keys) in &keyed[1..] {
            self.holders.leading(keys, dp, &mut scratch.matched);
            for (r, m) in out.iter_mut().enumerate() {
                if self.sizes.of(r as u32) == Some(size) {
                    *m = scratch.matched[r];
                }
            }
        }
    }

    /// [`PrefixIndex::leading_in`] once some rank published a group other
    /// than 0, `keys_of(size)` the prompt's keys in blocks of `size`.
    fn leading_groups<'k>(
        &self,
        keys_of: impl Fn(u32) -> Option<&'k [u64]>,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
    ) {
        let dp = self.ranks.len() as u32;
        let Scratch { tokens, keys: filtered, shapes, .. } = scratch;
        tokens.clear();
        tokens.extend((0..dp).map(|r| {
            let bits = self.groups.published(r);
            if bits == 0 || bits & BEYOND != 0 {
                0
            } else {
                u64::MAX
            }
        }));
        let mut rest = self.groups.any() & !BEYOND;
        while rest != 0 {
            let group = rest.trailing_zeros();
            rest &= rest - 1;
            let bit = 1u64 << group;
            // The group's distinct shapes over the ranks that published it;
            // a rank that published it but has none of its blocks holds none.
            shapes.clear();
            for r in 0..dp {
                if self.groups.published(r) & bit == 0 || tokens[r as usize] == 0 {
                    continue;
                }
                match self.sizes.group(r, group) {
                    None => tokens[r as usize] = 0,
                    Some(s) if !shapes.contains(&s) => shapes.push(s),
                    Some(_) => {}
                }
            }
            for &shape in shapes.iter() {
                let of_shape =
                    |r: u32| self.groups.published(r) & bit != 0 && self.sizes.group(r, group) == Some(shape);
                let Some(keys) = keys_of(shape.size) else {
                    (0..dp).filter(|&r| of_shape(r)).for_each(|r| tokens[r as usize] = 0);
                    continue;
                };
                let keys = if shape.sparse() {
                    filtered.clear();
                    filtered.extend(keys.iter().enumerate().filter(|&(i, _)| shape.keeps(i)).map(|(_, &k)| k));
                    &filtered[..]
                } else {
                    keys
                };
                self.holders.scan(
                    keys,
                    dp,
                    |k| groups::key(k, group),
                    |r, n| {
                        if of_shape(r) {
                            let t = &mut tokens[r as usize];
                            *t = (*t).min(shape.tokens(n));
                        }
                    },
                );
            }
        }
        out.clear();
        out.extend(tokens.iter().enumerate().map(|(r, &t)| {
            let (lcm, size) = (self.sizes.lcm(r as u32), self.sizes.of(r as u32).map_or(0, u64::from));
            if lcm == 0 || size == 0 || t == u64::MAX {
                0
            } else {
                (t / lcm * lcm / size) as u32
            }
        }));
    }
}

#[cfg(test)]
mod tests;
