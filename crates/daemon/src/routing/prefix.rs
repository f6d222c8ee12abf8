//! What `cache_aware` reads: for one request's prompt, how many leading
//! blocks each rank holds, from the KV events (`kv/`) or, where a rank
//! publishes none, from dpcoord's own placements (approximate mode), as
//! `routing.prefix_mode` says (docs/PROTOCOL.md §7).

use std::time::Instant;

use super::kv::KvStreams;
use crate::config::{PrefixMode, Settings};
use crate::engines::prefix::{keys, ApproxIndex, Scratch, MAX_SIZES};
use crate::wire::{PrefixSource, Prompt};

/// The block size used before any KV event taught the engines' own (the
/// approximate index's granularity; vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// The approximate index's share of the budget, split: 3/4 for the
/// approximate index, 1/4 for recent placements on event-fed ranks.
fn split(bytes: u64) -> (u64, u64) {
    (bytes - bytes / 4, bytes / 4)
}

/// One request's prefix matches, per rank.
#[derive(Debug, Clone, Copy)]
pub struct PrefixView<'a> {
    /// Leading blocks held, per rank, each in the rank's own block size.
    pub matched: &'a [u32],
    /// The size the prompt was keyed with first (the one most ranks use).
    pub block_size: u64,
    /// Per rank, its own block size when ranks differ; empty when every
    /// rank's is `block_size`.
    pub sizes: &'a [u32],
    /// The prompt's length in tokens.
    pub prompt_tokens: u64,
}

impl PrefixView<'_> {
    /// The prompt tokens predicted cached on `rank`: those it would not prefill.
    pub fn cached(&self, rank: u32) -> u64 {
        self.prompt_tokens - self.uncached(rank)
    }

    /// The tokens rank `rank` would have to prefill.
    pub fn uncached(&self, rank: u32) -> u64 {
        let size = self.sizes.get(rank as usize).map_or(self.block_size, |&s| u64::from(s));
        let cached = u64::from(self.matched.get(rank as usize).copied().unwrap_or(0)) * size;
        self.prompt_tokens.saturating_sub(cached)
    }
}

pub(super) struct PrefixRouting {
    approx: ApproxIndex,
    /// Placements on ranks whose matches come from KV events, kept for
    /// `routing.pending_ttl_ms`: a prompt's siblings (best-of-N, an agent's
    /// fan-out) arriving before the engine's first `BlockStored` land where
    /// the first went, until the events say what the engine holds.
    recent: ApproxIndex,
    recent_matched: Vec<u32>,
    mode: PrefixMode,
    keys: Vec<u64>,
    matched: Vec<u32>,
    approx_matched: Vec<u32>,
    /// Keys in the block sizes other than the first, and the index's
    /// buffers for a lookup in several sizes or KV cache groups.
    other_keys: Vec<Vec<u64>>,
    scratch: Scratch,
    sizes: Vec<u32>,
}

impl PrefixRouting {
    pub fn new(s: &Settings) -> Self {
        let c = &s.routing.cache;
        let (approx, recent) = split(s.memory.approx_index);
        PrefixRouting {
            approx: ApproxIndex::new(s.engines.dp_size, c.ttl, approx),
            recent: ApproxIndex::new(s.engines.dp_size, s.routing.pending_ttl, recent),
            recent_matched: Vec::new(),
            mode: c.mode,
            keys: Vec::new(),
            matched: Vec::new(),
            approx_matched: Vec::new(),
            other_keys: Vec::new(),
            scratch: Scratch::default(),
            sizes: Vec::new(),
        }
    }

    pub fn reload(&mut self, s: &Settings) {
        self.mode = s.routing.cache.mode;
        let (approx, recent) = split(s.memory.approx_index);
        self.approx.set_limits(s.routing.cache.ttl, approx);
        self.recent.set_limits(s.routing.pending_ttl, recent);
    }

    pub fn resize(&mut self, dp_size: u32) {
        self.approx.resize(dp_size);
        self.recent.resize(dp_size);
    }

    /// The ranks each index keeps: the approximate one, the recent placements.
    #[cfg(test)]
    pub fn ranks(&self) -> [usize; 2] {
        [self.approx.ranks(), self.recent.ranks()]
    }

    /// Whether no recent placement is kept.
    #[cfg(test)]
    pub fn recent_is_empty(&self) -> bool {
        self.recent.is_empty()
    }

    pub fn tick(&mut self, now: Instant) {
        self.approx.expire(now);
        self.recent.expire(now);
    }

    /// The block size prompts are keyed with first: the one most ranks
    /// use, once a rank has stored a block.
    pub fn block_size(kv: &KvStreams) -> u32 {
        kv.index().block_size().unwrap_or(DEFAULT_BLOCK_SIZE)
    }

    /// The prompt's length in tokens (a keys prompt counts whole blocks).
    pub fn prompt_tokens(prompt: &Prompt<'_>, kv: &KvStreams) -> u64 {
        match *prompt {
            Prompt::Tokens { tokens, .. } => tokens.len() as u64,
            Prompt::Keys { count, .. } => u64::from(count) * u64::from(Self::block_size(kv)),
        }
    }

