//! The KV block size of each rank's KV cache groups, as its indexed
//! `BlockStored` events taught them, and the sizes prompts are keyed with.
//!
//! A group's size is learned from the first `BlockStored` of it the index
//! takes in (never from one it drops), so one rank's events cannot set the
//! size of another, nor one group's the size of another (vLLM's hybrid
//! models may keep full attention in blocks of 64 beside a sliding window
//! in blocks of 32). A rank's own size is its group 0's (its lowest
//! group's when it published no group 0). All are forgotten when the
//! rank's engine restarts or goes away (not when its blocks are merely
//! cleared), so an engine that comes back with other sizes is learned anew.

/// How many distinct block sizes a lookup keys a prompt for: those most
/// ranks use. A rank with a group of a rarer size than these has no
/// matches, so a few ranks of odd sizes cannot multiply the work of every
/// request.
pub const MAX_SIZES: usize = 4;

/// One KV cache group of a rank, as its indexed stores taught it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub group: u32,
    /// Tokens per block.
    pub size: u32,
    /// A sparse group (vLLM's sliding window beside groups of larger
    /// blocks): of each run of `per` blocks (one unit of the engine's hit
    /// alignment, the groups' sizes' LCM) it keeps the last `need`, the
    /// only ones a hit can use; the others are never stored. `per` 0: it
    /// keeps every block.
    pub per: u32,
    pub need: u32,
}

impl Shape {
    pub fn dense(group: u32, size: u32) -> Self {
        Shape { group, size, per: 0, need: 0 }
    }

    /// Whether the group keeps only some of its blocks.
    pub fn sparse(&self) -> bool {
        self.per > 0
    }

    /// Whether the group keeps block `slot` (counted from the chain's first).
    pub fn keeps(&self, slot: usize) -> bool {
        !self.sparse() || slot % self.per as usize >= (self.per - self.need) as usize
    }

    /// The slot of the `j`-th block the group keeps.
    pub fn slot(&self, j: usize) -> usize {
        if !self.sparse() {
            return j;
        }
        let (per, need) = (self.per as usize, self.need as usize);
        j / need * per + (per - need) + j % need
    }

    /// The tokens covered up to the end of the `n`-th block kept (0 for none).
    pub fn tokens(&self, n: u32) -> u64 {
        match n {
            0 => 0,
            n => (self.slot(n as usize - 1) as u64 + 1) * u64::from(self.size),
        }
    }
}

#[derive(Debug, Default)]
pub struct BlockSizes {
    /// Per rank, its groups by group number.
    per_rank: Vec<Vec<Shape>>,
    /// Per rank, the LCM of its groups' sizes (0 when past `u32::MAX`):
    /// the engine's hits are multiples of it.
    lcm: Vec<u64>,
    /// Distinct sizes in use: first the ranks' own, most ranks first (at
    /// a tie, the size of the lowest-numbered rank first), then those of
    /// other groups, most ranks first; at most [`MAX_SIZES`].
    in_use: Vec<u32>,
}

