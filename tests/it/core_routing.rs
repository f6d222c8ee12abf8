//! User routing with `round_robin` over real sockets: batches continue the
//! rotation, pins and bootstrap rooms count as load without moving the
//! cursor, `rank` wins over `bootstrap_room`; REQ and DEALER peers (with the
//! empty delimiter) are both answered; `ping` and `state` on both sockets.

use crate::common::*;
use serde_json::{json, Value};

/// `(routed, pending)` per rank when the engines acknowledged nothing yet.
fn placed(per_rank: &[u64]) -> Vec<(u64, u64)> {
    per_rank.iter().map(|&n| (n, n)).collect()
}

#[test]
fn batches_continue_the_rotation() {
    let d = Daemon::frozen_up("4", &[0, 1, 2, 3]);
    let c = d.client();
    let r = c.call(json!({"v": 1, "op": "route", "n": 3, "id": "b1"}));
    assert_eq!(r, json!({"v": 1, "ok": true, "id": "b1", "ranks": [0, 1, 2], "epoch": 4}));
    assert_eq!(c.route(json!({"v": 1, "op": "route", "n": 2})), [3, 0]);
    assert_eq!(c.route(json!({"v": 1, "op": "route", "n": 5})), [1, 2, 3, 0, 1]);
    assert_eq!(c.route(json!({"v": 1, "op": "route"})), [2]);
    assert_eq!(d.routed_pending(), placed(&[3, 3, 3, 2]));
}

#[test]
fn a_batch_of_max_batch_is_placed_in_rotation_order() {
    let d = Daemon::frozen_up("4", &[0, 1, 2, 3]);
    let c = d.client();
    assert_eq!(c.route(json!({"v": 1, "op": "route"})), [0]);
    let want: Vec<u64> = (1..=1024).map(|i| i % 4).collect();
    assert_eq!(c.route(json!({"v": 1, "op": "route", "n": 1024})), want);
    assert_eq!(d.routed_pending(), placed(&[257, 256, 256, 256]));
}

#[test]
fn rotation_skips_ranks_that_are_not_routable() {
    let d = Daemon::frozen_up("4", &[0, 2, 3]);
    let c = d.client();
    assert_eq!(c.route(json!({"v": 1, "op": "route", "n": 4})), [0, 2, 3, 0]);
    assert_eq!(c.route(json!({"v": 1, "op": "route", "n": 3})), [2, 3, 0]);
    assert_eq!(d.routed_pending(), placed(&[3, 0, 2, 2]));
}

#[test]
fn pins_and_rooms_count_as_load_but_do_not_advance_the_cursor() {
    let d = Daemon::frozen_up("4", &[0, 1, 2, 3]);
    let c = d.client();
    assert_eq!(c.route(json!({"v": 1, "op": "route"})), [0]);
    assert_eq!(c.route(json!({"v": 1, "op": "route", "rank": 2, "n": 3})), [2, 2, 2]);
    assert_eq!(c.route(json!({"v": 1, "op": "route", "bootstrap_room": 9, "n": 2})), [1, 1]);
    assert_eq!(c.route(json!({"v": 1, "op": "route", "bootstrap_room": u64::MAX})), [3]);
    // The next policy answer is the one due after [0]: the cursor did not move.
    assert_eq!(c.route(json!({"v": 1, "op": "route", "n": 2})), [1, 2]);
    assert_eq!(d.routed_pending(), placed(&[1, 3, 4, 1]));
    assert_eq!(c.route(json!({"v": 1, "op": "route", "rank": 0})), [0]);
    assert_eq!(c.route(json!({"v": 1, "op": "route"})), [3]);
    assert_eq!(d.routed_pending(), placed(&[2, 3, 4, 2]));
}

#[test]
fn bootstrap_room_maps_to_room_mod_dp_size_and_rank_wins_over_it() {
    let d = Daemon::frozen_up("4", &[0, 1, 2, 3]);
    let c = d.client();
    for room in [0u64, 1, 2, 3, 4, 5, 6, 7, 1_000_003, u64::MAX - 1] {
        assert_eq!(c.route(json!({"v": 1, "op": "route", "bootstrap_room": room})), [room % 4], "room {room}");
    }
    for (rank, room) in [(3u64, 1u64), (0, 2), (2, 2)] {
        let q = json!({"v": 1, "op": "route", "rank": rank, "bootstrap_room": room, "n": 2});
        assert_eq!(c.route(q), [rank, rank], "rank {rank} with room {room}");
    }
    // None of that moved the cursor.
    assert_eq!(c.route(json!({"v": 1, "op": "route", "n": 4})), [0, 1, 2, 3]);
    assert_eq!(d.routed_pending(), placed(&[5, 3, 6, 6]));
}

