//! The engine table: what each DP rank reported, and whether it is routable.
//!
//! It holds facts about engines only (counters, boot/seq, liveness,
//! penalty). User bookkeeping (`routed`, `pending`, cursors) lives in
//! `routing`, so code that can only see this table cannot touch it. The
//! rank count is runtime state ([`EngineTable::resize`]), and so are the
//! liveness and penalty settings ([`EngineTable::reload`]).

use std::time::{Duration, Instant};

use super::event::{Counts, LoadReport, TokenLoad};
use super::penalty::{self, PenaltyState, TickInputs};
use crate::config::{Penalty, Settings};

mod order;
pub use order::Reject;
use order::{seq_of, step, Step};

crate::names! {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Status {
        /// No valid update seen yet. Not routable.
        Unknown => "unknown",
        Up => "up",
        /// No update for `stale_after`: still routable, penalized.
        Stale => "stale",
        /// No update for `down_after`: never routed until readmitted.
        Down => "down",
        /// Reporting but not working: work and no progress for `stall_after`,
        /// or `probe_failures` failed probes in a row. Never routed until
        /// progress resumes (`readmit_updates` updates in a row with it) or a
        /// probe succeeds.
        Stalled => "stalled",
    }
}

crate::names! {
    /// Why a rank is `stalled`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum StallCause {
        Progress => "progress",
        Probe => "probe",
    }
}

impl Status {
    pub fn is_routable(self) -> bool {
        matches!(self, Status::Up | Status::Stale)
    }
}

/// One DP rank as dpcoord knows it.
#[derive(Debug, Clone)]
pub struct EngineState {
    pub status: Status,
    pub boot: u64,
    pub seq: u64,
    /// The counters of the current boot.
    pub counts: Counts,
    /// The engine's token load, when it sends one.
    pub tokens: Option<TokenLoad>,
    pub kv_usage: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub last_update: Option<Instant>,
    /// Consecutive valid updates while down (readmission).
    readmit_streak: u32,
    pub penalty: f64,
    penalty_state: PenaltyState,
    /// `finished` and `failed` of earlier boots, for totals across restarts.
    pub finished_before: u64,
    pub failed_before: u64,
    /// The source's longest silence between unchanged reports.
    heartbeat: Duration,
    /// How often the rank's routability flipped, by way.
    pub changes: RoutableChanges,
    /// The last `progress` reported in this boot, and when it last moved
    /// (or the rank had no work, or it restarted).
    pub progress: Option<u64>,
    moved_at: Option<Instant>,
    /// Why the rank is `stalled`, while it is.
    pub stall: Option<StallCause>,
    /// Failed probes in a row.
    probe_failures: u32,
    /// Times the rank was found stalled, by [`StallCause::ALL`] order.
    pub stalls: [u64; 2],
}

/// How often a rank became routable or stopped being routable. Each
/// change counts, even when several ranks flip in one tick (which moves
/// the epoch once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoutableChanges {
    /// `unknown` -> `up`: the rank's first valid update.
    pub joined: u64,
    /// `up` or `stale` -> `down`: silent for `down_after`.
    pub lost: u64,
    /// `down` -> `up`: readmitted after `readmit_updates` updates.
    pub readmitted: u64,
}

impl EngineState {
    fn new() -> Self {
        EngineState {
            status: Status::Unknown,
            boot: 0,
            seq: 0,
            counts: Counts::default(),
            tokens: None,
            kv_usage: None,
            ttft_ms: None,
            tpot_ms: None,
            last_update: None,
            readmit_streak: 0,
            penalty: 0.0,
            penalty_state: PenaltyState::default(),
            finished_before: 0,
            failed_before: 0,
            heartbeat: Duration::ZERO,
            changes: RoutableChanges::default(),
            progress: None,
            moved_at: None,
            stall: None,
            probe_failures: 0,
            stalls: [0; 2],
        }
    }

    /// Time since the last valid update; `None` while unknown.
    pub fn age(&self, now: Instant) -> Option<Duration> {
        self.last_update.map(|t| now.saturating_duration_since(t))
    }
}

/// An update that was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub rank: u32,
    /// The engine restarted (a new `boot`): its counters started over.
    pub restarted: bool,
    /// The engine's `received` counter after the update; `None` from a
    /// source of gauges only.
    pub received: Option<u64>,
    /// Updates of this boot that never arrived (a `seq` gap).
    pub missed: u64,
}

#[derive(Debug, Clone)]
struct Liveness {
    stale_after: Duration,
    down_after: Duration,
    readmit_updates: u32,
    stall_after: Duration,
    probe_failures: u32,
}

impl Liveness {
    fn of(s: &Settings) -> Self {
        let e = &s.engines;
        Liveness {
            stale_after: e.stale_after,
            down_after: e.down_after,
            readmit_updates: e.readmit_updates,
            stall_after: e.stall_after,
            probe_failures: e.probe_failures,
        }
    }

