//! Applying a batch of KV events to the index a slice at a time: at most a
//! given number of blocks per call, resumed where it stopped, so a batch of
//! hundreds of thousands of blocks never holds the routing thread for more
//! than one slice. The per-rank cap (the rank's share of the memory
//! budget) is enforced between slices, a shard of the rank's maps per
//! step: everything older than the newest 7/8 of the cap goes, so a sweep
//! runs once per cap/8 stores at most, and a rank is never more than one
//! slice over its cap.

use super::blocks::GpuKeys;
use super::sizes::{self, Shape};
use super::{groups, keys, Applied, PrefixIndex, MAX_GROUP};
use crate::engines::kv::{KvEvent, Medium, Stored};

/// Where one batch's application stands, and what it did so far.
#[derive(Default)]
pub struct Progress {
    /// The event being applied.
    event: usize,
    /// Within it, the next block (`BlockStored`, `BlockRemoved`).
    block: usize,
    /// `BlockStored`: the chain key of the block before `block` (not mixed
    /// with the group).
    chain: u64,
    /// `BlockStored`: the first block held as unmatchable (its length when none).
    cut: usize,
    /// `BlockStored`: its group's block size and which of the event's
    /// blocks its hashes are (a sparse group's skip some), and whether the
    /// group is learned from it once a block is indexed.
    shape: Option<Shape>,
    learns: bool,
    /// `BlockRemoved`: a hash of the event so far was not held.
    unknown: bool,
    /// `AllBlocksCleared`: the GPU keys whose holder bits are still to go.
    clearing: Option<GpuKeys>,
    /// The cap's sweep once the events are applied: the stamp below which
    /// blocks go, and the next step.
    sweeping: Option<(u64, usize)>,
    pub applied: Applied,
}

impl Progress {
    fn next_event(&mut self) {
        self.event += 1;
        self.block = 0;
        self.unknown = false;
    }
}

impl PrefixIndex {
    /// Applies the events of one batch to rank `rank` (in range) from where
    /// `at` stands, touching at most `budget` blocks (an event that touches
    /// none counts as one), or as many more as one step of the cap's sweep
    /// drops (about cap/8/64: 2,048 at the default cap); `at.applied`
    /// accumulates what it did. Returns the blocks touched and whether the
    /// batch is whole, the cap enforced.
    ///
    /// Between two calls the index holds the batch's first part: stores
    /// and removals go block by block in the engine's order, and a clear
    /// has emptied the rank's maps while some of its keys still show as
    /// held (lookups may see them until the clear ends).
    pub fn apply_some(&mut self, rank: u32, events: &[KvEvent], at: &mut Progress, budget: usize) -> (usize, bool) {
        let budget = budget.max(1);
        let mut used = 0;
        while used < budget {
            // Past the cap mid-batch, the sweep runs before the next store:
            // a rank exceeds its cap by at most one slice.
            if at.sweeping.is_some() || self.ranks[rank as usize].total() > self.cap {
                let (u, done) = self.sweep_some(rank, at, budget, used);
                used = u;
                if !done {
                    return (used, false);
                }
                continue;
            }
            let Some(ev) = events.get(at.event) else {
                return (used, true);
            };
            let left = budget - used;
            used += match ev {
                KvEvent::Stored(st) => self.store_some(rank, st, &events[at.event + 1..], at, left),
                KvEvent::Removed { hashes, medium, group } => {
                    self.remove_some(rank, hashes, (*medium, *group), at, left)
                }
                KvEvent::Cleared => self.clear_some(rank, at, left),
                KvEvent::Unindexable(_) => {
                    at.applied.bad_event += 1;
                    at.next_event();
                    1
                }
            };
        }
        (used, false)
    }

