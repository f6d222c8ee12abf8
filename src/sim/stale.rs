//! Frontends that place requests themselves, without dpcoord's shared view.
//! A coordinator sends every frontend the engines' `[waiting, running]`
//! counts every `every` (vLLM: 100 ms); between snapshots each frontend
//! picks the rank with the lowest `4 * waiting + running` in its copy.
//! Without `guess` the copy stays as received, so every pick until the next
//! snapshot goes to the same rank (DP controllers balancing on periodic
//! load reports). With `guess`, as vLLM's API servers do, a frontend adds
//! the number of frontends to its pick's `waiting` (its guess at what the
//! others do meanwhile) and rotates its scan start. Either way a snapshot
//! replaces every copy, so requests placed but not yet at their engine (in
//! the hop) count nowhere.

use super::model::{Micros, SimEngine};

/// How frontends place requests on their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaleRule {
    /// Virtual microseconds between snapshots.
    pub every: Micros,
    /// Whether a frontend counts its own picks between snapshots (vLLM's rule).
    pub guess: bool,
}

#[derive(Debug, Clone)]
pub struct StalePicker {
    rule: StaleRule,
    /// When the next snapshot is due.
    next: Micros,
    /// Each frontend's copy of `[waiting, running]` per rank.
    copies: Vec<Vec<[u64; 2]>>,
    /// Each frontend's scan start.
    start: Vec<usize>,
}

impl StalePicker {
    /// `frontends` frontends over `ranks` ranks. Frontends start their
    /// scans spread over the ranks, as vLLM's do.
    pub fn new(rule: StaleRule, frontends: u32, ranks: u32) -> StalePicker {
        let n = frontends.max(1) as usize;
        let start = (0..n).map(|i| ranks as usize * i / n).collect();
        StalePicker {
            rule: StaleRule { every: rule.every.max(1), ..rule },
            next: 0,
            copies: vec![Vec::new(); n],
            start,
        }
    }

    /// Frontend `f`'s pick at `now` among ranks `0..ranks` of `engines`.
    pub fn pick(&mut self, f: usize, now: Micros, engines: &[SimEngine], ranks: u32) -> u32 {
        let n = (ranks as usize).min(engines.len()).max(1);
        let frontends = self.copies.len() as u64;
        if now >= self.next || self.copies[f].len() != n {
            let snapshot: Vec<[u64; 2]> = engines[..n].iter().map(|e| [e.counts()[0], e.counts()[1]]).collect();
            for copy in &mut self.copies {
                copy.clone_from(&snapshot);
            }
            self.next = (now / self.rule.every + 1) * self.rule.every;
        }
        let copy = &mut self.copies[f];
        let score = |c: &[u64; 2]| 4 * c[0] + c[1];
        let s = self.start[f] % n;
        let pick = (0..n).map(|i| (s + i) % n).min_by_key(|&r| (score(&copy[r]), (r + n - s) % n)).unwrap_or(0);
        if self.rule.guess {
            copy[pick][0] += frontends;
            self.start[f] = (s + 1) % n;
        }
        pick as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::model::{Job, DEFAULT_COST};

    fn engines(held: &[u32]) -> Vec<SimEngine> {
        held.iter()
            .map(|&k| {
                let mut e = SimEngine::new(8192, 256, DEFAULT_COST, 100);
                for id in 0..k {
                    e.admit(Job::new(u64::from(id), 100, 1, 0));
                }
                e
            })
            .collect()
    }

    #[test]
    fn without_guesses_every_pick_goes_to_the_snapshots_least_loaded_rank() {
        let mut p = StalePicker::new(StaleRule { every: 100, guess: false }, 2, 4);
        let e = engines(&[3, 3, 0, 3]);
        let picks: Vec<u32> = (0..6).map(|i| p.pick(i % 2, i as Micros * 10, &e, 4)).collect();
        assert_eq!(picks, [2; 6]);
        assert_eq!(p.pick(0, 100, &engines(&[3, 1, 3, 3]), 4), 1, "the next snapshot moves the herd");
    }

    #[test]
    fn guesses_spread_picks_until_the_snapshot_replaces_them() {
        let mut p = StalePicker::new(StaleRule { every: 100, guess: true }, 2, 4);
        let mut e = engines(&[3, 3, 0, 3]);
        // Both frontends read rank 2 as empty; each then counts its own pick twice.
        assert_eq!((p.pick(0, 0, &e, 4), p.pick(1, 0, &e, 4)), (2, 2));
        assert_eq!(p.pick(0, 10, &e, 4), 2, "4 * 2 = 8 < 12: frontend 0 still sees rank 2 as least loaded");
        assert_eq!(p.pick(0, 20, &e, 4), 3, "16 on rank 2, ties among 12s: the first from the rotated start");
        // Rank 2 now holds 3 requests; the next snapshot shows them all.
        e = engines(&[3, 3, 3, 1]);
        assert_eq!(p.pick(1, 100, &e, 4), 3);
    }
}
