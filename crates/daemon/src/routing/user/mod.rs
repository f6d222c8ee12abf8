//! The user dispatcher: the only owner of user routing state.
//!
//! It holds the user cursor (round-robin position, and the rotating start
//! that breaks load ties), the power_of_two RNG, each rank's placement
//! ledger (`routed`, `pending`), the session table, the cached per-rank
//! costs, and the sliding window behind `dpcoord_user_dispatch_stddev`.
//! It is private to `routing`: the health channel cannot name it.

use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::ledger::Ledger;
use super::placement::Placement;
use super::policy::{Candidates, Metric, Policy, PolicyKind, PrefixTerm, RankTerms, Scorer};
use super::prefix::PrefixView;
use super::session::SessionTable;
use super::window::DispatchWindow;
use crate::config::{CacheAware, Settings};
use crate::engines::routable::check_fixed;
use crate::engines::{Accepted, EngineTable, RankSet, Target, Unroutable};
use crate::wire::RouteRequest;

#[derive(Debug)]
pub struct UserDispatcher {
    policy: &'static Policy,
    /// The policy's scorer with the configured weights.
    scorer: Scorer,
    cursor: u32,
    seed: u64,
    rng: SmallRng,
    ledgers: Vec<Ledger>,
    /// The scorer's cost of every rank, kept current: infinity when not routable.
    costs: Vec<f64>,
    /// Routable ranks, ascending, rebuilt when the engine table's epoch moves.
    routable: Vec<u32>,
    synced_epoch: Option<u64>,
    sessions: SessionTable,
    session_ratio: f64,
    pending_ttl: Duration,
    pending_transit: Duration,
    window: DispatchWindow,
    cache: CacheAware,
    /// Per-request costs of a prefix-aware pick.
    request_costs: Vec<f64>,
    /// Whether the balance guard held for a pick of the last route.
    guarded: bool,
    /// Whether `request_costs` holds the last pick's per-request costs.
    per_request: bool,
    /// The last route's fallbacks: its next-best ranks, cheapest first.
    fallbacks: Vec<u32>,
    /// The mean prompt length of recent placements (about the last
    /// [`PROMPT_WINDOW`]), 0 before the first: what a queued request is
    /// worth in tokens where the engine reports no token load.
    prompt_mean: f64,
    /// The current route's `among`: while it is set, ranks outside it cost
    /// infinity and are left out of `routable`.
    among: Option<RankSet>,
}

/// How many placements the mean prompt length averages over.
pub const PROMPT_WINDOW: f64 = 64.0;

impl UserDispatcher {
    pub fn new(s: &Settings, now: Instant) -> Self {
        let r = &s.routing;
        let mut d = UserDispatcher {
            policy: r.policy.policy(),
            scorer: r.policy.policy().scorer(r.weights),
            cursor: 0,
            seed: r.seed,
            rng: SmallRng::seed_from_u64(r.seed),
            ledgers: Vec::new(),
            costs: Vec::new(),
            routable: Vec::new(),
            synced_epoch: None,
            sessions: SessionTable::new(&r.sessions),
            session_ratio: r.sessions.max_load_ratio,
            pending_ttl: r.pending_ttl,
            pending_transit: r.pending_transit,
            window: DispatchWindow::new(0, r.imbalance_window, now),
            cache: r.cache,
            request_costs: Vec::new(),
            guarded: false,
            per_request: false,
            fallbacks: Vec::new(),
            prompt_mean: 0.0,
            among: None,
        };
        d.resize(s.engines.dp_size);
        d
    }

    /// Grows or shrinks every per-rank structure to `dp_size` ranks (the
    /// engine table is resized first). A session bound to a rank that no
    /// longer exists is placed again on its next request.
    pub fn resize(&mut self, dp_size: u32) {
        let n = dp_size as usize;
        self.ledgers.resize_with(n, Ledger::default);
        self.costs.resize(n, f64::INFINITY);
        self.window.resize(n);
        self.cursor = self.cursor.checked_rem(dp_size).unwrap_or(0);
        self.synced_epoch = None;
    }

    /// The ranks of each per-rank part: ledgers, costs, the dispatch window.
    #[cfg(test)]
    pub fn ranks(&self) -> [usize; 3] {
        [self.ledgers.len(), self.costs.len(), self.window.ranks()]
    }