    /// Past the cap, drops the rank's oldest blocks a shard per step (each
    /// step counts the blocks it drops, and one): everything older than the
    /// newest 7/8 of the cap. `true` once the sweep (if any) is done.
    fn sweep_some(&mut self, rank: u32, at: &mut Progress, budget: usize, mut used: usize) -> (usize, bool) {
        let blocks = &mut self.ranks[rank as usize];
        let (threshold, mut step) = match at.sweeping {
            Some(s) => s,
            None if blocks.total() > self.cap => (blocks.threshold(self.cap - self.cap / 8), 0),
            None => return (used, true),
        };
        let holders = &mut self.holders;
        while step < blocks.sweep_steps() {
            if used >= budget {
                at.sweeping = Some((threshold, step));
                return (used, false);
            }
            let dropped = blocks.sweep(step, threshold, |key| holders.unset(key, rank));
            at.applied.evicted += dropped as u64;
            used += dropped + 1;
            step += 1;
        }
        at.sweeping = None;
        (used, true)
    }

    /// What a `BlockStored` is, before its first block: `Err` counts it
    /// (and it is passed over), `Ok` sets `at` to index it.
    /// `later` is the rest of the batch.
    fn start_store(
        &self,
        rank: u32,
        st: &Stored,
        later: &[KvEvent],
        at: &mut Progress,
    ) -> Result<(), fn(&mut Applied) -> &mut u64> {
        let known = (st.group <= MAX_GROUP).then(|| self.sizes.group(rank, st.group)).flatten();
        let bs = known.map_or(st.block_size, |s| s.size);
        let (k, tokens) = (st.hashes.len(), st.tokens.len());
        // vLLM's partial block (a hybrid model's group whose blocks are
        // larger than the hash block, the GCD of the groups' sizes: a prompt
        // ending inside a block makes the hash unit it ends on a cache entry
        // of its own): held, so its removal is understood, never matched (a
        // prefix of part of a block).
        let partial = st.block_size < bs
            && k == 1
            && tokens == st.block_size as usize
            && self.hash_block(rank, st, bs, later) == u64::from(st.block_size);
        if partial {
            at.shape = Some(Shape::dense(st.group, st.block_size));
            (at.cut, at.learns, at.chain) = (0, false, keys::UNMATCHABLE);
            return Ok(());
        }
        let per_block = bs as usize;
        if st.block_size != bs || per_block == 0 || tokens % per_block != 0 || tokens / per_block < k {
            return Err(|a| &mut a.bad_event);
        }
        let slots = tokens / per_block;
        let mut shape = known.unwrap_or(Shape::dense(st.group, bs));
        let mut sparse_unknown = false;
        if slots > k {
            // A sparse group's store (its tokens cover blocks it did not
            // keep), once the rank's groups are of different sizes.
            if k == 0 || self.sizes.lcm_with(rank, bs) <= u64::from(bs) {
                return Err(|a| &mut a.bad_event);
            }
            match self.sparse_shape(rank, st, slots).filter(|s| !shape.sparse() || *s == shape) {
                Some(s) => shape = s,
                None => sparse_unknown = true,
            }
        }
        at.shape = Some(shape);
        at.learns = st.group <= MAX_GROUP;
        if sparse_unknown {
            // Which blocks the hashes are is unknown: held, never matched.
            (at.cut, at.chain) = (0, keys::UNMATCHABLE);
            return Ok(());
        }
        at.chain = match st.parent {
            None => keys::chain_seed(st.lora.as_deref(), st.salt.as_deref()),
            Some(p) => match self.ranks[rank as usize].key_of(st.medium, groups::hash(p, st.group)) {
                Some(k) => groups::unkey(k, st.group),
                None => return Err(|a| &mut a.unknown_parent),
            },
        };
        // A block continuing an unmatchable one is unmatchable too, and
        // so is every block of a group the index does not represent.
        at.cut = match st.unmatchable {
            _ if at.chain == keys::UNMATCHABLE || st.group > MAX_GROUP => 0,
            Some((first, _)) => first.min(k),
            None => k,
        };
        Ok(())
    }

