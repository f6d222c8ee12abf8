//! The metrics of `cache_aware`'s predictions (`dpcoord_prefix_*_tokens*`,
//! docs/PROTOCOL.md §4 `explain` and §12): what each placement predicted
//! was cached on its rank and on the best rank, and what the engines
//! reported they delivered.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};

use super::metrics::{built, register};
use crate::wire::Delivered;

/// `dpcoord_prefix_prediction_error_tokens`' buckets: a prediction off by
/// less than a block (16 tokens) either way, then by a few blocks, then by
/// a long prompt's worth.
const ERROR_BUCKETS: [f64; 14] =
    [-16384.0, -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0];

/// One rank's handles.
struct RankPrefix {
    chosen: IntCounter,
    best: IntCounter,
    reported: IntCounter,
    delivered: IntCounter,
}

pub struct PrefixMetrics {
    predicted: IntCounterVec,
    reported: IntCounterVec,
    error: Histogram,
    ranks: Vec<RankPrefix>,
}

/// Adds `n` to `c`, stopping at the counter's top rather than wrapping.
fn add(c: &IntCounter, n: u64) {
    c.inc_by(n.min(u64::MAX - c.get()));
}

impl PrefixMetrics {
    pub fn new(r: &Registry, dp_size: u32) -> Self {
        let predicted = IntCounterVec::new(
            Opts::new(
                "dpcoord_prefix_predicted_tokens_total",
                "Prompt tokens predicted cached, per placement with a prediction, by the rank placed on: on that \
                 rank (chosen) and on the best routable rank (best).",
            ),
            &["dp_rank", "of"],
        );
        let reported = IntCounterVec::new(
            Opts::new(
                "dpcoord_prefix_reported_tokens_total",
                "Per delivered report: the prediction it carries back (predicted) and the prompt tokens the \
                 engine served from its cache (delivered).",
            ),
            &["dp_rank", "kind"],
        );
        let error = HistogramOpts::new(
            "dpcoord_prefix_prediction_error_tokens",
            "Per delivered report: predicted minus delivered cached prompt tokens.",
        )
        .buckets(ERROR_BUCKETS.to_vec());
        let mut m = PrefixMetrics {
            predicted: register(r, built(predicted)),
            reported: register(r, built(reported)),
            error: register(r, built(Histogram::with_opts(error))),
            ranks: Vec::new(),
        };
        m.resize(dp_size);
        m
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
            // Each series was created below, so removal finds it.
            for of in ["chosen", "best"] {
                let _ = self.predicted.remove_label_values(&[&k, of]);
            }
            for kind in ["predicted", "delivered"] {
                let _ = self.reported.remove_label_values(&[&k, kind]);
            }
        }
        while self.ranks.len() < dp_size as usize {
            let k = self.ranks.len().to_string();
            self.ranks.push(RankPrefix {
                chosen: self.predicted.with_label_values(&[&k, "chosen"]),
                best: self.predicted.with_label_values(&[&k, "best"]),
                reported: self.reported.with_label_values(&[&k, "predicted"]),
                delivered: self.reported.with_label_values(&[&k, "delivered"]),
            });
        }
    }

    /// `count` placements on `rank`, each predicted to find `predicted`
    /// prompt tokens cached there and `best` on the best rank.
    pub fn placed(&self, rank: u32, count: u64, predicted: u64, best: u64) {
        if let Some(m) = self.ranks.get(rank as usize) {
            add(&m.chosen, predicted.saturating_mul(count));
            add(&m.best, best.saturating_mul(count));
        }
    }

    /// One `delivered` report (its rank was checked against `dp_size`).
    pub fn delivered(&self, d: &Delivered) {
        if let Some(m) = self.ranks.get(d.rank as usize) {
            add(&m.reported, d.predicted);
            add(&m.delivered, d.delivered);
            self.error.observe(d.predicted as f64 - d.delivered as f64);
        }
    }
}
