//! KV cache groups (vLLM's hybrid models: full attention beside sliding
//! window or mamba layers, each group its own blocks). An engine publishes
//! each block once per group, with the same hashes, and gives a request a
//! prefix hit only as far as every group holds it.
//!
//! Each group is indexed apart: its blocks' engine hashes and keys are
//! mixed with the group number ([`hash`], [`key`]), group 0's left as they
//! are, so an engine with one group costs what it did before groups. A
//! rank's predicted hit is the least, over the groups it has published, of
//! the leading blocks that group holds, in tokens (`PrefixIndex::leading_in`;
//! each group in its own block size, `sizes.rs`): a lower bound
//! of the engine's own hit (a sliding-window group may hit past a block it
//! dropped; dpcoord stops there), never more than the engine holds.

use super::keys::UNMATCHABLE;

/// The highest group indexed; a store of a higher one is held but never
/// matched, and the rank's predicted hit is 0 from then on (what that
/// group holds is unknown).
pub const MAX_GROUP: u32 = 62;
/// The bit of a rank's groups that stands for every group above [`MAX_GROUP`].
pub const BEYOND: u64 = 1 << (MAX_GROUP + 1);

/// Odd constants of the mixing: the group's multiplier and MurmurHash3's
/// 64-bit finalizer, a bijection of `u64`, so a mixed key gives its chain
/// key back ([`unkey`]).
const GROUP_MUL: u64 = 0xd6e8_feb8_6659_fd93;
const M1: u64 = 0xff51_afd7_ed55_8ccd;
const M2: u64 = 0xc4ce_b9fe_1a85_ec53;

/// `a`'s inverse modulo 2^64 (`a` odd), by Newton's iteration: each step
/// doubles the correct low bits, from 3.
const fn inverse(a: u64) -> u64 {
    let mut x = a;
    let mut i = 0;
    while i < 5 {
        x = x.wrapping_mul(2u64.wrapping_sub(a.wrapping_mul(x)));
        i += 1;
    }
    x
}

fn mix(x: u64, group: u32) -> u64 {
    let mut k = x ^ u64::from(group).wrapping_mul(GROUP_MUL);
    k ^= k >> 33;
    k = k.wrapping_mul(M1);
    k ^= k >> 33;
    k = k.wrapping_mul(M2);
    k ^ (k >> 33)
}

fn unmix(mut k: u64, group: u32) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(inverse(M2));
    k ^= k >> 33;
    k = k.wrapping_mul(inverse(M1));
    k ^= k >> 33;
    k ^ u64::from(group).wrapping_mul(GROUP_MUL)
}

/// The index's key of chain key `chain` in `group` (group 0: the chain key
/// itself); an unmatchable key stays unmatchable.
pub fn key(chain: u64, group: u32) -> u64 {
    if group == 0 || chain == UNMATCHABLE {
        chain
    } else {
        mix(chain, group)
    }
}

/// The chain key of `group`'s index key `key` (the inverse of [`key`]).
pub fn unkey(key: u64, group: u32) -> u64 {
    if group == 0 || key == UNMATCHABLE {
        key
    } else {
        unmix(key, group)
    }
}

/// The engine's block hash `hash` of `group`, as a rank's block maps hold it.
pub fn hash(hash: u64, group: u32) -> u64 {
    if group == 0 {
        hash
    } else {
        mix(hash, group)
    }
}

/// Which groups each rank has published a `BlockStored` for.
#[derive(Default)]
pub struct Groups {
    /// Per rank, bit `g` for group `g`, [`BEYOND`] for any above [`MAX_GROUP`].
    published: Vec<u64>,
    /// Every rank's bits together: a lookup with none past group 0 is
    /// group 0's alone.
    any: u64,
}

impl Groups {
    pub fn new(dp_size: u32) -> Self {
        Groups { published: vec![0; dp_size as usize], any: 0 }
    }

    pub fn resize(&mut self, dp_size: u32) {
        self.published.resize(dp_size as usize, 0);
        self.recount();
    }

    /// Rank `rank` (in range) published a store of `group`.
    pub fn publish(&mut self, rank: u32, group: u32) {
        let bit = if group > MAX_GROUP { BEYOND } else { 1 << group };
        self.published[rank as usize] |= bit;
        self.any |= bit;
    }

    /// Rank `rank`'s engine restarted or is gone: the next may have other groups.
    pub fn forget(&mut self, rank: u32) {
        if let Some(bits) = self.published.get_mut(rank as usize) {
            *bits = 0;
            self.recount();
        }
    }

    fn recount(&mut self) {
        self.any = self.published.iter().fold(0, |a, &b| a | b);
    }

    /// Rank `rank`'s groups: bit `g` for group `g`, [`BEYOND`] for any
    /// above [`MAX_GROUP`].
    pub fn published(&self, rank: u32) -> u64 {
        self.published.get(rank as usize).copied().unwrap_or(0)
    }

    /// Whether some rank published a group other than 0.
    pub fn beyond_zero(&self) -> bool {
        self.any & !1 != 0
    }

    /// Every rank's groups together.
    pub fn any(&self) -> u64 {
        self.any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixing_keeps_group_0_and_is_undone_in_every_group() {
        for x in [1u64, 2, 0x9e37_79b9_7f4a_7c15, u64::MAX] {
            assert_eq!((key(x, 0), hash(x, 0)), (x, x), "group 0 is as before groups");
            for g in [1, 2, MAX_GROUP, MAX_GROUP + 1, u32::MAX] {
                assert_ne!(key(x, g), x);
                assert_eq!(unkey(key(x, g), g), x);
                assert_ne!(key(x, g), key(x, g ^ 1), "groups differ");
            }
        }
        assert_eq!((key(UNMATCHABLE, 3), unkey(UNMATCHABLE, 3)), (UNMATCHABLE, UNMATCHABLE));
        assert_eq!(M1.wrapping_mul(inverse(M1)), 1);
    }
}
