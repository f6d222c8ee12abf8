//! The coordinator: the single owner of all routing state.
//!
//! The transport hands it raw payloads with the time they arrived; it
//! decodes them, decides, keeps the books and writes the reply bytes. It
//! does no I/O, so it can be driven directly by tests and benchmarks.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::engines::{EngineTable, StatsReject, RUNNING, WAITING};
use crate::health::{self, HealthDispatcher};
use crate::observability::metrics::{Metrics, StatsResult};
use crate::observability::ratelimit::LogLimiter;
use crate::routing::user::UserDispatcher;
use crate::wire::{self, Channel, Op, Query, QueryLimits, RankView, StateView, WireError};

pub struct Coordinator {
    limits: QueryLimits,
    tick_every: Duration,
    next_tick: Instant,
    engines: EngineTable,
    user: UserDispatcher,
    health: HealthDispatcher,
    metrics: Metrics,
    /// Rate limit of the dropped-update warning, per `StatsResult`.
    drops: LogLimiter<4>,
    /// Reused buffer for the ranks of one route answer.
    placed: Vec<u32>,
    /// The engine table as of the last tick, for readers on other threads.
    published: Arc<Published>,
}

/// What the coordinator shares with other threads (the HTTP server): a
/// snapshot of the engine table, replaced on every tick. Routing state
/// itself is never shared.
#[derive(Debug)]
pub struct Published {
    state: Mutex<Arc<StateView>>,
}

