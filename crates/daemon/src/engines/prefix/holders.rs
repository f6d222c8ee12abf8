//! Which ranks hold each block key: a bitset per key, one word per 64
//! ranks (the word's group mixed into the map key), so a prompt's
//! leading-match scan is one probe per block for up to 64 ranks and stops
//! at the first block no rank holds. Shared by the event-fed index and the
//! approximate one. The map is sharded (`sharded.rs`): with millions of
//! keys, growing it rehashes one shard at a time.

use super::sharded::Sharded;

/// Ranks per bitset word.
const WORD: u32 = 64;
/// `log2` of the shards: 8 million keys are 32,768 a shard.
const SHARD_BITS: u32 = 8;

/// The map key of block `key` for the rank group `group`.
fn slot(key: u64, group: u32) -> u64 {
    key ^ u64::from(group).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

pub struct Holders(Sharded<u64>);

impl Default for Holders {
    fn default() -> Self {
        Holders(Sharded::new(SHARD_BITS))
    }
}

impl Holders {
    /// Distinct (key, rank group) entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn set(&mut self, key: u64, rank: u32) {
        *self.0.or_insert(slot(key, rank / WORD), 0) |= 1 << (rank % WORD);
    }

    /// Rank `rank` no longer holds `key`.
    pub fn unset(&mut self, key: u64, rank: u32) {
        let s = slot(key, rank / WORD);
        if let Some(bits) = self.0.get_mut(s) {
            *bits &= !(1 << (rank % WORD));
            if *bits == 0 {
                self.0.remove(s);
            }
        }
    }

    /// For the chain `keys`, how many leading blocks each of `dp` ranks
    /// holds: `out[r]` (resized to `dp`).
    pub fn leading(&self, keys: &[u64], dp: u32, out: &mut Vec<u32>) {
        out.clear();
        out.resize(dp as usize, 0);
        for group in 0..dp.div_ceil(WORD) {
            let in_group = (dp - group * WORD).min(WORD);
            let mut active = if in_group == WORD { u64::MAX } else { (1u64 << in_group) - 1 };
            let mut matched = 0;
            while matched < keys.len() && active != 0 {
                let bits = self.0.get(slot(keys[matched], group)).copied().unwrap_or(0);
                set_ranks(out, group, active & !bits, matched);
                active &= bits;
                matched += 1;
            }
            set_ranks(out, group, active, matched);
        }
    }
}

/// `out[r] = n` for each rank `r` of `group` whose bit is set in `bits`.
fn set_ranks(out: &mut [u32], group: u32, mut bits: u64, n: usize) {
    while bits != 0 {
        let b = bits.trailing_zeros();
        out[(group * WORD + b) as usize] = n as u32;
        bits &= bits - 1;
    }
}
