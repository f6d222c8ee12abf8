//! The KV block size of each rank, as its indexed `BlockStored` events
//! taught it, and the sizes prompts are keyed with.
//!
//! A rank's size is learned from the first `BlockStored` its index takes in
//! (never from one it drops), so one rank's events cannot set the size of
//! another. It is forgotten when the rank's engine restarts or goes away
//! (not when its blocks are merely cleared), so an engine that comes back
//! with another block size is learned anew.

/// How many distinct block sizes a lookup keys a prompt for: those most
/// ranks use. A rank with a rarer size than these has no matches, so a
/// few ranks of odd sizes cannot multiply the work of every request.
pub const MAX_SIZES: usize = 4;

#[derive(Debug, Default)]
pub struct BlockSizes {
    per_rank: Vec<Option<u32>>,
    /// Distinct sizes in use, most ranks first (at a tie, the size of the
    /// lowest-numbered rank first), at most [`MAX_SIZES`].
    in_use: Vec<u32>,
}

impl BlockSizes {
    pub fn new(dp_size: u32) -> Self {
        BlockSizes { per_rank: vec![None; dp_size as usize], in_use: Vec::new() }
    }

    /// Rank `rank`'s block size; `None` until it stored a block (or since it was forgotten).
    pub fn of(&self, rank: u32) -> Option<u32> {
        self.per_rank.get(rank as usize).copied().flatten()
    }

    /// The sizes to key a prompt with, most ranks first.
    pub fn in_use(&self) -> &[u32] {
        &self.in_use
    }

    /// Rank `rank` (in range) applied a store of blocks of `size`.
    pub fn learn(&mut self, rank: u32, size: u32) {
        let slot = &mut self.per_rank[rank as usize];
        if *slot != Some(size) {
            *slot = Some(size);
            self.regroup();
        }
    }

    /// Rank `rank`'s engine restarted or is gone: its size is learned again.
    pub fn forget(&mut self, rank: u32) {
        if let Some(slot) = self.per_rank.get_mut(rank as usize).filter(|s| s.is_some()) {
            *slot = None;
            self.regroup();
        }
    }

    pub fn resize(&mut self, dp_size: u32) {
        self.per_rank.resize(dp_size as usize, None);
        self.regroup();
    }

    /// Recomputes [`BlockSizes::in_use`] (only when a rank's size changes).
    fn regroup(&mut self) {
        let mut known: Vec<(u32, u32)> =
            self.per_rank.iter().enumerate().filter_map(|(r, s)| s.map(|s| (s, r as u32))).collect();
        known.sort_unstable();
        // (size, ranks using it, the lowest such rank)
        let mut groups: Vec<(u32, u32, u32)> = Vec::new();
        for (size, rank) in known {
            match groups.last_mut() {
                Some(g) if g.0 == size => g.1 += 1,
                _ => groups.push((size, 1, rank)),
            }
        }
        groups.sort_unstable_by_key(|&(_, count, first)| (std::cmp::Reverse(count), first));
        self.in_use = groups.into_iter().take(MAX_SIZES).map(|(size, _, _)| size).collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_most_ranks_use_comes_first_and_at_most_four_are_kept() {
        let mut s = BlockSizes::new(8);
        assert_eq!((s.in_use(), s.of(0)), (&[][..], None));
        s.learn(0, 999);
        assert_eq!(s.in_use(), [999]);
        s.learn(1, 16);
        assert_eq!(s.in_use(), [999, 16], "a tie: the lowest rank's size first");
        s.learn(2, 16);
        assert_eq!(s.in_use(), [16, 999]);
        for (rank, size) in [(3, 1), (4, 2), (5, 3)] {
            s.learn(rank, size);
        }
        assert_eq!(s.in_use(), [16, 999, 1, 2], "four sizes at most");
        s.forget(0);
        assert_eq!((s.of(0), s.of(1)), (None, Some(16)));
        assert_eq!(s.in_use(), [16, 1, 2, 3]);
        s.resize(2);
        assert_eq!(s.in_use(), [16]);
        s.forget(7);
    }
}
