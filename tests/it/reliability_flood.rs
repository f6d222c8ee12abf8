//! Floods against the real binary: garbage at full speed on all three
//! sockets while real clients route, DEALER peers that never read their
//! replies, and 64 concurrent frontends.
//!
//! Every check is exact. `round_robin` over the up ranks makes the real
//! clients' answers a known rotation that garbage must not move; every
//! garbage query is answered with the code it deserves (replies per DEALER
//! come back in order, so each is matched to what was sent); the error and
//! stats counters move by exactly what was sent. Floods are bounded in time
//! and count; nothing here asserts a duration.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rmpv::Value as M;
use serde_json::{json, Value};

/// dp_size 4, ranks 0, 1 and 3 up, rank 2 never reporting (`unknown`).
const DP: &str = "4";
const UP: [u64; 3] = [0, 1, 3];
/// How long each flood sends.
const FLOOD: Duration = Duration::from_millis(1500);
/// Garbage queries a DEALER sends before reading their replies.
const WINDOW: usize = 64;
/// Most garbage stats updates one publisher sends (each is counted exactly,
/// so the publisher never drops: its high-water mark is unlimited).
const STATS_CAP: u64 = 30_000;

/// Liveness and pending expiry far out, so only what the test sends changes state.
fn daemon() -> Daemon {
    Daemon::frozen_up(DP, &[0, 1, 3])
}

/// The `n` placements the user rotation over [`UP`] gives from position `at`.
fn rotation(at: usize, n: usize) -> Vec<u64> {
    (at..at + n).map(|i| UP[i % UP.len()]).collect()
}

/// One garbage query: the frames after the empty delimiter, and the error code it must get.
struct Junk {
    body: Vec<Vec<u8>>,
    code: &'static str,
}

fn bad(body: Vec<u8>) -> Junk {
    Junk { body: vec![body], code: "bad_request" }
}

/// Random bytes that do not start with a map marker: never a valid query or update.
fn random_bytes(rng: &mut SmallRng) -> Vec<u8> {
    let len = rng.random_range(1..200);
    let mut b: Vec<u8> = (0..len).map(|_| rng.random()).collect();
    while matches!(b[0], 0x80..=0x8f | 0xde | 0xdf) {
        b[0] = rng.random();
    }
    b
}

/// Headers claiming gigabytes that are not there, at the top and inside a map.
fn huge_prefix(k: u64) -> Vec<u8> {
    let cases: [&[u8]; 8] = [
        b"\xdb\xff\xff\xff\xffabc",                     // str32 of 4 GiB
        b"\xc6\xff\xff\xff\xff\x00",                    // bin32 of 4 GiB
        b"\xdd\xff\xff\xff\xff\x01",                    // array32 of 4 G elements
        b"\xdf\xff\xff\xff\xff\xa1v\x01",               // map32 of 4 G entries
        b"\xc9\xff\xff\xff\xff\x01\x00",                // ext32 of 4 GiB
        b"\x81\xa1v\xc6\xff\xff\xff\xff",               // a value of 4 GiB
        b"\x81\xa2id\xdb\xff\xff\xff\xff",              // an id of 4 GiB
        b"\x82\xa1v\x01\xa2op\xdd\xff\xff\xff\xff\xc0", // an op array of 4 G elements
    ];
    cases[k as usize % cases.len()].to_vec()
}

/// A prefix (never the whole) of an otherwise valid message.
fn truncated(rng: &mut SmallRng, whole: &[u8]) -> Vec<u8> {
    whole[..rng.random_range(1..whole.len())].to_vec()
}

/// Garbage that every socket refuses as `bad_request`, including wrong frame counts.
fn common_junk(rng: &mut SmallRng, k: u64, valid: &[u8]) -> Junk {
    match k % 6 {
        0 => bad(random_bytes(rng)),
        1 => bad(truncated(rng, valid)),
        2 => bad(huge_prefix(k / 6)),
        3 => Junk { body: vec![], code: "bad_request" },
        4 => Junk { body: vec![valid.to_vec(), valid.to_vec()], code: "bad_request" },
        _ => Junk { body: vec![valid.to_vec(); 10], code: "bad_request" },
    }
}

