//! The engine table: what each DP rank reported, and whether it is routable.
//!
//! It holds facts about engines only (the 5-tuple, boot/seq, liveness,
//! penalty). User bookkeeping (`routed`, `pending`, cursors) lives in
//! `user.rs`, so code that can only see this table cannot touch it.

use std::time::{Duration, Instant};

use crate::config::{Config, Penalty};
use crate::engines::penalty::{self, PenaltyState, TickInputs};
use crate::wire::StatsUpdate;

/// Index of a counter in the 5-tuple `[waiting, running, received, finished, failed]`.
pub const WAITING: usize = 0;
pub const RUNNING: usize = 1;
pub const RECEIVED: usize = 2;
pub const FINISHED: usize = 3;
pub const FAILED: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// No valid update seen yet. Not routable.
    Unknown,
    Up,
    /// No update for `stale_after`: still routable, penalized.
    Stale,
    /// No update for `down_after`: never routed until readmitted.
    Down,
}

impl Status {
    pub fn is_routable(self) -> bool {
        matches!(self, Status::Up | Status::Stale)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Unknown => "unknown",
            Status::Up => "up",
            Status::Stale => "stale",
            Status::Down => "down",
        }
    }
}

/// One DP rank as dpcoord knows it.
#[derive(Debug, Clone)]
pub struct EngineState {
    pub status: Status,
    pub boot: u64,
    pub seq: u64,
    /// `[waiting, running, received, finished, failed]` of the current boot.
    pub counts: [u64; 5],
    /// `[waiting_tokens, running_tokens]`, when the engine sends them.
    pub tokens: Option<[u64; 2]>,
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
}

impl EngineState {
    fn new() -> Self {
        EngineState {
            status: Status::Unknown,
            boot: 0,
            seq: 0,
            counts: [0; 5],
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
        }
    }

    /// Time since the last valid update; `None` while unknown.
    pub fn age(&self, now: Instant) -> Option<Duration> {
        self.last_update.map(|t| now.saturating_duration_since(t))
    }
}

/// Why an update was dropped (the `result` label of the stats counter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatsReject {
    UnknownRank(i128),
    Stale(String),
    Malformed(String),
}

/// An update that was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub rank: u32,
    /// The engine restarted (a new `boot`): its counters started over.
    pub restarted: bool,
    /// The engine's `received` counter after the update.
    pub received: u64,
    /// Updates of this boot that never arrived (a `seq` gap).
    pub missed: u64,
}

