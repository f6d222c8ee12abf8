//! Frontends that place requests themselves, without dpcoord's shared view.
//! A coordinator sends every frontend the engines' `[waiting, running,
//! kv_usage]` every `every` (vLLM: 100 ms), and each snapshot replaces every
//! frontend's copy. Two rules:
//!
//! - stale snapshot (`guess: false`): the rank with the lowest
//!   `4 * waiting + running` in the copy as received, so every pick until
//!   the next snapshot goes to the same rank (DP controllers balancing on
//!   periodic load reports).
//! - vLLM's (`guess: true`), as vLLM 0.33's API servers place requests
//!   with `--data-parallel-size N --api-server-count K` (`vllm/v1/engine/
//!   core_client.py`, `DPLBAsyncMPClient.get_core_engine_for_request`, with
//!   the in-flight count kept by `DPLBAsyncMPClient.process_engine_outputs`):
//!   each frontend scores a rank `max(K * own, waiting + running)`, `own`
//!   being its own placements on the rank not yet finished, plus
//!   `waiting * 6 * max(0, kv_usage - 0.5)` when `waiting > 0`; it scans
//!   from its start (`N * index / K` at first) and takes the first lowest
//!   score, then adds `K` to its copy's `waiting` of the pick (its guess at
//!   what the others do meanwhile) and moves its start on by one. The
//!   in-flight floor outlives snapshots; the guessed `waiting` does not.
//!   `kv_usage` is the engine's (`SimEngine::kv_usage`): the share of its
//!   prefix cache that running jobs hold, so the term is 0 on engines
//!   without a prefix cache (every scenario but the prefix-cache ones).

use std::collections::HashMap;

use super::model::{Micros, SimEngine};

/// How frontends place requests on their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaleRule {
    /// Virtual microseconds between snapshots.
    pub every: Micros,
    /// vLLM's rule (else the stale snapshot's).
    pub guess: bool,
}

/// One rank in a frontend's copy of the snapshot.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Seen {
    waiting: u64,
    running: u64,
    kv_usage: f64,
}

/// vLLM's score of a rank: `frontends` API servers, `own` of this one's
/// unfinished placements on it, `seen` its copy of the rank's counts.
fn vllm_score(frontends: u64, own: u64, seen: Seen) -> f64 {
    let load = (frontends * own).max(seen.waiting + seen.running) as f64;
    let queue = if seen.waiting > 0 { seen.waiting as f64 * 6.0 * (seen.kv_usage - 0.5).max(0.0) } else { 0.0 };
    load + queue
}

