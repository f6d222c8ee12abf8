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
//!
//! Over nodes (`nodes`, vLLM's `--data-parallel-hybrid-lb`), each frontend
//! is an API server of one node and sees, scans and places on that node's
//! ranks only, as vLLM's client does over `engine_ranks_managed`: `K` is
//! then the API servers on its node (its `client_count`), and its scan
//! starts at `first + M * index / K` (`M` the node's ranks, `index` its
//! `client_index` there).

use std::collections::HashMap;
use std::ops::Range;

use super::model::{Micros, SimEngine};
use super::nodes::Nodes;

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
    /// Each frontend's scan start, counted from the first rank of its node.
    start: Vec<usize>,
    /// Each frontend's node's ranks.
    span: Vec<Range<usize>>,
    /// The API servers on each frontend's node (vLLM's `client_count`).
    peers: Vec<u64>,
    /// vLLM's rule: each frontend's unfinished placements per rank.
    own: Vec<Vec<u64>>,
    /// vLLM's rule: the frontend and rank of each unfinished request, by id.
    placed: HashMap<u64, (usize, usize)>,
}

impl StalePicker {
    /// `frontends` frontends over `ranks` ranks. Frontends start their
    /// scans spread over the ranks, as vLLM's do.
    pub fn new(rule: StaleRule, frontends: u32, ranks: u32) -> StalePicker {
        StalePicker::over(rule, Nodes::one(frontends, ranks))
    }

    /// An API server per frontend, split over nodes as `nodes` says; each
    /// starts its scan at `M * index / K` of its node's `M` ranks (`index`
    /// of its node's `K` API servers), as vLLM's do.
    pub fn over(rule: StaleRule, nodes: Nodes) -> StalePicker {
        let servers = nodes.servers();
        let span: Vec<Range<usize>> = (0..servers)
            .map(|a| {
                let r = nodes.ranks_of(nodes.node_of(a));
                r.start as usize..r.end as usize
            })
            .collect();
        let per = nodes.per_node() as usize;
        let start = (0..servers).map(|a| span[a as usize].len() * nodes.local_index(a) as usize / per).collect();
        let n = servers as usize;
        StalePicker {
            rule: StaleRule { every: rule.every.max(1), ..rule },
            next: 0,
            copies: vec![Vec::new(); n],
            start,
            span,
            peers: vec![per as u64; n],
            own: vec![Vec::new(); n],
            placed: HashMap::new(),
        }
    }

    /// Frontend `f`'s pick for request `id` at `now` among ranks `0..ranks`
    /// of `engines` (those of its node). A request placed again (a retry)
    /// first lets go of its earlier placement.
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
        // The frontend's node's ranks among the first `n`, never none.
        let first = self.span[f].start.min(n - 1);
        let m = self.span[f].end.min(n).saturating_sub(first).max(1);
        let s = self.start[f] % m;
        let scan = (0..m).map(|i| first + (s + i) % m);
        if !self.rule.guess {
            let score = |c: &Seen| 4 * c.waiting + c.running;
            let copy = &self.copies[f];
            return scan.min_by_key(|&r| (score(&copy[r]), (r - first + m - s) % m)).unwrap_or(first) as u32;
        }
        self.finished(id);
        let frontends = self.peers[f];
        let own = &mut self.own[f];
        if own.len() < n {
            own.resize(n, 0);
        }
        let copy = &mut self.copies[f];
        let (mut pick, mut best) = (first + s, f64::INFINITY);
        for r in scan {
            let score = vllm_score(frontends, own[r], copy[r]);
            if score < best {
                (pick, best) = (r, score);
            }
        }
        copy[pick].waiting += frontends;
        own[pick] += 1;
        self.placed.insert(id, (f, pick));
        self.start[f] = (s + 1) % m;
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

    fn by_node(servers: u32) -> StalePicker {
        StalePicker::over(StaleRule { every: 100, guess: true }, Nodes::new(2, servers, 8))
    }

    #[test]
    fn over_two_nodes_each_api_server_starts_on_its_node_and_counts_its_nodes_peers() {
        let idle = engines(&[0; 8]);
        // 2 API servers, one a node: each starts at its node's first rank.
        let mut p = by_node(2);
        assert_eq!((p.pick(0, 0, 0, &idle, 8), p.pick(1, 1, 0, &idle, 8)), (0, 4));
        assert_eq!(p.copies[1][4].waiting, 1, "one API server on the node: K = 1");
        // 4 API servers, two a node: local index 1 starts at 4 * 1 / 2 = 2 of its node's 4.
        let mut p = by_node(4);
        let first: Vec<u32> = (0..4).map(|a| p.pick(a, a as u64, 0, &idle, 8)).collect();
        assert_eq!(first, [0, 2, 4, 6]);
        assert_eq!((p.copies[2][4].waiting, p.own[2][4]), (2, 1), "K = 2 API servers on node 1");
        // API server 2's next scan starts at rank 5; rank 4 scores max(2 * 1, 2) = 2 > 0.
        assert_eq!(p.pick(2, 4, 10, &idle, 8), 5);
    }

    #[test]
    fn over_two_nodes_vllm_never_places_outside_the_api_servers_node() {
        // Node 0 busy, node 1 idle: node 0's API servers still pick among ranks 0-3.
        let e = engines(&[9, 9, 9, 9, 0, 0, 0, 0]);
        for servers in [2, 4] {
            let mut p = by_node(servers);
            let per = servers as usize / 2;
            for id in 0..400u64 {
                let a = id as usize % servers as usize;
                let rank = p.pick(a, id, id * 7, &e, 8);
                let node = if a < per { 0..4 } else { 4..8 };
                assert!(node.contains(&rank), "API server {a} of {servers} placed on rank {rank}");
                if id % 3 == 0 {
                    p.finished(id);
                }
            }
        }
        let mut snapshot = StalePicker::over(StaleRule { every: 100, guess: false }, Nodes::new(2, 2, 8));
        assert_eq!(snapshot.pick(0, 0, 0, &e, 8), 0, "the stale snapshot's rule keeps to the node too");
        assert_eq!(snapshot.pick(1, 1, 0, &e, 8), 4);
    }
}
