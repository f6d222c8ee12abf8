//! Prometheus metrics: one registry of handles, built once at start.
//!
//! Per-rank and per-code series are resolved to handles up front, so the hot
//! path touches an atomic and never hashes a label set.

use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::wire::ErrorCode;

/// Handles for one rank's series.
pub struct RankMetrics {
    pub routed_user: IntCounter,
    pub routed_health: IntCounter,
    pub waiting: IntGauge,
    pub running: IntGauge,
    pub pending: IntGauge,
    pub finished: IntCounter,
    pub failed: IntCounter,
    pub up: IntGauge,
    pub penalty: Gauge,
    pub age: Gauge,
}

/// The `result` label of `dpcoord_stats_messages_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsResult {
    Ok,
    Malformed,
    Stale,
    UnknownRank,
}

impl StatsResult {
    pub const ALL: [StatsResult; 4] =
        [StatsResult::Ok, StatsResult::Malformed, StatsResult::Stale, StatsResult::UnknownRank];

    pub fn as_str(self) -> &'static str {
        match self {
            StatsResult::Ok => "ok",
            StatsResult::Malformed => "malformed",
            StatsResult::Stale => "stale",
            StatsResult::UnknownRank => "unknown_rank",
        }
    }
}

pub struct Metrics {
    pub registry: Registry,
    pub ranks: Vec<RankMetrics>,
    errors: Vec<IntCounter>,
    stats: Vec<IntCounter>,
    pub route_duration: Histogram,
    pub health_duration: Histogram,
    pub tick_duration: Histogram,
    pub dispatch_stddev: Gauge,
    pub epoch: IntGauge,
}

const ROUTE_BUCKETS: [f64; 9] = [2e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2];
const TICK_BUCKETS: [f64; 8] = [1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 2.5e-2];

fn register<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> T {
    // Names are fixed and distinct, so registration cannot collide.
    if let Err(e) = r.register(Box::new(c.clone())) {
        unreachable!("metric registration failed: {e}");
    }
    c
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
}

fn built<T>(r: prometheus::Result<T>) -> T {
    // Only invalid names or label sets fail, and ours are constants.
    r.unwrap_or_else(|e| unreachable!("metric definition is invalid: {e}"))
}

impl Metrics {
    pub fn new(dp_size: u32) -> Self {
        let r = Registry::new();
        let routed = register(
            &r,
            built(IntCounterVec::new(
                opts("dpcoord_routed_total", "Placements answered, by rank and traffic class."),
                &["dp_rank", "class"],
            )),
        );
        let errors = register(
            &r,
            built(IntCounterVec::new(opts("dpcoord_route_errors_total", "Refused queries, by error code."), &["code"])),
        );
        let duration = register(
            &r,
            built(HistogramVec::new(
                HistogramOpts::new("dpcoord_route_duration_seconds", "Query receive-to-reply time inside dpcoord.")
                    .buckets(ROUTE_BUCKETS.to_vec()),
                &["channel"],
            )),
        );
        let requests = register(
            &r,
            built(IntGaugeVec::new(
                opts("dpcoord_engine_requests", "The load routing sees: engine waiting/running and dpcoord pending."),
                &["dp_rank", "state"],
            )),
        );
        let finished = register(
            &r,
            built(IntCounterVec::new(
                opts("dpcoord_engine_finished_total", "Requests the engine reported finished, summed across boots."),
                &["dp_rank"],
            )),
        );
        let failed = register(
            &r,
            built(IntCounterVec::new(
                opts("dpcoord_engine_failed_total", "Requests the engine reported failed, summed across boots."),
                &["dp_rank"],
            )),
        );
        let up = register(
            &r,
            built(IntGaugeVec::new(opts("dpcoord_engine_up", "1 when the rank is routable."), &["dp_rank"])),
        );
        let penalty = register(
            &r,
            built(prometheus::GaugeVec::new(
                opts("dpcoord_engine_penalty", "Current result-metric penalty of the rank."),
                &["dp_rank"],
            )),
        );
        let age = register(
            &r,
            built(prometheus::GaugeVec::new(
                opts(
                    "dpcoord_engine_stats_age_seconds",
                    "Time since the rank's last valid stats update (NaN before the first).",
                ),
                &["dp_rank"],
            )),
        );
        let stats = register(
            &r,
            built(IntCounterVec::new(
                opts("dpcoord_stats_messages_total", "Engine stats updates seen, by result."),
                &["result"],
            )),
        );
        let tick_duration = register(
            &r,
            built(Histogram::with_opts(
                HistogramOpts::new("dpcoord_tick_duration_seconds", "Time of one tick.").buckets(TICK_BUCKETS.to_vec()),
            )),
        );
        let dispatch_stddev = register(
            &r,
            built(Gauge::with_opts(opts(
                "dpcoord_user_dispatch_stddev",
                "Standard deviation of user placements per routable rank over the imbalance window.",
            ))),
        );
        let epoch = register(
            &r,
            built(IntGauge::with_opts(opts("dpcoord_epoch", "Current epoch: bumps when the routable set changes."))),
        );
        let ranks = (0..dp_size)
            .map(|rank| {
                let k = rank.to_string();
                let m = RankMetrics {
                    routed_user: routed.with_label_values(&[&k, "user"]),
                    routed_health: routed.with_label_values(&[&k, "health"]),
                    waiting: requests.with_label_values(&[&k, "waiting"]),
                    running: requests.with_label_values(&[&k, "running"]),
                    pending: requests.with_label_values(&[&k, "pending"]),
                    finished: finished.with_label_values(&[&k]),
                    failed: failed.with_label_values(&[&k]),
                    up: up.with_label_values(&[&k]),
                    penalty: penalty.with_label_values(&[&k]),
                    age: age.with_label_values(&[&k]),
                };
                m.age.set(f64::NAN);
                m
            })
            .collect();
        Metrics {
            registry: r,
            ranks,
            errors: ErrorCode::ALL.iter().map(|c| errors.with_label_values(&[c.as_str()])).collect(),
            stats: StatsResult::ALL.iter().map(|s| stats.with_label_values(&[s.as_str()])).collect(),
            route_duration: duration.with_label_values(&["route"]),
            health_duration: duration.with_label_values(&["health"]),
            tick_duration,
            dispatch_stddev,
            epoch,
        }
    }

    pub fn error(&self, code: ErrorCode) {
        let i = ErrorCode::ALL.iter().position(|c| *c == code).unwrap_or(0);
        self.errors[i].inc();
    }

    pub fn stats(&self, result: StatsResult) {
        let i = StatsResult::ALL.iter().position(|c| *c == result).unwrap_or(0);
        self.stats[i].inc();
    }
}
