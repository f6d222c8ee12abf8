//! One rank's ledger of dpcoord's own user placements since the rank's
//! current boot: `routed`, and the outstanding placements behind `pending`.
//!
//! `pending = routed - received`, never below 0: the engine's `received`
//! counter acknowledges the oldest outstanding placements first, and a
//! placement not acknowledged within `pending_ttl` stops counting, so a lost
//! request cannot inflate a rank's load forever.
//!
//! A source of gauges only (no `received`: SGLang's load stream, vLLM's
//! `/metrics`) reports what the engine holds, which includes the placements
//! that reached it. Its snapshots acknowledge by time: a snapshot that
//! arrives at least `pending_transit` after a placement is taken to include
//! it, so it stops being pending (no double count); younger placements stay
//! pending on top of the snapshot (no herding after it, the failure of
//! frontends that let each snapshot overwrite their own counts).
//!
//! A gateway that sees a request end (`finished`, docs/PROTOCOL.md §6)
//! acknowledges an outstanding placement early. The engine's `received`
//! still rises for that request later, so each early acknowledgment is
//! remembered and consumed first by the next rise of `received` (it then
//! acknowledges nothing more); one not consumed within `pending_ttl` is forgotten.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::engines::Accepted;

/// Placements within this interval with the same prompt length share one
/// entry, which bounds the ledger to about `pending_ttl / COALESCE` entries.
const COALESCE: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, Copy)]
struct Outstanding {
    at: Instant,
    count: u64,
    tokens_each: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Ledger {
    pub routed: u64,
    /// The engine's `received` at its last update.
    received: u64,
    outstanding: VecDeque<Outstanding>,
    pub pending: u64,
    /// Sum of the prompt tokens of the pending placements.
    pub pending_tokens: u64,
    /// Placements acknowledged early (`finished`) that the engine's
    /// `received` has not counted yet, oldest first.
    early: VecDeque<(Instant, u64)>,
}

impl Ledger {
    /// Records `count` placements of `tokens_each` prompt tokens each.
    pub fn place(&mut self, count: u64, tokens_each: u64, now: Instant) {
        // `routed` may have been raised to an engine's absurd `received`.
        self.routed = self.routed.saturating_add(count);
        self.pending += count;
        self.pending_tokens += count * tokens_each;
        match self.outstanding.back_mut() {
            Some(o) if o.tokens_each == tokens_each && now.saturating_duration_since(o.at) < COALESCE => {
                o.count += count
            }
            _ => self.outstanding.push_back(Outstanding { at: now, count, tokens_each }),
        }
    }

    /// Removes up to `count` of the oldest outstanding placements.
    fn acknowledge(&mut self, mut count: u64) {
        while count > 0 {
            let Some(o) = self.outstanding.front_mut() else { break };
            let take = count.min(o.count);
            o.count -= take;
            count -= take;
            self.pending -= take;
            self.pending_tokens -= take * o.tokens_each;
            if o.count == 0 {
                self.outstanding.pop_front();
            }
        }
    }

    /// `finished`: up to `count` outstanding placements ended before the
    /// engine's `received` counted them; they stop counting now, and the
    /// next rise of `received` takes them first.
    pub fn finish(&mut self, count: u64, now: Instant) {
        let before = self.pending;
        self.acknowledge(count);
        let done = before - self.pending;
        if done > 0 {
            self.early.push_back((now, done));
        }
    }

    /// `count` of the newest outstanding placements never reached this rank
    /// (a gateway served them elsewhere): they are undone.
    pub fn withdraw(&mut self, mut count: u64) {
        while count > 0 {
            let Some(o) = self.outstanding.back_mut() else { break };
            let take = count.min(o.count);
            o.count -= take;
            count -= take;
            self.routed = self.routed.saturating_sub(take);
            self.pending -= take;
            self.pending_tokens -= take * o.tokens_each;
            if o.count == 0 {
                self.outstanding.pop_back();
            }
        }
    }

