//! Prometheus metrics: one registry of handles, built once at start.
//!
//! Per-rank and per-code series are resolved to handles up front, so the hot
//! path touches an atomic and never hashes a label set.

use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::engines::StallCause;
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
    /// NaN while the rank's last update carried no KV usage.
    pub kv_usage: Gauge,
    /// `dpcoord_engine_routable_changes_total` by `change`.
    pub joined: IntCounter,
    pub lost: IntCounter,
    pub readmitted: IntCounter,
    /// `dpcoord_rank_stalls_total` by `cause`, in `StallCause::ALL` order.
    pub stalls: [IntCounter; 2],
    /// `dpcoord_engine_stalled`: 1 while the rank is `stalled`.
    pub stalled: IntGauge,
}

crate::names! {
    /// The `result` label of `dpcoord_stats_messages_total`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum StatsResult {
        Ok => "ok",
        Malformed => "malformed",
        Stale => "stale",
        UnknownRank => "unknown_rank",
        /// From a per-rank source (an SGLang load endpoint), naming another rank.
        WrongRank => "wrong_rank",
    }
}

crate::names! {
    /// The `result` label of `dpcoord_scrapes_total`: how one scrape of a
    /// vLLM `/metrics` ended.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ScrapeResult {
        /// The body decoded into a load report.
        Ok => "ok",
        /// Refused, unreachable or reset before a response.
        ConnectError => "connect_error",
        Timeout => "timeout",
        /// A status other than 200, or not HTTP.
        HttpError => "http_error",
        /// A body above the scrape cap.
        TooLarge => "too_large",
        /// A body that did not decode (not the text format, or no vLLM gauges).
        Malformed => "malformed",
    }
}

/// The `dpcoord_scrapes_total` handles: atomics, shared with the scraper threads.
#[derive(Clone)]
pub struct Scrapes(Vec<IntCounter>);

impl Scrapes {
    pub fn count(&self, result: ScrapeResult) {
        let i = ScrapeResult::ALL.iter().position(|r| *r == result).unwrap_or(0);
        self.0[i].inc();
    }
}

/// The labelled families behind [`RankMetrics`], kept so that ranks can
/// be added and removed at run time.
struct RankFamilies {
    routed: IntCounterVec,
    requests: IntGaugeVec,
    finished: IntCounterVec,
    failed: IntCounterVec,
    up: IntGaugeVec,
    penalty: prometheus::GaugeVec,
    age: prometheus::GaugeVec,
    kv_usage: prometheus::GaugeVec,
    changes: IntCounterVec,
    stalls: IntCounterVec,
    stalled: IntGaugeVec,
}

impl RankFamilies {
    fn handles(&self, rank: usize) -> RankMetrics {
        let k = rank.to_string();
        let m = RankMetrics {
            routed_user: self.routed.with_label_values(&[&k, "user"]),
            routed_health: self.routed.with_label_values(&[&k, "health"]),
            waiting: self.requests.with_label_values(&[&k, "waiting"]),
            running: self.requests.with_label_values(&[&k, "running"]),
            pending: self.requests.with_label_values(&[&k, "pending"]),
            finished: self.finished.with_label_values(&[&k]),
            failed: self.failed.with_label_values(&[&k]),
            up: self.up.with_label_values(&[&k]),
            penalty: self.penalty.with_label_values(&[&k]),
            age: self.age.with_label_values(&[&k]),
            kv_usage: self.kv_usage.with_label_values(&[&k]),
            joined: self.changes.with_label_values(&[&k, "joined"]),
            lost: self.changes.with_label_values(&[&k, "lost"]),
            readmitted: self.changes.with_label_values(&[&k, "readmitted"]),
            stalls: StallCause::ALL.map(|c| self.stalls.with_label_values(&[&k, c.as_str()])),
            stalled: self.stalled.with_label_values(&[&k]),
        };
        m.age.set(f64::NAN);
        m.kv_usage.set(f64::NAN);
        m
    }

