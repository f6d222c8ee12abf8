//! Every error code of the contract, over the wire, on both sockets: the
//! reply has the code, echoes the query's `id` (when it had a readable one),
//! says what was wrong, and the refused query changes no state: `state` is
//! the same before and after, and the next user and health route answers are
//! the ones the round-robin would have given anyway.

use crate::common::*;
use rmpv::Value as M;
use serde_json::{json, Value};

/// dp_size 4 with ranks 0..=2 up and rank 3 never reporting (`unknown`).
const DP: &str = "4";
const UP: [u64; 3] = [0, 1, 2];

/// Liveness and pending expiry far out, so only queries can change state.
fn daemon() -> Daemon {
    Daemon::frozen(DP, &[])
}

/// A route query `{v:1, op:"route", id}` plus `extra`.
fn route(id: &str, extra: &[(&str, M)]) -> Vec<u8> {
    query("route", id, extra)
}

/// How a refused query reaches the daemon.
enum Via {
    /// One frame from a REQ peer on the route socket.
    Route(Vec<u8>),
    /// One frame from a REQ peer on the health socket.
    Health(Vec<u8>),
    /// A DEALER peer on the route (`true`) or health socket: the empty
    /// delimiter frame, then these body frames.
    Dealer(bool, Vec<Vec<u8>>),
}

struct Rig {
    d: Daemon,
    user: Client,
    health: Client,
    /// How many policy answers each channel has given (both rotate over `UP`).
    user_answers: usize,
    health_answers: usize,
}

impl Rig {
    fn new() -> Rig {
        let d = Daemon::frozen_up(DP, &[0, 1, 2]);
        let (user, health) = (d.client(), d.health_client());
        Rig { d, user, health, user_answers: 0, health_answers: 0 }
    }

    fn send(&self, via: Via) -> Value {
        match via {
            Via::Route(b) => self.user.call_raw(&b),
            Via::Health(b) => self.health.call_raw(&b),
            Via::Dealer(to_route, body) => {
                let ep = if to_route { &self.d.route } else { &self.d.health };
                dealer_call(&self.d.socket(zmq::DEALER, ep), body)
            }
        }
    }

