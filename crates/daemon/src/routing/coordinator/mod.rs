//! The coordinator: the single owner of all routing state.
//!
//! The transport hands it source messages and queries with the time they
//! arrived; it decodes them, decides, keeps the books and writes the reply
//! bytes. It does no I/O, so tests and benchmarks drive it directly.
//!
//! Route and health queries are different types from the decoder on: a
//! route query is answered with the user dispatcher, a health probe by the
//! [`HealthDispatcher`] with a [`crate::engines::HealthHandle`] and nothing
//! else. The rank count and the routing settings are runtime state:
//! [`Coordinator::reload`] swaps them between two queries, and the admin
//! ops (`resize`, `reload`; see `admin.rs`) reach the same path.

use std::fmt::Display;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::explain::Explained;
use super::kv::KvStreams;
use super::placement::{self, Placement};
use super::prefix::PrefixRouting;
use super::published::Published;
use super::user::UserDispatcher;
use crate::config::{KvEndpoint, Settings};
use crate::engines::{EngineEvent, EngineTable, Reject, Unroutable};
use crate::health::{HealthDispatcher, Served};
use crate::observability::kv_metrics::{BatchResult, KvMetrics, ResetCause};
use crate::observability::memory_metrics::MemoryMetrics;
use crate::observability::metrics::{Metrics, StatsResult};
use crate::observability::prefix_metrics::PrefixMetrics;
use crate::observability::ratelimit::LogLimiter;
use crate::wire::{
    self, Channel, Finished, HealthOp, Id, Prompt, Query, QueryLimits, Rejected, RouteOp, RouteRequest, SourceError,
    SourceKind, SourceLimits, SourceRequest, Target, WireError,
};

pub struct Coordinator {
    tick_every: Duration,
    /// Where `reload` reads the configuration, and the socket settings in
    /// force (allowlists change on reload; the rest needs a restart).
    config: Option<admin::Reloadable>,
    /// Where the rank count in force came from (a `resize` or the configuration).
    dp: admin::DpOrigin,
    limits: QueryLimits,
    sources: SourceLimits,
    next_tick: Instant,
    engines: EngineTable,
    user: UserDispatcher,
    health: HealthDispatcher,
    metrics: Metrics,
    /// The engines' KV-event streams and the prefix index they feed.
    kv: KvStreams,
    /// Prompt lookups for `cache_aware` and the `prefix` op, and the
    /// approximate index.
    prefix: PrefixRouting,
    memory: MemoryMetrics,
    /// What the last route predicted was cached, and the predictions' metrics.
    explained: Explained,
    predictions: PrefixMetrics,
    /// Rate limit of the dropped-update warning, per `StatsResult`.
    drops: LogLimiter<{ StatsResult::ALL.len() }>,
    /// Reused buffers for the placements of one route and their ranks.
    placed: Vec<Placement>,
    ranks: Vec<u32>,
    /// The token ids of the query being answered (decoded once, reused).
    tokens: Vec<u32>,
    /// The engine table as of the last tick, for readers on other threads.
    published: Arc<Published>,
    /// This process's identity, shown by `ping` and `state`.
    instance: wire::Instance,
    /// The `id` of the `reload` op just taken, answered after the read.
    reload_asked: Option<Option<wire::OwnedId>>,
}

/// The query limits of `s`; `max_dp_size` is the ceiling of the start,
/// which no reload changes (the reply queues were sized for it).
fn limits(s: &Settings, max_dp_size: u32) -> QueryLimits {
    QueryLimits {
        dp_size: s.engines.dp_size,
        max_dp_size,
        max_batch: s.limits.max_batch,
        max_message_bytes: s.limits.max_message_bytes,
        max_prompt_tokens: s.limits.max_prompt_tokens,
    }
}

fn source_limits(s: &Settings) -> SourceLimits {
    SourceLimits { message: s.limits.max_message_bytes, kv_batch: s.kv.max_batch_bytes }
}

/// Counts booked user placements in `dpcoord_routed_total{class="user"}`.
fn count_routed(metrics: &Metrics, placed: &[Placement]) {
    for p in placed {
        metrics.ranks[p.rank as usize].routed_user.inc_by(p.count);
    }
}

/// The `result` label of a report the engine table refused.
fn reject_result(r: &Reject) -> StatsResult {
    match r {
        Reject::UnknownRank { .. } => StatsResult::UnknownRank,
        Reject::OldBoot { .. } | Reject::OldSeq { .. } => StatsResult::Stale,
        Reject::Backwards { .. } => StatsResult::Malformed,
    }
}

