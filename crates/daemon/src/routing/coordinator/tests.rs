//! Unit tests of the coordinator: sources in, queries answered, settings
//! and the rank count swapped at a tick.

use std::time::Instant;

use serde_json::{json, Value};

use super::*;
use crate::config::{Config, PolicyKind};
use crate::engines::testing::settings;

fn coordinator(dp: u32, policy: PolicyKind) -> Coordinator {
    let mut s = settings(dp);
    s.routing.policy = policy;
    Coordinator::new(&s, Metrics::new(dp), Instant::now())
}

fn msgpack(v: Value) -> Vec<u8> {
    rmp_serde::to_vec_named(&v).unwrap()
}

fn update(c: &mut Coordinator, rank: u32, seq: u64, now: Instant) {
    let u = msgpack(json!({"v": 1, "rank": rank, "boot": 1, "seq": seq, "counts": [0, 0, 0, 0, 0]}));
    c.on_source(SourceKind::Stats, Some(&[&u[..]][..]), now);
}

fn ask(c: &mut Coordinator, ch: Channel, q: Value, now: Instant) -> Value {
    let mut out = Vec::new();
    c.on_query(ch, &msgpack(q), now, &mut out);
    rmp_serde::from_slice(&out).unwrap()
}

fn route(c: &mut Coordinator, now: Instant) -> Value {
    ask(c, Channel::Route, json!({"v": 1, "op": "route"}), now)["ranks"][0].clone()
}

#[test]
fn a_multipart_or_oversized_source_message_is_counted_and_changes_nothing() {
    let mut c = coordinator(2, PolicyKind::RoundRobin);
    let now = Instant::now();
    let u = msgpack(json!({"v": 1, "rank": 0, "boot": 1, "seq": 1, "counts": [0, 0, 0, 0, 0]}));
    c.on_source(SourceKind::Stats, Some(&[&u[..], &u[..]][..]), now);
    c.on_source::<&[u8]>(SourceKind::Stats, None, now);
    let big = vec![0u8; 70_000];
    c.on_source(SourceKind::Stats, Some(&[&big[..]][..]), now);
    assert_eq!(c.state_view(now).epoch, 0);
    update(&mut c, 0, 1, now);
    assert_eq!(c.state_view(now).ranks[0].status, "up");
}

#[test]
fn failed_health_reports_move_least_load_placements_and_nothing_else() {
    let mut c = coordinator(2, PolicyKind::LeastLoad);
    let t0 = Instant::now();
    update(&mut c, 0, 1, t0);
    update(&mut c, 1, 1, t0);
    let report = json!({"v": 1, "op": "health_report", "rank": 0, "ok": false});
    assert_eq!(ask(&mut c, Channel::Health, report, t0), json!({"v": 1, "ok": true}));
    // The penalty arrives with the tick: rank 0 idle costs 2, rank 1 costs 1.
    c.tick(t0);
    let view = c.state_view(t0);
    assert_eq!((view.ranks[0].penalty, view.ranks[0].status, view.epoch), (1.0, "up", 2));
    let picks: Vec<Value> = (0..3).map(|_| route(&mut c, t0)).collect();
    assert_eq!(picks, [json!(1), json!(0), json!(1)]);
    // Round robin ignores the penalty.
    let mut rr = coordinator(2, PolicyKind::RoundRobin);
    update(&mut rr, 0, 1, t0);
    update(&mut rr, 1, 1, t0);
    ask(&mut rr, Channel::Health, json!({"v": 1, "op": "health_report", "rank": 0, "ok": false}), t0);
    rr.tick(t0);
    assert_eq!([route(&mut rr, t0), route(&mut rr, t0)], [json!(0), json!(1)]);
}

#[test]
fn reload_resizes_every_per_rank_structure_before_the_next_query() {
    let mut c = coordinator(2, PolicyKind::RoundRobin);
    let t0 = Instant::now();
    update(&mut c, 0, 1, t0);
    update(&mut c, 1, 1, t0);
    let rank3 = json!({"v": 1, "op": "route", "rank": 3});
    assert_eq!(ask(&mut c, Channel::Route, rank3.clone(), t0)["error"]["code"], "invalid_rank");
    let mut s = settings(4);
    s.routing.policy = PolicyKind::LeastLoad;
    c.reload(s, t0);
    let view = c.state_view(t0);
    assert_eq!((view.ranks.len(), view.policy, view.ranks[3].status, view.epoch), (4, "least_load", "unknown", 3));
    assert_eq!(c.metrics().ranks.len(), 4);
    update(&mut c, 3, 1, t0);
    assert_eq!(ask(&mut c, Channel::Route, rank3, t0)["ranks"], json!([3]));
    let probe = json!({"v": 1, "op": "health_route", "rank": 3});
    assert_eq!(ask(&mut c, Channel::Health, probe, t0)["rank"], 3);
    // Shrinking drops the ranks, their metric series and the epoch moves once.
    let epoch = c.state_view(t0).epoch;
    c.reload(settings(1), t0);
    let view = c.state_view(t0);
    assert_eq!((view.ranks.len(), view.epoch, c.metrics().ranks.len()), (1, epoch + 1, 1));
    assert_eq!(route(&mut c, t0), json!(0));
}

