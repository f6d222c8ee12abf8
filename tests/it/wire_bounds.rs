//! What a peer can make dpcoord hold and echo, against the real binary:
//! the `id` cap (a long or non-scalar id is refused and never echoed), the
//! envelope bounds on the route and health ROUTERs (a frame above 255 bytes
//! or more than 8 frames before the delimiter: dropped unanswered, counted,
//! other clients served), and the contract fields a client matches replies
//! with: `instance` in `ping` and `state`, `epoch` and a readable `id` in
//! refusals (docs/PROTOCOL.md §1, §4, §10).

use crate::common::*;
use rmpv::Value as M;
use serde_json::{json, Value};

/// `dpcoord_queries_dropped_total` for `socket` and `reason`.
fn dropped(d: &Daemon, socket: &str, reason: &str) -> Option<f64> {
    d.metric(&format!("dpcoord_queries_dropped_total{{reason=\"{reason}\",socket=\"{socket}\"}}"))
}

/// Sends `frames` from `s` as they are, then a ping `{id: k}` after an
/// empty delimiter; returns the first reply the DEALER gets. Replies on
/// one connection keep their order, so a ping's reply first proves the
/// frames before it were not answered.
fn first_reply_after(s: &zmq::Socket, frames: &[&[u8]], k: i64) -> Vec<Vec<u8>> {
    s.send_multipart(frames, 0).unwrap();
    s.send_multipart([&b""[..], &encode(&json!({"v": 1, "op": "ping", "id": k}))[..]], 0).unwrap();
    s.recv_multipart(0).expect("dpcoord did not answer the DEALER in time")
}

fn ping_bytes(id: &str) -> Vec<u8> {
    encode(&json!({"v": 1, "op": "ping", "id": id}))
}