    /// Takes new routing settings: policy, weights, sessions, pending TTL,
    /// imbalance window and seed. Ledgers, sessions and the cursor carry over;
    /// costs are recomputed on the next query.
    pub fn reload(&mut self, s: &Settings, now: Instant) {
        let r = &s.routing;
        self.policy = r.policy.policy();
        self.scorer = self.policy.scorer(r.weights);
        self.sessions.reconfigure(&r.sessions);
        self.session_ratio = r.sessions.max_load_ratio;
        self.pending_ttl = r.pending_ttl;
        self.pending_transit = r.pending_transit;
        self.cache = r.cache;
        if self.window.length() != r.imbalance_window {
            self.window = DispatchWindow::new(self.ledgers.len(), r.imbalance_window, now);
        }
        if self.seed != r.seed {
            self.seed = r.seed;
            self.rng = SmallRng::seed_from_u64(r.seed);
        }
        self.synced_epoch = None;
    }

    pub fn policy(&self) -> PolicyKind {
        self.policy.kind
    }

    /// Whether the balance guard set the prefix aside for a pick of the
    /// last route (its policy picks weighed load alone).
    pub fn guarded(&self) -> bool {
        self.guarded
    }

    /// The last route's fallbacks (`fallbacks` of the request): routable
    /// ranks it did not place on, cheapest first by the policy's cost for
    /// that request; none for a pin or a room.
    pub fn fallbacks(&self) -> &[u32] {
        &self.fallbacks
    }

    /// The policy's per-request prefix term, if it weighs the prompt.
    pub fn prefix_term(&self) -> Option<PrefixTerm> {
        self.policy.prefix
    }

    pub fn routed(&self, rank: u32) -> u64 {
        self.ledgers[rank as usize].routed
    }

    pub fn pending(&self, rank: u32) -> u64 {
        self.ledgers[rank as usize].pending
    }

    /// The scorer's load estimate of `rank`.
    pub fn load(&self, rank: u32, engines: &EngineTable) -> f64 {
        self.scorer.load(engines.get(rank), &self.ledgers[rank as usize], self.prompt_mean)
    }

    #[cfg(test)]
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    fn refresh(&mut self, rank: u32, engines: &EngineTable) {
        let r = rank as usize;
        self.costs[r] = match self.among {
            Some(set) if !set.contains(rank) => f64::INFINITY,
            _ => self.scorer.cost(engines.get(rank), &self.ledgers[r], self.prompt_mean),
        };
    }

    /// Recomputes every cost and the routable list.
    fn refresh_all(&mut self, engines: &EngineTable) {
        self.routable.clear();
        for rank in 0..engines.dp_size() {
            self.refresh(rank, engines);
            if engines.is_routable(rank) && self.among.is_none_or(|set| set.contains(rank)) {
                self.routable.push(rank);
            }
        }
        self.synced_epoch = Some(engines.epoch());
    }

    /// Places a request's `n` copies: each placement is booked
    /// ([`UserDispatcher::book`]) before the next pick and written to
    /// `out`, in order. On error nothing changed and `out` is empty.
    /// `prefix` (a prefix-aware policy, a request with a prompt) adds each
    /// rank's uncached prefill to the policy's picks.
    pub fn route(
        &mut self,
        req: &RouteRequest<'_>,
        engines: &EngineTable,
        prefix: Option<&PrefixView<'_>>,
        now: Instant,
        out: &mut Vec<Placement>,
    ) -> Result<(), Unroutable> {
        if req.among.is_none() {
            return self.route_all(req, engines, prefix, now, out);
        }
        // Only the ranks of `among` are candidates for this route; the
        // costs and the routable list are restored after it.
        self.among = req.among;
        self.refresh_all(engines);
        let result = self.route_all(req, engines, prefix, now, out);
        self.among = None;
        self.refresh_all(engines);
        result
    }

    fn route_all(
        &mut self,
        req: &RouteRequest<'_>,
        engines: &EngineTable,
        prefix: Option<&PrefixView<'_>>,
        now: Instant,
        out: &mut Vec<Placement>,
    ) -> Result<(), Unroutable> {
        out.clear();
        self.guarded = false;
        self.per_request = false;
        self.fallbacks.clear();
        if self.synced_epoch != Some(engines.epoch()) {
            self.refresh_all(engines);
        }
        // Capped so that the ledger's token sums cannot overflow: no prompt
        // is anywhere near 2^32 tokens, and n <= max_batch.
        // A placement counts its whole prompt, cached or not: the request
        // holds that much KV while it runs, and a fully cached prompt must
        // still make its rank look busier, or affinity would pile on it.
        let tokens = req.prompt_tokens.unwrap_or(1).min(u64::from(u32::MAX));
        let whole = self.whole_batch_rank(req, engines, now)?;
        if req.prompt_tokens.is_some() {
            self.observe_prompt(req.n.into(), tokens, engines);
        }
        let placement = |rank, count| Placement { rank, count, tokens_each: tokens, at: now };
        match whole {
            Some(rank) => {
                let p = placement(rank, req.n.into());
                self.book(&p, engines);
                out.push(p);
            }
            None => {
                for _ in 0..req.n {
                    let rank = match prefix {
                        Some(view) => self.pick_cached(engines, view),
                        None => self.pick(engines),
                    };
                    let p = placement(rank, 1);
                    self.book(&p, engines);
                    out.push(p);
                }
            }
        }
        if req.fallbacks > 0 && req.target == Target::Policy {
            self.rank_fallbacks(req.fallbacks.into(), out);
        }
        Ok(())
    }