#[test]
fn every_per_rank_part_follows_each_resize_and_reload() {
    let mut c = coordinator(3, PolicyKind::CacheAware);
    let t0 = Instant::now();
    let agree = |c: &Coordinator, dp: usize| {
        for (part, ranks) in c.per_rank_parts() {
            assert_eq!(ranks, dp, "{part} after the rank count became {dp}");
        }
    };
    agree(&c, 3);
    for dp in [7, 2, 5] {
        c.resize(dp);
        agree(&c, dp as usize);
    }
    c.reload(settings(4), t0);
    agree(&c, 4);
    let resize = json!({"v": 1, "op": "resize", "dp_size": 6});
    assert_eq!(ask(&mut c, Channel::Health, resize, t0)["dp_size"], 6);
    agree(&c, 6);
}

/// A `reload` op is answered after the read: `Answered::AfterReload`
/// with its id, then `reloaded` with what was read and `reload_reply`.
fn reload(c: &mut Coordinator, id: Option<Value>, text: &str, now: Instant) -> Value {
    let mut q = json!({"v": 1, "op": "reload"});
    if let Some(id) = &id {
        q["id"] = id.clone();
    }
    let mut out = Vec::new();
    let answered = c.on_query(Channel::Health, &msgpack(q), now, &mut out);
    let want = id.map(|v| wire::OwnedId::Str(v.as_str().unwrap().to_owned()));
    assert_eq!((answered, out.len()), (Answered::AfterReload(want.clone()), 0));
    let outcome = c.reloaded(Config::parse_toml(text).and_then(Config::from_table), now);
    c.reload_reply(want.as_ref().map(wire::OwnedId::as_id), &outcome, &mut out);
    rmp_serde::from_slice(&out).unwrap()
}

#[test]
fn resize_and_reload_ops_answer_with_the_new_view() {
    let t0 = Instant::now();
    let mut c = coordinator(2, PolicyKind::RoundRobin).with_server(Config::default().server);
    let resize = json!({"v": 1, "op": "resize", "dp_size": 5, "id": "r"});
    assert_eq!(
        ask(&mut c, Channel::Health, resize, t0),
        json!({"v": 1, "ok": true, "id": "r", "dp_size": 5, "dp_size_from": "resize", "epoch": 1})
    );
    let ok = reload(&mut c, Some(json!("l")), "[engines]\ndp_size = 3\n", t0);
    assert_eq!(ok, json!({"v": 1, "ok": true, "id": "l", "dp_size": 3, "dp_size_from": "file", "epoch": 2}));
    let refused = reload(&mut c, None, "[engines]\ndp_size = 0\n", t0);
    assert_eq!(refused["error"]["code"], "invalid_config");
    assert_eq!(refused["error"]["message"], "engines.dp_size: must be between 1 and 1024, got 0; nothing changed");
    assert_eq!(reload(&mut c, None, "[server]\nroute_allow = [\"10.0.0.0/8\"]\n", t0)["dp_size"], 8);
    assert_eq!(c.allowlist("route").map(|l| l.allows("10.1.2.3")), Some(true));
    assert_eq!(c.allowlist("route").map(|l| l.allows("127.0.0.1")), Some(false));
    // Without the server settings there is nothing to apply: refused at once.
    let mut bare = coordinator(2, PolicyKind::RoundRobin);
    let mut out = Vec::new();
    let answered = bare.on_query(Channel::Health, &msgpack(json!({"v": 1, "op": "reload"})), t0, &mut out);
    assert_eq!(answered, Answered::Now);
    let r: Value = rmp_serde::from_slice(&out).unwrap();
    assert_eq!(r["error"]["message"], "config: this dpcoord has no configuration to re-read; nothing changed");
    assert_eq!(bare.allowlist("route"), None);
}

/// A size kept from a resize must fit the `max_batch` a reload brings back
/// (within what the queues were sized for), or the reload changes nothing.
#[test]
fn a_kept_resize_must_fit_the_reloaded_max_batch() {
    let t0 = Instant::now();
    let mut c = coordinator(8, PolicyKind::RoundRobin).with_server(Config::default().server);
    let small = "[engines]\ndp_size = 8\n[limits]\nmax_batch = 64\n";
    assert_eq!(reload(&mut c, None, small, t0)["ok"], true);
    let resize = json!({"v": 1, "op": "resize", "dp_size": 1024});
    assert_eq!(ask(&mut c, Channel::Health, resize, t0)["dp_size"], 1024);
    let refused = reload(&mut c, None, "[engines]\ndp_size = 8\n", t0);
    assert_eq!(
        refused["error"]["message"],
        "limits.max_batch: engines.dp_size = 1024 with limits.max_batch = 1024 is 1048576 rank weighings per \
         query, above 262144; with this dp_size, max_batch may be at most 256 (dp_size 1024 is in force from a \
         resize); nothing changed"
    );
    assert_eq!(c.engines.dp_size(), 1024);
}

#[test]
fn the_missed_updates_counter_saturates_instead_of_wrapping() {
    let mut c = coordinator(1, PolicyKind::RoundRobin);
    let now = Instant::now();
    let send = |c: &mut Coordinator, boot: u64, seq: u64| {
        let u = msgpack(json!({"v": 1, "rank": 0, "boot": boot, "seq": seq, "counts": [0, 0, 0, 0, 0]}));
        c.on_source(SourceKind::Stats, Some(&[&u[..]][..]), now);
    };
    let mut last = 0;
    // Each boot jumps from seq 1 to 2^63 + 1: 2^63 - 1 missed, three times over.
    for boot in 1..=3 {
        send(&mut c, boot, 1);
        send(&mut c, boot, (1 << 63) + 1);
        let missed = c.metrics().stats_missed.get();
        assert!(missed >= last, "the counter went down: {last} -> {missed}");
        last = missed;
    }
    assert_eq!(last, u64::MAX);
}