impl Published {
    /// The engine table as of the last tick.
    pub fn state(&self) -> Arc<StateView> {
        match self.state.lock() {
            Ok(s) => Arc::clone(&s),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    fn set(&self, view: StateView) {
        let view = Arc::new(view);
        match self.state.lock() {
            Ok(mut s) => *s = view,
            Err(poisoned) => *poisoned.into_inner() = view,
        }
    }
}

impl Coordinator {
    pub fn new(cfg: &Config, metrics: Metrics, now: Instant) -> Self {
        let c = Coordinator {
            limits: QueryLimits {
                dp_size: cfg.settings.engines.dp_size,
                max_batch: cfg.settings.limits.max_batch,
                max_message_bytes: cfg.settings.limits.max_message_bytes,
            },
            tick_every: cfg.settings.routing.tick,
            next_tick: now + cfg.settings.routing.tick,
            engines: EngineTable::new(cfg),
            user: UserDispatcher::new(cfg, now),
            health: HealthDispatcher::default(),
            metrics,
            drops: LogLimiter::default(),
            placed: Vec::with_capacity(cfg.settings.limits.max_batch as usize),
            published: Arc::new(Published { state: Mutex::new(Arc::new(StateView::default())) }),
        };
        c.published.set(c.state_view(now));
        c
    }

    /// The handle other threads read snapshots from.
    pub fn published(&self) -> Arc<Published> {
        Arc::clone(&self.published)
    }

    pub fn next_tick(&self) -> Instant {
        self.next_tick
    }

    /// One engine stats update.
    pub fn on_stats(&mut self, bytes: &[u8], now: Instant) {
        let outcome = if bytes.len() > self.limits.max_message_bytes {
            Err(StatsReject::Malformed(format!("update is {} bytes, above max_message_bytes", bytes.len())))
        } else {
            wire::decode_stats(bytes).map_err(StatsReject::Malformed).and_then(|u| self.engines.apply(&u, now))
        };
        match outcome {
            Ok(accepted) => {
                self.user.on_report(&accepted, &self.engines);
                self.metrics.stats(StatsResult::Ok);
                self.metrics.stats_missed.inc_by(accepted.missed);
            }
            Err(reject) => {
                let (result, why) = match reject {
                    StatsReject::UnknownRank(r) => {
                        (StatsResult::UnknownRank, format!("rank {r} is outside 0..{}", self.limits.dp_size))
                    }
                    StatsReject::Stale(why) => (StatsResult::Stale, why),
                    StatsReject::Malformed(why) => (StatsResult::Malformed, why),
                };
                self.metrics.stats(result);
                let cause = StatsResult::ALL.iter().position(|r| *r == result).unwrap_or(0);
                if let Some(suppressed) = self.drops.allow(cause, now) {
                    tracing::warn!(result = result.as_str(), reason = %why, suppressed, "dropped a stats update");
                }
            }
        }
    }

    /// One query from `ch`; the reply is written into `out`.
    pub fn on_query(&mut self, ch: Channel, bytes: &[u8], now: Instant, out: &mut Vec<u8>) {
        match wire::decode_query(bytes, ch, &self.limits) {
            Ok(q) => {
                tracing::trace!(channel = ch.as_str(), query = ?q, "query");
                if let Err(e) = self.answer(&q, now, out) {
                    self.refuse(q.id, &e, out);
                }
            }
            Err(rej) => self.refuse(rej.id, &rej.error, out),
        }
        self.observe(ch, now);
    }

    /// A request whose frames are not `envelope + one payload`.
    pub fn on_bad_frames(&mut self, ch: Channel, body_frames: usize, now: Instant, out: &mut Vec<u8>) {
        let e = WireError::new(
            wire::ErrorCode::BadRequest,
            format!("a query is exactly one MessagePack frame after the envelope, got {body_frames} frames (or too many in all)"),
        );
        self.refuse(None, &e, out);
        self.observe(ch, now);
    }

    fn observe(&self, ch: Channel, since: Instant) {
        let hist = match ch {
            Channel::Route => &self.metrics.route_duration,
            Channel::Health => &self.metrics.health_duration,
        };
        hist.observe(since.elapsed().as_secs_f64());
    }

    fn refuse(&self, id: Option<wire::Id<'_>>, e: &WireError, out: &mut Vec<u8>) {
        tracing::debug!(code = e.code.as_str(), message = %e.message, "query refused");
        self.metrics.error(e.code);
        wire::encode_error(out, id, e);
    }

    fn answer(&mut self, q: &Query<'_>, now: Instant, out: &mut Vec<u8>) -> Result<(), WireError> {
        let epoch = self.engines.epoch();
        match &q.op {
            Op::Ping => wire::encode_ok(out, q.id, Some(epoch)),
            Op::State => wire::encode_state(out, q.id, &self.state_view(now)),
            Op::Route(req) => {
                self.user.route(req, &self.engines, now, &mut self.placed)?;
                for &r in &self.placed {
                    self.metrics.ranks[r as usize].routed_user.inc();
                }
                wire::encode_ranks(out, q.id, &self.placed, epoch);
            }
            // The health arms see the health dispatcher and the engine
            // table, never `self.user`: the isolation invariant.
            Op::HealthRoute(target) => {
                let rank = self.health.route(*target, &self.engines)?;
                self.metrics.ranks[rank as usize].routed_health.inc();
                wire::encode_health_rank(out, q.id, rank, epoch);
            }
            Op::HealthReport { rank, ok } => {
                health::report(&mut self.engines, *rank, *ok, now);
                wire::encode_ok(out, q.id, None);
            }
        }
        Ok(())
    }

    /// Liveness, epoch, pending expiry, penalties and gauges.
    pub fn tick(&mut self, now: Instant) {
        let started = Instant::now();
        self.engines.tick(now);
        self.user.tick(now, &self.engines);
        self.export(now);
        self.published.set(self.state_view(now));
        self.next_tick = now + self.tick_every;
        self.metrics.tick_duration.observe(started.elapsed().as_secs_f64());
    }

    fn export(&mut self, now: Instant) {
        for (rank, (e, m)) in self.engines.iter().zip(&self.metrics.ranks).enumerate() {
            // Engines may report anything up to u64::MAX: saturate, never wrap.
            let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            m.waiting.set(gauge(e.counts[WAITING]));
            m.running.set(gauge(e.counts[RUNNING]));
            m.pending.set(gauge(self.user.pending(rank as u32)));
            let finished = e.finished_before.saturating_add(e.counts[crate::engines::FINISHED]);
            let failed = e.failed_before.saturating_add(e.counts[crate::engines::FAILED]);
            m.finished.inc_by(finished.saturating_sub(m.finished.get()));
            m.failed.inc_by(failed.saturating_sub(m.failed.get()));
            m.up.set(i64::from(e.status.is_routable()));
            m.penalty.set(e.penalty);
            m.age.set(e.age(now).map_or(f64::NAN, |a| a.as_secs_f64()));
        }
        self.metrics.dispatch_stddev.set(self.user.dispatch_stddev(&self.engines));
        self.metrics.epoch.set(self.engines.epoch() as i64);
    }

    /// The engine table as the `state` op and `/state` show it.
    pub fn state_view(&self, now: Instant) -> StateView {
        let ranks = self
            .engines
            .iter()
            .enumerate()
            .map(|(rank, e)| {
                let rank = rank as u32;
                let known = e.last_update.is_some();
                RankView {
                    rank,
                    status: e.status.as_str(),
                    counts: e.counts,
                    pending: self.user.pending(rank),
                    routed: self.user.routed(rank),
                    penalty: e.penalty,
                    age_ms: e.age(now).map(|a| a.as_millis() as u64),
                    boot: known.then_some(e.boot),
                    load: self.user.load(rank, &self.engines),
                }
            })
            .collect();
        StateView { epoch: self.engines.epoch(), policy: self.user.policy().as_str(), ranks }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}