    /// The `k` cheapest routable ranks not placed on, by the costs of the
    /// last pick (per request for a prefix-aware one): where a gateway
    /// sends the request should the placement's rank fail it.
    fn rank_fallbacks(&mut self, k: usize, placed: &[Placement]) {
        let costs = if self.per_request { &self.request_costs } else { &self.costs };
        let mut others: Vec<(f64, u32)> = (self.routable.iter())
            .filter(|&&r| !placed.iter().any(|p| p.rank == r))
            .map(|&r| (costs[r as usize], r))
            .filter(|(c, _)| c.is_finite())
            .collect();
        others.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        self.fallbacks.extend(others.iter().take(k).map(|&(_, r)| r));
    }

    /// A prefix-aware pick: each rank's cost for this request from the
    /// policy's prefix term, unless the term is guarded and the balance
    /// guard holds (the routable ranks' loads spread too far): then the
    /// policy's costs alone.
    fn pick_cached(&mut self, engines: &EngineTable, view: &PrefixView<'_>) -> u32 {
        let Some(term) = self.policy.prefix else { return self.pick(engines) };
        if term.guarded && self.unbalanced(engines) {
            self.guarded = true;
            return self.pick(engines);
        }
        self.request_costs.clear();
        for (rank, &cost) in self.costs.iter().enumerate() {
            let r = rank as u32;
            let terms = RankTerms { cost, uncached: view.uncached(r) as f64, penalty: engines.get(r).penalty };
            self.request_costs.push((term.cost)(&terms, &self.cache));
        }
        self.per_request = true;
        self.pick_by(engines, true)
    }

    /// The balance guard: the routable ranks' loads spread by more than
    /// `balance_abs_tokens` and the largest is more than `balance_rel`
    /// times the smallest.
    fn unbalanced(&self, engines: &EngineTable) -> bool {
        let mean = self.prompt_mean;
        let loads = self.routable.iter().map(|&r| self.scorer.load(engines.get(r), &self.ledgers[r as usize], mean));
        let (min, max) = loads.fold((f64::INFINITY, 0.0f64), |(lo, hi), l| (lo.min(l), hi.max(l)));
        max - min > self.cache.balance_abs_tokens as f64 && max > self.cache.balance_rel * min
    }

    /// The one rank that takes all `n` (a pin, a room or a session), or
    /// `None` when the policy places them one by one. A refusal changes nothing.
    fn whole_batch_rank(
        &mut self,
        req: &RouteRequest<'_>,
        engines: &EngineTable,
        now: Instant,
    ) -> Result<Option<u32>, Unroutable> {
        if let Some(rank) = req.target.fixed_rank(engines.dp_size()) {
            // Pins and rooms count as load but leave the cursor alone.
            return check_fixed(engines, rank, req.target).map(Some);
        }
        if self.routable.is_empty() {
            let dp_size = engines.dp_size();
            return Err(match self.among {
                Some(_) => Unroutable::NoneAmong { dp_size },
                None => Unroutable::NoEngine { dp_size },
            });
        }
        if let Some(shed_waiting) = req.shed_waiting {
            let least = self.shortest_queue(engines);
            if least >= shed_waiting {
                return Err(Unroutable::Saturated { shed_waiting, least });
            }
        }
        let Some(key) = req.session else { return Ok(None) };
        let rank = match self.sessions.peek(key, now).filter(|&r| self.keeps_session(r)) {
            Some(rank) => rank,
            None => self.pick(engines),
        };
        self.sessions.assign(key, rank, now);
        Ok(Some(rank))
    }

    /// The fewest requests queued on a candidate rank: its engine's waiting
    /// plus the placements not yet acknowledged (pending).
    fn shortest_queue(&self, engines: &EngineTable) -> u64 {
        let queued = |r: u32| engines.get(r).counts.waiting.saturating_add(self.ledgers[r as usize].pending);
        self.routable.iter().map(|&r| queued(r)).min().unwrap_or(0)
    }

