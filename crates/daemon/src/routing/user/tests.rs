//! Unit tests of the user dispatcher: every policy with exact expectations.

use std::time::{Duration, Instant};

use super::*;
use crate::engines::testing::{settings, table_with_up};
use crate::engines::{LoadReport, Target};
use crate::routing::placement::ranks_of;

fn req(n: u32, target: Target) -> RouteRequest<'static> {
    RouteRequest {
        n,
        prompt_tokens: None,
        target,
        session: None,
        prompt: None,
        explain: false,
        among: None,
        fallbacks: 0,
        shed_waiting: None,
    }
}

fn dispatcher(dp: u32, policy: PolicyKind) -> UserDispatcher {
    let mut s = settings(dp);
    s.routing.policy = policy;
    UserDispatcher::new(&s, Instant::now())
}

fn route(d: &mut UserDispatcher, t: &EngineTable, r: &RouteRequest<'_>) -> Vec<u32> {
    let (mut placed, mut ranks) = (Vec::new(), Vec::new());
    d.route(r, t, None, Instant::now(), &mut placed).unwrap();
    ranks_of(&placed, &mut ranks);
    ranks
}

/// Applies an update to the table and tells the dispatcher.
fn report(d: &mut UserDispatcher, t: &mut EngineTable, u: LoadReport) {
    let a = t.apply(&u, Instant::now()).unwrap();
    d.on_report(&a, t, Instant::now());
}

fn upd(rank: u32, seq: u64, counts: [u64; 5]) -> LoadReport {
    LoadReport::new(rank, 1, seq + 1).counts(counts)
}

fn per_rank(d: &UserDispatcher, dp: u32) -> Vec<u64> {
    (0..dp).map(|r| d.routed(r)).collect()
}

#[test]
fn round_robin_batches_pins_and_rooms() {
    let t = table_with_up(4, &[0, 1, 2, 3]);
    let mut d = dispatcher(4, PolicyKind::RoundRobin);
    assert_eq!(route(&mut d, &t, &req(3, Target::Policy)), [0, 1, 2]);
    assert_eq!(route(&mut d, &t, &req(2, Target::Pinned(1))), [1, 1]);
    assert_eq!(route(&mut d, &t, &req(1, Target::Room(10))), [2]);
    assert_eq!(route(&mut d, &t, &req(2, Target::Policy)), [3, 0]);
    assert_eq!(per_rank(&d, 4), [2, 3, 2, 1]);
}

#[test]
fn refused_routes_change_nothing() {
    let t = table_with_up(4, &[1]);
    let mut d = dispatcher(4, PolicyKind::LeastLoad);
    let mut out = Vec::new();
    let e = d.route(&req(5, Target::Pinned(2)), &t, None, Instant::now(), &mut out).unwrap_err();
    assert!(matches!(e, Unroutable::Rank { rank: 2, .. }), "{e:?}");
    assert_eq!(per_rank(&d, 4), [0; 4]);
    let none = table_with_up(4, &[]);
    let e = d.route(&req(1, Target::Policy), &none, None, Instant::now(), &mut out).unwrap_err();
    assert_eq!(e, Unroutable::NoEngine { dp_size: 4 });
    assert_eq!(route(&mut d, &t, &req(1, Target::Policy)), [1]);
}

#[test]
fn least_load_spreads_idle_ranks_exactly_and_skips_down_ones() {
    let t = table_with_up(5, &[0, 1, 2, 3]);
    let mut d = dispatcher(5, PolicyKind::LeastLoad);
    for _ in 0..10 {
        route(&mut d, &t, &req(4, Target::Policy));
    }
    assert_eq!(per_rank(&d, 5), [10, 10, 10, 10, 0]);
}

#[test]
fn least_load_prefers_the_rank_that_acknowledged() {
    let mut t = table_with_up(3, &[0, 1, 2]);
    let mut d = dispatcher(3, PolicyKind::LeastLoad);
    assert_eq!(route(&mut d, &t, &req(6, Target::Policy)), [0, 1, 2, 0, 1, 2]);
    // Rank 1 reports both requests received and finished: its pending drops to 0.
    report(&mut d, &mut t, upd(1, 1, [0, 0, 2, 2, 0]));
    assert_eq!(route(&mut d, &t, &req(2, Target::Policy)), [1, 1]);
    // Engine load counts too: rank 0 reports 3 waiting (weight 4), rank 2 is left.
    report(&mut d, &mut t, upd(0, 1, [3, 0, 2, 0, 0]));
    assert_eq!(route(&mut d, &t, &req(1, Target::Policy)), [2]);
}