/// Garbage for the route socket: undecodable or refused with each error code.
fn route_junk(rng: &mut SmallRng, k: u64) -> Junk {
    let q = |extra: &[(&str, M)]| query("route", k, extra);
    let refused = |body, code| Junk { body: vec![body], code };
    if k.is_multiple_of(512) {
        return refused(q(&[("pad", M::Binary(vec![0; 70_000]))]), "too_large");
    }
    match k % 11 {
        6 => refused(map(&[("v", 2.into()), ("op", "route".into())]), "unsupported_version"),
        7 => refused(map(&[("v", 1.into()), ("op", "health_route".into())]), "unknown_op"),
        8 => refused(q(&[("rank", 9.into())]), "invalid_rank"),
        9 => refused(q(&[("rank", 2.into()), ("n", 3.into())]), "rank_unavailable"),
        10 => refused(q(&[("n", 5000.into())]), "too_large"),
        _ => common_junk(rng, k, &q(&[("n", 2.into())])),
    }
}

/// Garbage for the health socket.
fn health_junk(rng: &mut SmallRng, k: u64) -> Junk {
    let q = |op: &str, extra: &[(&str, M)]| query(op, k, extra);
    let refused = |body, code| Junk { body: vec![body], code };
    match k % 10 {
        6 => refused(map(&[("v", 0.into()), ("op", "health_route".into())]), "unsupported_version"),
        7 => refused(q("route", &[]), "unknown_op"),
        8 => refused(q("health_report", &[("rank", 9.into()), ("ok", false.into())]), "invalid_rank"),
        9 => refused(q("health_route", &[("rank", 2.into())]), "rank_unavailable"),
        _ => common_junk(rng, k, &q("health_route", &[])),
    }
}

/// Sends garbage from a DEALER at full speed until `until`, [`WINDOW`] at a
/// time, and checks that every one is answered, in order, with its code.
/// Returns how many of each code it got.
fn junk_dealer(ep: &str, until: Instant, seed: u64, make: fn(&mut SmallRng, u64) -> Junk) -> BTreeMap<String, u64> {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    s.connect(ep).unwrap();
    let mut rng = SmallRng::seed_from_u64(seed);
    let (mut k, mut tally, mut expect) = (0, BTreeMap::new(), VecDeque::new());
    while Instant::now() < until {
        for _ in 0..WINDOW {
            let junk = make(&mut rng, k);
            k += 1;
            dealer_send(&s, junk.body);
            expect.push_back(junk.code);
        }
        while let Some(code) = expect.pop_front() {
            let reply = s.recv_multipart(0).expect("a garbage query was not answered in time");
            assert_eq!(reply.len(), 2, "delimiter and payload");
            let r: Value = rmp_serde::from_slice(&reply[1]).unwrap();
            assert_eq!((&r["ok"], &r["error"]["code"]), (&json!(false), &json!(code)), "{r}");
            *tally.entry(code.to_owned()).or_insert(0) += 1;
        }
    }
    tally
}

/// What one garbage publisher sent, by the `result` it must be counted under.
#[derive(Default, Debug)]
struct StatsJunk {
    malformed: u64,
    stale: u64,
    unknown_rank: u64,
}

/// A garbage publisher whose subscription is in place (PUB/SUB drops what is
/// sent before): it has delivered a valid update for `rank`, seq `seq - 1`.
fn subscribed_publisher(d: &Daemon, rank: u32, mut seq: u64) -> zmq::Socket {
    let ctx = zmq::Context::new();
    let p = ctx.socket(zmq::PUB).unwrap();
    p.set_sndhwm(0).unwrap();
    p.set_linger(0).unwrap();
    p.connect(&d.stats).unwrap();
    d.publish_until_shown(&p, rank, &mut seq, [20 + u64::from(rank), 0, 0, 0, 0]);
    p
}