    /// Keys `prompt` and looks its chain up; `prompt_tokens` is its length.
    /// With `siblings`, recent placements on event-fed ranks count as cached.
    pub fn lookup(
        &mut self,
        prompt: &Prompt<'_>,
        prompt_tokens: u64,
        kv: &KvStreams,
        siblings: bool,
    ) -> PrefixView<'_> {
        let bs = Self::block_size(kv);
        match *prompt {
            Prompt::Tokens { tokens, lora, salt } => {
                self.keys.clear();
                keys::chain_keys(keys::chain_seed(lora, salt), tokens, bs as usize, &mut self.keys);
            }
            Prompt::Keys { .. } => prompt.keys_into(&mut self.keys),
        }
        let index = kv.index();
        if self.mode == PrefixMode::Approximate {
            self.approx.leading(&self.keys, &mut self.matched);
        } else if index.block_sizes().len() > 1 || index.has_groups() {
            self.other_sizes(prompt, kv, bs);
        } else {
            index.leading(&self.keys, &mut self.matched);
        }
        self.sizes.clear();
        if index.block_sizes().len() > 1 && self.mode != PrefixMode::Approximate {
            self.sizes.extend((0..index.dp_size()).map(|r| index.rank_block_size(r).unwrap_or(bs)));
        }
        // Siblings: a placement not yet confirmed by events counts as cached.
        if siblings && self.mode != PrefixMode::Approximate && !self.recent.is_empty() {
            self.recent.leading(&self.keys, &mut self.recent_matched);
            for (m, &r) in self.matched.iter_mut().zip(&self.recent_matched) {
                *m = (*m).max(r);
            }
        }
        // Ranks whose events do not speak for them: none yet (auto: dpcoord's
        // own placements), or a degraded index (no credit from it).
        if self.mode != PrefixMode::Approximate && (0..index.dp_size()).any(|r| !Self::events_trusted(kv, r)) {
            let auto = self.mode == PrefixMode::Auto;
            if auto {
                self.approx.leading(&self.keys, &mut self.approx_matched);
            }
            for (r, m) in self.matched.iter_mut().enumerate() {
                let r = r as u32;
                if auto && !Self::events_trusted(kv, r) {
                    *m = self.approx_matched[r as usize];
                } else if kv.degraded(r) {
                    *m = 0;
                }
            }
        }
        PrefixView { matched: &self.matched, block_size: u64::from(bs), sizes: &self.sizes, prompt_tokens }
    }

    /// The lookup when ranks use several block sizes (their own, or their
    /// KV cache groups'): a prompt of tokens is keyed again in each other
    /// size in use (at most [`MAX_SIZES`] in all), and each rank's KV cache
    /// groups are matched in their own sizes' keys (block keys, made in
    /// one size by the client, match only the groups of that size).
    fn other_sizes(&mut self, prompt: &Prompt<'_>, kv: &KvStreams, bs: u32) {
        let index = kv.index();
        let mut n = 0;
        if let Prompt::Tokens { tokens, lora, salt } = *prompt {
            for &size in index.block_sizes().iter().filter(|&&s| s != bs).take(MAX_SIZES - 1) {
                if self.other_keys.len() == n {
                    self.other_keys.push(Vec::new());
                }
                let keys = &mut self.other_keys[n];
                keys.clear();
                keys::chain_keys(keys::chain_seed(lora, salt), tokens, size as usize, keys);
                n += 1;
            }
        }
        let sizes = index.block_sizes().iter().filter(|&&s| s != bs);
        let mut keyed: [(u32, &[u64]); MAX_SIZES] = [(bs, &self.keys[..]); MAX_SIZES];
        for (slot, (&size, keys)) in keyed[1..].iter_mut().zip(sizes.zip(&self.other_keys[..n])) {
            *slot = (size, &keys[..]);
        }
        index.leading_in(&keyed[..=n], &mut self.matched, &mut self.scratch);
    }

    pub fn mode(&self) -> PrefixMode {
        self.mode
    }

    /// Where rank `rank`'s matches come from in `mode`, as
    /// [`PrefixRouting::lookup`] takes them.
    pub fn source(mode: PrefixMode, kv: &KvStreams, rank: u32) -> PrefixSource {
        match mode {
            PrefixMode::Approximate => PrefixSource::Approximate,
            PrefixMode::Auto if !Self::events_trusted(kv, rank) => PrefixSource::Approximate,
            PrefixMode::Events if kv.degraded(rank) => PrefixSource::Degraded,
            PrefixMode::Auto | PrefixMode::Events => PrefixSource::Events,
        }
    }

    /// Whether rank `rank`'s matches come from its KV events: it has
    /// published, and its index is exact.
    fn events_trusted(kv: &KvStreams, rank: u32) -> bool {
        kv.has_events(rank) && !kv.degraded(rank)
    }

    /// The last looked-up prompt was placed on `rank` by a policy pick:
    /// the approximate index takes it as cached there, unless that rank's
    /// matches come from its KV events: then it is a recent placement, for
    /// its siblings. Returns the keys the index's share of the memory
    /// budget evicted to make room.
    pub fn learn(&mut self, rank: u32, kv: &KvStreams, now: Instant) -> usize {
        let learns = match self.mode {
            PrefixMode::Events => false,
            PrefixMode::Approximate => true,
            PrefixMode::Auto => !Self::events_trusted(kv, rank),
        };
        if learns {
            self.approx.record(rank, &self.keys, now)
        } else if self.mode != PrefixMode::Approximate && Self::events_trusted(kv, rank) {
            self.recent.record(rank, &self.keys, now)
        } else {
            0
        }
    }
}
