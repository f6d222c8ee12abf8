//! A simulated rank's prefix cache, chained like vLLM's and SGLang's: a
//! block of `block` tokens is known by a hash of its whole prefix (the
//! engine-side hash, of the simulator's choosing), so a prompt hits the
//! leading run of its blocks the cache holds. Blocks a running job uses are
//! referenced; unreferenced ones are evicted least recently used first, and
//! a job releases its blocks deepest first (as vLLM frees them), so a
//! prompt's tail goes before its shared head. The cache records what it
//! stores and evicts, which the engine publishes as KV-event batches.

use std::collections::{BTreeMap, HashMap};

/// Block size and capacity of every rank's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSpec {
    /// Tokens per block.
    pub block: u32,
    /// Blocks a rank holds; referenced blocks may go above it (never evicted).
    pub capacity: usize,
    /// The capacity is the rank's KV memory: a job joins the batch only
    /// while the blocks it adds fit beside those running jobs reference
    /// (as vLLM waits for free blocks); else it bounds only cached blocks.
    pub bounded: bool,
}

/// One KV event, as vLLM publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A run of consecutive blocks, the first continuing `parent`.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed {
        hashes: Vec<u64>,
    },
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    refs: u32,
    /// Position in the LRU order while unreferenced.
    tick: u64,
}

#[derive(Debug, Clone)]
pub struct PrefixCache {
    pub spec: CacheSpec,
    blocks: HashMap<u64, Entry>,
    /// Unreferenced blocks by last release, oldest first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    /// Events since the last `take_events`.
    events: Vec<KvEvent>,
    /// Blocks evicted so far.
    pub evicted: u64,
}

impl PrefixCache {
    pub fn new(spec: CacheSpec) -> PrefixCache {
        let spec = CacheSpec { block: spec.block.max(1), ..spec };
        PrefixCache { spec, blocks: HashMap::new(), lru: BTreeMap::new(), tick: 0, events: Vec::new(), evicted: 0 }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The share of the capacity that running jobs reference, at most 1:
    /// vLLM's `kv_cache_usage`, which counts cached blocks no request uses
    /// as free (they are evicted on demand).
    pub fn usage(&self) -> f64 {
        (self.referenced() as f64 / self.spec.capacity.max(1) as f64).min(1.0)
    }

    /// Blocks running jobs reference.
    pub fn referenced(&self) -> usize {
        self.blocks.len() - self.lru.len()
    }

    /// How many of `hashes`, from the first, the cache holds (no side effect).
    pub fn matched(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.blocks.contains_key(h)).count()
    }

    /// Matches `hashes` and references the blocks matched; how many.
    pub fn acquire(&mut self, hashes: &[u64]) -> usize {
        let n = self.matched(hashes);
        for h in &hashes[..n] {
            self.reference(*h);
        }
        n
    }

    fn reference(&mut self, h: u64) {
        if let Some(e) = self.blocks.get_mut(&h) {
            if e.refs == 0 {
                self.lru.remove(&e.tick);
            }
            e.refs += 1;
        }
    }

    /// Stores and references blocks `from..to` of a job whose block hashes
    /// are `hashes` and tokens `tokens` (blocks already held are only
    /// referenced); evicts down to capacity.
    pub fn store(&mut self, hashes: &[u64], tokens: &[u32], from: usize, to: usize) {
        let b = self.spec.block as usize;
        let mut run: Option<(usize, usize)> = None;
        for i in from..to {
            match self.blocks.get_mut(&hashes[i]) {
                Some(entry) => {
                    if entry.refs == 0 {
                        self.lru.remove(&entry.tick);
                    }
                    entry.refs += 1;
                    if let Some((s, e)) = run.take() {
                        self.stored(hashes, tokens, s, e, b);
                    }
                }
                None => {
                    self.blocks.insert(hashes[i], Entry { refs: 1, tick: 0 });
                    run = Some(run.map_or((i, i + 1), |(s, _)| (s, i + 1)));
                }
            }
        }
        if let Some((s, e)) = run {
            self.stored(hashes, tokens, s, e, b);
        }
        self.evict();
    }

