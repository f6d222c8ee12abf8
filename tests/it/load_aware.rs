//! Load-aware routing against the real binary: exact spreads with frozen
//! stats, acknowledgement, KV pressure, penalties from failures and ttft,
//! silent ranks, and the isolation invariant for least_load and power_of_two.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

fn daemon(policy: &str, dp: u32, extra: &[&str]) -> Daemon {
    let dp = dp.to_string();
    let mut args = vec!["--policy", policy, "--dp-size", &dp, "--tick-ms", "20"];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

fn route(c: &Client, n: u32) -> Vec<u64> {
    c.route(json!({"v": 1, "op": "route", "n": n}))
}

/// Polls `state` until rank `rank`'s penalty equals `want`.
fn await_penalty(d: &Daemon, rank: usize, want: f64) {
    eventually(&format!("rank {rank} penalty {want}"), || (d.ranks()[rank]["penalty"] == json!(want)).then_some(()));
}

#[test]
fn least_load_spreads_40_placements_over_4_idle_ranks_exactly() {
    let d = daemon("least_load", 4, &FROZEN);
    d.bring_up(&d.publisher(), &[0, 1, 2, 3]);
    let c = d.client();
    // 20 queries of n = 1, 2, 1, 2, ... (30 placements), then one of n = 10.
    let mut all: Vec<u64> = (0..20).flat_map(|i| route(&c, 1 + i % 2)).collect();
    all.extend(route(&c, 10));
    assert_eq!(per_rank(&all, 4), [10, 10, 10, 10]);
    let pending: Vec<u64> = d.routed_pending().iter().map(|&(_, p)| p).collect();
    assert_eq!(pending, [10, 10, 10, 10]);
}

#[test]
fn a_rank_that_acknowledges_its_placements_takes_the_next_ones() {
    let d = daemon("least_load", 3, &FROZEN);
    let p = d.publisher();
    let seq = d.bring_up(&p, &[0, 1, 2]);
    let c = d.client();
    assert_eq!(route(&c, 6), [0, 1, 2, 0, 1, 2]);
    // Rank 2 reports both of its requests received and finished.
    p.send(&update(2, 1, seq, [0, 0, 2, 2, 0]));
    d.await_counts(2, [0, 0, 2, 2, 0]);
    assert_eq!(d.routed_pending()[2], (2, 0));
    assert_eq!(route(&c, 2), [2, 2]);
}

/// `field` of every rank in `state`.
fn per_rank_field(d: &Daemon, field: &str) -> Vec<Value> {
    d.ranks().iter().map(|r| r[field].clone()).collect()
}

fn kv_gauge(d: &Daemon, rank: u32) -> Option<f64> {
    d.metric(&format!("dpcoord_engine_kv_usage{{dp_rank=\"{rank}\"}}"))
}

#[test]
fn a_rank_whose_kv_cache_is_nearly_full_weighs_its_queue_more() {
    let d = daemon("least_load", 3, &FROZEN);
    let p = d.publisher();
    let seq = d.bring_up(&p, &[0, 1]);
    // Equal counts, 2 waiting and 4 running; KV 7/8 full on rank 0 (pressure
    // 1 + 6 * 0.375 = 3.25), 1/8 on rank 1 (1). Rank 2 never reports.
    p.send(&Update::new(0, 1, seq).counts([2, 4, 0, 0, 0]).kv_usage(0.875).value());
    p.send(&Update::new(1, 1, seq).counts([2, 4, 0, 0, 0]).kv_usage(0.125).value());
    d.await_counts(0, [2, 4, 0, 0, 0]);
    d.await_counts(1, [2, 4, 0, 0, 0]);
    assert_eq!(per_rank_field(&d, "kv_usage"), [json!(0.875), json!(0.125), Value::Null]);
    // 3.25 * 4*2 + 4 = 30 against 4*2 + 4 = 12.
    assert_eq!(per_rank_field(&d, "load"), [json!(30.0), json!(12.0), json!(0.0)]);
    eventually("the KV gauges after a tick", || (kv_gauge(&d, 0) == Some(0.875)).then_some(()));
    assert_eq!(kv_gauge(&d, 1), Some(0.125));
    assert!(kv_gauge(&d, 2).unwrap().is_nan(), "no report yet: NaN");
    // A placement adds 3.25 * 4 = 13 to rank 0, 4 to rank 1: rank 1 takes
    // 5 (12 .. 28 < 30), then rank 0 (30 < 32), then rank 1 twice (32, 36 < 43).
    assert_eq!(route(&d.client(), 8), [1, 1, 1, 1, 1, 0, 1, 1]);
    assert_eq!(per_rank_field(&d, "load"), [json!(43.0), json!(40.0), json!(0.0)]);
    // An update without `kv_usage`: the plain weighted sum again, 8 + 4 + 4*1.
    p.send(&Update::new(0, 1, seq + 1).counts([2, 4, 0, 0, 0]).value());
    eventually("rank 0 without a KV usage", || d.ranks()[0]["kv_usage"].is_null().then_some(()));
    assert_eq!(per_rank_field(&d, "load"), [json!(16.0), json!(40.0), json!(0.0)]);
    eventually("its gauge NaN after a tick", || kv_gauge(&d, 0).unwrap().is_nan().then_some(()));
}

#[test]
fn failures_and_slow_first_tokens_raise_penalty_within_two_ticks_and_shrink_the_share() {
    let d = daemon("least_load", 3, &FROZEN);
    let p = d.publisher();
    let seq = d.bring_up(&p, &[0, 1, 2]);
    // Rank 1: 10 finished and 10 failed in one tick -> ratio 0.5, smoothed 0.25, weight 5.
    // Rank 2: first tokens 4x the median of the up ranks (100 ms) -> ttft penalty 3.
    for (rank, counts, ttft) in [(0u32, [0; 5], 100.0), (1, [0, 0, 20, 10, 10], 100.0), (2, [0; 5], 400.0)] {
        p.send(&Update::new(rank, 1, seq).counts(counts).ttft(ttft).value());
    }
    await_penalty(&d, 1, 1.25);
    await_penalty(&d, 2, 3.0);
    assert_eq!(d.ranks()[0]["penalty"], json!(0.0));
    // Costs (4*pending + 1) * (1 + penalty), multipliers 1, 2.25 and 4: of 12
    // placements the healthy rank 0 takes 7, the failing rank 1 takes 3 and
    // the slow rank 2 takes 2 (each pick is the cheapest after the last).
    let c = d.client();
    let got = route(&c, 12);
    assert_eq!(got, [0, 1, 2, 0, 0, 1, 0, 0, 2, 1, 0, 0]);
}

#[test]
fn a_silent_rank_stops_receiving_traffic_once_down() {
    let d = daemon("least_load", 2, &["--stale-after-ms", "100", "--down-after-ms", "300"]);
    let p = d.publisher();
    let mut seq = d.bring_up(&p, &[0, 1]);
    // Rank 0 keeps publishing, rank 1 falls silent.
    let state = eventually("rank 1 down", || {
        p.send(&update(0, 1, seq, [0; 5]));
        seq += 1;
        std::thread::sleep(Duration::from_millis(20));
        let ranks = d.ranks();
        (ranks[1]["status"] == "down").then(|| ranks[1].clone())
    });
    // It went down on the first tick at or after down_after_ms (tick 20 ms);
    // the margin covers this test's own polling.
    let age = state["age_ms"].as_u64().unwrap();
    assert!((300..300 + 20 + 200).contains(&age), "down at age {age} ms");
    let c = d.client();
    assert_eq!(route(&c, 8), [0; 8]);
    let h = d.health_client();
    assert_eq!(h.call(json!({"v": 1, "op": "health_route"}))["rank"], json!(0));
}

/// Health queries that leave penalties alone: plain, pinned and room routes, ok reports.
fn health_query(k: u32) -> Value {
    match k % 4 {
        0 => json!({"v": 1, "op": "health_route"}),
        1 => json!({"v": 1, "op": "health_route", "rank": k % 8}),
        2 => json!({"v": 1, "op": "health_route", "bootstrap_room": 1000 + k}),
        _ => json!({"v": 1, "op": "health_report", "rank": k % 8, "ok": true}),
    }
}

/// 160 user answers (mixed n) with or without a health query after every third.
fn user_answers(policy: &str, with_health: bool) -> (Vec<u64>, Vec<(u64, u64)>) {
    let d = daemon(policy, 8, &FROZEN);
    d.bring_up(&d.publisher(), &(0..8).collect::<Vec<_>>());
    let (c, h) = (d.client(), d.health_client());
    let mut answers = Vec::new();
    let mut health_sent = 0;
    for i in 0..80u32 {
        answers.extend(route(&c, 1 + i % 2)); // n = 1, 2, 1, 2, ...: 120 placements
        if with_health && i % 3 == 2 {
            assert_eq!(h.call(health_query(health_sent))["ok"], json!(true));
            health_sent += 1;
        }
    }
    answers.extend(route(&c, 40));
    assert_eq!(health_sent, if with_health { 26 } else { 0 });
    (answers, d.routed_pending())
}

#[test]
fn isolation_holds_for_least_load() {
    let (quiet, quiet_books) = user_answers("least_load", false);
    let (busy, busy_books) = user_answers("least_load", true);
    assert_eq!(busy, quiet);
    assert_eq!(busy_books, quiet_books);
    assert_eq!(per_rank(&quiet, 8), [20; 8]);
}

#[test]
fn isolation_holds_for_seeded_power_of_two() {
    let (quiet, quiet_books) = user_answers("power_of_two", false);
    let (busy, busy_books) = user_answers("power_of_two", true);
    assert_eq!(busy, quiet);
    assert_eq!(busy_books, quiet_books);
    assert_eq!(quiet.len(), 160);
}