impl Coordinator {
    pub fn new(settings: &Settings, metrics: Metrics, now: Instant) -> Self {
        let c = Coordinator {
            tick_every: settings.routing.tick,
            config: None,
            dp: admin::DpOrigin::new(settings.engines.dp_size),
            limits: limits(settings, settings.engines.dp_ceiling()),
            sources: source_limits(settings),
            next_tick: now + settings.routing.tick,
            engines: EngineTable::new(settings),
            user: UserDispatcher::new(settings, now),
            health: HealthDispatcher::default(),
            kv: KvStreams::new(
                &settings.kv,
                settings.memory.events_index,
                settings.engines.dp_size,
                KvMetrics::new(&metrics.registry, settings.engines.dp_size),
            ),
            prefix: PrefixRouting::new(settings),
            memory: MemoryMetrics::new(&metrics.registry, &settings.memory),
            explained: Explained::default(),
            predictions: PrefixMetrics::new(&metrics.registry, settings.engines.dp_size),
            metrics,
            drops: LogLimiter::default(),
            placed: Vec::with_capacity(settings.limits.max_batch as usize),
            ranks: Vec::with_capacity(settings.limits.max_batch as usize),
            tokens: Vec::new(),
            published: Arc::new(Published::default()),
            instance: wire::Instance::random(),
            reload_asked: None,
        };
        c.published.set(c.state_view(now));
        c.published.set_gateway(settings.gateway.clone());
        c.published.set_dp_size(settings.engines.dp_size);
        c.published.set_max_prompt_tokens(settings.limits.max_prompt_tokens);
        c
    }

    /// The handle other threads read snapshots from.
    pub fn published(&self) -> Arc<Published> {
        Arc::clone(&self.published)
    }