#[derive(Debug, Clone)]
pub struct StalePicker {
    rule: StaleRule,
    /// When the next snapshot is due.
    next: Micros,
    /// Each frontend's copy of the snapshot.
    copies: Vec<Vec<Seen>>,
    /// Each frontend's scan start.
    start: Vec<usize>,
    /// vLLM's rule: each frontend's unfinished placements per rank.
    own: Vec<Vec<u64>>,
    /// vLLM's rule: the frontend and rank of each unfinished request, by id.
    placed: HashMap<u64, (usize, usize)>,
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
            own: vec![Vec::new(); n],
            placed: HashMap::new(),
        }
    }

    /// Frontend `f`'s pick for request `id` at `now` among ranks `0..ranks`
    /// of `engines`. A request placed again (a retry) first lets go of its
    /// earlier placement.
    pub fn pick(&mut self, f: usize, id: u64, now: Micros, engines: &[SimEngine], ranks: u32) -> u32 {
        let n = (ranks as usize).min(engines.len()).max(1);
        if now >= self.next || self.copies[f].len() != n {
            let snapshot: Vec<Seen> = engines[..n]
                .iter()
                .map(|e| Seen { waiting: e.counts()[0], running: e.counts()[1], kv_usage: e.kv_usage() })
                .collect();
            for copy in &mut self.copies {
                copy.clone_from(&snapshot);
            }
            self.next = (now / self.rule.every + 1) * self.rule.every;
        }
        let s = self.start[f] % n;
        if !self.rule.guess {
            let score = |c: &Seen| 4 * c.waiting + c.running;
            let copy = &self.copies[f];
            return (0..n).map(|i| (s + i) % n).min_by_key(|&r| (score(&copy[r]), (r + n - s) % n)).unwrap_or(0) as u32;
        }
        self.finished(id);
        let frontends = self.copies.len() as u64;
        let own = &mut self.own[f];
        if own.len() < n {
            own.resize(n, 0);
        }
        let copy = &mut self.copies[f];
        let (mut pick, mut best) = (s, f64::INFINITY);
        for r in (0..n).map(|i| (s + i) % n) {
            let score = vllm_score(frontends, own[r], copy[r]);
            if score < best {
                (pick, best) = (r, score);
            }
        }
        copy[pick].waiting += frontends;
        own[pick] += 1;
        self.placed.insert(id, (f, pick));
        self.start[f] = (s + 1) % n;
        pick as u32
    }

    /// Request `id` finished (or failed): its frontend no longer counts it.
    pub fn finished(&mut self, id: u64) {
        if let Some((f, r)) = self.placed.remove(&id) {
            self.own[f][r] -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Job, DEFAULT_COST};

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

    fn vllm(frontends: u32, ranks: u32) -> StalePicker {
        StalePicker::new(StaleRule { every: 100, guess: true }, frontends, ranks)
    }

    #[test]
    fn without_guesses_every_pick_goes_to_the_snapshots_least_loaded_rank() {
        let mut p = StalePicker::new(StaleRule { every: 100, guess: false }, 2, 4);
        let e = engines(&[3, 3, 0, 3]);
        let picks: Vec<u32> = (0..6).map(|i| p.pick(i % 2, i as u64, i as Micros * 10, &e, 4)).collect();
        assert_eq!(picks, [2; 6]);
        assert_eq!(p.pick(0, 6, 100, &engines(&[3, 1, 3, 3]), 4), 1, "the next snapshot moves the herd");
    }

    #[test]
    fn vllm_scores_the_greater_of_the_floor_and_the_counts_plus_the_kv_term() {
        let seen = |waiting, running, kv_usage| Seen { waiting, running, kv_usage };
        assert_eq!(vllm_score(2, 1, seen(0, 1, 0.9)), 2.0, "2 API servers x 1 own request > 1 seen");
        assert_eq!(vllm_score(2, 1, seen(4, 2, 0.5)), 6.0, "no kv term at or below half usage");
        assert_eq!(vllm_score(2, 1, seen(4, 2, 0.75)), 6.0 + 4.0 * 6.0 * 0.25);
        assert_eq!(vllm_score(4, 3, seen(0, 5, 1.0)), 12.0, "no kv term without waiting requests");
    }

    #[test]
    fn vllm_adds_the_api_servers_to_its_copy_and_rotates_its_start() {
        let mut p = vllm(2, 4);
        let mut e = engines(&[3, 3, 0, 3]);
        // Frontend 1 starts its scan at rank 4 * 1 / 2 = 2; both read rank 2 as empty.
        assert_eq!((p.pick(0, 0, 0, &e, 4), p.pick(1, 1, 0, &e, 4)), (2, 2));
        // Frontend 0's copy: rank 2 at max(2 * 1, 2 + 0) = 2 < 3.
        assert_eq!(p.pick(0, 2, 10, &e, 4), 2);
        // Now max(2 * 2, 4) = 4 on rank 2; the 3s tie, the first from the rotated start (2) is rank 3.
        assert_eq!(p.pick(0, 3, 20, &e, 4), 3);
        // The next snapshot shows rank 2's three requests and replaces the guesses.
        e = engines(&[3, 3, 3, 1]);
        assert_eq!(p.pick(1, 4, 100, &e, 4), 3);
    }

    #[test]
    fn vllm_own_placements_outlive_the_snapshot_until_they_finish() {
        let mut p = vllm(1, 2);
        let idle = engines(&[0, 0]);
        assert_eq!(p.pick(0, 0, 0, &idle, 2), 0);
        assert_eq!(p.pick(0, 1, 0, &idle, 2), 1, "rank 0 scores max(1, 1) = 1 against 0");
        p.finished(1);
        // The snapshot still shows no request anywhere (request 0 is in the hop); the
        // scan starts at rank 0 again, but request 0 keeps rank 0's floor at 1.
        assert_eq!(p.pick(0, 2, 100, &idle, 2), 1);
        p.finished(0);
        p.finished(2);
        assert_eq!(p.own, [[0, 0]]);
        assert_eq!(p.pick(0, 3, 200, &idle, 2), 1, "all even: the first from the start (1)");
        // A retry of request 3 lets go of its first placement.
        assert_eq!(p.pick(0, 3, 300, &idle, 2), 0);
        assert_eq!(p.own, [[1, 0]]);
    }
}
