//! The user dispatcher: the only owner of user routing state.
//!
//! It holds the user round-robin cursor, each rank's placement ledger
//! (`routed`, outstanding placements behind `pending`) and the sliding window
//! of placements behind `dpcoord_user_dispatch_stddev`. Health code never
//! receives it (see `health.rs`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::config::{Config, PolicyKind};
use crate::engine::{Accepted, EngineTable};
use crate::health::{check_fixed, no_engine};
use crate::policy;
use crate::window::DispatchWindow;
use crate::wire::{RouteRequest, WireError};

/// dpcoord's own placements on one rank, since the rank's current boot.
#[derive(Debug, Clone, Default)]
struct Ledger {
    routed: u64,
    /// The engine's `received` at its last update.
    received: u64,
    /// Placements not yet acknowledged: (time, count), oldest first.
    outstanding: VecDeque<(Instant, u64)>,
    pending: u64,
}

/// Placements within this interval share one ledger entry, which bounds
/// the ledger to `pending_ttl / COALESCE` entries per rank.
const COALESCE: Duration = Duration::from_millis(1);

impl Ledger {
    fn place(&mut self, count: u64, now: Instant) {
        self.routed += count;
        self.pending += count;
        match self.outstanding.back_mut() {
            Some((t, c)) if now.saturating_duration_since(*t) < COALESCE => *c += count,
            _ => self.outstanding.push_back((now, count)),
        }
    }

    /// Removes up to `count` of the oldest outstanding placements.
    fn acknowledge(&mut self, mut count: u64) {
        while count > 0 {
            let Some((_, c)) = self.outstanding.front_mut() else { break };
            let take = count.min(*c);
            *c -= take;
            count -= take;
            self.pending -= take;
            if *c == 0 {
                self.outstanding.pop_front();
            }
        }
    }

    fn expire(&mut self, now: Instant, ttl: Duration) {
        while let Some(&(t, c)) = self.outstanding.front() {
            if now.saturating_duration_since(t) < ttl {
                break;
            }
            self.pending -= c;
            self.outstanding.pop_front();
        }
    }

    fn on_report(&mut self, a: &Accepted) {
        if a.restarted {
            *self = Ledger::default();
        } else {
            self.acknowledge(a.received.saturating_sub(self.received));
        }
        self.received = a.received;
        self.routed = self.routed.max(a.received);
    }
}

#[derive(Debug)]
pub struct UserDispatcher {
    policy: PolicyKind,
    cursor: u32,
    ledgers: Vec<Ledger>,
    pending_ttl: Duration,
    window: DispatchWindow,
}

impl UserDispatcher {
    pub fn new(cfg: &Config, now: Instant) -> Self {
        let dp = cfg.engines.dp_size as usize;
        UserDispatcher {
            policy: cfg.routing.policy,
            cursor: 0,
            ledgers: vec![Ledger::default(); dp],
            pending_ttl: cfg.routing.pending_ttl,
            window: DispatchWindow::new(dp, cfg.routing.imbalance_window, now),
        }
    }

    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    pub fn routed(&self, rank: u32) -> u64 {
        self.ledgers[rank as usize].routed
    }

    pub fn pending(&self, rank: u32) -> u64 {
        self.ledgers[rank as usize].pending
    }

    /// Places a request's `n` copies into `out`; on error nothing changed.
    pub fn route(
        &mut self,
        req: &RouteRequest<'_>,
        engines: &EngineTable,
        now: Instant,
        out: &mut Vec<u32>,
    ) -> Result<(), WireError> {
        out.clear();
        let n = req.n as usize;
        if let Some(rank) = req.target.fixed_rank(engines.dp_size()) {
            // Pins and rooms count as load but leave the cursor alone.
            check_fixed(engines, rank, req.target)?;
            out.resize(n, rank);
            self.record(rank, req.n.into(), now);
            return Ok(());
        }
        if !engines.any_routable() {
            return Err(no_engine(engines));
        }
        for _ in 0..n {
            let rank = match self.policy {
                PolicyKind::RoundRobin => policy::round_robin(self.cursor, engines),
            };
            let Some(rank) = rank else { unreachable!("a routable rank exists") };
            self.cursor = (rank + 1) % engines.dp_size();
            self.record(rank, 1, now);
            out.push(rank);
        }
        Ok(())
    }

    fn record(&mut self, rank: u32, count: u64, now: Instant) {
        self.ledgers[rank as usize].place(count, now);
        self.window.record(rank as usize, count, now);
    }

    /// Folds an applied stats update into the rank's ledger.
    pub fn on_report(&mut self, a: &Accepted) {
        self.ledgers[a.rank as usize].on_report(a);
    }