#[test]
fn health_rotation_is_its_own_and_pins_and_rooms_do_not_advance_it() {
    let d = Daemon::frozen_up("4", &[0, 1, 3]);
    let h = d.health_client();
    let probe = |q: Value| h.health_rank(q);
    assert_eq!(probe(json!({"v": 1, "op": "health_route"})), 0);
    assert_eq!(probe(json!({"v": 1, "op": "health_route", "rank": 3})), 3);
    assert_eq!(probe(json!({"v": 1, "op": "health_route", "bootstrap_room": 4})), 0);
    assert_eq!(probe(json!({"v": 1, "op": "health_route"})), 1);
    assert_eq!(probe(json!({"v": 1, "op": "health_route"})), 3);
    assert_eq!(probe(json!({"v": 1, "op": "health_route"})), 0);
    let r = h.call(json!({"v": 1, "op": "health_route", "id": 9, "rank": 1, "bootstrap_room": 3}));
    assert_eq!(r, json!({"v": 1, "ok": true, "id": 9, "rank": 1, "epoch": 3}), "rank wins over bootstrap_room");
    // Health placements are not user placements.
    assert_eq!(d.routed_pending(), placed(&[0, 0, 0, 0]));
}

#[test]
fn req_and_dealer_peers_with_the_empty_delimiter_get_answers_on_both_sockets() {
    let d = Daemon::frozen_up("4", &[0, 1, 2, 3]);
    let dealer_replies = |endpoint: &str, queries: Vec<Value>| -> Vec<Value> {
        let s = d.socket(zmq::DEALER, endpoint);
        let n = queries.len();
        for q in queries {
            dealer_send(&s, vec![encode(&q)]);
        }
        (0..n).map(|_| dealer_reply(&s)).collect()
    };

    // Several DEALER queries in flight at once, answered in order, ids echoed.
    let queries = (0..6).map(|i| json!({"v": 1, "op": "route", "id": i})).collect();
    let replies = dealer_replies(&d.route, queries);
    for (i, r) in replies.iter().enumerate() {
        assert_eq!(*r, json!({"v": 1, "ok": true, "id": i, "ranks": [i % 4], "epoch": 4}));
    }
    // A REQ peer carries on the same rotation.
    let r = d.client().call(json!({"v": 1, "op": "route", "id": "req", "n": 2}));
    assert_eq!(r, json!({"v": 1, "ok": true, "id": "req", "ranks": [2, 3], "epoch": 4}));

    let queries = vec![
        json!({"v": 1, "op": "health_route", "id": "a"}),
        json!({"v": 1, "op": "health_report", "id": "b", "rank": 2, "ok": true}),
        json!({"v": 1, "op": "ping", "id": "c"}),
    ];
    let replies = dealer_replies(&d.health, queries);
    assert_eq!(replies[0], json!({"v": 1, "ok": true, "id": "a", "rank": 0, "epoch": 4}));
    assert_eq!(replies[1], json!({"v": 1, "ok": true, "id": "b"}));
    assert_eq!(
        replies[2],
        json!({"v": 1, "ok": true, "id": "c", "epoch": 4, "instance": d.state()["instance"], "block_size": 16})
    );
    let r = d.health_client().call(json!({"v": 1, "op": "health_route", "id": 5}));
    assert_eq!(r, json!({"v": 1, "ok": true, "id": 5, "rank": 1, "epoch": 4}));
}

#[test]
fn ping_and_state_are_served_on_both_sockets_and_unknown_keys_are_ignored() {
    let d = Daemon::frozen_up("3", &[0, 2]);
    let (c, h) = (d.client(), d.health_client());
    for client in [&c, &h] {
        let r = client.call(json!({"v": 1, "op": "ping", "id": -7, "future": {"x": [1, 2]}}));
        assert_eq!(
            r,
            json!({"v": 1, "ok": true, "id": -7, "epoch": 2, "instance": d.state()["instance"], "block_size": 16})
        );
        let s = client.call(json!({"v": 1, "op": "state", "id": "s"}));
        assert_eq!((&s["v"], &s["ok"], &s["id"], &s["epoch"]), (&json!(1), &json!(true), &json!("s"), &json!(2)));
        let entries = s["ranks"].as_array().unwrap();
        assert_eq!(statuses(&s), json!(["up", "unknown", "up"]));
        for (i, r) in entries.iter().enumerate() {
            assert_eq!(r["rank"], json!(i));
            assert_eq!(r["counts"], json!([0, 0, 0, 0, 0]));
            assert_eq!((&r["pending"], &r["penalty"]), (&json!(0), &json!(0.0)));
            assert_eq!(r["age_ms"].is_u64(), i != 1, "age_ms is nil only while unknown: {r}");
        }
    }
    let q = json!({"v": 1, "op": "route", "n": 2, "prompt_tokens": 100, "session": null, "extra": "x"});
    assert_eq!(c.route(q), [0, 2]);
}