pub fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl BlockSizes {
    pub fn new(dp_size: u32) -> Self {
        let mut s = BlockSizes::default();
        s.resize(dp_size);
        s
    }

    /// Rank `rank`'s block size: its group 0's (its lowest group's); `None`
    /// until it stored a block (or since it was forgotten).
    pub fn of(&self, rank: u32) -> Option<u32> {
        self.per_rank.get(rank as usize).and_then(|g| g.first()).map(|s| s.size)
    }

    /// Rank `rank`'s groups learned, by group number.
    pub fn groups(&self, rank: u32) -> &[Shape] {
        self.per_rank.get(rank as usize).map_or(&[], Vec::as_slice)
    }

    /// Rank `rank`'s group `group`, once one of its blocks was indexed.
    pub fn group(&self, rank: u32, group: u32) -> Option<Shape> {
        self.per_rank.get(rank as usize)?.iter().find(|s| s.group == group).copied()
    }

    /// The LCM of rank `rank`'s groups' sizes (0: too large; 1: none known).
    pub fn lcm(&self, rank: u32) -> u64 {
        self.lcm.get(rank as usize).copied().unwrap_or(1)
    }

    /// The LCM of rank `rank`'s groups' sizes and `size`.
    pub fn lcm_with(&self, rank: u32, size: u32) -> u64 {
        let (l, s) = (self.lcm(rank), u64::from(size));
        if l == 0 || s == 0 {
            return 0;
        }
        let v = l / gcd(l, s) * s;
        if v > u64::from(u32::MAX) {
            0
        } else {
            v
        }
    }

    /// The sizes to key a prompt with, the ranks' own first.
    pub fn in_use(&self) -> &[u32] {
        &self.in_use
    }

    /// Rank `rank` (in range) applied a store of `shape`'s group.
    pub fn learn(&mut self, rank: u32, shape: Shape) {
        let groups = &mut self.per_rank[rank as usize];
        match groups.binary_search_by_key(&shape.group, |s| s.group) {
            Ok(i) if groups[i] == shape => return,
            Ok(i) => groups[i] = shape,
            Err(i) => groups.insert(i, shape),
        }
        self.regroup();
    }

    /// Rank `rank`'s engine restarted or is gone: its sizes are learned again.
    pub fn forget(&mut self, rank: u32) {
        if let Some(groups) = self.per_rank.get_mut(rank as usize).filter(|g| !g.is_empty()) {
            *groups = Vec::new();
            self.regroup();
        }
    }

    pub fn resize(&mut self, dp_size: u32) {
        self.per_rank.resize_with(dp_size as usize, Vec::new);
        self.regroup();
    }

    /// Recomputes the LCMs and [`BlockSizes::in_use`] (only when a rank's
    /// groups change).
    fn regroup(&mut self) {
        self.lcm = self
            .per_rank
            .iter()
            .map(|groups| {
                groups.iter().try_fold(1u64, |l, s| {
                    let s = u64::from(s.size);
                    let v = l / gcd(l, s).max(1) * s;
                    (v <= u64::from(u32::MAX)).then_some(v)
                })
            })
            .map(|l| l.unwrap_or(0))
            .collect();
        // (size, ranks using it, the lowest such rank), for the ranks' own
        // sizes, then for every other size any group uses.
        let rank_sizes = self.per_rank.iter().enumerate().filter_map(|(r, g)| g.first().map(|s| (s.size, r as u32)));
        let mut sizes = Self::count(rank_sizes);
        let others = self.per_rank.iter().enumerate().flat_map(|(r, g)| {
            let own = g.first().map(|s| s.size);
            let mut seen: Vec<u32> = g.iter().map(|s| s.size).filter(|&s| Some(s) != own).collect();
            seen.sort_unstable();
            seen.dedup();
            seen.into_iter().map(move |s| (s, r as u32))
        });
        let mut others = Self::count(others);
        others.retain(|o| sizes.iter().all(|s| s.0 != o.0));
        sizes.extend(others);
        self.in_use = sizes.into_iter().take(MAX_SIZES).map(|(size, _, _)| size).collect();
    }

    /// `(size, rank)` pairs as `(size, ranks, lowest rank)`, most ranks first.
    fn count(pairs: impl Iterator<Item = (u32, u32)>) -> Vec<(u32, u32, u32)> {
        let mut known: Vec<(u32, u32)> = pairs.collect();
        known.sort_unstable();
        let mut groups: Vec<(u32, u32, u32)> = Vec::new();
        for (size, rank) in known {
            match groups.last_mut() {
                Some(g) if g.0 == size => g.1 += 1,
                _ => groups.push((size, 1, rank)),
            }
        }
        groups.sort_unstable_by_key(|&(_, count, first)| (std::cmp::Reverse(count), first));
        groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn learn(s: &mut BlockSizes, rank: u32, size: u32) {
        s.learn(rank, Shape::dense(0, size));
    }

    #[test]
    fn the_size_most_ranks_use_comes_first_and_at_most_four_are_kept() {
        let mut s = BlockSizes::new(8);
        assert_eq!((s.in_use(), s.of(0)), (&[][..], None));
        learn(&mut s, 0, 999);
        assert_eq!(s.in_use(), [999]);
        learn(&mut s, 1, 16);
        assert_eq!(s.in_use(), [999, 16], "a tie: the lowest rank's size first");
        learn(&mut s, 2, 16);
        assert_eq!(s.in_use(), [16, 999]);
        for (rank, size) in [(3, 1), (4, 2), (5, 3)] {
            learn(&mut s, rank, size);
        }
        assert_eq!(s.in_use(), [16, 999, 1, 2], "four sizes at most");
        s.forget(0);
        assert_eq!((s.of(0), s.of(1)), (None, Some(16)));
        assert_eq!(s.in_use(), [16, 1, 2, 3]);
        s.resize(2);
        assert_eq!(s.in_use(), [16]);
        s.forget(7);
    }

    #[test]
    fn other_groups_sizes_come_after_the_ranks_own_and_set_the_lcm() {
        let mut s = BlockSizes::new(3);
        for rank in 0..3 {
            learn(&mut s, rank, 64);
        }
        s.learn(0, Shape { group: 1, size: 32, per: 2, need: 1 });
        s.learn(2, Shape::dense(2, 48));
        s.learn(1, Shape::dense(2, 48));
        assert_eq!((s.in_use(), s.of(0)), (&[64, 48, 32][..], Some(64)));
        assert_eq!((s.lcm(0), s.lcm(1), s.lcm(2), s.lcm_with(1, 32)), (64, 192, 192, 192));
        assert_eq!(s.group(0, 1).map(|g| (g.size, g.slot(0), g.slot(1), g.tokens(2))), Some((32, 1, 3, 128)));
        s.forget(0);
        assert_eq!((s.in_use(), s.lcm(0), s.group(0, 1)), (&[64, 48][..], 1, None));
    }
}