#[test]
fn penalty_multiplies_cost_for_load_aware_policies_only() {
    let mut t = table_with_up(2, &[0, 1]);
    t.health_handle().record(0, false, Instant::now());
    t.tick(Instant::now()); // rank 0 penalty 1.0: an idle rank 0 costs 2, rank 1 costs 1
    let mut ll = dispatcher(2, PolicyKind::LeastLoad);
    ll.tick(Instant::now(), &t);
    // Rank 1 takes placements until its cost (pending*4 + 1) passes rank 0's 2.
    assert_eq!(route(&mut ll, &t, &req(3, Target::Policy)), [1, 0, 1]);
    let mut rr = dispatcher(2, PolicyKind::RoundRobin);
    assert_eq!(route(&mut rr, &t, &req(3, Target::Policy)), [0, 1, 0]);
}

#[test]
fn least_tokens_counts_engine_and_pending_prompt_tokens() {
    let mut t = table_with_up(3, &[0, 1, 2]);
    let mut d = dispatcher(3, PolicyKind::LeastTokens);
    report(&mut d, &mut t, upd(0, 1, [0; 5]).tokens([500, 500]));
    let long = RouteRequest { prompt_tokens: Some(800), ..req(1, Target::Policy) };
    // Ranks 1 and 2 take two 800-token prompts each before rank 0 (1000 engine
    // tokens) becomes the cheapest.
    let picks: Vec<u32> = (0..5).flat_map(|_| route(&mut d, &t, &long)).collect();
    assert_eq!(picks, [1, 2, 1, 2, 0]);
    assert_eq!((d.load(0, &t), d.load(1, &t)), (1800.0, 1600.0));
}

/// Every cached cost is the one the current prompt mean gives, after each
/// route: a pick never depends on when a rank's stats last arrived (a small
/// move of the mean used to leave the other ranks costed with the old one).
#[test]
fn token_costs_follow_every_move_of_the_prompt_mean() {
    let mut t = table_with_up(3, &[0, 1, 2]);
    let mut d = dispatcher(3, PolicyKind::LeastTokens);
    report(&mut d, &mut t, upd(0, 1, [1, 0, 1, 0, 0]));
    report(&mut d, &mut t, upd(1, 1, [0, 1, 1, 0, 0]));
    for tokens in [1000, 1060, 990, 1003, 1200] {
        route(&mut d, &t, &RouteRequest { prompt_tokens: Some(tokens), ..req(1, Target::Policy) });
        for r in 0..3u32 {
            let exact = d.scorer.cost(t.get(r), &d.ledgers[r as usize], d.prompt_mean);
            assert_eq!(d.costs[r as usize], exact, "rank {r} after a {tokens}-token prompt");
        }
    }
}

#[test]
fn power_of_two_is_seeded_and_never_picks_unroutable() {
    let t = table_with_up(8, &[0, 1, 2, 3, 5, 6, 7]);
    let run = || {
        let mut d = dispatcher(8, PolicyKind::PowerOfTwo);
        route(&mut d, &t, &req(70, Target::Policy))
    };
    let a = run();
    assert_eq!(a, run());
    let mut counts = [0u32; 8];
    a.iter().for_each(|&r| counts[r as usize] += 1);
    // Never rank 4; every placement landed (the picker's own invariants are
    // property-tested in `policy::picker`, independent of the RNG's stream).
    assert_eq!((counts[4], counts.iter().sum::<u32>()), (0, 70));
}

#[test]
fn sessions_stick_then_move_when_overloaded_or_down() {
    let mut t = table_with_up(3, &[0, 1, 2]);
    let mut d = dispatcher(3, PolicyKind::LeastLoad);
    let s = |n| RouteRequest { session: Some("chat-1"), ..req(n, Target::Policy) };
    assert_eq!(route(&mut d, &t, &s(1)), [0]);
    // Other traffic spreads; the session keeps rank 0 while within 2x of the cheapest.
    assert_eq!(route(&mut d, &t, &req(2, Target::Policy)), [1, 2]);
    assert_eq!(route(&mut d, &t, &s(2)), [0, 0]);
    // Rank 0 now costs 3*4+1 = 13 against 5: the session moves to the cheapest and sticks.
    assert_eq!(route(&mut d, &t, &s(1)), [1]);
    assert_eq!(route(&mut d, &t, &s(1)), [1]);
    // Rank 1 goes down (a restart to boot 0 is stale; simulate with a table lacking rank 1).
    t = table_with_up(3, &[0, 2]);
    d.tick(Instant::now(), &t);
    assert_eq!(route(&mut d, &t, &s(1)), [2]);
    assert_eq!(d.sessions(), 1);
}