    /// The GCD of `bs` and the sizes of the rank's other groups, learned or
    /// stored later in the batch (vLLM publishes a step's stores of every
    /// group in one batch): vLLM's hash block.
    fn hash_block(&self, rank: u32, st: &Stored, bs: u32, later: &[KvEvent]) -> u64 {
        let learned = self.sizes.groups(rank).iter().filter(|s| s.group != st.group).map(|s| s.size);
        let stored = later.iter().filter_map(|ev| match ev {
            KvEvent::Stored(o) if o.group != st.group => Some(o.block_size),
            _ => None,
        });
        learned.chain(stored).fold(u64::from(bs), |g, s| sizes::gcd(g, u64::from(s)))
    }

    /// The shape of a group whose store of `slots` blocks names fewer
    /// hashes: vLLM's sliding window beside groups of larger blocks keeps,
    /// of each run of `per` blocks (the groups' sizes' LCM), the last
    /// `need` (`SlidingWindowManager.reachable_block_mask`), the others
    /// never stored. Known only for a chain's first store (its blocks
    /// counted from the prompt's first) whose count fits one `need`.
    fn sparse_shape(&self, rank: u32, st: &Stored, slots: usize) -> Option<Shape> {
        let size = st.block_size;
        let lcm = self.sizes.lcm_with(rank, size);
        let per = (lcm / u64::from(size)) as usize;
        if st.parent.is_some() || st.hashes.is_empty() || st.group > MAX_GROUP || per < 2 {
            return None;
        }
        let kept = |need: usize| slots / per * need + (slots % per).saturating_sub(per - need);
        let need = (1..per).find(|&need| kept(need) == st.hashes.len())?;
        Some(Shape { group: st.group, size, per: per as u32, need: need as u32 })
    }

    fn store_some(&mut self, rank: u32, st: &Stored, later: &[KvEvent], at: &mut Progress, budget: usize) -> usize {
        if at.block == 0 {
            // Any store of a group, indexed or not, makes the rank's hit the
            // least of its groups': what the group holds bounds it.
            self.groups.publish(rank, st.group);
            if let Err(count) = self.start_store(rank, st, later, at) {
                *count(&mut at.applied) += 1;
                at.next_event();
                return 1;
            }
        }
        let shape = at.shape.unwrap_or(Shape::dense(st.group, st.block_size));
        // A slice stops one block past the cap, where the sweep starts: the
        // same blocks go however the batch is sliced.
        let room = self.cap.saturating_add(1).saturating_sub(self.ranks[rank as usize].total()).max(1);
        let (from, to) = (at.block, st.hashes.len().min(at.block.saturating_add(budget.min(room))));
        let bs = shape.size as usize;
        self.keys.clear();
        let keyed = to.min(at.cut).max(from);
        if keyed > from {
            // The keys of every block from the one after the last keyed
            // through the last to key, then those of the blocks kept.
            let first = if from == 0 { 0 } else { shape.slot(from - 1) + 1 };
            let last = shape.slot(keyed - 1) + 1;
            keys::chain_keys(at.chain, &st.tokens[first * bs..last * bs], bs, &mut self.keys);
            if shape.sparse() {
                for (i, j) in (from..keyed).enumerate() {
                    self.keys[i] = self.keys[shape.slot(j) - first];
                }
                self.keys.truncate(keyed - from);
            }
        }
        self.keys.resize(to - from, keys::UNMATCHABLE);
        let blocks = &mut self.ranks[rank as usize];
        for (&hash, &chain) in st.hashes[from..to].iter().zip(&self.keys) {
            let key = groups::key(chain, st.group);
            let replaced = blocks.insert(st.medium, groups::hash(hash, st.group), key);
            if st.medium == Medium::Gpu {
                if let Some(old) = replaced.filter(|&k| k != keys::UNMATCHABLE) {
                    self.holders.unset(old, rank);
                }
                if key != keys::UNMATCHABLE {
                    self.holders.set(key, rank);
                }
            }
        }
        at.applied.blocks_stored += (to - from) as u64;
        if to > from && at.learns {
            self.sizes.learn(rank, shape);
        }
        at.chain = self.keys.last().copied().unwrap_or(at.chain);
        at.block = to;
        if to == st.hashes.len() {
            *if at.cut < to { &mut at.applied.unmatchable } else { &mut at.applied.stored } += 1;
            at.next_event();
        }
        (to - from).max(1)
    }