#[derive(Debug, Clone)]
struct Liveness {
    stale_after: Duration,
    down_after: Duration,
    readmit_updates: u32,
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

/// The boot/seq rules. A lower `boot` is a stale incarnation, except for a
/// rank that is `down`: its last incarnation is gone, so whatever publishes
/// now is the live engine (one whose clock stepped back across a restart).
fn check_order(e: &EngineState, u: &StatsUpdate) -> Result<(), StatsReject> {
    if e.status == Status::Unknown || u.boot > e.boot || (u.boot < e.boot && e.status == Status::Down) {
        return Ok(());
    }
    if u.boot < e.boot {
        return Err(StatsReject::Stale(format!("boot {} is older than the current boot {}", u.boot, e.boot)));
    }
    if u.seq <= e.seq {
        return Err(StatsReject::Stale(format!("seq {} is not above the last accepted seq {}", u.seq, e.seq)));
    }
    const NAMES: [&str; 5] = ["waiting", "running", "received", "finished", "failed"];
    for i in [RECEIVED, FINISHED, FAILED] {
        if u.counts[i] < e.counts[i] {
            return Err(StatsReject::Malformed(format!(
                "counter `{}` went backwards within boot {} ({} -> {})",
                NAMES[i], u.boot, e.counts[i], u.counts[i]
            )));
        }
    }
    Ok(())
}

impl EngineTable {
    pub fn new(cfg: &Config) -> Self {
        EngineTable {
            engines: vec![EngineState::new(); cfg.settings.engines.dp_size as usize],
            epoch: 0,
            liveness: Liveness {
                stale_after: cfg.settings.engines.stale_after,
                down_after: cfg.settings.engines.down_after,
                readmit_updates: cfg.settings.engines.readmit_updates,
            },
            penalty: cfg.settings.penalty.clone(),
            ttfts: Vec::with_capacity(cfg.settings.engines.dp_size as usize),
        }
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
        if to == Status::Down {
            e.readmit_streak = 0;
        }
        let flipped = from.is_routable() != to.is_routable();
        let epoch = self.epoch + u64::from(flipped);
        let readmitted = from == Status::Down && to == Status::Up;
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

    /// Applies one decoded update, or says why it was dropped (then nothing changed).
    pub fn apply(&mut self, u: &StatsUpdate, now: Instant) -> Result<Accepted, StatsReject> {
        let rank =
            usize::try_from(u.rank).ok().filter(|&r| r < self.engines.len()).ok_or(StatsReject::UnknownRank(u.rank))?;
        let live = &self.liveness;
        let e = &mut self.engines[rank];
        check_order(e, u)?;
        let restarted = e.status != Status::Unknown && u.boot != e.boot;
        let same_boot = e.status != Status::Unknown && u.boot == e.boot;
        let missed = if same_boot { u.seq - e.seq - 1 } else { 0 };
        if restarted {
            e.finished_before = e.finished_before.saturating_add(e.counts[FINISHED]);
            e.failed_before = e.failed_before.saturating_add(e.counts[FAILED]);
            e.penalty_state.on_restart();
            tracing::info!(
                dp_rank = rank,
                old_boot = e.boot,
                new_boot = u.boot,
                "engine restarted: counters start over"
            );
        }
        let close_gap = e.last_update.is_some_and(|t| now.saturating_duration_since(t) <= live.stale_after);
        e.readmit_streak = if close_gap { e.readmit_streak + 1 } else { 1 };
        e.boot = u.boot;
        e.seq = u.seq;
        e.counts = u.counts;
        e.tokens = u.tokens;
        e.kv_usage = u.kv_usage;
        e.ttft_ms = u.ttft_ms;
        e.tpot_ms = u.tpot_ms;
        e.last_update = Some(now);
        let next = match e.status {
            Status::Down if e.readmit_streak < live.readmit_updates => Status::Down,
            _ => Status::Up,
        };
        if self.set_status(rank, next) {
            self.epoch += 1;
        }
        Ok(Accepted { rank: rank as u32, restarted, received: u.counts[RECEIVED], missed })
    }

    /// A health prober's outcome for `rank` (already checked to be in range).
    pub fn record_health_report(&mut self, rank: u32, ok: bool, now: Instant) {
        if !ok {
            let weight = self.penalty.health_failure;
            self.engines[rank as usize].penalty_state.health.add(weight, now, self.penalty.health_half_life);
        }
    }

    /// Ages liveness and recomputes penalties; called every tick.
    pub fn tick(&mut self, now: Instant) {
        let mut changed = false;
        for rank in 0..self.engines.len() {
            let e = &self.engines[rank];
            let next = match (e.status, e.age(now)) {
                (Status::Up | Status::Stale, Some(age)) if age >= self.liveness.down_after => Status::Down,
                (Status::Up, Some(age)) if age >= self.liveness.stale_after => Status::Stale,
                (s, _) => s,
            };
            changed |= self.set_status(rank, next);
        }
        self.epoch += u64::from(changed);
        self.ttfts.clear();
        self.ttfts.extend(self.engines.iter().filter(|e| e.status == Status::Up).filter_map(|e| e.ttft_ms));
        let median = penalty::median(&mut self.ttfts).filter(|m| *m > 0.0);
        for e in &mut self.engines {
            let inputs = TickInputs {
                finished: e.counts[FINISHED],
                failed: e.counts[FAILED],
                stale: e.status == Status::Stale,
                ttft_ratio: median.zip(e.ttft_ms).map(|(m, t)| t / m),
            };
            e.penalty = e.penalty_state.update(&self.penalty, inputs, now);
        }
    }
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