#[test]
fn even_rotation_has_zero_stddev() {
    let t = table_with_up(8, &[0, 1, 2, 3, 4, 5, 6, 7]);
    let mut d = dispatcher(8, PolicyKind::RoundRobin);
    for _ in 0..160 {
        route(&mut d, &t, &req(1, Target::Policy));
    }
    assert_eq!(per_rank(&d, 8), [20; 8]);
    assert_eq!(d.dispatch_stddev(&t), 0.0);
    route(&mut d, &t, &req(8, Target::Pinned(0)));
    // [28, 20 x 7]: mean 21, variance (49 + 7) / 8 = 7.
    assert_eq!(d.dispatch_stddev(&t), 7f64.sqrt());
}

#[test]
fn pending_expires_after_ttl_on_tick() {
    let t = table_with_up(2, &[0, 1]);
    let mut d = dispatcher(2, PolicyKind::LeastLoad);
    let t0 = Instant::now();
    let mut out = Vec::new();
    d.route(&req(3, Target::Pinned(0)), &t, None, t0, &mut out).unwrap();
    d.tick(t0 + Duration::from_millis(1999), &t);
    assert_eq!(d.pending(0), 3);
    d.tick(t0 + Duration::from_millis(2000), &t);
    assert_eq!((d.pending(0), d.routed(0)), (0, 3));
    // With rank 0's pending expired, both are idle again; the cursor starts at 0.
    d.route(&req(1, Target::Policy), &t, None, t0, &mut out).unwrap();
    assert_eq!(out, [Placement { rank: 0, count: 1, tokens_each: 1, at: t0 }]);
}

#[test]
fn a_placement_books_the_same_wherever_it_was_decided() {
    // A batch pinned whole is one placement of n; a policy batch one per pick.
    let t = table_with_up(3, &[0, 1, 2]);
    let mut here = dispatcher(3, PolicyKind::LeastTokens);
    let t0 = Instant::now();
    let mut placed = Vec::new();
    let pinned = RouteRequest { prompt_tokens: Some(100), ..req(4, Target::Pinned(2)) };
    here.route(&pinned, &t, None, t0, &mut placed).unwrap();
    assert_eq!(placed, [Placement { rank: 2, count: 4, tokens_each: 100, at: t0 }]);
    let mut all = placed.clone();
    here.route(&RouteRequest { prompt_tokens: Some(30), ..req(2, Target::Policy) }, &t, None, t0, &mut placed).unwrap();
    assert_eq!(placed.iter().map(|p| (p.rank, p.count, p.tokens_each)).collect::<Vec<_>>(), [(0, 1, 30), (1, 1, 30)]);
    all.extend_from_slice(&placed);
    // Another dispatcher that only books those placements holds the same books.
    let mut there = dispatcher(3, PolicyKind::LeastTokens);
    for p in &all {
        there.book(p, &t);
    }
    for r in 0..3 {
        assert_eq!((there.routed(r), there.pending(r)), (here.routed(r), here.pending(r)), "rank {r}");
        assert_eq!(there.load(r, &t), here.load(r, &t), "rank {r}");
    }
    assert_eq!((here.pending(2), here.load(2, &t)), (4, 400.0));
    // A placement on a rank a shrink removed is ignored.
    there.book(&Placement { rank: 7, ..all[0] }, &t);
    assert_eq!((0..3).map(|r| there.routed(r)).sum::<u64>(), 6);
}

#[test]
fn absurd_prompt_tokens_are_capped_not_overflowed() {
    let t = table_with_up(2, &[0, 1]);
    let mut d = dispatcher(2, PolicyKind::LeastTokens);
    let huge = RouteRequest { prompt_tokens: Some(u64::MAX), ..req(1024, Target::Policy) };
    for _ in 0..4 {
        route(&mut d, &t, &huge);
    }
    // 2048 placements per rank of 2^32 - 1 tokens each.
    assert_eq!((d.load(0, &t), d.load(1, &t)), (2048.0 * 4294967295.0, 2048.0 * 4294967295.0));
}

#[test]
fn resize_keeps_surviving_ledgers_and_replaces_sessions_on_gone_ranks() {
    let mut t = table_with_up(4, &[0, 1, 2, 3]);
    let mut d = dispatcher(4, PolicyKind::RoundRobin);
    let s = RouteRequest { session: Some("s"), ..req(1, Target::Policy) };
    assert_eq!(route(&mut d, &t, &req(3, Target::Policy)), [0, 1, 2]);
    assert_eq!(route(&mut d, &t, &s), [3]);
    t.resize(2);
    d.resize(2);
    assert_eq!(per_rank(&d, 2), [1, 1]);
    // Rank 3 is gone: the session is placed again (the cursor wrapped to 0).
    assert_eq!(route(&mut d, &t, &s), [0]);
    t.resize(3);
    d.resize(3);
    t.apply(&LoadReport::new(2, 1, 1), Instant::now()).unwrap();
    assert_eq!(per_rank(&d, 3), [2, 1, 0]);
    assert_eq!(route(&mut d, &t, &req(2, Target::Policy)), [1, 2]);
}

