//! What a run did: every request's timeline, placements and probes per rank,
//! dpcoord's table at the start and at each resize, periodic samples for the
//! chart. The numbers a report shows are `summary`'s, cut into phases by
//! `phase`; both stand on this module.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::model::Micros;
use super::prompts::Prompt;

/// One user request from its first send to its last token.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub frontend: u32,
    pub prompt: u32,
    pub output: u32,
    pub issued: Micros,
    pub first_token: Option<Micros>,
    pub done: Option<Micros>,
    /// Placements it took (more than one after a failure).
    pub attempts: u32,
    /// Its tokens, when the run's requests carry them.
    pub content: Option<Arc<Prompt>>,
    /// Prompt tokens the engine found in its prefix cache.
    pub cached: u32,
}

/// Per-rank state at one instant, for the chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at: Micros,
    /// User placements so far.
    pub placements: Vec<u64>,
    /// Requests the rank holds (waiting and running).
    pub held: Vec<u64>,
    /// Tokens of work the rank holds: prompt tokens not yet prefilled plus output tokens still to generate.
    pub work: Vec<u64>,
}

/// Something that happened to one rank, for the chart's markers.
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    pub at: Micros,
    pub rank: u32,
    pub what: Happened,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Happened {
    /// The engine died.
    Died,
    /// The engine hung (its stats kept going out).
    Hung,
    /// A health probe went to the rank; `ok`: the engine was alive.
    Probe { ok: bool },
    /// dpcoord's status of the rank changed to `down`, `stale` or `stalled`.
    SeenDown(String),
    /// dpcoord's status of the rank went back to `up`.
    Readmitted,
}

/// dpcoord's rank table from `at` on: the first is the table a run starts
/// with, each later one an operator's resize (with its reply's epoch).
#[derive(Debug, Clone, PartialEq)]
pub struct TableStart {
    pub at: Micros,
    pub dp_size: u32,
    pub epoch: u64,
    /// User placements per rank so far.
    pub placements: Vec<u64>,
    /// Prompt tokens prefilled so far over every rank.
    pub prefilled: u64,
}

/// Counters a live view (the demo) reads while the run goes on.
#[derive(Debug, Default)]
pub struct Live {
    pub completed: AtomicU64,
    pub input_tokens: AtomicU64,
    /// Virtual time of the run, in microseconds.
    pub now_us: AtomicU64,
    pub probes: Vec<AtomicU64>,
    /// Per rank, prompt tokens batched and of them found in the prefix cache.
    pub prompt: Vec<AtomicU64>,
    pub cached: Vec<AtomicU64>,
}

impl Live {
    pub fn new(ranks: u32) -> Live {
        let zeros = || (0..ranks).map(|_| AtomicU64::new(0)).collect();
        Live { probes: zeros(), prompt: zeros(), cached: zeros(), ..Live::default() }
    }

    /// Rank `rank`'s prefix-cache hit rate so far, if it batched any prompt.
    pub fn hit_rate(&self, rank: usize) -> Option<f64> {
        let prompt = self.prompt.get(rank)?.load(Ordering::Relaxed);
        let cached = self.cached.get(rank)?.load(Ordering::Relaxed);
        (prompt > 0).then(|| cached as f64 / prompt as f64)
    }
}

#[derive(Debug, Default)]
pub struct Recorder {
    pub requests: Vec<Request>,
    pub placements: Vec<u64>,
    pub probes: Vec<u64>,
    pub probe_failures: u64,
    /// Placements dpcoord refused (the request was retried).
    pub refusals: u64,
    pub samples: Vec<Sample>,
    pub tables: Vec<TableStart>,
    /// `(rank, at)`: a removed rank had drained and stopped.
    pub stopped: Vec<(u32, Micros)>,
    /// Prompt tokens prefilled over every rank by the end of the run.
    pub prefilled: u64,
    pub pending: PendingError,
    /// Paced events handled well after their wall-clock due time.
    pub late: u64,
    /// Per rank, `[prompt tokens, of them cached]` of the jobs it batched.
    pub hits: Vec<[u64; 2]>,
    pub marks: Vec<Mark>,
    /// dpcoord's status of each rank at the last sample.
    seen: Vec<String>,
    /// The rank that died, if one did.
    pub death: Option<Death>,
    /// The rank that hung, if one did (`down_at`: when dpcoord showed it `stalled`).
    pub hang: Option<Death>,
    /// Requests a frontend gave up on (no first token in time) and placed again.
    pub timeouts: u64,
    /// Over nodes: user placements outside the asking API server's node.
    pub off_node: u64,
}

/// A rank's death, when dpcoord showed it `down`, and the user placements
/// dpcoord gave it after each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Death {
    pub rank: u32,
    pub at: Micros,
    /// The first event at which dpcoord's `state` showed the rank `down`.
    pub down_at: Option<Micros>,
    pub after_death: u64,
    pub after_down: u64,
    /// The virtual time the run stopped.
    pub ended: Micros,
}

impl Death {
    pub fn new(rank: u32, at: Micros) -> Death {
        Death { rank, at, down_at: None, after_death: 0, after_down: 0, ended: at }
    }

    /// dpcoord placed a user request on `rank`.
    pub fn placed(&mut self, rank: u32) {
        if rank == self.rank {
            self.after_death += 1;
            self.after_down += u64::from(self.down_at.is_some());
        }
    }
}