    /// Removes every series of `rank`; a rank that comes back starts from 0.
    fn remove(&self, rank: usize) {
        let k = rank.to_string();
        // Each series was created by `handles`, so removal finds it.
        for class in ["user", "health"] {
            let _ = self.routed.remove_label_values(&[&k, class]);
        }
        for state in ["waiting", "running", "pending"] {
            let _ = self.requests.remove_label_values(&[&k, state]);
        }
        let _ = self.finished.remove_label_values(&[&k]);
        let _ = self.failed.remove_label_values(&[&k]);
        let _ = self.up.remove_label_values(&[&k]);
        let _ = self.penalty.remove_label_values(&[&k]);
        let _ = self.age.remove_label_values(&[&k]);
        let _ = self.kv_usage.remove_label_values(&[&k]);
        for change in ["joined", "lost", "readmitted"] {
            let _ = self.changes.remove_label_values(&[&k, change]);
        }
        for c in StallCause::ALL {
            let _ = self.stalls.remove_label_values(&[&k, c.as_str()]);
        }
        let _ = self.stalled.remove_label_values(&[&k]);
    }
}

crate::names! {
    /// The `result` label of `dpcoord_config_reloads_total`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ReloadResult {
        Ok => "ok",
        /// The configuration did not parse or check.
        Invalid => "invalid",
        /// It changed a key that only a restart can apply.
        RestartRequired => "restart_required",
    }
}

pub struct Metrics {
    pub registry: Registry,
    pub ranks: Vec<RankMetrics>,
    families: RankFamilies,
    errors: Vec<IntCounter>,
    stats: Vec<IntCounter>,
    pub route_duration: Histogram,
    pub health_duration: Histogram,
    pub tick_duration: Histogram,
    pub dispatch_stddev: Gauge,
    pub epoch: IntGauge,
    /// Stats updates an engine sent that never arrived (seq gaps within a boot).
    pub stats_missed: IntCounter,
    /// `dpcoord_access_denied_total` for the route, health and stats sockets.
    access_denied: [IntCounter; 3],
    reloads: Vec<IntCounter>,
    dp_size: IntGauge,
    /// `dpcoord_scrapes_total`, by result.
    pub scrapes: Scrapes,
}

/// A query costs 1 to 5 us inside dpcoord (release build, 8 ranks); the
/// upper buckets catch stalls.
const ROUTE_BUCKETS: [f64; 10] = [1e-6, 2e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2];
/// A tick costs about 10 us for 8 ranks and grows with the rank count.
const TICK_BUCKETS: [f64; 9] = [5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 5e-3, 2.5e-2];

/// Registers a collector (the gateway registers its own on the daemon's registry).
pub fn register<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> T {
    // Names are fixed and distinct, so registration cannot collide.
    if let Err(e) = r.register(Box::new(c.clone())) {
        unreachable!("metric registration failed: {e}");
    }
    c
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
}

/// A collector whose definition is constant, so cannot fail.
pub fn built<T>(r: prometheus::Result<T>) -> T {
    // Only invalid names or label sets fail, and ours are constants.
    r.unwrap_or_else(|e| unreachable!("metric definition is invalid: {e}"))
}

/// Builds and registers a collector.
fn add<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, made: prometheus::Result<T>) -> T {
    register(r, built(made))
}

/// The query series: placements by rank and class (a rank family, kept in
/// [`RankFamilies`]), refusals by error code, query time by channel.
struct QuerySeries {
    routed: IntCounterVec,
    errors: Vec<IntCounter>,
    route_duration: Histogram,
    health_duration: Histogram,
}

impl QuerySeries {
    fn register(r: &Registry) -> Self {
        let routed = add(
            r,
            IntCounterVec::new(
                opts("dpcoord_routed_total", "Placements answered, by rank and traffic class."),
                &["dp_rank", "class"],
            ),
        );
        let errors = add(
            r,
            IntCounterVec::new(opts("dpcoord_route_errors_total", "Refused queries, by error code."), &["code"]),
        );
        let duration = add(
            r,
            HistogramVec::new(
                HistogramOpts::new("dpcoord_route_duration_seconds", "Query receive-to-reply time inside dpcoord.")
                    .buckets(ROUTE_BUCKETS.to_vec()),
                &["channel"],
            ),
        );
        QuerySeries {
            routed,
            errors: ErrorCode::ALL.iter().map(|c| errors.with_label_values(&[c.as_str()])).collect(),
            route_duration: duration.with_label_values(&["route"]),
            health_duration: duration.with_label_values(&["health"]),
        }
    }
}