    /// Expires unacknowledged placements and ages the dispatch window.
    pub fn tick(&mut self, now: Instant) {
        for l in &mut self.ledgers {
            l.expire(now, self.pending_ttl);
        }
        self.window.advance(now);
    }

    /// Population standard deviation of user placements per routable rank
    /// over the window (0 when fewer than two ranks are routable).
    pub fn dispatch_stddev(&self, engines: &EngineTable) -> f64 {
        let routable = (0..engines.dp_size()).filter(|&r| engines.is_routable(r));
        self.window.stddev(routable.map(|r| r as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::table_with_up;
    use crate::wire::{ErrorCode, Target};

    fn req(n: u32, target: Target) -> RouteRequest<'static> {
        RouteRequest { n, prompt_tokens: None, target, session: None }
    }

    fn dispatcher(dp: u32) -> UserDispatcher {
        let mut c = Config::default();
        c.engines.dp_size = dp;
        UserDispatcher::new(&c, Instant::now())
    }

    #[test]
    fn round_robin_batches_pins_and_rooms() {
        let t = table_with_up(4, &[0, 1, 2, 3]);
        let mut d = dispatcher(4);
        let now = Instant::now();
        let mut out = Vec::new();
        d.route(&req(3, Target::Policy), &t, now, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2]);
        d.route(&req(2, Target::Pinned(1)), &t, now, &mut out).unwrap();
        assert_eq!(out, [1, 1]);
        d.route(&req(1, Target::Room(10)), &t, now, &mut out).unwrap();
        assert_eq!(out, [2]);
        d.route(&req(2, Target::Policy), &t, now, &mut out).unwrap();
        assert_eq!(out, [3, 0]);
        let routed: Vec<u64> = (0..4).map(|r| d.routed(r)).collect();
        assert_eq!(routed, [2, 3, 2, 1]);
    }

    #[test]
    fn refused_routes_change_nothing() {
        let t = table_with_up(4, &[1]);
        let mut d = dispatcher(4);
        let now = Instant::now();
        let mut out = Vec::new();
        let e = d.route(&req(5, Target::Pinned(2)), &t, now, &mut out).unwrap_err();
        assert_eq!(e.code, ErrorCode::RankUnavailable);
        assert_eq!((0..4).map(|r| d.routed(r)).sum::<u64>(), 0);
        let none = table_with_up(4, &[]);
        assert_eq!(
            d.route(&req(1, Target::Policy), &none, now, &mut out).unwrap_err().code,
            ErrorCode::NoEngineAvailable
        );
        d.route(&req(1, Target::Policy), &t, now, &mut out).unwrap();
        assert_eq!(out, [1]);
    }

    #[test]
    fn pending_is_acknowledged_by_received_and_expires_by_ttl() {
        let t0 = Instant::now();
        let ms = |m| t0 + Duration::from_millis(m);
        let mut l = Ledger::default();
        l.place(3, t0);
        l.place(2, ms(500));
        assert_eq!((l.routed, l.pending), (5, 5));
        l.on_report(&Accepted { rank: 0, restarted: false, received: 4 });
        assert_eq!((l.routed, l.pending), (5, 1));
        l.expire(ms(2499), Duration::from_secs(2));
        assert_eq!(l.pending, 1);
        l.expire(ms(2500), Duration::from_secs(2));
        assert_eq!(l.pending, 0);
        // Requests that reached the engine another way raise `routed`.
        l.on_report(&Accepted { rank: 0, restarted: false, received: 9 });
        assert_eq!((l.routed, l.pending), (9, 0));
        l.place(1, ms(3000));
        l.on_report(&Accepted { rank: 0, restarted: true, received: 0 });
        assert_eq!((l.routed, l.pending, l.received), (0, 0, 0));
    }

    #[test]
    fn even_rotation_has_zero_stddev() {
        let t = table_with_up(8, &[0, 1, 2, 3, 4, 5, 6, 7]);
        let mut d = dispatcher(8);
        let now = Instant::now();
        let mut out = Vec::new();
        for _ in 0..160 {
            d.route(&req(1, Target::Policy), &t, now, &mut out).unwrap();
        }
        assert_eq!((0..8).map(|r| d.routed(r)).collect::<Vec<_>>(), [20; 8]);
        assert_eq!(d.dispatch_stddev(&t), 0.0);
        d.route(&req(8, Target::Pinned(0)), &t, now, &mut out).unwrap();
        // [28, 20 x 7]: mean 21, variance (49 + 7) / 8 = 7.
        assert_eq!(d.dispatch_stddev(&t), 7f64.sqrt());
    }
}
