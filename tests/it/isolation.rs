//! The isolation invariant (docs/PROTOCOL.md §5, "Isolation"): nothing that arrives on
//! the health socket changes user routing state. Two fresh daemons get the
//! same engine stats and the same user queries; one also gets ~50 health
//! queries interleaved. The user answers and the user bookkeeping must match.

use crate::common::*;
use serde_json::{json, Value};

const DP: u32 = 8;
const USER_QUERIES: u32 = 160;

/// A daemon over 8 ranks, all up with zero counts. Liveness and pending
/// expiry are set far out so neither can move while a run is in progress.
fn fresh_daemon() -> Daemon {
    Daemon::frozen_up("8", &(0..DP).collect::<Vec<_>>())
}

/// One health query and the reply it must get. `plain` is the index of
/// the next plain `health_route`, which follows the health channel's own
/// rotation (0, 1, 2, ... over the 8 up ranks).
fn health_query(k: u32, plain: &mut u32) -> (Value, Value) {
    let rank = k % DP;
    match k % 6 {
        0 => {
            let want = *plain % DP;
            *plain += 1;
            (
                json!({"v": 1, "op": "health_route", "id": k}),
                json!({"v": 1, "ok": true, "id": k, "rank": want, "epoch": DP}),
            )
        }
        1 => (
            json!({"v": 1, "op": "health_route", "rank": rank}),
            json!({"v": 1, "ok": true, "rank": rank, "epoch": DP}),
        ),
        2 => {
            let room = 1000 + u64::from(k);
            (
                json!({"v": 1, "op": "health_route", "bootstrap_room": room}),
                json!({"v": 1, "ok": true, "rank": room % u64::from(DP), "epoch": DP}),
            )
        }
        3 => (json!({"v": 1, "op": "health_report", "rank": rank, "ok": true}), json!({"v": 1, "ok": true})),
        4 => (json!({"v": 1, "op": "health_report", "rank": rank, "ok": false}), json!({"v": 1, "ok": true})),
        _ => (json!({"v": 1, "op": "health_route", "rank": DP}), Value::Null), // invalid_rank, checked below
    }
}

/// Sends `user` route queries (in order) and returns the ranks answered.
/// With `with_health`, a health query follows every third user query.
/// Returns (user answers, number of health queries sent).
fn run(d: &Daemon, user: &[Value], with_health: bool) -> (Vec<Vec<u64>>, u32) {
    let c = d.client();
    let h = d.health_client();
    let (mut answers, mut sent, mut plain) = (Vec::new(), 0, 0);
    for (i, q) in user.iter().enumerate() {
        let r = c.call(q.clone());
        assert_eq!(r["ok"], json!(true), "user query {i} {q} refused: {r}");
        assert_eq!(r["id"], q["id"], "user query {i}: id not echoed");
        answers.push(ranks_of(&r));
        if with_health && i % 3 == 2 {
            let (hq, want) = health_query(sent, &mut plain);
            let got = h.call(hq.clone());
            if want.is_null() {
                assert_eq!(got["error"]["code"], json!("invalid_rank"), "{hq} -> {got}");
            } else {
                assert_eq!(got, want, "health query {sent}: {hq}");
            }
            sent += 1;
        }
    }
    (answers, sent)
}

/// Population standard deviation of placements per rank.
fn population_std(per_rank: &[u64]) -> f64 {
    let n = per_rank.len() as f64;
    let mean = per_rank.iter().sum::<u64>() as f64 / n;
    (per_rank.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
}

#[test]
fn same_160_user_answers_with_and_without_50_interleaved_health_queries() {
    let user: Vec<Value> = (0..USER_QUERIES).map(|i| json!({"v": 1, "op": "route", "id": i})).collect();

    let quiet = fresh_daemon();
    let (without, none) = run(&quiet, &user, false);
    let quiet_books = quiet.routed_pending();
    assert_eq!(none, 0);

    let busy = fresh_daemon();
    let (with, health_sent) = run(&busy, &user, true);
    let busy_books = busy.routed_pending();
    assert_eq!(health_sent, 53);

    let expected: Vec<Vec<u64>> = (0..USER_QUERIES).map(|i| vec![u64::from(i % DP)]).collect();
    assert_eq!(without, expected, "plain round-robin over 8 up ranks");
    assert_eq!(with, without, "health traffic changed the user answers");
    let counts = per_rank(&with.concat(), DP as usize);
    assert_eq!(counts, vec![20; DP as usize]);
    let std = population_std(&counts);
    assert_eq!(std, 0.0);
    assert_eq!(format!("{std:.2}"), "0.00");
    // Every placement is still pending (engines reported received = 0).
    assert_eq!(quiet_books, vec![(20, 20); DP as usize]);
    assert_eq!(busy_books, quiet_books, "health traffic changed routed/pending");

    assert_eq!(quiet.stop().code(), Some(0));
    assert_eq!(busy.stop().code(), Some(0));
}

#[test]
fn batches_pins_and_rooms_answer_the_same_with_health_traffic_interleaved() {
    // A mix of user query shapes; pins and rooms must not move the cursor
    // in either run, and health must move nothing at all.
    let user: Vec<Value> = (0..60u32)
        .map(|i| match i % 4 {
            0 => json!({"v": 1, "op": "route", "id": i, "n": 3}),
            1 => json!({"v": 1, "op": "route", "id": i, "rank": (i * 5) % DP}),
            2 => json!({"v": 1, "op": "route", "id": i, "bootstrap_room": 77 + i, "n": 2}),
            _ => json!({"v": 1, "op": "route", "id": i}),
        })
        .collect();

    let quiet = fresh_daemon();
    let (without, _) = run(&quiet, &user, false);
    let busy = fresh_daemon();
    let (with, health_sent) = run(&busy, &user, true);
    assert_eq!(health_sent, 20);
    assert_eq!(with, without, "health traffic changed the user answers");

    // The policy-placed answers alone form one unbroken rotation.
    let rotation: Vec<u64> =
        with.iter().enumerate().filter(|(i, _)| i % 4 == 0 || i % 4 == 3).flat_map(|(_, r)| r.clone()).collect();
    let want: Vec<u64> = (0..rotation.len() as u64).map(|i| i % u64::from(DP)).collect();
    assert_eq!(rotation, want);

    let books = quiet.routed_pending();
    let placed = per_rank(&with.concat(), DP as usize);
    assert_eq!(books, placed.iter().map(|&n| (n, n)).collect::<Vec<_>>());
    assert_eq!(busy.routed_pending(), books, "health traffic changed routed/pending");
}