#[test]
fn an_id_above_128_bytes_or_not_a_string_or_int_is_refused_with_no_id_and_changes_nothing() {
    let d = Daemon::frozen_up("2", &[0, 1]);
    let before = d.books();
    let epoch = before["epoch"].clone();
    let long = "x".repeat(129);
    for c in [d.client(), d.health_client()] {
        let at_cap = "y".repeat(128);
        let r = c.call(json!({"v": 1, "op": "ping", "id": at_cap}));
        assert_eq!((&r["ok"], &r["id"]), (&json!(true), &json!(at_cap)), "{r}");
        let ids = [M::from(long.as_str()), M::Binary(vec![b'x'; 64]), M::Array(vec![1.into()]), M::Map(vec![])];
        for id in ids {
            let r = c.call_raw(&query("ping", id.clone(), &[]));
            let message = r["error"]["message"].as_str().unwrap_or_default().to_owned();
            let keys: Vec<&str> = r.as_object().unwrap().keys().map(String::as_str).collect();
            assert_eq!(keys, ["epoch", "error", "ok", "v"], "{id}: {r}");
            assert_eq!((&r["ok"], &r["error"]["code"], &r["epoch"]), (&json!(false), &json!("bad_request"), &epoch));
            assert!(message.starts_with("`id`"), "{id}: {message}");
            assert!(!message.contains("xx"), "{id}: the message echoes the id: {message}");
        }
        // Also when the query is above max_message_bytes (too_large, still no id).
        let big = query("ping", long.as_str(), &[("pad", M::Binary(vec![0; 70_000]))]);
        let r = c.call_raw(&big);
        assert_eq!((&r["error"]["code"], r.get("id")), (&json!("too_large"), None), "{r}");
    }
    assert_eq!(d.metric("dpcoord_route_errors_total{code=\"bad_request\"}"), Some(8.0));
    assert_eq!(d.books(), before);
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn an_envelope_frame_above_255_bytes_is_dropped_unanswered_and_counted() {
    let d = Daemon::frozen_up("2", &[0, 1]);
    let bystander = d.client();
    let hop = [b'h'; 255];
    let big = [b'b'; 300];
    for (endpoint, socket) in [(&d.route, "route"), (&d.health, "health")] {
        let s = d.socket(zmq::DEALER, endpoint);
        // A frame of exactly 255 bytes before the delimiter is echoed.
        let q = ping_bytes("ok");
        let reply = first_reply_after(&s, &[&hop, b"", &q], 1);
        assert_eq!(reply[0], hop.to_vec());
        let r: Value = rmp_serde::from_slice(&reply[2]).unwrap();
        assert_eq!(r["id"], json!("ok"));
        // The ping sent after it.
        let reply = s.recv_multipart(0).unwrap();
        assert_eq!(rmp_serde::from_slice::<Value>(&reply[1]).unwrap()["id"], json!(1));
        // 300 bytes: no reply; the ping sent next is the first answer.
        let reply = first_reply_after(&s, &[&big, b"", &ping_bytes("big")], 2);
        assert_eq!(reply.len(), 2, "{reply:?}");
        assert_eq!(rmp_serde::from_slice::<Value>(&reply[1]).unwrap()["id"], json!(2));
        assert_eq!(dropped(&d, socket, "frame_too_large"), Some(1.0));
        assert_eq!(dropped(&d, socket, "too_many_frames"), Some(0.0));
        assert_eq!(bystander.call(json!({"v": 1, "op": "ping", "id": socket}))["id"], json!(socket));
    }
    assert_eq!(d.metric("dpcoord_route_errors_total{code=\"bad_request\"}"), Some(0.0));
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn a_megabyte_envelope_frame_is_dropped_by_dpcoord_or_by_libzmq_and_never_echoed() {
    // With max_message_bytes at 2 MiB the frame reaches dpcoord, which drops it.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("big.toml");
    std::fs::write(&cfg, "[limits]\nmax_message_bytes = 2097152\n").unwrap();
    let d = Daemon::frozen("2", &["--config", cfg.to_str().unwrap()]);
    let s = d.socket(zmq::DEALER, &d.route);
    let mega = vec![b'm'; 1 << 20];
    let reply = first_reply_after(&s, &[&mega, b"", &ping_bytes("mega")], 1);
    assert_eq!(reply.len(), 2, "the megabyte frame came back");
    assert_eq!(rmp_serde::from_slice::<Value>(&reply[1]).unwrap()["id"], json!(1));
    assert_eq!(dropped(&d, "route", "frame_too_large"), Some(1.0));
    assert_eq!(d.client().call(json!({"v": 1, "op": "ping", "id": 2}))["id"], json!(2));
    assert_eq!(d.stop().code(), Some(0));

    // At the default limit libzmq's backstop (65,536 + 64 KiB per frame)
    // closes the sender's connection first: dpcoord never sees the frame.
    let d = Daemon::frozen("2", &[]);
    let bystander = d.client();
    let s = d.socket(zmq::DEALER, &d.route);
    s.send_multipart([&mega[..], b"", &ping_bytes("mega")], 0).unwrap();
    assert_eq!(bystander.call(json!({"v": 1, "op": "ping", "id": 3}))["id"], json!(3));
    // The DEALER reconnects by itself; pings sent meanwhile may be lost.
    let mut k = 10;
    let first = eventually("the DEALER served again", || {
        k += 1;
        s.send_multipart([&b""[..], &encode(&json!({"v": 1, "op": "ping", "id": k}))[..]], 0).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        s.recv_multipart(zmq::DONTWAIT).ok()
    });
    assert_eq!(first.len(), 2, "the megabyte frame came back");
    assert!(rmp_serde::from_slice::<Value>(&first[1]).unwrap()["id"].as_i64().unwrap() > 10);
    assert_eq!(dropped(&d, "route", "frame_too_large"), Some(0.0));
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn more_than_8_frames_before_the_delimiter_are_dropped_unanswered_and_counted() {
    let d = Daemon::frozen("2", &[]);
    let hops: Vec<&[u8]> = vec![b"hop"; 8];
    for (endpoint, socket) in [(&d.route, "route"), (&d.health, "health")] {
        let s = d.socket(zmq::DEALER, endpoint);
        // The identity and 7 frames: 8 before the delimiter, answered along all of them.
        let q = ping_bytes("seven");
        let frames: Vec<&[u8]> = hops[..7].iter().copied().chain([&b""[..], &q[..]]).collect();
        let reply = first_reply_after(&s, &frames, 1);
        assert_eq!(reply.len(), 9, "{reply:?}");
        assert_eq!(rmp_serde::from_slice::<Value>(&reply[8]).unwrap()["id"], json!("seven"));
        s.recv_multipart(0).unwrap();
        // One more: dropped.
        let q = ping_bytes("eight");
        let frames: Vec<&[u8]> = hops.iter().copied().chain([&b""[..], &q[..]]).collect();
        let reply = first_reply_after(&s, &frames, 2);
        assert_eq!(rmp_serde::from_slice::<Value>(&reply[1]).unwrap()["id"], json!(2));
        assert_eq!(dropped(&d, socket, "too_many_frames"), Some(1.0));
        assert_eq!(dropped(&d, socket, "frame_too_large"), Some(0.0));
    }
    // Many body frames after a good envelope are still refused with a reply.
    let s = d.socket(zmq::DEALER, &d.route);
    let q = ping_bytes("many");
    let r = dealer_call(&s, vec![q.clone(); 20]);
    assert_eq!((&r["error"]["code"], &r["epoch"]), (&json!("bad_request"), &json!(0)), "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("got 20 frames"), "{r}");
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn refusals_carry_the_epoch_and_the_id_read_before_the_fault() {
    let d = Daemon::frozen_up("3", &[0, 2]);
    let c = d.client();
    // Epoch 2: ranks 0 and 2 came up.
    let r = c.call(json!({"v": 1, "op": "route", "id": "pin", "rank": 1}));
    assert_eq!((&r["error"]["code"], &r["id"], &r["epoch"]), (&json!("rank_unavailable"), &json!("pin"), &json!(2)));
    // The id comes first and the map is cut short: the id is still read.
    let whole = map(&[("id", "cut".into()), ("v", 1.into()), ("op", "ping".into())]);
    let r = c.call_raw(&whole[..whole.len() - 3]);
    assert_eq!((&r["error"]["code"], &r["id"], &r["epoch"]), (&json!("bad_request"), &json!("cut"), &json!(2)));
    // A non-string key before the id is skipped: the id after it is read.
    let odd =
        msgpack(&M::Map(vec![(M::from(5), M::from(5)), (M::from("id"), M::from(77)), (M::from("v"), M::from(1))]));
    let r = d.health_client().call_raw(&odd);
    assert_eq!((&r["error"]["code"], &r["id"], &r["epoch"]), (&json!("bad_request"), &json!(77), &json!(2)));
    assert_eq!(r["error"]["message"], json!("map keys must be strings, got an integer"));
    // Not one body frame: no id to read, the epoch all the same.
    let r = dealer_call(&d.socket(zmq::DEALER, &d.route), vec![]);
    assert_eq!((r.get("id"), &r["epoch"]), (None, &json!(2)), "{r}");
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn ping_state_and_http_state_carry_one_instance_that_a_restart_changes() {
    let mut d = Daemon::frozen("2", &[]);
    let instance_of = |d: &Daemon| {
        let ping = d.client().call(json!({"v": 1, "op": "ping"}));
        let health = d.health_client().call(json!({"v": 1, "op": "ping"}));
        let state = d.state();
        let (status, body) = d.http_get("/state");
        assert_eq!(status, 200);
        let http: Value = serde_json::from_str(&body).unwrap();
        // /state is published on the tick: the same instance from the start.
        assert_eq!([&health["instance"], &state["instance"], &http["instance"]], [&ping["instance"]; 3]);
        let id = ping["instance"].as_str().expect("instance is a string").to_owned();
        assert_eq!(id.len(), 16, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()), "{id}");
        id
    };
    let first = instance_of(&d);
    assert_eq!(instance_of(&d), first, "the instance is stable within a process");
    assert_eq!(d.restart("TERM").code(), Some(0));
    let second = instance_of(&d);
    assert_ne!(second, first, "a restarted dpcoord shows a new instance");
    assert_eq!(d.stop().code(), Some(0));
}
