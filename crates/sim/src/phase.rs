//! A run cut into phases at each resize of dpcoord's table: per phase, the
//! ranks and epoch of the table, user placements per rank, what the ranks a
//! resize removed got after its reply, throughput and time to first token.

use std::ops::Range;

use super::model::Micros;
use super::record::{percentile, std_dev, Recorder, TableStart};

/// One phase of a run: dpcoord's table unchanged from `from` to `to`.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    pub dp_size: u32,
    /// The table's epoch at the start (the resize reply's, after the first phase).
    pub epoch: u64,
    pub from: Micros,
    pub to: Micros,
    /// User placements per rank of the table (`0..dp_size`) in the phase.
    pub placements: Vec<u64>,
    /// Ranks the phase's resize removed, and the user placements they got after its reply.
    pub removed: Option<(Range<u32>, u64)>,
    /// When the last of the removed ranks had drained what it held and stopped.
    pub drained: Option<Micros>,
    /// Requests completed in the phase.
    pub completed: u64,
    /// Prompt tokens prefilled in the phase, over every rank.
    pub prefilled: u64,
    /// Time to first token of the requests sent in the phase.
    pub ttft_p50: Micros,
    pub ttft_p99: Micros,
}

impl Phase {
    /// Prompt tokens prefilled per virtual second.
    pub fn input_tps(&self) -> f64 {
        match self.to.saturating_sub(self.from) {
            0 => 0.0,
            span => self.prefilled as f64 / (span as f64 / 1e6),
        }
    }

    pub fn placement_std(&self) -> f64 {
        std_dev(&self.placements)
    }
}

/// The phases of `rec`'s run, the last ending at `end` (its last completion).
pub fn phases(rec: &Recorder, end: Micros) -> Vec<Phase> {
    let t = &rec.tables;
    if t.is_empty() {
        return Vec::new();
    }
    let index = |at: Micros| t.iter().rposition(|s| s.at <= at).unwrap_or(0);
    let mut completed = vec![0; t.len()];
    let mut ttfts = vec![Vec::new(); t.len()];
    for r in &rec.requests {
        if let Some(done) = r.done {
            completed[index(done)] += 1;
        }
        if let Some(first) = r.first_token {
            ttfts[index(r.issued)].push(first.saturating_sub(r.issued));
        }
    }
    let mut out = Vec::with_capacity(t.len());
    for (i, start) in t.iter().enumerate() {
        let (to, placements, prefilled) = match t.get(i + 1) {
            Some(next) => (next.at, &next.placements, next.prefilled),
            None => (end.max(start.at), &rec.placements, rec.prefilled),
        };
        let delta: Vec<u64> = placements.iter().zip(&start.placements).map(|(b, a)| b - a).collect();
        let removed = i.checked_sub(1).map(|p| t[p].dp_size).filter(|&before| before > start.dp_size);
        let removed = removed.map(|before| start.dp_size..before);
        let ttft = &mut ttfts[i];
        ttft.sort_unstable();
        out.push(Phase {
            dp_size: start.dp_size,
            epoch: start.epoch,
            from: start.at,
            to,
            placements: delta.iter().copied().take(start.dp_size as usize).collect(),
            drained: removed.as_ref().and_then(|r| drained(rec, r, start)),
            removed: removed.map(|r| (r.clone(), r.map(|rank| delta.get(rank as usize).copied().unwrap_or(0)).sum())),
            completed: completed[i],
            prefilled: prefilled - start.prefilled,
            ttft_p50: percentile(ttft, 50),
            ttft_p99: percentile(ttft, 99),
        });
    }
    out
}

/// When the last rank of `removed` stopped, if all did.
fn drained(rec: &Recorder, removed: &Range<u32>, start: &TableStart) -> Option<Micros> {
    let stops: Vec<Micros> =
        rec.stopped.iter().filter(|(r, at)| removed.contains(r) && *at >= start.at).map(|&(_, at)| at).collect();
    (stops.len() == removed.len()).then(|| stops.iter().copied().max().unwrap_or(start.at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Request;

    fn request(issued: Micros, first: Micros) -> Request {
        Request {
            frontend: 0,
            prompt: 10,
            output: 1,
            issued,
            first_token: Some(first),
            done: Some(first),
            attempts: 1,
            ..Request::default()
        }
    }

    #[test]
    fn a_shrink_phase_counts_placements_on_removed_ranks_and_their_drain() {
        let mut rec = Recorder::new(4);
        rec.table(0, 4, 4, 0);
        rec.placements = vec![3, 3, 2, 2];
        rec.requests = vec![request(0, 2_000_000), request(1_000_000, 3_500_000)];
        rec.table(2_000_000, 2, 5, 100);
        rec.placements = vec![5, 4, 2, 2];
        rec.stopped = vec![(3, 2_500_000), (2, 3_000_000)];
        rec.prefilled = 400;
        let p = phases(&rec, 4_000_000);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].dp_size, p[0].epoch, p[0].from, p[0].to), (4, 4, 0, 2_000_000));
        assert_eq!((p[0].placements.clone(), p[0].removed.clone(), p[0].drained), (vec![3, 3, 2, 2], None, None));
        // The request done at 2 s belongs to the second phase; both were sent in the first.
        assert_eq!((p[0].completed, p[0].ttft_p50, p[0].ttft_p99), (0, 2_000_000, 2_500_000));
        assert_eq!((p[0].prefilled, p[0].input_tps()), (100, 50.0));
        assert_eq!((p[1].placements.clone(), p[1].removed.clone()), (vec![2, 1], Some((2..4, 0))));
        assert_eq!((p[1].drained, p[1].completed, p[1].ttft_p99), (Some(3_000_000), 2, 0));
        assert_eq!((p[1].prefilled, p[1].input_tps(), p[1].placement_std()), (300, 150.0, 0.5));
    }

    #[test]
    fn a_rank_still_draining_leaves_the_drain_open() {
        let mut rec = Recorder::new(3);
        rec.table(0, 3, 3, 0);
        rec.table(1_000, 1, 4, 0);
        rec.stopped = vec![(2, 1_500)];
        assert_eq!(phases(&rec, 500)[1].drained, None);
        assert_eq!(phases(&rec, 500)[1].to, 1_000, "a phase ends no earlier than it starts");
        assert_eq!(phases(&Recorder::new(3), 0), []);
    }
}