    fn remove_some(&mut self, rank: u32, hashes: &[u64], of: (Medium, u32), at: &mut Progress, budget: usize) -> usize {
        let (medium, group) = of;
        let (from, to) = (at.block, hashes.len().min(at.block.saturating_add(budget)));
        for &h in &hashes[from..to] {
            match self.ranks[rank as usize].remove(medium, groups::hash(h, group)) {
                Some(key) => {
                    at.applied.blocks_removed += 1;
                    if medium == Medium::Gpu {
                        self.holders.unset(key, rank);
                    }
                }
                None => at.unknown = true,
            }
        }
        at.block = to;
        if to == hashes.len() {
            *if at.unknown { &mut at.applied.unknown_block } else { &mut at.applied.removed } += 1;
            at.next_event();
        }
        (to - from).max(1)
    }

    fn clear_some(&mut self, rank: u32, at: &mut Progress, budget: usize) -> usize {
        let keys = at.clearing.get_or_insert_with(|| self.ranks[rank as usize].take());
        let mut used = 0;
        while used < budget {
            let Some(key) = keys.next() else {
                at.clearing = None;
                at.applied.cleared += 1;
                at.next_event();
                return used.max(1);
            };
            self.holders.unset(key, rank);
            used += 1;
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: std::ops::Range<u64>, parent: Option<u64>, medium: Medium) -> KvEvent {
        let tokens = hashes.clone().flat_map(|h| [h as u32, 7]).collect();
        KvEvent::Stored(Stored {
            hashes: hashes.collect(),
            parent,
            tokens,
            block_size: 2,
            medium,
            lora: None,
            salt: None,
            unmatchable: None,
            group: 0,
        })
    }

    /// A batch of every kind of event: stores chained across events and
    /// media, removals with unknown hashes, a clear mid-batch, a bad event.
    fn batch() -> Vec<KvEvent> {
        vec![
            stored(0..40, None, Medium::Gpu),
            stored(40..45, Some(39), Medium::Cpu),
            KvEvent::Removed { hashes: vec![3, 999, 4], medium: Medium::Gpu, group: 0 },
            KvEvent::Unindexable("pairs"),
            stored(100..130, None, Medium::Gpu),
            KvEvent::Cleared,
            stored(200..233, None, Medium::Gpu),
            stored(233..240, Some(232), Medium::Gpu),
            stored(300..301, Some(12345), Medium::Gpu),
            KvEvent::Removed { hashes: (200..210).collect(), medium: Medium::Gpu, group: 0 },
            // Group 1 never held hash 210: group 0's stays.
            KvEvent::Removed { hashes: vec![210], medium: Medium::Gpu, group: 1 },
            KvEvent::Stored(Stored { hashes: vec![], ..stored_of(0) }),
        ]
    }

    fn stored_of(h: u64) -> Stored {
        match stored(h..h + 1, None, Medium::Gpu) {
            KvEvent::Stored(s) => s,
            _ => unreachable!(),
        }
    }

    /// What `rank` 1 and 0 hold, as prefix lookups of every chain stored.
    fn view(ix: &PrefixIndex) -> Vec<Vec<u32>> {
        let chains = [0..45, 100..130, 200..240];
        chains
            .iter()
            .map(|c| {
                let tokens: Vec<u32> = c.clone().flat_map(|h| [h as u32, 7]).collect();
                let mut keys = Vec::new();
                keys::chain_keys(keys::chain_seed(None, None), &tokens, 2, &mut keys);
                let mut out = Vec::new();
                ix.leading(&keys, &mut out);
                out
            })
            .collect()
    }

    #[test]
    fn a_batch_applied_in_slices_ends_as_one_applied_whole() {
        let events = batch();
        let mut whole = PrefixIndex::new(2, 1000);
        whole.apply(0, &[stored(0..10, None, Medium::Gpu)]);
        let expected = whole.apply(1, &events);
        assert_eq!((expected.blocks_stored, expected.cleared, expected.unknown_parent), (115, 1, 1));
        for budget in [1, 2, 3, 7, 64, 1000] {
            let mut ix = PrefixIndex::new(2, 1000);
            ix.apply(0, &[stored(0..10, None, Medium::Gpu)]);
            let mut at = Progress::default();
            let mut calls = 0;
            loop {
                let (used, done) = ix.apply_some(1, &events, &mut at, budget);
                assert!(used <= budget, "{used} > {budget}: no sweep under the cap");
                calls += 1;
                if done {
                    break;
                }
            }
            assert_eq!(at.applied, expected, "budget {budget}");
            assert_eq!(view(&ix), view(&whole), "budget {budget}");
            assert_eq!(ix.distinct_keys(), whole.distinct_keys());
            for m in Medium::ALL {
                assert_eq!(ix.blocks(1, m), whole.blocks(1, m));
            }
            assert!(budget > 200 || calls * budget >= 115, "budget {budget}: {calls} calls");
        }
    }

    #[test]
    fn a_clear_in_slices_hides_nothing_once_done_and_the_cap_applies_between_slices() {
        let mut ix = PrefixIndex::new(1, 64);
        let mut at = Progress::default();
        let events = [stored(0..100, None, Medium::Gpu)];
        let (used, done) = ix.apply_some(0, &events, &mut at, 90);
        // A sweep step counts the blocks it drops and one, so the call may
        // pass its budget by one step's drops (shards differ per process).
        assert!(used >= 90 && !done, "{used} {done}");
        let held = ix.blocks(0, Medium::Gpu) as u64;
        assert_eq!(held + at.applied.evicted, 65, "stores stop one block past the cap while the sweep runs");
        let mut calls = 0;
        while !ix.apply_some(0, &events, &mut at, 8).1 {
            calls += 1;
        }
        assert!(calls >= 256 / 8, "the sweep goes a shard at a time: {calls} calls");
        // 65, the newest 56 kept, 9 more, ... : 100 stored, 36 gone, 64 held.
        assert_eq!((at.applied.evicted, ix.blocks(0, Medium::Gpu)), (36, 64));
        let mut at = Progress::default();
        let clear = [KvEvent::Cleared];
        assert_eq!(ix.apply_some(0, &clear, &mut at, 50), (50, false));
        assert_eq!(ix.blocks(0, Medium::Gpu), 0, "the maps are emptied at once");
        assert_eq!(ix.distinct_keys(), 14, "the last holder bits go in the next slice");
        assert_eq!(ix.apply_some(0, &clear, &mut at, 50), (14, true));
        assert_eq!((ix.distinct_keys(), at.applied.cleared), (0, 1));
    }

    /// The cap swept in steps keeps exactly the newest 7/8 of it, as one
    /// sweep does, on every medium, and the holder bits follow.
    #[test]
    fn the_cap_swept_in_steps_keeps_the_newest_blocks() {
        let batch = [stored(0..700, None, Medium::Gpu), stored(700..1000, Some(699), Medium::Cpu)];
        let mut whole = PrefixIndex::new(1, 800);
        let a = whole.apply(0, &batch);
        let mut ix = PrefixIndex::new(1, 800);
        let mut at = Progress::default();
        loop {
            let before = at.applied.evicted;
            let (used, done) = ix.apply_some(0, &batch, &mut at, 3);
            assert!(used <= 3 + (at.applied.evicted - before) as usize, "{used}");
            if done {
                break;
            }
        }
        // 801 blocks, the newest 700 kept; 801 again, 700 kept; 98 more.
        assert_eq!((at.applied, a.evicted), (a, 202));
        assert_eq!((ix.blocks(0, Medium::Gpu), ix.blocks(0, Medium::Cpu)), (498, 300));
        assert_eq!(ix.distinct_keys(), 498);
        assert_eq!(view(&ix), view(&whole));
        assert_eq!(view(&ix)[0], vec![0], "the oldest blocks went: no leading match");
    }
}