    /// A session stays while its rank is routable and not overloaded.
    fn keeps_session(&self, rank: u32) -> bool {
        let cheapest = self.routable.iter().map(|&r| self.costs[r as usize]).fold(f64::INFINITY, f64::min);
        let cost = self.costs.get(rank as usize).copied().unwrap_or(f64::INFINITY);
        cost.is_finite() && cost <= self.session_ratio * cheapest
    }

    /// The policy's choice among routable ranks (at least one exists).
    fn pick(&mut self, engines: &EngineTable) -> u32 {
        self.pick_by(engines, false)
    }

    /// The picker's choice over the policy's costs, or over the per-request
    /// costs `pick_cached` just wrote; the cursor moves past it.
    fn pick_by(&mut self, engines: &EngineTable, per_request: bool) -> u32 {
        let costs = if per_request { &self.request_costs } else { &self.costs };
        let candidates = Candidates { engines, costs, routable: &self.routable };
        let chosen = self.policy.picker.pick(&candidates, self.cursor, &mut self.rng);
        // `routable` is non-empty and in sync with `costs`, so every picker finds a rank.
        let rank = chosen.unwrap_or(self.routable[0]);
        self.cursor = (rank + 1) % engines.dp_size();
        rank
    }

    /// Books a placement: the rank's ledger (`routed`, `pending`), the
    /// dispatch window and the rank's cost. A placement on a rank beyond
    /// the rank count (made before a shrink) is ignored.
    pub fn book(&mut self, p: &Placement, engines: &EngineTable) {
        let Some(ledger) = self.ledgers.get_mut(p.rank as usize) else { return };
        ledger.place(p.count, p.tokens_each, p.at);
        self.window.record(p.rank as usize, p.count, p.at);
        self.refresh(p.rank, engines);
    }

    /// Folds a request's `count` prompts of `tokens` each into the mean prompt length.
    fn observe_prompt(&mut self, count: u64, tokens: u64, engines: &EngineTable) {
        let before = self.prompt_mean;
        let weight = if before == 0.0 { 1.0 } else { (count as f64 / PROMPT_WINDOW).min(1.0) };
        self.prompt_mean += (tokens as f64 - before) * weight;
        // A token cost weighs a queue without token counts by the mean, so
        // every move re-costs all ranks: a cost computed with an older mean
        // would make the pick depend on when each rank's stats last arrived.
        if self.scorer.metric == Metric::Tokens && self.prompt_mean != before {
            self.refresh_all(engines);
        }
    }

    /// `finished` **(ext)**: `n` requests booked on `placed` were served by
    /// `rank` and have ended. On the same rank, its outstanding placements
    /// are acknowledged early; on another, `placed`'s are withdrawn and
    /// `rank` is charged (its `routed`).
    pub fn finished(&mut self, rank: u32, n: u32, placed: u32, engines: &EngineTable, now: Instant) {
        if rank == placed {
            self.ledgers[rank as usize].finish(n.into(), now);
        } else {
            self.ledgers[placed as usize].withdraw(n.into());
            self.ledgers[rank as usize].charge(n.into());
            self.refresh(placed, engines);
        }
        self.refresh(rank, engines);
    }

    /// `finished` without a rank **(ext)**: `n` requests booked on `placed`
    /// reached no rank dpcoord counts; its newest placements are withdrawn.
    pub fn withdrawn(&mut self, placed: u32, n: u32, engines: &EngineTable) {
        self.ledgers[placed as usize].withdraw(n.into());
        self.refresh(placed, engines);
    }

    /// Folds an applied stats update into the rank's ledger and cost.
    pub fn on_report(&mut self, a: &Accepted, engines: &EngineTable, now: Instant) {
        self.ledgers[a.rank as usize].on_report(a, now, self.pending_transit);
        self.refresh(a.rank, engines);
    }

    /// Expires unacknowledged placements, ages the dispatch window and
    /// picks up the tick's liveness and penalties.
    pub fn tick(&mut self, now: Instant, engines: &EngineTable) {
        for l in &mut self.ledgers {
            l.expire(now, self.pending_ttl);
        }
        self.window.advance(now);
        self.refresh_all(engines);
    }

    /// Population standard deviation of user placements per routable rank
    /// over the window (0 when fewer than two ranks are routable).
    pub fn dispatch_stddev(&self, engines: &EngineTable) -> f64 {
        let routable = (0..engines.dp_size()).filter(|&r| engines.is_routable(r));
        self.window.stddev(routable.map(|r| r as usize))
    }
}

#[cfg(test)]
mod tests;