    /// `count` requests this rank served and finished that were booked on
    /// another: charged to `routed`, never pending (they are over).
    pub fn charge(&mut self, count: u64) {
        self.routed = self.routed.saturating_add(count);
    }

    /// Takes up to `count` from the early acknowledgments; what is left of
    /// `count` acknowledges outstanding placements.
    fn consume_early(&mut self, mut count: u64) -> u64 {
        while count > 0 {
            let Some(e) = self.early.front_mut() else { break };
            let take = count.min(e.1);
            e.1 -= take;
            count -= take;
            if e.1 == 0 {
                self.early.pop_front();
            }
        }
        count
    }

    /// Drops placements older than `ttl`.
    pub fn expire(&mut self, now: Instant, ttl: Duration) {
        while self.early.front().is_some_and(|&(at, _)| now.saturating_duration_since(at) >= ttl) {
            self.early.pop_front();
        }
        while let Some(&o) = self.outstanding.front() {
            if now.saturating_duration_since(o.at) < ttl {
                break;
            }
            self.pending -= o.count;
            self.pending_tokens -= o.count * o.tokens_each;
            self.outstanding.pop_front();
        }
    }

    /// Removes the placements made at or before `cutoff`.
    fn acknowledge_until(&mut self, cutoff: Instant) {
        while let Some(&o) = self.outstanding.front() {
            if o.at > cutoff {
                break;
            }
            self.acknowledge(o.count);
        }
    }