    /// Whether `e` has had work and no progress for `stall_after`.
    fn stalled(&self, e: &EngineState, now: Instant) -> bool {
        let work = e.counts.waiting > 0 || e.counts.running > 0;
        !self.stall_after.is_zero()
            && work
            && e.progress.is_some()
            && e.moved_at.is_some_and(|t| now.saturating_duration_since(t) >= self.stall_after)
    }

    /// `stale_after`, or two and a half heartbeats of the rank's source if
    /// that is longer: a source that re-sends an unchanged report only every
    /// second must not flap between up and stale.
    fn stale_after(&self, e: &EngineState) -> Duration {
        self.stale_after.max(e.heartbeat * 5 / 2)
    }

    /// `down_after`, moved out as far as `stale_after` was.
    fn down_after(&self, e: &EngineState) -> Duration {
        self.down_after + (self.stale_after(e) - self.stale_after)
    }
}

#[derive(Debug, Clone)]
pub struct EngineTable {
    engines: Vec<EngineState>,
    epoch: u64,
    liveness: Liveness,
    penalty: Penalty,
    /// Scratch space for the ttft median, reused every tick.
    ttfts: Vec<f64>,
}

impl EngineTable {
    pub fn new(settings: &Settings) -> Self {
        let mut t = EngineTable {
            engines: Vec::new(),
            epoch: 0,
            liveness: Liveness::of(settings),
            penalty: settings.penalty.clone(),
            ttfts: Vec::new(),
        };
        t.resize(settings.engines.dp_size);
        t
    }

    /// Grows (new ranks are `unknown`) or shrinks to `dp_size` ranks. The
    /// epoch moves exactly once when the count changes: the set of ranks a
    /// client may name changed, whether or not a routable one left.
    pub fn resize(&mut self, dp_size: u32) {
        let n = dp_size as usize;
        if n == self.engines.len() {
            return;
        }
        let epoch = self.epoch + u64::from(!self.engines.is_empty());
        self.engines.resize_with(n, EngineState::new);
        self.ttfts = Vec::with_capacity(n);
        self.epoch = epoch;
    }

    /// Takes new liveness and penalty settings; they apply from the next tick.
    pub fn reload(&mut self, settings: &Settings) {
        self.liveness = Liveness::of(settings);
        self.penalty = settings.penalty.clone();
    }

