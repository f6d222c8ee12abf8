//! A flood of `prefix` ops on the health socket (each keys a long prompt)
//! while a frontend routes: every route query is answered, and so is every
//! health op, exactly once, in order. Health queries take a bounded slice
//! of each poll round; the latency this keeps for routes is measured by
//! `cargo bench --bench dpcoord -- health_flood`, not here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::common::*;
use serde_json::{json, Value};

/// Tokens of each flooding prompt (32 KiB as MessagePack: each token below 128 is one byte, so a
/// prompt fits the default 64 KiB message limit).
const TOKENS: u32 = 32_768;
/// Flooding DEALERs, the ops each sends, and how many each keeps in flight.
const DEALERS: u64 = 3;
const OPS: u64 = 300;
const WINDOW: u64 = 32;

fn prompt() -> Vec<u32> {
    (0..TOKENS).map(|i| (i * 7919) % 128).collect()
}

/// Sends [`OPS`] `prefix` ops, [`WINDOW`] in flight, and checks each reply
/// is `expected` with the op's id, in order. Returns the replies read.
fn flood(d: &Daemon, n: u64, body: &[u8], expected: &Value) -> u64 {
    let s = d.socket(zmq::DEALER, &d.health);
    let (mut sent, mut read) = (0, 0);
    while read < OPS {
        while sent < OPS && sent - read < WINDOW {
            // The id is spliced in front of the shared body: one map entry more.
            let id = n * OPS + sent;
            dealer_send(&s, vec![with_id(body, id)]);
            sent += 1;
        }
        let r = dealer_reply(&s);
        let mut want = expected.clone();
        want["id"] = json!(n * OPS + read);
        assert_eq!(r, want);
        read += 1;
    }
    read
}

/// `body` (a MessagePack map of fewer than 15 entries) with `"id": id` added.
fn with_id(body: &[u8], id: u64) -> Vec<u8> {
    let mut out = vec![body[0] + 1];
    rmp::encode::write_str(&mut out, "id").unwrap();
    rmp::encode::write_uint(&mut out, id).unwrap();
    out.extend_from_slice(&body[1..]);
    out
}

#[test]
fn a_prefix_flood_on_the_health_socket_leaves_every_route_answered() {
    let d = Daemon::frozen("4", &[]);
    d.bring_up(&d.publisher(), &[0, 1, 2, 3]);
    let tokens = prompt();
    let body = rmp_serde::to_vec_named(&json!({"v": 1, "op": "prefix", "tokens": tokens})).unwrap();
    let quiet = d.health_client().call(json!({"v": 1, "op": "prefix", "tokens": tokens, "id": 0}));
    // No KV events: prompts are keyed in blocks of 16 and no rank holds one.
    let expected = json!({"v": 1, "ok": true, "id": 0, "blocks": TOKENS / 16, "matched": [0, 0, 0, 0]});
    assert_eq!(quiet, expected);
    let user = d.client();
    let (done, routed) = (AtomicBool::new(false), AtomicU64::new(0));
    let answered: u64 = std::thread::scope(|s| {
        let _done = SetOnDrop(&done);
        let (done, routed) = (&done, &routed);
        s.spawn(move || {
            // Round robin over four ranks from a cursor no one else moves.
            while !done.load(Ordering::Relaxed) {
                let k = routed.load(Ordering::Relaxed);
                assert_eq!(user.route(json!({"v": 1, "op": "route", "id": k})), [k % 4]);
                routed.fetch_add(1, Ordering::Relaxed);
            }
        });
        let (d, body, expected) = (&d, &body, &expected);
        let floods: Vec<_> = (0..DEALERS).map(|n| s.spawn(move || flood(d, n, body, expected))).collect();
        let answered = floods.into_iter().map(|h| h.join().unwrap()).sum();
        // Routes kept being answered while the flood ran, and go on after it.
        let after = routed.load(Ordering::Relaxed);
        eventually("routes after the flood", || (routed.load(Ordering::Relaxed) >= after + 10).then_some(()));
        answered
    });
    assert_eq!(answered, DEALERS * OPS);
    // Every route the frontend sent was answered: the books hold all of them.
    assert_eq!(d.routed().iter().sum::<u64>(), routed.into_inner());
}