    fn stored(&mut self, hashes: &[u64], tokens: &[u32], s: usize, e: usize, b: usize) {
        let parent = s.checked_sub(1).map(|p| hashes[p]);
        self.events.push(KvEvent::Stored {
            hashes: hashes[s..e].to_vec(),
            parent,
            tokens: tokens[s * b..e * b].to_vec(),
        });
    }

    /// Drops the references of a job's first `held` blocks, deepest first.
    pub fn release(&mut self, hashes: &[u64]) {
        for h in hashes.iter().rev() {
            if let Some(e) = self.blocks.get_mut(h) {
                e.refs = e.refs.saturating_sub(1);
                if e.refs == 0 {
                    self.tick += 1;
                    e.tick = self.tick;
                    self.lru.insert(self.tick, *h);
                }
            }
        }
        self.evict();
    }

    fn evict(&mut self) {
        let mut gone = Vec::new();
        while self.blocks.len() > self.spec.capacity {
            let Some((_, h)) = self.lru.pop_first() else { break };
            self.blocks.remove(&h);
            gone.push(h);
        }
        if !gone.is_empty() {
            self.evicted += gone.len() as u64;
            self.events.push(KvEvent::Removed { hashes: gone });
        }
    }

    /// The events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(capacity: usize) -> PrefixCache {
        PrefixCache::new(CacheSpec { block: 2, capacity, bounded: false })
    }

    #[test]
    fn stores_chain_hits_lead_and_events_group_runs() {
        let mut c = cache(10);
        let (hashes, tokens) = ([1, 2, 3], [10, 11, 12, 13, 14, 15]);
        assert_eq!(c.acquire(&hashes), 0);
        c.store(&hashes, &tokens, 0, 3);
        assert_eq!(c.take_events(), [KvEvent::Stored { hashes: vec![1, 2, 3], parent: None, tokens: tokens.to_vec() }]);
        assert_eq!((c.matched(&[1, 2, 9]), c.matched(&[9, 1])), (2, 0));
        // A second job shares block 1 and stores its own block 4 after it.
        c.store(&[1, 4], &[10, 11, 20, 21], 0, 2);
        assert_eq!(c.take_events(), [KvEvent::Stored { hashes: vec![4], parent: Some(1), tokens: vec![20, 21] }]);
    }

    #[test]
    fn lru_evicts_unreferenced_tails_first_and_never_referenced_blocks() {
        let mut c = cache(3);
        c.store(&[1, 2], &[0; 4], 0, 2);
        c.release(&[1, 2]);
        c.store(&[5, 6], &[0; 4], 0, 2);
        // Over capacity by one: block 2 (released before block 1) goes.
        assert_eq!(c.take_events().last(), Some(&KvEvent::Removed { hashes: vec![2] }));
        assert_eq!((c.len(), c.matched(&[1, 2])), (3, 1));
        // Everything referenced: the cache grows past capacity rather than evict.
        c.acquire(&[1]);
        c.store(&[7], &[0; 2], 0, 1);
        assert_eq!((c.len(), c.evicted), (4, 1));
        c.release(&[7]);
        assert_eq!((c.len(), c.matched(&[7])), (3, 0));
    }

    #[test]
    fn usage_counts_referenced_blocks_only() {
        let mut c = cache(4);
        c.store(&[1, 2], &[0; 4], 0, 2);
        c.store(&[3], &[0; 2], 0, 1);
        assert_eq!(c.usage(), 0.75);
        c.release(&[1, 2]);
        assert_eq!((c.len(), c.usage()), (3, 0.25), "cached but unused blocks count as free");
        c.store(&[4, 5, 6, 7], &[0; 8], 0, 4);
        assert_eq!(c.usage(), 1.0, "referenced past capacity: full");
    }
}