    /// Folds in an applied report of this rank that arrived at `now`.
    pub fn on_report(&mut self, a: &Accepted, now: Instant, transit: Duration) {
        if a.restarted {
            *self = Ledger::default();
        }
        match a.received {
            Some(received) => {
                let rise = self.consume_early(received.saturating_sub(self.received));
                self.acknowledge(rise);
                self.received = received;
                self.routed = self.routed.max(received);
            }
            None => {
                if let Some(cutoff) = now.checked_sub(transit) {
                    self.acknowledge_until(cutoff);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(received: u64, restarted: bool) -> Accepted {
        Accepted { rank: 0, restarted, received: Some(received), missed: 0 }
    }

    fn on(l: &mut Ledger, a: Accepted) {
        l.on_report(&a, Instant::now(), Duration::ZERO);
    }

    #[test]
    fn pending_is_acknowledged_oldest_first_and_expires_by_ttl() {
        let t0 = Instant::now();
        let ms = |m| t0 + Duration::from_millis(m);
        let mut l = Ledger::default();
        l.place(3, 100, t0);
        l.place(2, 10, ms(500));
        assert_eq!((l.routed, l.pending, l.pending_tokens), (5, 5, 320));
        on(&mut l, report(4, false));
        assert_eq!((l.routed, l.pending, l.pending_tokens), (5, 1, 10));
        l.expire(ms(2499), Duration::from_secs(2));
        assert_eq!(l.pending, 1);
        l.expire(ms(2500), Duration::from_secs(2));
        assert_eq!((l.pending, l.pending_tokens), (0, 0));
        // Requests that reached the engine another way raise `routed`.
        on(&mut l, report(9, false));
        assert_eq!((l.routed, l.pending), (9, 0));
        l.place(1, 7, ms(3000));
        on(&mut l, report(0, true));
        assert_eq!((l.routed, l.pending, l.pending_tokens, l.received), (0, 0, 0, 0));
    }

    #[test]
    fn placements_close_in_time_share_an_entry() {
        let t0 = Instant::now();
        let mut l = Ledger::default();
        for _ in 0..1000 {
            l.place(1, 5, t0);
        }
        l.place(1, 6, t0);
        assert_eq!(l.outstanding.len(), 2);
        on(&mut l, report(999, false));
        assert_eq!((l.pending, l.pending_tokens), (2, 11));
    }
}

#[cfg(test)]
mod finish_tests {
    use super::*;

    fn received(l: &mut Ledger, n: u64, now: Instant) {
        let a = Accepted { rank: 0, restarted: false, received: Some(n), missed: 0 };
        l.on_report(&a, now, Duration::ZERO);
    }

    /// A request that ends before the engine's `received` counts it is
    /// acknowledged once: the later rise of `received` for it acknowledges
    /// no second placement.
    #[test]
    fn an_early_finish_is_not_acknowledged_twice() {
        let t0 = Instant::now();
        let ms = |m| t0 + Duration::from_millis(m);
        let mut l = Ledger::default();
        l.place(2, 10, t0);
        l.finish(1, ms(10));
        assert_eq!((l.routed, l.pending, l.pending_tokens), (2, 1, 10));
        // The engine counts the finished request: the other stays pending.
        received(&mut l, 1, ms(20));
        assert_eq!(l.pending, 1);
        received(&mut l, 2, ms(30));
        assert_eq!((l.pending, l.pending_tokens), (0, 0));
        // A finish with nothing outstanding (the engine counted it first) is not remembered.
        l.place(1, 5, ms(40));
        received(&mut l, 3, ms(50));
        l.finish(1, ms(60));
        l.place(1, 5, ms(70));
        received(&mut l, 4, ms(80));
        assert_eq!(l.pending, 0);
    }

    #[test]
    fn early_acknowledgments_expire_with_the_pending_ttl() {
        let t0 = Instant::now();
        let ms = |m| t0 + Duration::from_millis(m);
        let mut l = Ledger::default();
        l.place(1, 1, t0);
        l.finish(1, t0);
        l.expire(ms(2000), Duration::from_secs(2));
        // The engine never counted it (its `received` moved on without it).
        l.place(1, 1, ms(2100));
        received(&mut l, 1, ms(2200));
        assert_eq!(l.pending, 0);
    }

    #[test]
    fn a_placement_served_elsewhere_moves() {
        let t0 = Instant::now();
        let (mut a, mut b) = (Ledger::default(), Ledger::default());
        a.place(1, 100, t0);
        a.place(1, 7, t0 + Duration::from_millis(5));
        a.withdraw(1);
        b.charge(1);
        assert_eq!((a.routed, a.pending, a.pending_tokens), (1, 1, 100));
        assert_eq!((b.routed, b.pending), (1, 0));
        a.withdraw(5);
        assert_eq!((a.routed, a.pending, a.pending_tokens), (0, 0, 0));
    }
}

#[cfg(test)]
mod snapshot_tests {
    use super::*;

    fn snapshot(l: &mut Ledger, now: Instant, transit_ms: u64) {
        let a = Accepted { rank: 0, restarted: false, received: None, missed: 0 };
        l.on_report(&a, now, Duration::from_millis(transit_ms));
    }

    #[test]
    fn a_snapshot_acknowledges_what_it_had_time_to_see() {
        let t0 = Instant::now();
        let ms = |m| t0 + Duration::from_millis(m);
        let mut l = Ledger::default();
        l.place(2, 10, t0);
        l.place(1, 30, ms(40));
        l.place(1, 50, ms(90));
        // A snapshot at 100 ms with a 50 ms transit includes the placements up to 50 ms.
        snapshot(&mut l, ms(100), 50);
        assert_eq!((l.routed, l.pending, l.pending_tokens), (4, 1, 50));
        // Snapshots keep acknowledging as they age past the window; nothing twice.
        snapshot(&mut l, ms(139), 50);
        assert_eq!(l.pending, 1);
        snapshot(&mut l, ms(140), 50);
        assert_eq!((l.routed, l.pending, l.pending_tokens), (4, 0, 0));
        // A zero window: every snapshot overwrites what dpcoord placed before it.
        l.place(3, 1, ms(200));
        snapshot(&mut l, ms(200), 0);
        assert_eq!(l.pending, 0);
        // A restart starts the books over.
        l.place(1, 1, ms(300));
        let restart = Accepted { rank: 0, restarted: true, received: None, missed: 0 };
        l.on_report(&restart, ms(300), Duration::from_millis(50));
        assert_eq!((l.routed, l.pending), (0, 0));
    }
}