/// dpcoord's `pending` per rank against the truth, checked before each
/// placement: an estimate above the truth counts placements twice (in a
/// report and as pending), one below it counts them nowhere.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PendingError {
    /// Placements checked.
    pub checks: u64,
    /// Over every check, the sum over ranks of estimate minus truth where positive.
    pub over: u64,
    /// Over every check, the sum over ranks of truth minus estimate where positive.
    pub under: u64,
    /// The largest over- and undercount of one rank at one check.
    pub max_over: u64,
    pub max_under: u64,
}

impl PendingError {
    pub fn add(&mut self, estimate: &[u64], truth: &[u64]) {
        self.checks += 1;
        for (&e, &t) in estimate.iter().zip(truth) {
            self.over += e.saturating_sub(t);
            self.under += t.saturating_sub(e);
            self.max_over = self.max_over.max(e.saturating_sub(t));
            self.max_under = self.max_under.max(t.saturating_sub(e));
        }
    }

    /// Placements counted twice over all ranks, on average at a check.
    pub fn mean_over(&self) -> f64 {
        self.over as f64 / self.checks.max(1) as f64
    }

    /// Placements counted nowhere over all ranks, on average at a check.
    pub fn mean_under(&self) -> f64 {
        self.under as f64 / self.checks.max(1) as f64
    }
}

impl Recorder {
    pub fn new(ranks: u32) -> Recorder {
        Recorder { placements: vec![0; ranks as usize], probes: vec![0; ranks as usize], ..Recorder::default() }
    }

    pub fn sample(&mut self, at: Micros, held: Vec<u64>, work: Vec<u64>) {
        self.samples.push(Sample { at, placements: self.placements.clone(), held, work });
    }

    pub fn mark(&mut self, at: Micros, rank: u32, what: Happened) {
        self.marks.push(Mark { at, rank, what });
    }

    /// dpcoord shows `statuses` at `at`: marks each rank it newly sees down,
    /// stale or stalled, and each it sees up again (a rank's first status marks nothing).
    pub fn saw(&mut self, at: Micros, statuses: Vec<String>) {
        let bad = |s: &str| s == "down" || s == "stale" || s == "stalled";
        for (rank, (now, before)) in statuses.iter().zip(&self.seen).enumerate() {
            let what = match (bad(before), bad(now)) {
                _ if now == before => continue,
                (_, true) => Happened::SeenDown(now.clone()),
                (true, false) if now == "up" => Happened::Readmitted,
                _ => continue,
            };
            self.marks.push(Mark { at, rank: rank as u32, what });
        }
        if statuses.len() >= self.seen.len() {
            self.seen = statuses;
        } else {
            self.seen[..statuses.len()].clone_from_slice(&statuses);
        }
    }

    /// dpcoord's table is `dp_size` ranks at `epoch` from `at` on.
    pub fn table(&mut self, at: Micros, dp_size: u32, epoch: u64, prefilled: u64) {
        let placements = self.placements.clone();
        self.tables.push(TableStart { at, dp_size, epoch, placements, prefilled });
    }
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[Micros], p: u64) -> Micros {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as u64).div_ceil(100).max(1);
    sorted[rank as usize - 1]
}

/// Population standard deviation.
pub fn std_dev(xs: &[u64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<u64>() as f64 / n;
    (xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
}

/// Adds one to a live counter.
pub fn bump(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=200).collect();
        assert_eq!((percentile(&v, 50), percentile(&v, 99)), (100, 198));
        assert_eq!(percentile(&[5], 99), 5);
        assert_eq!(percentile(&[], 50), 0);
    }

    #[test]
    fn pending_error_splits_double_counts_from_missed_ones() {
        let mut p = PendingError::default();
        p.add(&[2, 0, 1], &[1, 0, 3]);
        p.add(&[0, 0, 0], &[0, 0, 0]);
        assert_eq!((p.checks, p.over, p.under, p.max_over, p.max_under), (2, 1, 2, 1, 2));
        assert_eq!((p.mean_over(), p.mean_under()), (0.5, 1.0));
        assert_eq!(PendingError::default().mean_over(), 0.0);
    }

    #[test]
    fn status_changes_become_marks() {
        let mut rec = Recorder::new(3);
        let s = |v: [&str; 3]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        rec.saw(0, s(["up", "unknown", "up"]));
        rec.saw(5, s(["up", "up", "stale"]));
        rec.saw(9, s(["up", "up", "down"]));
        rec.saw(12, s(["down", "up", "up"]));
        rec.saw(14, s(["down", "stalled", "up"]));
        let got: Vec<(Micros, u32, Happened)> = rec.marks.iter().map(|m| (m.at, m.rank, m.what.clone())).collect();
        assert_eq!(
            got,
            [
                (5, 2, Happened::SeenDown("stale".into())),
                (9, 2, Happened::SeenDown("down".into())),
                (12, 0, Happened::SeenDown("down".into())),
                (12, 2, Happened::Readmitted),
                (14, 1, Happened::SeenDown("stalled".into())),
            ]
        );
    }

    #[test]
    fn population_std() {
        assert_eq!(std_dev(&[20; 8]), 0.0);
        // [22, 21, 20, 20, 20, 20, 19, 18]: squared deviations sum to 10.
        assert_eq!(std_dev(&[22, 21, 20, 20, 20, 20, 19, 18]), (10.0f64 / 8.0).sqrt());
    }
}