    /// Sends a query that must be refused with `code`, naming `mentions`
    /// in its message and echoing `id`; then proves nothing changed.
    fn refused(&mut self, what: &str, via: Via, code: &str, id: Option<Value>, mentions: &str) {
        let before = self.d.books();
        let r = self.send(via);
        assert_eq!(r["v"], json!(1), "{what}: {r}");
        assert_eq!(r["ok"], json!(false), "{what}: {r}");
        assert_eq!(r["error"]["code"], json!(code), "{what}: {r}");
        let message = r["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(mentions), "{what}: message {message:?} should mention {mentions:?}");
        match id {
            Some(id) => assert_eq!(r["id"], id, "{what}: id not echoed: {r}"),
            None => assert!(r.get("id").is_none(), "{what}: no readable id, yet the reply has one: {r}"),
        }
        assert_eq!(self.d.books(), before, "{what}: a refused query changed state");
        self.next_answers_unchanged(what);
    }

    /// The next policy answers are the ones the rotations were due to give.
    fn next_answers_unchanged(&mut self, what: &str) {
        let r = self.user.call(json!({"v": 1, "op": "route"}));
        assert_eq!(r["ranks"], json!([UP[self.user_answers % UP.len()]]), "{what}: user round-robin moved: {r}");
        self.user_answers += 1;
        let r = self.health.call(json!({"v": 1, "op": "health_route"}));
        assert_eq!(r["rank"], json!(UP[self.health_answers % UP.len()]), "{what}: health round-robin moved: {r}");
        self.health_answers += 1;
    }
}

#[test]
fn bad_request_for_undecodable_non_map_missing_and_mistyped_fields() {
    let mut t = Rig::new();
    let no_id = None;
    let cases: Vec<(&str, Vec<u8>, Option<Value>, &str)> = vec![
        ("reserved marker", vec![0xc1], no_id.clone(), "MessagePack"),
        ("truncated map", vec![0x82, 0xa1, b'v'], no_id.clone(), "MessagePack"),
        ("empty frame", Vec::new(), no_id.clone(), "MessagePack"),
        ("trailing bytes", [map(&[("v", 1.into()), ("op", "ping".into())]), vec![0xc0]].concat(), None, "trailing"),
        ("array", msgpack(&M::Array(vec![1.into(), 2.into()])), no_id.clone(), "map"),
        ("string", msgpack(&M::from("route")), no_id.clone(), "map"),
        ("integer key", msgpack(&M::Map(vec![(1.into(), 1.into())])), no_id.clone(), "string"),
        ("missing v", map(&[("op", "route".into()), ("id", "m1".into())]), Some(json!("m1")), "v"),
        ("nil v", map(&[("v", M::Nil), ("op", "route".into()), ("id", 7.into())]), Some(json!(7)), "v"),
        ("missing op", map(&[("v", 1.into()), ("id", "m2".into())]), Some(json!("m2")), "op"),
        (
            "v is a string",
            map(&[("v", "1".into()), ("op", "route".into()), ("id", "m3".into())]),
            Some(json!("m3")),
            "v",
        ),
        ("op is an int", map(&[("v", 1.into()), ("op", 5.into()), ("id", "m4".into())]), Some(json!("m4")), "op"),
        ("n = 0", route("n0", &[("n", 0.into())]), Some(json!("n0")), "n"),
        ("n is a string", route("n1", &[("n", "2".into())]), Some(json!("n1")), "n"),
        ("n is negative", route("n2", &[("n", (-1).into())]), Some(json!("n2")), "n"),
        ("n is a float", route("n3", &[("n", 1.0.into())]), Some(json!("n3")), "n"),
        ("rank is a string", route("r1", &[("rank", "1".into())]), Some(json!("r1")), "rank"),
        ("room is a string", route("b1", &[("bootstrap_room", "7".into())]), Some(json!("b1")), "bootstrap_room"),
        ("room is negative", route("b2", &[("bootstrap_room", (-3).into())]), Some(json!("b2")), "bootstrap_room"),
        ("session is an int", route("s1", &[("session", 3.into())]), Some(json!("s1")), "session"),
        ("prompt_tokens string", route("p1", &[("prompt_tokens", "x".into())]), Some(json!("p1")), "prompt_tokens"),
        ("prompt_tokens negative", route("p2", &[("prompt_tokens", (-5).into())]), Some(json!("p2")), "prompt_tokens"),
        ("id is a float", map(&[("v", 1.into()), ("op", "route".into()), ("id", 1.5.into())]), None, "id"),
    ];
    for (what, bytes, id, mentions) in cases {
        t.refused(what, Via::Route(bytes), "bad_request", id, mentions);
    }
}

#[test]
fn bad_request_on_the_health_socket() {
    let mut t = Rig::new();
    let cases: Vec<(&str, Vec<u8>, Option<Value>, &str)> = vec![
        ("undecodable", vec![0xc1], None, "MessagePack"),
        ("array", msgpack(&M::Array(vec![])), None, "map"),
        ("missing v", map(&[("op", "health_route".into()), ("id", "h0".into())]), Some(json!("h0")), "v"),
        ("rank is a string", query("health_route", "h1", &[("rank", "0".into())]), Some(json!("h1")), "rank"),
        ("room is a float", query("health_route", "h2", &[("bootstrap_room", 0.5.into())]), Some(json!("h2")), "room"),
        ("report without rank", query("health_report", "h3", &[("ok", true.into())]), Some(json!("h3")), "rank"),
        ("report without ok", query("health_report", "h4", &[("rank", 0.into())]), Some(json!("h4")), "ok"),
        (
            "report ok is an int",
            query("health_report", "h5", &[("rank", 0.into()), ("ok", 1.into())]),
            Some(json!("h5")),
            "ok",
        ),
    ];
    for (what, bytes, id, mentions) in cases {
        t.refused(what, Via::Health(bytes), "bad_request", id, mentions);
    }
}

#[test]
fn dealer_sending_two_body_frames_or_none_gets_bad_request() {
    let mut t = Rig::new();
    let q = map(&[("v", 1.into()), ("op", "route".into())]);
    let h = map(&[("v", 1.into()), ("op", "health_route".into())]);
    t.refused("route, 2 frames", Via::Dealer(true, vec![q.clone(), q.clone()]), "bad_request", None, "frame");
    t.refused("route, 0 frames", Via::Dealer(true, vec![]), "bad_request", None, "frame");
    t.refused("health, 2 frames", Via::Dealer(false, vec![h.clone(), h]), "bad_request", None, "frame");
}

#[test]
fn unsupported_version_echoes_the_id() {
    let mut t = Rig::new();
    let v = |v: i64, op: &str, id: &str| map(&[("v", v.into()), ("op", op.into()), ("id", id.into())]);
    t.refused("route v2", Via::Route(v(2, "route", "v2")), "unsupported_version", Some(json!("v2")), "version");
    t.refused("route v0", Via::Route(v(0, "route", "v0")), "unsupported_version", Some(json!("v0")), "version");
    t.refused("ping v2", Via::Route(v(2, "ping", "pv")), "unsupported_version", Some(json!("pv")), "version");
    let hv = v(2, "health_route", "hv");
    t.refused("health v2", Via::Health(hv), "unsupported_version", Some(json!("hv")), "version");
}

#[test]
fn unknown_op_including_each_op_on_the_other_socket() {
    let mut t = Rig::new();
    let op = |op: &str, id: i64| query(op, id, &[]);
    t.refused("made-up op", Via::Route(op("frobnicate", 1)), "unknown_op", Some(json!(1)), "frobnicate");
    t.refused("health_route on route", Via::Route(op("health_route", 2)), "unknown_op", Some(json!(2)), "health");
    let report = query("health_report", "x", &[("rank", 0.into()), ("ok", false.into())]);
    t.refused("health_report on route", Via::Route(report), "unknown_op", Some(json!("x")), "health");
    t.refused("route on health", Via::Health(op("route", -3)), "unknown_op", Some(json!(-3)), "route");
    let routed_pin = route("y", &[("rank", 0.into()), ("n", 4.into())]);
    t.refused("pinned route on health", Via::Health(routed_pin), "unknown_op", Some(json!("y")), "route");
    t.refused("made-up op on health", Via::Health(op("reset", 4)), "unknown_op", Some(json!(4)), "reset");
}

#[test]
fn invalid_rank_negative_or_not_below_dp_size_on_route_health_route_and_health_report() {
    let mut t = Rig::new();
    for rank in [-1i64, 4, 5, 1 << 40] {
        let id = format!("rank{rank}");
        let want = Some(json!(id));
        let r = route(&id, &[("rank", rank.into()), ("n", 3.into())]);
        t.refused(&format!("route rank {rank}"), Via::Route(r), "invalid_rank", want.clone(), "rank");
        let r = route(&id, &[("rank", rank.into()), ("bootstrap_room", 1.into())]);
        t.refused(&format!("route rank {rank} + room"), Via::Route(r), "invalid_rank", want.clone(), "rank");
        let h = query("health_route", id.as_str(), &[("rank", rank.into())]);
        t.refused(&format!("health_route rank {rank}"), Via::Health(h), "invalid_rank", want.clone(), "rank");
        let h = query("health_report", id.as_str(), &[("rank", rank.into()), ("ok", false.into())]);
        t.refused(&format!("health_report rank {rank}"), Via::Health(h), "invalid_rank", want, "rank");
    }
}

#[test]
fn rank_unavailable_for_pins_and_rooms_on_a_rank_that_is_not_routable() {
    let mut t = Rig::new();
    let unavailable: Vec<(&str, Via, &str)> = vec![
        ("pin to unknown rank 3", Via::Route(route("u1", &[("rank", 3.into())])), "u1"),
        ("pin n=5 to rank 3", Via::Route(route("u2", &[("rank", 3.into()), ("n", 5.into())])), "u2"),
        ("room 3", Via::Route(route("u3", &[("bootstrap_room", 3.into())])), "u3"),
        ("room 7 -> 3", Via::Route(route("u4", &[("bootstrap_room", 7.into()), ("n", 2.into())])), "u4"),
        // `rank` wins over `bootstrap_room` even when the room's rank is routable.
        ("pin 3 wins over room 0", Via::Route(route("u5", &[("rank", 3.into()), ("bootstrap_room", 0.into())])), "u5"),
        ("health pin 3", Via::Health(query("health_route", "u6", &[("rank", 3.into())])), "u6"),
        ("health room 11 -> 3", Via::Health(query("health_route", "u7", &[("bootstrap_room", 11.into())])), "u7"),
    ];
    for (what, via, id) in unavailable {
        t.refused(what, via, "rank_unavailable", Some(json!(id)), "3");
    }
}

#[test]
fn too_large_for_n_above_max_batch_and_payloads_above_max_message_bytes() {
    let mut t = Rig::new();
    for n in [1025u64, 1 << 40, u64::MAX] {
        let q = route("big-n", &[("n", n.into())]);
        t.refused(&format!("n = {n}"), Via::Route(q), "too_large", Some(json!("big-n")), "max_batch");
    }
    let pad = ("pad", M::Binary(vec![0; 70_000]));
    let q = route("big-route", std::slice::from_ref(&pad));
    t.refused("70 kB route query", Via::Route(q), "too_large", Some(json!("big-route")), "max_message_bytes");
    let h = query("health_route", "big-health", &[pad]);
    t.refused("70 kB health query", Via::Health(h), "too_large", Some(json!("big-health")), "max_message_bytes");
}

#[test]
fn a_payload_of_exactly_max_message_bytes_is_served_and_one_byte_more_is_too_large() {
    let d = daemon();
    let ping = |len: usize| {
        map(&[("v", 1.into()), ("op", "ping".into()), ("id", "edge".into()), ("pad", M::Binary(vec![7; len]))])
    };
    let overhead = ping(60_000).len() - 60_000;
    let at_limit = ping(65_536 - overhead);
    assert_eq!(at_limit.len(), 65_536);
    let c = d.client();
    let instance = d.state()["instance"].clone();
    assert_eq!(
        c.call_raw(&at_limit),
        json!({"v": 1, "ok": true, "id": "edge", "epoch": 0, "instance": instance, "block_size": 16})
    );
    let over = ping(65_537 - overhead);
    assert_eq!(over.len(), 65_537);
    assert_eq!(c.call_raw(&over)["error"]["code"], json!("too_large"));
    let pong = json!({"v": 1, "ok": true, "id": "edge", "epoch": 0, "instance": instance, "block_size": 16});
    assert_eq!(d.health_client().call_raw(&at_limit), pong);
}

#[test]
fn no_engine_available_while_no_rank_is_routable_and_nothing_changes() {
    let d = daemon();
    let (c, h) = (d.client(), d.health_client());
    let before = d.books();
    for q in [json!({"v": 1, "op": "route", "id": 1}), json!({"v": 1, "op": "route", "id": 1, "n": 5})] {
        let r = c.call(q);
        assert_eq!(r["error"]["code"], json!("no_engine_available"), "{r}");
        assert_eq!(r["id"], json!(1));
    }
    let r = h.call(json!({"v": 1, "op": "health_route", "id": "h"}));
    assert_eq!(r["error"]["code"], json!("no_engine_available"), "{r}");
    assert_eq!(r["id"], json!("h"));
    // A pin or room names its rank, so it is that rank that is unavailable.
    assert_eq!(c.error_code(json!({"v": 1, "op": "route", "rank": 0})), "rank_unavailable");
    assert_eq!(c.error_code(json!({"v": 1, "op": "route", "bootstrap_room": 6})), "rank_unavailable");
    assert_eq!(d.books(), before);
    assert_eq!(before["epoch"], json!(0));

    // Once every rank is up, both rotations start at rank 0: nothing moved them.
    let p = d.publisher();
    d.bring_up(&p, &[0, 1, 2, 3]);
    let r = c.call(json!({"v": 1, "op": "route", "n": 4}));
    assert_eq!(r, json!({"v": 1, "ok": true, "ranks": [0, 1, 2, 3], "epoch": 4}));
    assert_eq!(h.call(json!({"v": 1, "op": "health_route"}))["rank"], json!(0));
}

/// A query's extra fields.
type Fields = Vec<(&'static str, M)>;

#[test]
fn bad_prompts_are_refused_on_route_and_prefix_and_change_nothing() {
    let mut t = Rig::new();
    let ints = |xs: &[u64]| M::Array(xs.iter().map(|&x| M::from(x)).collect());
    let keys = ("block_keys", ints(&[11, 12]));
    // `tokens` and `block_keys` together: which one the prompt is cannot be told.
    let bad: Vec<(&str, Fields, &str, &str)> = vec![
        ("tokens and block_keys", vec![("tokens", ints(&[1, 2])), keys.clone()], "bad_request", "not both"),
        ("block_keys with lora", vec![keys.clone(), ("lora", "a".into())], "bad_request", "already in `block_keys`"),
        ("block_keys with salt", vec![keys.clone(), ("salt", "s".into())], "bad_request", "already in `block_keys`"),
        ("lora without a prompt", vec![("lora", "a".into())], "bad_request", "go with `tokens`"),
        ("a token above u32", vec![("tokens", ints(&[1, 1 << 32]))], "bad_request", "`tokens[1]`"),
        ("a key that is a string", vec![("block_keys", M::Array(vec!["k".into()]))], "bad_request", "`block_keys[0]`"),
        (
            "lora NUL is fine, salt an int is not",
            vec![("tokens", ints(&[1])), ("lora", "a\0".into()), ("salt", 3.into())],
            "bad_request",
            "salt",
        ),
        // limits.max_prompt_tokens (262,144) / 16 tokens per key.
        ("16,385 keys", vec![("block_keys", ints(&[1; 16_385]))], "too_large", "above the limit of 16384"),
    ];
    for (what, fields, code, mentions) in bad {
        let r = route("bad-prompt", &fields);
        t.refused(&format!("route: {what}"), Via::Route(r), code, Some(json!("bad-prompt")), mentions);
        let p = query("prefix", "bad-prefix", &fields);
        t.refused(&format!("prefix: {what}"), Via::Health(p), code, Some(json!("bad-prefix")), mentions);
    }
    // The limit itself is served, and a LoRA name with a NUL byte is a name like any other.
    let ok = t.health.call_raw(&query("prefix", "at-limit", &[("block_keys", ints(&[1; 16_384]))]));
    assert_eq!((ok["ok"].clone(), ok["blocks"].clone()), (json!(true), json!(16_384)), "{ok}");
    let nul = t.health.call_raw(&query("prefix", "nul", &[("tokens", ints(&[1; 32])), ("lora", "a\0".into())]));
    assert_eq!((nul["ok"].clone(), nul["matched"].clone()), (json!(true), json!([0, 0, 0, 0])), "{nul}");
}
