//! The memory budget as operators see it: its parts, and what the
//! approximate index evicted to stay within its share.

use prometheus::{IntCounter, IntGaugeVec, Opts, Registry};

use super::metrics::{built, register};
use crate::config::Budget;

pub struct MemoryMetrics {
    parts: IntGaugeVec,
    approx_evicted: IntCounter,
}

impl MemoryMetrics {
    pub fn new(r: &Registry, budget: &Budget) -> Self {
        let parts = register(
            r,
            built(IntGaugeVec::new(
                Opts::new(
                    "dpcoord_memory_budget_bytes",
                    "limits.memory_budget_bytes by part: what peers, HTTP connections, the session table and the \
                     sources may hold at their caps, and the prefix indexes' shares of the rest.",
                ),
                &["part"],
            )),
        );
        let approx_evicted = register(
            r,
            built(IntCounter::with_opts(Opts::new(
                "dpcoord_prefix_approx_evicted_total",
                "Keys of the approximate prefix index dropped, oldest first, to stay within its share of the \
                 memory budget.",
            ))),
        );
        let m = MemoryMetrics { parts, approx_evicted };
        m.budget(budget);
        m
    }

    /// Shows `budget`'s parts (at start and on each reload).
    pub fn budget(&self, budget: &Budget) {
        for (part, bytes) in budget.parts() {
            self.parts.with_label_values(&[part]).set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    pub fn approx_evicted(&self, keys: usize) {
        self.approx_evicted.inc_by(keys as u64);
    }
}
