//! Which ranks hold each block key: a bitset per key, one word per 64
//! ranks (the word's number mixed into the map key), so a prompt's
//! leading-match scan is one probe per block for up to 64 ranks and stops
//! at the first block no rank holds. Shared by the event-fed index and the
//! approximate one. The map is sharded (`sharded.rs`): with millions of
//! keys, growing it rehashes one shard at a time.

use super::sharded::Sharded;

/// Ranks per bitset word.
const WORD: u32 = 64;
/// `log2` of the shards: 8 million keys are 32,768 a shard.
const SHARD_BITS: u32 = 8;

/// The map key of block `key` for the ranks of word `word`.
fn slot(key: u64, word: u32) -> u64 {
    key ^ u64::from(word).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

pub struct Holders(Sharded<u64>);

impl Default for Holders {
    fn default() -> Self {
        Holders(Sharded::new(SHARD_BITS))
    }
}

impl Holders {
    /// Distinct (key, rank word) entries.
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
        self.scan(keys, dp, |k| k, |rank, n| out[rank as usize] = n);
    }

    /// For the chain `keys`, each map key taken as `key_of(key)`: calls
    /// `found(rank, n)` once for each of `dp` ranks, which holds `n` leading blocks.
    pub fn scan(&self, keys: &[u64], dp: u32, key_of: impl Fn(u64) -> u64, mut found: impl FnMut(u32, u32)) {
        for word in 0..dp.div_ceil(WORD) {
            let in_word = (dp - word * WORD).min(WORD);
            let mut active = if in_word == WORD { u64::MAX } else { (1u64 << in_word) - 1 };
            let mut matched = 0;
            while matched < keys.len() && active != 0 {
                let bits = self.0.get(slot(key_of(keys[matched]), word)).copied().unwrap_or(0);
                each_rank(word, active & !bits, |r| found(r, matched as u32));
                active &= bits;
                matched += 1;
            }
            each_rank(word, active, |r| found(r, matched as u32));
        }
    }
}

/// `f(r)` for each rank `r` of word `word` whose bit is set in `bits`.
fn each_rank(word: u32, mut bits: u64, mut f: impl FnMut(u32)) {
    while bits != 0 {
        f(word * WORD + bits.trailing_zeros());
        bits &= bits - 1;
    }
}