    /// The narrow handle the health channel gets: see [`HealthHandle`].
    pub fn health_handle(&mut self) -> HealthHandle<'_> {
        HealthHandle { table: self }
    }

    pub fn dp_size(&self) -> u32 {
        self.engines.len() as u32
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn get(&self, rank: u32) -> &EngineState {
        &self.engines[rank as usize]
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &EngineState> {
        self.engines.iter()
    }

    pub fn is_routable(&self, rank: u32) -> bool {
        self.engines.get(rank as usize).is_some_and(|e| e.status.is_routable())
    }

    pub fn any_routable(&self) -> bool {
        self.engines.iter().any(|e| e.status.is_routable())
    }

    /// Moves `rank` to `to`; true when its routability flipped (the caller
    /// bumps the epoch once per change of the routable set).
    fn set_status(&mut self, rank: usize, to: Status) -> bool {
        let e = &mut self.engines[rank];
        let from = e.status;
        if from == to {
            return false;
        }
        e.status = to;
        if matches!(to, Status::Down | Status::Stalled) {
            e.readmit_streak = 0;
        }
        if to != Status::Stalled {
            e.stall = None;
        }
        let flipped = from.is_routable() != to.is_routable();
        let epoch = self.epoch + u64::from(flipped);
        let readmitted = from == Status::Down && to == Status::Up;
        if flipped {
            let way = match from {
                Status::Unknown => &mut e.changes.joined,
                Status::Down | Status::Stalled => &mut e.changes.readmitted,
                Status::Up | Status::Stale => &mut e.changes.lost,
            };
            *way += 1;
        }
        tracing::info!(
            dp_rank = rank,
            from = from.as_str(),
            to = to.as_str(),
            readmitted,
            epoch,
            "rank status changed"
        );
        flipped
    }

    /// Applies one load report, or says why it was dropped (then nothing changed).
    pub fn apply(&mut self, u: &LoadReport, now: Instant) -> Result<Accepted, Reject> {
        let unknown = Reject::UnknownRank { rank: u.rank, dp_size: self.dp_size() };
        let rank = usize::try_from(u.rank).ok().filter(|&r| r < self.engines.len()).ok_or(unknown)?;
        let live = &self.liveness;
        let e = &mut self.engines[rank];
        let (boot, restarted, missed) = match step(e, u)? {
            Step::First { boot } => (boot, false, 0),
            Step::Same { missed } => (e.boot, false, missed),
            Step::Restart { boot } => (boot, true, 0),
        };
        if restarted {
            e.finished_before = e.finished_before.saturating_add(e.counts.finished);
            e.failed_before = e.failed_before.saturating_add(e.counts.failed);
            e.penalty_state.on_restart();
            tracing::info!(dp_rank = rank, old_boot = e.boot, new_boot = boot, "engine restarted: counters start over");
        }
        let close_gap = e.last_update.is_some_and(|t| now.saturating_duration_since(t) <= live.stale_after(e));
        // Progress moved, or there is nothing to progress on: the clock of
        // a stall starts over (a restart starts it over too).
        let idle = u.counts.waiting == 0 && u.counts.running == 0;
        let moved = restarted || idle || u.progress.is_some_and(|p| e.progress != Some(p));
        if moved || e.moved_at.is_none() {
            e.moved_at = Some(now);
        }
        e.progress = u.progress;
        e.readmit_streak = match e.status {
            // A stalled rank counts only updates that show progress.
            Status::Stalled if e.stall == Some(StallCause::Progress) && !moved => 0,
            _ if close_gap => e.readmit_streak + 1,
            _ => 1,
        };
        e.boot = boot;
        e.seq = seq_of(u);
        e.counts = u.counts;
        e.tokens = u.tokens;
        e.kv_usage = u.kv_usage;
        e.ttft_ms = u.ttft_ms;
        e.tpot_ms = u.tpot_ms;
        e.heartbeat = u.heartbeat;
        e.last_update = Some(now);
        let next = match e.status {
            Status::Down if e.readmit_streak < live.readmit_updates => Status::Down,
            Status::Stalled if e.stall == Some(StallCause::Probe) => Status::Stalled,
            Status::Stalled if e.readmit_streak < live.readmit_updates => Status::Stalled,
            _ => Status::Up,
        };
        if self.set_status(rank, next) {
            self.epoch += 1;
        }
        let received = u.cumulative.then_some(u.counts.received);
        Ok(Accepted { rank: rank as u32, restarted, received, missed })
    }

    /// A health prober's outcome for `rank`; a rank out of range (the
    /// table shrank since the probe was decoded) is ignored.
    /// `probe_failures` failures in a row make a routable rank `stalled`;
    /// a success clears that.
    fn record_health_report(&mut self, rank: u32, ok: bool, now: Instant) {
        let Some(e) = self.engines.get_mut(rank as usize) else { return };
        let to = if ok {
            e.probe_failures = 0;
            (e.stall == Some(StallCause::Probe)).then_some(Status::Up)
        } else {
            e.penalty_state.health.add(self.penalty.health_failure, now, self.penalty.health_half_life);
            e.probe_failures = e.probe_failures.saturating_add(1);
            let n = self.liveness.probe_failures;
            (n > 0 && e.probe_failures >= n && e.status.is_routable()).then_some(Status::Stalled)
        };
        if let Some(to) = to {
            if to == Status::Stalled {
                e.stall = Some(StallCause::Probe);
                e.stalls[1] += 1;
            }
            if self.set_status(rank as usize, to) {
                self.epoch += 1;
            }
        }
    }

    /// Ages liveness and recomputes penalties; called every tick.
    pub fn tick(&mut self, now: Instant) {
        let mut changed = false;
        for rank in 0..self.engines.len() {
            let e = &self.engines[rank];
            let next = match (e.status, e.age(now)) {
                (Status::Up | Status::Stale | Status::Stalled, Some(age)) if age >= self.liveness.down_after(e) => {
                    Status::Down
                }
                (Status::Up | Status::Stale, _) if self.liveness.stalled(e, now) => Status::Stalled,
                (Status::Up, Some(age)) if age >= self.liveness.stale_after(e) => Status::Stale,
                (s, _) => s,
            };
            if next == Status::Stalled && e.status != Status::Stalled {
                let e = &mut self.engines[rank];
                e.stall = Some(StallCause::Progress);
                e.stalls[0] += 1;
                tracing::warn!(dp_rank = rank, "rank stalled: work and no progress for engines.stall_after_ms");
            }
            changed |= self.set_status(rank, next);
        }
        self.epoch += u64::from(changed);
        self.ttfts.clear();
        self.ttfts.extend(self.engines.iter().filter(|e| e.status == Status::Up).filter_map(|e| e.ttft_ms));
        let median = penalty::median(&mut self.ttfts).filter(|m| *m > 0.0);
        for e in &mut self.engines {
            let inputs = TickInputs {
                finished: e.counts.finished,
                failed: e.counts.failed,
                stale: e.status == Status::Stale,
                ttft_ratio: median.zip(e.ttft_ms).map(|(m, t)| t / m),
            };
            e.penalty = e.penalty_state.update(&self.penalty, inputs, now);
        }
    }
}

/// What the health channel may do with the engine table: read it, and
/// record probe outcomes, which feed the rank's penalty (and through it the
/// load-aware policies' costs). It cannot apply reports, age liveness,
/// resize, or reach anything of the user side, which is not in this table.
pub struct HealthHandle<'a> {
    table: &'a mut EngineTable,
}

impl HealthHandle<'_> {
    /// The table, read-only.
    pub fn engines(&self) -> &EngineTable {
        self.table
    }

    /// A probe's outcome: a failure adds `penalty.health_failure` to the
    /// rank's health score, which halves every `health_half_life_ms`.
    pub fn record(&mut self, rank: u32, ok: bool, now: Instant) {
        self.table.record_health_report(rank, ok, now);
    }
}

#[cfg(test)]
mod tests;