impl RankFamilies {
    /// The engine series by rank, after `routed` (registered with the
    /// query series): the load routing sees, whether the rank is routable,
    /// its penalty, stats age and KV usage, its routable changes and stalls.
    fn register(r: &Registry, routed: IntCounterVec) -> Self {
        let requests = add(
            r,
            IntGaugeVec::new(
                opts("dpcoord_engine_requests", "The load routing sees: engine waiting/running and dpcoord pending."),
                &["dp_rank", "state"],
            ),
        );
        let finished = add(
            r,
            IntCounterVec::new(
                opts("dpcoord_engine_finished_total", "Requests the engine reported finished, summed across boots."),
                &["dp_rank"],
            ),
        );
        let failed = add(
            r,
            IntCounterVec::new(
                opts("dpcoord_engine_failed_total", "Requests the engine reported failed, summed across boots."),
                &["dp_rank"],
            ),
        );
        let up = add(r, IntGaugeVec::new(opts("dpcoord_engine_up", "1 when the rank is routable."), &["dp_rank"]));
        let penalty = add(
            r,
            prometheus::GaugeVec::new(
                opts("dpcoord_engine_penalty", "Current result-metric penalty of the rank."),
                &["dp_rank"],
            ),
        );
        let age = add(
            r,
            prometheus::GaugeVec::new(
                opts(
                    "dpcoord_engine_stats_age_seconds",
                    "Time since the rank's last valid stats update (NaN before the first).",
                ),
                &["dp_rank"],
            ),
        );
        let kv_usage = add(
            r,
            prometheus::GaugeVec::new(
                opts(
                    "dpcoord_engine_kv_usage",
                    "KV-cache usage (0..1) of the rank's last valid update (NaN when it carried none).",
                ),
                &["dp_rank"],
            ),
        );
        let changes = add(
            r,
            IntCounterVec::new(
                opts(
                    "dpcoord_engine_routable_changes_total",
                    "Times the rank became or stopped being routable, by change: joined (first valid update), \
                     lost (up or stale to down), readmitted (down to up). Every change counts, also when several \
                     land in one tick (the epoch then moves once).",
                ),
                &["dp_rank", "change"],
            ),
        );
        let stalls = add(
            r,
            IntCounterVec::new(
                opts(
                    "dpcoord_rank_stalls_total",
                    "Times the rank was found stalled, by cause: progress (work and no progress for \
                     engines.stall_after_ms), probe (engines.probe_failures failed probes in a row).",
                ),
                &["dp_rank", "cause"],
            ),
        );
        let stalled = add(
            r,
            IntGaugeVec::new(
                opts(
                    "dpcoord_engine_stalled",
                    "1 while the rank is stalled: reporting, but work and no progress, or failed probes in a row.",
                ),
                &["dp_rank"],
            ),
        );
        RankFamilies { routed, requests, finished, failed, up, penalty, age, kv_usage, changes, stalls, stalled }
    }
}

/// The coordinator's own series: stats updates by result, tick time, the
/// spread of user placements, the epoch, stats updates lost on the way.
struct CoreSeries {
    stats: Vec<IntCounter>,
    tick_duration: Histogram,
    dispatch_stddev: Gauge,
    epoch: IntGauge,
    stats_missed: IntCounter,
}

impl CoreSeries {
    fn register(r: &Registry) -> Self {
        let stats = add(
            r,
            IntCounterVec::new(
                opts("dpcoord_stats_messages_total", "Engine stats updates seen, by result."),
                &["result"],
            ),
        );
        let tick_duration = add(
            r,
            Histogram::with_opts(
                HistogramOpts::new("dpcoord_tick_duration_seconds", "Time of one tick.").buckets(TICK_BUCKETS.to_vec()),
            ),
        );
        let dispatch_stddev = add(
            r,
            Gauge::with_opts(opts(
                "dpcoord_user_dispatch_stddev",
                "Standard deviation of user placements per routable rank over the imbalance window.",
            )),
        );
        let epoch =
            add(r, IntGauge::with_opts(opts("dpcoord_epoch", "Current epoch: bumps when the routable set changes.")));
        let stats_missed = add(
            r,
            IntCounter::with_opts(opts(
                "dpcoord_stats_missed_total",
                "Stats updates lost before dpcoord read them (seq gaps within a boot), e.g. dropped at a high-water mark.",
            )),
        );
        CoreSeries {
            stats: StatsResult::ALL.iter().map(|s| stats.with_label_values(&[s.as_str()])).collect(),
            tick_duration,
            dispatch_stddev,
            epoch,
            stats_missed,
        }
    }
}