/// Publishes garbage stats on `p` at full speed until `until` (at most
/// [`STATS_CAP`]); returns the socket and the tally.
fn junk_publisher(p: zmq::Socket, until: Instant, seed: u64) -> (zmq::Socket, StatsJunk) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let valid = encode(&update(0, 1, 1, [0; 5]));
    let mut t = StatsJunk::default();
    let mut k = 0u64;
    while Instant::now() < until && k < STATS_CAP {
        k += 1;
        let send = |b: &[u8]| p.send(b, 0).unwrap();
        match k % 9 {
            0 => send(&random_bytes(&mut rng)),
            1 => send(&truncated(&mut rng, &valid)),
            2 => send(&huge_prefix(k / 9)),
            3 => p.send_multipart([&valid[..], &valid[..]], 0).unwrap(),
            4 => send(&Update::new(0, 1, k).without("counts").bytes()),
            5 => send(&Update::new(1, 1, k + 1_000_000).ttft(f64::NAN).bytes()),
            6 => {
                let rank = [2i64 + 2, -1, 1 << 40][k as usize % 3];
                send(&encode(&Update::new(rank, 1, k).value()));
                t.unknown_rank += 1;
                continue;
            }
            7 => {
                // Boot 0 is older than the ranks' boot 1.
                send(&encode(&update(UP[k as usize % 3] as u32, 0, k, [0; 5])));
                t.stale += 1;
                continue;
            }
            _ => {
                // seq 1 of boot 1 was accepted long ago.
                send(&encode(&update(0, 1, 1, [0; 5])));
                t.stale += 1;
                continue;
            }
        }
        t.malformed += 1;
    }
    (p, t)
}

/// The counters this file checks, as one snapshot.
fn counters(d: &Daemon) -> BTreeMap<String, f64> {
    let mut names: Vec<String> = ["ok", "malformed", "stale", "unknown_rank"]
        .iter()
        .map(|r| format!("dpcoord_stats_messages_total{{result=\"{r}\"}}"))
        .collect();
    for code in ["bad_request", "unsupported_version", "unknown_op", "invalid_rank", "rank_unavailable"] {
        names.push(format!("dpcoord_route_errors_total{{code=\"{code}\"}}"));
    }
    names.push("dpcoord_route_errors_total{code=\"too_large\"}".into());
    names.push("dpcoord_route_errors_total{code=\"no_engine_available\"}".into());
    for class in ["user", "health"] {
        for r in 0..4 {
            names.push(format!("dpcoord_routed_total{{class=\"{class}\",dp_rank=\"{r}\"}}"));
        }
    }
    let (_, body) = d.http_get("/metrics");
    names
        .into_iter()
        .map(|n| {
            let v = series(&body, &n).unwrap_or_else(|| panic!("no series {n}"));
            (n, v)
        })
        .collect()
}

