//! Liveness over real time, with short flags: `unknown` -> `up` -> `stale`
//! -> `down` -> `up` after `readmit_updates` consecutive updates, the exact
//! epoch at each step, stale ranks still routed, down and unknown ranks
//! never routed (user or health). Every wait polls `state`; nothing asserts
//! how fast a transition happened.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

const STALE_MS: u64 = 300;

fn status(d: &Daemon, rank: usize) -> Value {
    d.ranks()[rank]["status"].clone()
}

fn epoch(d: &Daemon) -> Value {
    d.client().call(json!({"v": 1, "op": "ping"}))["epoch"].clone()
}

/// Publishes a valid update for `rank` every 20 ms until `stop`, so the
/// rank stays up whatever the test does meanwhile.
fn heartbeat(d: &Daemon, rank: u32, stop: &AtomicBool) {
    let p = d.publisher();
    let mut seq = 0;
    while !stop.load(Ordering::Relaxed) {
        seq += 1;
        p.send(&update(rank, 1, seq, [0; 5]));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn unknown_up_stale_down_and_readmitted_with_exact_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("dpcoord.toml");
    std::fs::write(&cfg, "[engines]\nreadmit_updates = 3\n").unwrap();
    let stale = STALE_MS.to_string();
    let d = Daemon::start(&[
        "--config",
        cfg.to_str().unwrap(),
        "--dp-size",
        "3",
        "--tick-ms",
        "20",
        "--stale-after-ms",
        &stale,
        "--down-after-ms",
        "1500",
        "--pending-ttl-ms",
        "3600000",
    ]);
    let (c, h) = (d.client(), d.health_client());
    let route = |q: Value| c.call(q)["ranks"].clone();
    let probe = |q: Value| h.call(q)["rank"].clone();

    // Nothing reported yet: every rank unknown, counts 0, no age, epoch 0.
    let s = d.state();
    assert_eq!(s["epoch"], json!(0));
    for r in s["ranks"].as_array().unwrap() {
        assert_eq!(
            (&r["status"], &r["counts"], &r["age_ms"]),
            (&json!("unknown"), &json!([0, 0, 0, 0, 0]), &Value::Null)
        );
    }
    assert_eq!(c.error_code(json!({"v": 1, "op": "route"})), "no_engine_available");
    assert_eq!(h.error_code(json!({"v": 1, "op": "health_route"})), "no_engine_available");

    // Rank 1 is kept up throughout; rank 2 never reports; rank 0 goes through the cycle.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| heartbeat(&d, 1, &stop));
        let _stop = SetOnDrop(&stop);
        let s = d.wait_status(1, "up");
        assert_eq!(s["epoch"], json!(1), "the first rank coming up makes epoch 1");
        let p = d.publisher();
        let mut seq = d.bring_up(&p, &[0]);
        assert_eq!(epoch(&d), json!(2));
        assert_eq!(
            c.call(json!({"v": 1, "op": "route", "n": 4})),
            json!({"v": 1, "ok": true, "ranks": [0, 1, 0, 1], "epoch": 2})
        );

        // Stale: still routable, so still routed; the epoch does not move.
        let s = d.wait_status(0, "stale");
        assert_eq!(s["epoch"], json!(2));
        assert!(s["ranks"][0]["age_ms"].as_u64().unwrap() >= STALE_MS, "{s}");
        assert_eq!(route(json!({"v": 1, "op": "route", "n": 2})), json!([0, 1]));
        assert_eq!(route(json!({"v": 1, "op": "route", "rank": 0})), json!([0]));
        assert_eq!(route(json!({"v": 1, "op": "route", "bootstrap_room": 3})), json!([0]));
        assert_eq!(probe(json!({"v": 1, "op": "health_route"})), json!(0));
        assert_eq!(probe(json!({"v": 1, "op": "health_route"})), json!(1));
        assert_eq!(probe(json!({"v": 1, "op": "health_route", "rank": 0})), json!(0));
        assert_eq!(status(&d, 0), json!("stale"), "the answers above were given while stale");

        // A stale rank is up again on its next update, with no epoch change.
        p.send(&update(0, 1, seq, [1, 0, 0, 0, 0]));
        seq += 1;
        let e = d.await_counts(0, [1, 0, 0, 0, 0]);
        assert_eq!(e["status"], json!("up"));
        assert_eq!(epoch(&d), json!(2));

        // Silent again: stale (epoch 2), then down (epoch 3).
        assert_eq!(d.wait_status(0, "stale")["epoch"], json!(2));
        assert_eq!(d.wait_status(0, "down")["epoch"], json!(3));

        // Down and unknown ranks are never routed, by the policy or by a pin or room.
        let books = d.routed_pending();
        assert_eq!(route(json!({"v": 1, "op": "route", "n": 4})), json!([1, 1, 1, 1]));
        assert_eq!(probe(json!({"v": 1, "op": "health_route"})), json!(1));
        assert_eq!(probe(json!({"v": 1, "op": "health_route"})), json!(1));
        let refused = [
            (&c, json!({"v": 1, "op": "route", "rank": 0})),
            (&c, json!({"v": 1, "op": "route", "bootstrap_room": 6, "n": 3})),
            (&c, json!({"v": 1, "op": "route", "rank": 2})),
            (&h, json!({"v": 1, "op": "health_route", "rank": 0})),
            (&h, json!({"v": 1, "op": "health_route", "bootstrap_room": 3})),
            (&h, json!({"v": 1, "op": "health_route", "rank": 2})),
        ];
        for (client, q) in refused {
            assert_eq!(client.error_code(q.clone()), "rank_unavailable", "{q}");
        }
        let mut want = books.clone();
        want[1].0 += 4;
        want[1].1 += 4;
        assert_eq!(d.routed_pending(), want, "only the 4 placements on rank 1 counted");

        // Readmission takes readmit_updates (3) consecutive updates; one is not enough.
        p.send(&update(0, 1, seq, [2, 0, 0, 0, 0]));
        seq += 1;
        assert_eq!(d.await_counts(0, [2, 0, 0, 0, 0])["status"], json!("down"));
        // A gap above stale_after_ms restarts the count.
        eventually("a gap above stale_after_ms", || {
            (d.ranks()[0]["age_ms"].as_u64().unwrap() > STALE_MS).then_some(())
        });
        for (i, waiting) in [3, 4].into_iter().enumerate() {
            p.send(&update(0, 1, seq, [waiting, 0, 0, 0, 0]));
            seq += 1;
            let e = d.await_counts(0, [waiting, 0, 0, 0, 0]);
            assert_eq!(e["status"], json!("down"), "update {} of 3 after the gap", i + 1);
        }
        assert_eq!(epoch(&d), json!(3));
        assert_eq!(route(json!({"v": 1, "op": "route", "n": 2})), json!([1, 1]));
        p.send(&update(0, 1, seq, [5, 0, 0, 0, 0]));
        assert_eq!(d.await_counts(0, [5, 0, 0, 0, 0])["status"], json!("up"));
        assert_eq!(epoch(&d), json!(4));
        assert_eq!(
            c.call(json!({"v": 1, "op": "route", "n": 2})),
            json!({"v": 1, "ok": true, "ranks": [0, 1], "epoch": 4})
        );
        assert_eq!(probe(json!({"v": 1, "op": "health_route"})), json!(0));
        assert_eq!(d.ranks()[2]["status"], json!("unknown"));
    });
}

#[test]
fn ranks_going_down_on_the_same_tick_bump_the_epoch_once() {
    // docs/PROTOCOL.md §3: epoch "increments whenever the set of routable ranks
    // changes". Two ranks whose last updates arrived together cross
    // down_after on the same tick (ticks are a second apart here), so the
    // routable set changes once: {0, 1} -> {}.
    let d =
        Daemon::start(&["--dp-size", "2", "--tick-ms", "1000", "--stale-after-ms", "100", "--down-after-ms", "200"]);
    let p = d.publisher();
    d.bring_up(&p, &[0, 1]);
    assert_eq!(epoch(&d), json!(2), "two ranks came up on two separate updates");
    // Should a tick ever fall between the two (one down, one not), the set
    // changed twice, and two bumps are right.
    let mut split = false;
    let s = eventually("both ranks down", || {
        let s = d.state();
        let down = s["ranks"].as_array().unwrap().iter().filter(|r| r["status"] == "down").count();
        split |= down == 1;
        (down == 2).then_some(s)
    });
    let want = if split { 4 } else { 3 };
    assert_eq!(s["epoch"], json!(want), "one bump per change of the routable set (split ticks: {split})");
}