    pub fn next_tick(&self) -> Instant {
        self.next_tick
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The KV-event publishers, in `kv_events.connect` order: a KV
    /// source's `stream` is its place here.
    pub fn with_kv_endpoints(mut self, endpoints: &[KvEndpoint]) -> Self {
        self.kv.set_endpoints(endpoints);
        self
    }

    /// What to send the sources (replays to ask the KV publishers for):
    /// the transport sends each to the socket of its kind.
    pub fn take_source_requests(&mut self, out: &mut Vec<SourceRequest>) {
        self.kv.take_asks(out);
    }

    /// The link to a source of `kind` was connected again: a new session,
    /// whose peer may be a new process (a KV publisher's history is then
    /// checked again, `routing::kv`).
    pub fn on_relinked(&mut self, kind: SourceKind) {
        if let SourceKind::KvEvents { stream, replay: false } = kind {
            self.kv.new_session(stream);
        }
    }

    /// New settings, in force from the next query on: the rank count (every
    /// per-rank structure grows or shrinks; see [`Coordinator::resize`]),
    /// liveness, penalties, policy, weights, sessions, TTLs and limits.
    /// Counts, pending placements, sessions and penalties carry over.
    pub fn reload(&mut self, settings: Settings, now: Instant) {
        self.resize(settings.engines.dp_size);
        self.engines.reload(&settings);
        self.user.reload(&settings, now);
        self.limits = limits(&settings, self.limits.max_dp_size);
        self.sources = source_limits(&settings);
        self.kv.reload(&settings.kv, settings.memory.events_index);
        self.memory.budget(&settings.memory);
        self.prefix.reload(&settings);
        self.placed = Vec::with_capacity(settings.limits.max_batch as usize);
        self.ranks = Vec::with_capacity(settings.limits.max_batch as usize);
        self.tick_every = settings.routing.tick;
        self.next_tick = self.next_tick.min(now + self.tick_every);
        self.published.set_max_prompt_tokens(settings.limits.max_prompt_tokens);
        self.published.set_gateway(settings.gateway);
        self.warn_unmapped();
    }

    /// Says which ranks the gateway endpoint picker cannot send to (no
    /// endpoint in `gateway.endpoints` after a resize or a reload).
    fn warn_unmapped(&self) {
        let gateway = self.published.gateway();
        let dp = self.engines.dp_size();
        if gateway.endpoints.is_empty() {
            return;
        }
        let unmapped = (0..dp).filter(|&r| gateway.endpoint(r).is_none()).count();
        if unmapped > 0 {
            tracing::warn!(
                dp_size = dp,
                endpoints = gateway.endpoints.len(),
                "{unmapped} ranks have no gateway.endpoints entry: the gateway picker does not send to them"
            );
        }
    }

    /// Grows or shrinks every per-rank structure to `dp_size` ranks, at
    /// once: new ranks are `unknown` until they publish; removed ranks take
    /// no placement from here on (a pin to one is `invalid_rank`), their
    /// sessions move, their metric series go, their reports are refused as
    /// `unknown_rank`. The epoch moves exactly once when the count changes.
    /// A new per-rank part is resized here and listed in `per_rank_parts`.
    pub fn resize(&mut self, dp_size: u32) {
        if dp_size == self.engines.dp_size() {
            return;
        }
        tracing::info!(from = self.engines.dp_size(), to = dp_size, "dp_size changed");
        self.engines.resize(dp_size);
        self.published.set_dp_size(dp_size);
        self.warn_unmapped();
        self.user.resize(dp_size);
        self.health.resize(dp_size);
        self.metrics.resize(dp_size);
        self.kv.resize(dp_size);
        self.prefix.resize(dp_size);
        self.predictions.resize(dp_size);
        self.limits.dp_size = dp_size;
    }

    /// Every per-rank part's rank count, by name (each must be the table's).
    #[cfg(test)]
    fn per_rank_parts(&self) -> Vec<(&'static str, usize)> {
        let [ledgers, costs, window] = self.user.ranks();
        let [kv, index, kv_series] = self.kv.ranks();
        let [approx, recent] = self.prefix.ranks();
        vec![
            ("engines", self.engines.dp_size() as usize),
            ("ledgers", ledgers),
            ("costs", costs),
            ("window", window),
            ("series", self.metrics.ranks.len()),
            ("kv", kv),
            ("index", index),
            ("kv series", kv_series),
            ("approx", approx),
            ("recent", recent),
            ("prediction series", self.predictions.ranks()),
            ("query limits", self.limits.dp_size as usize),
        ]
    }

    /// One message from an engine source: every frame, or `None` when it
    /// had more frames than the transport keeps; applied whole.
    pub fn on_source<F: Deref<Target = [u8]>>(&mut self, kind: SourceKind, frames: Option<&[F]>, now: Instant) {
        self.receive(kind, frames, now);
        self.kv.finish();
    }

    /// As [`Coordinator::on_source`], but what a KV batch changes stays
    /// queued for [`Coordinator::apply_kv`] (the transport's way: a stats
    /// update must not wait for a batch to be applied whole).
    pub fn receive<F: Deref<Target = [u8]>>(&mut self, kind: SourceKind, frames: Option<&[F]>, now: Instant) {
        let decoded = wire::decode_source(kind, frames, &self.sources);
        self.on_decoded(kind, decoded, now);
    }

    /// The limits a source message is decoded with (`wire::decode_source`),
    /// for a decoder on another thread.
    pub fn source_limits(&self) -> SourceLimits {
        self.sources
    }

    /// One source message decoded elsewhere. What a KV batch changes in the
    /// prefix index is queued: [`Coordinator::apply_kv`] applies it.
    pub fn on_decoded(&mut self, kind: SourceKind, decoded: Result<EngineEvent, wire::SourceError>, now: Instant) {
        match (decoded, kind) {
            (Ok(event), _) => self.accept(event, now),
            (Err(e), SourceKind::KvEvents { .. }) => self.kv.drop_batch(BatchResult::Malformed, &e.to_string(), now),
            (Err(e @ SourceError::WrongRank { .. }), _) => self.dropped(StatsResult::WrongRank, &e, now),
            (Err(e), _) => self.dropped(StatsResult::Malformed, &e, now),
        }
    }

    /// Whether KV changes are waiting for [`Coordinator::apply_kv`].
    pub fn kv_pending(&self) -> bool {
        self.kv.pending()
    }

    /// Applies queued KV changes, in order, touching at most `blocks`
    /// blocks; returns how many it touched.
    pub fn apply_kv(&mut self, blocks: usize) -> usize {
        self.kv.work(blocks)
    }

    /// One decoded engine event, applied whole.
    pub fn on_event(&mut self, event: EngineEvent, now: Instant) {
        self.accept(event, now);
        self.kv.finish();
    }

    fn accept(&mut self, event: EngineEvent, now: Instant) {
        match event {
            EngineEvent::Load(report) => match self.engines.apply(&report, now) {
                Ok(accepted) => {
                    // A batch still queued for the rank is from before the restart too.
                    if accepted.restarted && self.kv.holds_or_queued(accepted.rank) {
                        self.kv.reset(Some(accepted.rank), ResetCause::Restart);
                    }
                    self.user.on_report(&accepted, &self.engines, now);
                    self.metrics.stats(StatsResult::Ok);
                    // A seq can jump by up to 2^64: the counter stops at its top, never wraps.
                    let missed = &self.metrics.stats_missed;
                    missed.inc_by(accepted.missed.min(u64::MAX - missed.get()));
                }
                Err(reject) => self.dropped(reject_result(&reject), &reject, now),
            },
            EngineEvent::Kv(msg) => self.kv.accept(msg, now),
        }
    }

    /// Counts a dropped source message; the reason is formatted only when logged.
    fn dropped(&mut self, result: StatsResult, why: &dyn Display, now: Instant) {
        self.metrics.stats(result);
        let cause = StatsResult::ALL.iter().position(|r| *r == result).unwrap_or(0);
        if let Some(suppressed) = self.drops.allow(cause, now) {
            tracing::warn!(result = result.as_str(), reason = %why, suppressed, "dropped a stats update");
        }
    }

    /// One query from `ch`; the reply is written into `out`, except for a
    /// `reload` op, answered once the configuration has been read.
    pub fn on_query(&mut self, ch: Channel, bytes: &[u8], now: Instant, out: &mut Vec<u8>) -> Answered {
        let mut tokens = std::mem::take(&mut self.tokens);
        match ch {
            Channel::Route => {
                let decoded = wire::decode_route_query(bytes, &self.limits, &mut tokens);
                self.answer(ch, decoded, Self::answer_route, now, out);
            }
            Channel::Health => {
                let decoded = wire::decode_health_query(bytes, &self.limits, &mut tokens);
                self.answer(ch, decoded, Self::answer_health, now, out);
            }
        }
        self.tokens = tokens;
        self.observe(ch, now);
        match self.reload_asked.take() {
            Some(id) => Answered::AfterReload(id),
            None => Answered::Now,
        }
    }

    /// Answers a decoded query of `ch` with `answer`, or refuses it.
    fn answer<'a, O: std::fmt::Debug>(
        &mut self,
        ch: Channel,
        decoded: Result<Query<'a, O>, Rejected<'a>>,
        answer: impl FnOnce(&mut Self, Option<Id<'a>>, O, Instant, &mut Vec<u8>) -> Result<(), WireError>,
        now: Instant,
        out: &mut Vec<u8>,
    ) {
        match decoded {
            Ok(q) => {
                tracing::trace!(channel = ch.as_str(), query = ?q, "query");
                if let Err(e) = answer(self, q.id, q.op, now, out) {
                    self.refuse(q.id, &e, out);
                }
            }
            Err(rej) => self.refuse(rej.id, &rej.error, out),
        }
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

    fn refuse(&self, id: Option<Id<'_>>, e: &WireError, out: &mut Vec<u8>) {
        tracing::debug!(code = e.code.as_str(), message = %e.message, "query refused");
        self.metrics.error(e.code);
        wire::encode_error(out, id, Some(self.engines.epoch()), e);
    }

    /// Places one decoded route request: its placements, booked, land in
    /// `out`, in order. On error nothing changed. A placement weighed
    /// against the prompt's cached prefix is explained ([`Explained`]).
    pub fn place(&mut self, req: &RouteRequest<'_>, now: Instant, out: &mut Vec<Placement>) -> Result<(), Unroutable> {
        self.explained.clear();
        let Some(prompt) = req.prompt else {
            self.user.route(req, &self.engines, None, now, out)?;
            count_routed(&self.metrics, out);
            return Ok(());
        };
        let length = PrefixRouting::prompt_tokens(&prompt, &self.kv);
        let req = RouteRequest { prompt_tokens: req.prompt_tokens.or(Some(length)), ..req.clone() };
        let Some(term) = self.user.prefix_term() else {
            self.user.route(&req, &self.engines, None, now, out)?;
            count_routed(&self.metrics, out);
            return Ok(());
        };
        let mode = self.prefix.mode();
        let view = self.prefix.lookup(&prompt, req.prompt_tokens.unwrap_or(length), &self.kv, term.siblings);
        self.user.route(&req, &self.engines, Some(&view), now, out)?;
        count_routed(&self.metrics, out);
        let source = |r| PrefixRouting::source(mode, &self.kv, r);
        self.explained.record(&view, self.user.guarded(), out, &self.engines, source, &self.predictions);
        // What a policy pick will leave in the rank's cache (approximate mode).
        if req.target == Target::Policy && req.session.is_none() {
            let mut last = None;
            for p in out.iter() {
                if last != Some(p.rank) {
                    self.memory.approx_evicted(self.prefix.learn(p.rank, &self.kv, now));
                    last = Some(p.rank);
                }
            }
        }
        Ok(())
    }

    fn answer_route(
        &mut self,
        id: Option<Id<'_>>,
        op: RouteOp<'_>,
        now: Instant,
        out: &mut Vec<u8>,
    ) -> Result<(), WireError> {
        let epoch = self.engines.epoch();
        match op {
            RouteOp::Ping => wire::encode_ping(out, id, epoch, self.instance, PrefixRouting::block_size(&self.kv)),
            RouteOp::State => wire::encode_state(out, id, &self.state_view(now)),
            RouteOp::Route(req) => {
                let mut placed = std::mem::take(&mut self.placed);
                let result = self.place(&req, now, &mut placed);
                if result.is_ok() {
                    placement::ranks_of(&placed, &mut self.ranks);
                    let explain = if req.explain { self.explained.reply() } else { None };
                    let fallbacks = (req.fallbacks > 0).then(|| self.user.fallbacks());
                    wire::encode_ranks(out, id, &self.ranks, epoch, explain, fallbacks);
                }
                self.placed = placed;
                result?;
            }
            RouteOp::Delivered(d) => {
                self.predictions.delivered(&d);
                wire::encode_ok(out, id, None);
            }
            RouteOp::Finished(f) => {
                match f {
                    Finished::Served { rank, n, placed } => {
                        self.user.finished(rank, n, placed.unwrap_or(rank), &self.engines, now)
                    }
                    Finished::Withdrawn { placed, n } => self.user.withdrawn(placed, n, &self.engines),
                }
                wire::encode_ok(out, id, None);
            }
        }
        Ok(())
    }

    /// The health socket's answers: ping and state read; a probe goes to
    /// the health dispatcher with the engines' health handle, nothing more.
    fn answer_health(
        &mut self,
        id: Option<Id<'_>>,
        op: HealthOp<'_>,
        now: Instant,
        out: &mut Vec<u8>,
    ) -> Result<(), WireError> {
        let epoch = self.engines.epoch();
        match op {
            HealthOp::Ping => wire::encode_ping(out, id, epoch, self.instance, PrefixRouting::block_size(&self.kv)),
            HealthOp::State => wire::encode_state(out, id, &self.state_view(now)),
            HealthOp::Probe(probe) => match self.health.serve(probe, self.engines.health_handle(), now)? {
                Served::Routed(rank) => {
                    self.metrics.ranks[rank as usize].routed_health.inc();
                    wire::encode_health_rank(out, id, rank, epoch);
                }
                Served::Recorded => wire::encode_ok(out, id, None),
            },
            HealthOp::Admin(wire::Admin::Reload) if self.reloads() => {
                self.reload_asked = Some(id.map(Id::to_owned_id));
            }
            HealthOp::Admin(op) => {
                self.admin(op, now)?;
                self.admin_reply(id, out);
            }
            HealthOp::Prefix(p) => self.answer_prefix(id, &p, out),
        }
        Ok(())
    }

    /// The `prefix` op: how many whole blocks the prompt has, and how many
    /// of them, from the first, each rank holds (as `cache_aware` sees them).
    fn answer_prefix(&mut self, id: Option<Id<'_>>, prompt: &Prompt<'_>, out: &mut Vec<u8>) {
        let length = PrefixRouting::prompt_tokens(prompt, &self.kv);
        let view = self.prefix.lookup(prompt, length, &self.kv, false);
        let blocks = (length / view.block_size) as usize;
        wire::encode_prefix(out, id, blocks, view.matched);
    }

    /// Liveness, epoch, pending expiry, penalties and gauges.
    pub fn tick(&mut self, now: Instant) {
        let started = Instant::now();
        self.engines.tick(now);
        self.kv.tick(now, &self.engines);
        self.prefix.tick(now);
        self.user.tick(now, &self.engines);
        super::export::export(&self.engines, &self.user, &self.metrics, now);
        self.published.set(self.state_view(now));
        self.next_tick = now + self.tick_every;
        self.metrics.tick_duration.observe(started.elapsed().as_secs_f64());
    }

    /// The engine table as the `state` op and `/state` show it.
    pub fn state_view(&self, now: Instant) -> wire::StateView {
        super::export::state_view(&self.engines, &self.user, &self.kv, self.instance, now)
    }
}

mod admin;
pub use admin::Answered;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod cache_tests;