#[test]
fn garbage_on_all_three_sockets_moves_no_real_answer_and_is_counted_exactly() {
    let d = daemon();
    let publishers: Vec<zmq::Socket> = (0..2).map(|i| subscribed_publisher(&d, UP[i] as u32, 100)).collect();
    let base = counters(&d);
    let epoch = d.client().call(json!({"v": 1, "op": "ping"}))["epoch"].clone();
    assert_eq!(epoch, json!(3));
    let done = AtomicBool::new(false);
    let until = Instant::now() + FLOOD;
    let (route_tallies, health_tallies, stats, user_placed, health_answers) = std::thread::scope(|s| {
        let stop = SetOnDrop(&done);
        let dealers: Vec<_> = (0..2)
            .map(|i| {
                let (route, health) = (&d.route, &d.health);
                (
                    s.spawn(move || junk_dealer(route, until, 10 + i, route_junk)),
                    s.spawn(move || junk_dealer(health, until, 20 + i, health_junk)),
                )
            })
            .collect();
        let pubs: Vec<_> =
            publishers.into_iter().zip(30..).map(|(p, seed)| s.spawn(move || junk_publisher(p, until, seed))).collect();
        // The real user client: each answer is the next stretch of the rotation, id echoed.
        let user = s.spawn(|| {
            let c = d.client();
            let (mut at, mut i) = (0usize, 0u64);
            while !done.load(Ordering::Relaxed) || i < 50 {
                let n = 1 + (i % 3) as usize;
                let r = c.call(json!({"v": 1, "op": "route", "id": i, "n": n}));
                assert_eq!(r, json!({"v": 1, "ok": true, "id": i, "ranks": rotation(at, n), "epoch": 3}), "query {i}");
                at += n;
                i += 1;
            }
            at
        });
        // The real prober: the health channel's own rotation, unmoved by health garbage.
        let prober = s.spawn(|| {
            let c = d.health_client();
            let mut i = 0u64;
            while !done.load(Ordering::Relaxed) || i < 50 {
                let r = c.call(json!({"v": 1, "op": "health_route", "id": i}));
                let want = json!({"v": 1, "ok": true, "id": i, "rank": UP[i as usize % 3], "epoch": 3});
                assert_eq!(r, want, "probe {i}");
                i += 1;
            }
            i
        });
        let mut route_tallies = Vec::new();
        let mut health_tallies = Vec::new();
        for (r, h) in dealers {
            route_tallies.push(r.join().unwrap());
            health_tallies.push(h.join().unwrap());
        }
        let stats: Vec<_> = pubs.into_iter().map(|p| p.join().unwrap()).collect();
        drop(stop);
        (route_tallies, health_tallies, stats, user.join().unwrap(), prober.join().unwrap())
    });

    // A valid update after each publisher's garbage: once it shows, all of that garbage was handled.
    let next_seq = 1_000;
    for (i, (p, _)) in stats.iter().enumerate() {
        let rank = UP[i] as u32;
        p.send(encode(&update(rank, 1, next_seq, [40 + i as u64, 0, 0, 0, 0])), 0).unwrap();
    }
    for (i, &rank) in UP.iter().enumerate().take(stats.len()) {
        d.await_counts(rank as u32, [40 + i as u64, 0, 0, 0, 0]);
    }

    let mut want = base.clone();
    let mut add = |name: String, n: f64| *want.get_mut(&name).unwrap() += n;
    for tally in route_tallies.iter().chain(&health_tallies) {
        for (code, n) in tally {
            add(format!("dpcoord_route_errors_total{{code=\"{code}\"}}"), *n as f64);
        }
    }
    for (_, t) in &stats {
        add("dpcoord_stats_messages_total{result=\"malformed\"}".into(), t.malformed as f64);
        add("dpcoord_stats_messages_total{result=\"stale\"}".into(), t.stale as f64);
        add("dpcoord_stats_messages_total{result=\"unknown_rank\"}".into(), t.unknown_rank as f64);
        add("dpcoord_stats_messages_total{result=\"ok\"}".into(), 1.0);
    }
    let placed = per_rank(&rotation(0, user_placed), 4);
    for (r, &n) in placed.iter().enumerate() {
        add(format!("dpcoord_routed_total{{class=\"user\",dp_rank=\"{r}\"}}"), n as f64);
        let probes = (0..health_answers as usize).filter(|&i| UP[i % 3] == r as u64).count();
        add(format!("dpcoord_routed_total{{class=\"health\",dp_rank=\"{r}\"}}"), probes as f64);
    }
    assert_eq!(counters(&d), want);
    let sent: u64 = route_tallies.iter().chain(&health_tallies).flat_map(|t| t.values()).sum();
    println!("garbage queries answered: {sent}; stats garbage: {:?}", stats.iter().map(|s| &s.1).collect::<Vec<_>>());

    // The books: routed is exactly the real placements; epoch and statuses unmoved.
    let s = d.state();
    assert_eq!(s["epoch"], json!(3));
    assert_eq!(statuses(&s), json!(["up", "up", "unknown", "up"]));
    assert_eq!(d.routed(), placed);
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn dealers_that_never_read_lose_their_own_replies_and_hold_up_no_one() {
    // The never-readers send pins to rank 3: user load that does not move the
    // rotation, so the real client's answers stay exact.
    const SENT: u64 = 20_000;
    let d = daemon();
    let done = AtomicBool::new(false);
    let (never_readers, user_placed) = std::thread::scope(|s| {
        let stop = SetOnDrop(&done);
        let peers: Vec<_> = (0..3)
            .map(|i| {
                let (ep, op) = if i < 2 { (&d.route, "route") } else { (&d.health, "health_route") };
                s.spawn(move || {
                    let ctx = zmq::Context::new();
                    let p = ctx.socket(zmq::DEALER).unwrap();
                    p.set_linger(0).unwrap();
                    p.set_rcvhwm(10).unwrap();
                    // A fixed kernel receive buffer (no autotuning): what the
                    // kernel may hold for this peer stays far below the bound
                    // checked below, however loaded the machine is.
                    p.set_rcvbuf(16 * 1024).unwrap();
                    p.connect(ep).unwrap();
                    for k in 0..SENT {
                        let q = map(&[("v", 1.into()), ("op", op.into()), ("id", k.into()), ("rank", 3.into())]);
                        p.send_multipart([&b""[..], &q[..]], 0).unwrap();
                    }
                    (ctx, p)
                })
            })
            .collect();
        let user = s.spawn(|| {
            let c = d.client();
            let (mut at, mut i) = (0usize, 0u64);
            while !done.load(Ordering::Relaxed) || i < 50 {
                let r = c.call(json!({"v": 1, "op": "route", "id": i}));
                assert_eq!(r, json!({"v": 1, "ok": true, "id": i, "ranks": rotation(at, 1), "epoch": 3}), "query {i}");
                at += 1;
                i += 1;
            }
            at
        });
        let peers: Vec<_> = peers.into_iter().map(|p| p.join().unwrap()).collect();
        drop(stop);
        (peers, user.join().unwrap())
    });

    // Every pin was placed (the two route peers), each once.
    let mut want = per_rank(&rotation(0, user_placed), 4);
    want[3] += 2 * SENT;
    eventually("every pin placed", || {
        let routed = d.routed();
        assert!(routed[3] <= want[3], "more placements than queries: {routed:?}");
        (routed == want).then_some(())
    });
    // A query answered after them is the next in the rotation.
    let r = d.client().call(json!({"v": 1, "op": "route"}));
    assert_eq!(r["ranks"], json!(rotation(user_placed, 1)));

    // What each never-reader can still read: correct replies, in order, and
    // fewer than it asked for (the rest were dropped at the high-water mark,
    // not buffered in dpcoord). It reads until nothing came for half a
    // second, which only bounds how long the count takes.
    for (i, (_ctx, p)) in never_readers.iter().enumerate() {
        p.set_rcvtimeo(500).unwrap();
        let mut last = None;
        let mut got = 0u64;
        while let Ok(reply) = p.recv_multipart(0) {
            let r: Value = rmp_serde::from_slice(&reply[1]).unwrap();
            assert_eq!(r["ok"], json!(true), "{r}");
            let id = r["id"].as_u64().unwrap();
            assert!(last.is_none_or(|l| id > l), "replies out of order: {id} after {last:?}");
            last = Some(id);
            got += 1;
        }
        println!("never-reader {i}: {got} of {SENT} replies were still deliverable");
        // Two 1000-message high-water marks (dpcoord's side of the pipe) plus socket buffers.
        assert!(got <= 5_000, "never-reader {i}: {got} of {SENT} replies were kept for a peer that never reads");
    }
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn sixty_four_frontends_are_all_answered_and_split_exactly_evenly() {
    const FRONTENDS: u64 = 64;
    /// Route queries per frontend, and refused ones among them.
    const K: u64 = 30;
    const BAD: u64 = 5;
    let d = daemon();
    let base = counters(&d);
    let answers: Vec<Vec<u64>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..FRONTENDS)
            .map(|f| {
                let d = &d;
                s.spawn(move || {
                    let c = d.client();
                    let mut mine = Vec::new();
                    for i in 0..K + BAD {
                        let id = format!("{f}-{i}");
                        if i % 7 == 3 {
                            // Refused queries between the real ones: answered, counted, no placement.
                            let r = c.call(json!({"v": 1, "op": "route", "id": id, "n": 0}));
                            assert_eq!((&r["id"], &r["error"]["code"]), (&json!(id), &json!("bad_request")), "{r}");
                            continue;
                        }
                        let r = c.call(json!({"v": 1, "op": "route", "id": id}));
                        assert_eq!((&r["ok"], &r["id"], &r["epoch"]), (&json!(true), &json!(id), &json!(3)), "{r}");
                        mine.push(r["ranks"][0].as_u64().unwrap());
                    }
                    mine
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let all: Vec<u64> = answers.concat();
    assert_eq!(all.len() as u64, FRONTENDS * K);
    let placed = per_rank(&all, 4);
    let even = FRONTENDS * K / 3;
    assert_eq!(placed, [even, even, 0, even]);
    assert_eq!(d.routed(), placed);
    let m = counters(&d);
    let delta = |name: &str| m[name] - base[name];
    assert_eq!(delta("dpcoord_route_errors_total{code=\"bad_request\"}"), (FRONTENDS * BAD) as f64);
    for (r, &n) in placed.iter().enumerate() {
        let name = format!("dpcoord_routed_total{{class=\"user\",dp_rank=\"{r}\"}}");
        assert_eq!(delta(&name), n as f64, "{name}");
    }
    assert_eq!(d.stop().code(), Some(0));
}