#[test]
fn reload_swaps_the_policy_and_keeps_the_books() {
    let t = table_with_up(2, &[0, 1]);
    let mut d = dispatcher(2, PolicyKind::RoundRobin);
    assert_eq!(route(&mut d, &t, &req(3, Target::Pinned(0))), [0, 0, 0]);
    let mut s = settings(2);
    s.routing.policy = PolicyKind::LeastLoad;
    d.reload(&s, Instant::now());
    assert_eq!((d.policy(), d.pending(0)), (PolicyKind::LeastLoad, 3));
    // Rank 0 holds 3 pending (cost 13): least_load sends the next three to rank 1.
    assert_eq!(route(&mut d, &t, &req(3, Target::Policy)), [1, 1, 1]);
}

#[test]
fn fallbacks_are_the_next_cheapest_ranks_not_placed_on() {
    let mut t = table_with_up(5, &[0, 1, 2, 3]);
    let mut d = dispatcher(5, PolicyKind::LeastLoad);
    // Queues: rank 0 holds 3 waiting, rank 1 one, rank 2 none, rank 3 two; rank 4 is down.
    for (rank, waiting) in [(0, 3), (1, 1), (3, 2)] {
        report(&mut d, &mut t, upd(rank, 1, [waiting, 0, waiting, 0, 0]));
    }
    let asked = |k| RouteRequest { fallbacks: k, ..req(1, Target::Policy) };
    assert_eq!(route(&mut d, &t, &asked(3)), [2]);
    assert_eq!(d.fallbacks(), [1, 3, 0]);
    // Rank 2 took a placement (pending costs 4): rank 1 (one waiting, 4) ties it and comes first.
    assert_eq!(route(&mut d, &t, &asked(16)), [1]);
    assert_eq!(d.fallbacks(), [2, 3, 0], "only the routable ranks, however many are asked for");
    // A batch's fallbacks leave out every rank it placed on; a pin has none.
    assert_eq!(route(&mut d, &t, &RouteRequest { n: 2, ..asked(2) }), [2, 3]);
    assert_eq!(d.fallbacks(), [1, 0]);
    assert_eq!(route(&mut d, &t, &RouteRequest { target: Target::Pinned(0), ..asked(2) }), [0]);
    assert_eq!(d.fallbacks(), [] as [u32; 0]);
    route(&mut d, &t, &req(1, Target::Policy));
    assert_eq!(d.fallbacks(), [] as [u32; 0], "not asked for: none");
}

#[test]
fn a_route_is_shed_only_when_every_candidate_queue_is_that_deep() {
    let mut t = table_with_up(3, &[0, 1, 2]);
    let mut d = dispatcher(3, PolicyKind::LeastLoad);
    report(&mut d, &mut t, upd(0, 1, [4, 0, 4, 0, 0]));
    report(&mut d, &mut t, upd(1, 1, [2, 0, 2, 0, 0]));
    report(&mut d, &mut t, upd(2, 1, [3, 0, 3, 0, 0]));
    let shed = |w| RouteRequest { shed_waiting: Some(w), session: Some("s"), ..req(2, Target::Policy) };
    let mut out = Vec::new();
    let routed = per_rank(&d, 3);
    // The shortest queue is rank 1's 2 waiting.
    let e = d.route(&shed(2), &t, None, Instant::now(), &mut out).unwrap_err();
    assert_eq!(e, Unroutable::Saturated { shed_waiting: 2, least: 2 });
    assert!(out.is_empty());
    assert_eq!(per_rank(&d, 3), routed, "nothing placed");
    assert_eq!(d.sessions(), 0, "no session bound");
    // Pending counts as queued: two placements on rank 1 make its queue 4.
    assert_eq!(route(&mut d, &t, &shed(3)), [1, 1]);
    let e = d.route(&RouteRequest { session: None, ..shed(3) }, &t, None, Instant::now(), &mut out).unwrap_err();
    assert_eq!(e, Unroutable::Saturated { shed_waiting: 3, least: 3 });
    // A pin goes where it says, however deep the queues.
    assert_eq!(route(&mut d, &t, &RouteRequest { target: Target::Pinned(0), ..shed(1) }), [0, 0]);
    // `among` narrows the candidates: rank 2 alone (3 queued) is not shed at 4.
    let mut among = crate::engines::RankSet::default();
    among.insert(2);
    assert_eq!(route(&mut d, &t, &RouteRequest { among: Some(among), session: None, ..shed(4) }), [2, 2]);
}
