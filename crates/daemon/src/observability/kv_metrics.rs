//! The KV-event metrics (`dpcoord_kv_*`, docs/PROTOCOL.md §12), registered
//! in the daemon's one registry and resized with the rank count.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::metrics::{built, register};
use crate::engines::kv::Medium;
use crate::engines::prefix::Applied;

crate::names! {
    /// The `result` label of `dpcoord_kv_batches_total`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum BatchResult {
        Ok => "ok",
        Malformed => "malformed",
        UnknownRank => "unknown_rank",
        Stale => "stale",
        /// From a `+rank` endpoint (or its replay socket), naming another rank.
        WrongRank => "wrong_rank",
    }
}

crate::names! {
    /// The `result` label of `dpcoord_kv_replays_total`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ReplayResult {
        Recovered => "recovered",
        Incomplete => "incomplete",
        Timeout => "timeout",
        Unavailable => "unavailable",
    }
}

crate::names! {
    /// The `cause` label of `dpcoord_kv_index_resets_total`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ResetCause {
        Cleared => "cleared",
        Restart => "restart",
        Down => "down",
        Gap => "gap",
        /// The publisher's link was connected again: a new session, maybe a
        /// new publisher whose `seq` says nothing of the old one's.
        Reconnect => "reconnect",
    }
}

/// `dpcoord_kv_events_total`'s results, in the order of [`RankKv::events`].
const EVENT_RESULTS: [&str; 7] =
    ["stored", "removed", "cleared", "unknown_parent", "unknown_block", "bad_event", "unmatchable"];

/// One rank's handles.
struct RankKv {
    events: [IntCounter; 7],
    blocks: [IntGauge; 4],
    resets: [IntCounter; 5],
    evicted: IntCounter,
    degraded: IntGauge,
}

pub struct KvMetrics {
    batches: Vec<IntCounter>,
    gaps: IntCounter,
    replays: Vec<IntCounter>,
    events: IntCounterVec,
    blocks: IntGaugeVec,
    resets: IntCounterVec,
    evicted: IntCounterVec,
    degraded: IntGaugeVec,
    ranks: Vec<RankKv>,
}

/// Builds and registers a collector (the daemon's one way, `metrics/`).
fn add<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, made: prometheus::Result<T>) -> T {
    register(r, built(made))
}

impl KvMetrics {
    pub fn new(r: &Registry, dp_size: u32) -> Self {
        let batches = add(
            r,
            IntCounterVec::new(Opts::new("dpcoord_kv_batches_total", "KV event batches, by outcome."), &["result"]),
        );
        let replays = add(
            r,
            IntCounterVec::new(
                Opts::new("dpcoord_kv_replays_total", "KV event gap recoveries, by outcome."),
                &["result"],
            ),
        );
        let mut m = KvMetrics {
            batches: BatchResult::ALL.iter().map(|b| batches.with_label_values(&[b.as_str()])).collect(),
            gaps: add(r, IntCounter::new("dpcoord_kv_event_gaps_total", "Seq gaps seen on the KV event publishers.")),
            replays: ReplayResult::ALL.iter().map(|x| replays.with_label_values(&[x.as_str()])).collect(),
            events: add(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "dpcoord_kv_events_total",
                        "KV events (blocks for stores and removals), by rank and outcome.",
                    ),
                    &["dp_rank", "result"],
                ),
            ),
            blocks: add(
                r,
                IntGaugeVec::new(
                    Opts::new("dpcoord_kv_blocks", "KV blocks indexed, by rank and medium."),
                    &["dp_rank", "medium"],
                ),
            ),
            resets: add(
                r,
                IntCounterVec::new(
                    Opts::new("dpcoord_kv_index_resets_total", "A rank's KV index emptied, by cause."),
                    &["dp_rank", "cause"],
                ),
            ),
            evicted: add(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "dpcoord_kv_blocks_evicted_total",
                        "KV blocks dropped, oldest first, to keep the rank in its share of the memory budget.",
                    ),
                    &["dp_rank"],
                ),
            ),
            degraded: add(
                r,
                IntGaugeVec::new(
                    Opts::new(
                        "dpcoord_kv_index_degraded",
                        "1 while a rank's KV index may hold blocks its engine dropped (a gap, a replay or a reset \
                         under way): it earns no prefix credit from events until exact again.",
                    ),
                    &["dp_rank"],
                ),
            ),
            ranks: Vec::new(),
        };
        m.resize(dp_size);
        m
    }

    fn handles(&self, rank: usize) -> RankKv {
        let k = rank.to_string();
        RankKv {
            events: EVENT_RESULTS.map(|res| self.events.with_label_values(&[&k, res])),
            blocks: Medium::ALL.map(|md| self.blocks.with_label_values(&[&k, md.as_str()])),
            resets: ResetCause::ALL.map(|c| self.resets.with_label_values(&[&k, c.as_str()])),
            evicted: self.evicted.with_label_values(&[&k]),
            degraded: self.degraded.with_label_values(&[&k]),
        }
    }

    /// The ranks that have series.
    #[cfg(test)]
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Adds or removes per-rank series to match `dp_size`.
    pub fn resize(&mut self, dp_size: u32) {
        while self.ranks.len() > dp_size as usize {
            self.ranks.pop();
            let k = self.ranks.len().to_string();
            // Each series was created by `handles`, so removal finds it.
            for res in EVENT_RESULTS {
                let _ = self.events.remove_label_values(&[&k, res]);
            }
            for md in Medium::ALL {
                let _ = self.blocks.remove_label_values(&[&k, md.as_str()]);
            }
            for c in ResetCause::ALL {
                let _ = self.resets.remove_label_values(&[&k, c.as_str()]);
            }
            let _ = self.evicted.remove_label_values(&[&k]);
            let _ = self.degraded.remove_label_values(&[&k]);
        }
        while self.ranks.len() < dp_size as usize {
            self.ranks.push(self.handles(self.ranks.len()));
        }
    }

    pub fn batch(&self, result: BatchResult) {
        self.batches[BatchResult::ALL.iter().position(|b| *b == result).unwrap_or(0)].inc();
    }

    pub fn gap(&self) {
        self.gaps.inc();
    }

    pub fn replay(&self, result: ReplayResult) {
        self.replays[ReplayResult::ALL.iter().position(|x| *x == result).unwrap_or(0)].inc();
    }

    pub fn applied(&self, rank: u32, a: &Applied) {
        let Some(m) = self.ranks.get(rank as usize) else { return };
        let counts = [a.stored, a.removed, a.cleared, a.unknown_parent, a.unknown_block, a.bad_event, a.unmatchable];
        for (c, n) in m.events.iter().zip(counts) {
            c.inc_by(n);
        }
        m.evicted.inc_by(a.evicted);
    }

    pub fn reset(&self, rank: u32, cause: ResetCause) {
        if let Some(m) = self.ranks.get(rank as usize) {
            m.resets[ResetCause::ALL.iter().position(|c| *c == cause).unwrap_or(0)].inc();
        }
    }

    /// Sets the block gauges of `rank` and whether its index is degraded.
    pub fn blocks(&self, rank: u32, per_medium: [usize; 4], degraded: bool) {
        if let Some(m) = self.ranks.get(rank as usize) {
            for (g, n) in m.blocks.iter().zip(per_medium) {
                g.set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            m.degraded.set(i64::from(degraded));
        }
    }
}