/// The operations series: connections refused by an allowlist, config
/// reloads by result, the DP size, scrapes of vLLM `/metrics` by result.
struct OperationsSeries {
    access_denied: [IntCounter; 3],
    reloads: Vec<IntCounter>,
    dp_size: IntGauge,
    scrapes: Scrapes,
}

impl OperationsSeries {
    fn register(r: &Registry) -> Self {
        let access_denied = add(
            r,
            IntCounterVec::new(
                opts("dpcoord_access_denied_total", "Connections refused by a socket's peer allowlist."),
                &["socket"],
            ),
        );
        let reloads = add(
            r,
            IntCounterVec::new(
                opts("dpcoord_config_reloads_total", "Configuration reloads (SIGHUP or the reload op), by result."),
                &["result"],
            ),
        );
        let dp_size =
            add(r, IntGauge::with_opts(opts("dpcoord_dp_size", "The number of DP ranks dpcoord routes over.")));
        let scrapes = add(
            r,
            IntCounterVec::new(
                opts("dpcoord_scrapes_total", "Scrapes of vLLM /metrics (engines.vllm_metrics_url), by result."),
                &["result"],
            ),
        );
        OperationsSeries {
            access_denied: ["route", "health", "stats"].map(|s| access_denied.with_label_values(&[s])),
            reloads: ReloadResult::ALL.iter().map(|r| reloads.with_label_values(&[r.as_str()])).collect(),
            dp_size,
            scrapes: Scrapes(ScrapeResult::ALL.iter().map(|s| scrapes.with_label_values(&[s.as_str()])).collect()),
        }
    }
}

impl Metrics {
    /// Registers every series, group by group in this order, and creates
    /// the series of `dp_size` ranks.
    pub fn new(dp_size: u32) -> Self {
        let r = Registry::new();
        let query = QuerySeries::register(&r);
        let families = RankFamilies::register(&r, query.routed);
        let core = CoreSeries::register(&r);
        let ops = OperationsSeries::register(&r);
        let mut m = Metrics {
            registry: r,
            ranks: Vec::new(),
            families,
            errors: query.errors,
            stats: core.stats,
            route_duration: query.route_duration,
            health_duration: query.health_duration,
            tick_duration: core.tick_duration,
            dispatch_stddev: core.dispatch_stddev,
            epoch: core.epoch,
            stats_missed: core.stats_missed,
            access_denied: ops.access_denied,
            reloads: ops.reloads,
            dp_size: ops.dp_size,
            scrapes: ops.scrapes,
        };
        m.resize(dp_size);
        m
    }

    /// Creates the series of new ranks and removes those of ranks gone.
    pub fn resize(&mut self, dp_size: u32) {
        let n = dp_size as usize;
        while self.ranks.len() > n {
            self.ranks.pop();
            self.families.remove(self.ranks.len());
        }
        while self.ranks.len() < n {
            self.ranks.push(self.families.handles(self.ranks.len()));
        }
        self.dp_size.set(i64::from(dp_size));
    }

    pub fn reload(&self, result: ReloadResult) {
        let i = ReloadResult::ALL.iter().position(|r| *r == result).unwrap_or(0);
        self.reloads[i].inc();
    }

    /// A connection to `socket` (a ZAP domain: route, health or stats) was refused.
    pub fn access_denied(&self, socket: &str) {
        let i = match socket {
            "route" => 0,
            "health" => 1,
            _ => 2,
        };
        self.access_denied[i].inc();
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

#[cfg(test)]
mod tests;
