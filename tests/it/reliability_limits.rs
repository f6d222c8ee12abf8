//! Limits of the real binary: a configured `max_message_bytes` on every
//! socket (the default limit and the error codes are in core_errors.rs and
//! core_stats.rs), payloads beyond libzmq's backstop, links dpcoord opens to
//! engines (size limits and allowlists must not cut them), bounded shutdown
//! with queries in flight, rate-limited warnings under a flood of bad stats,
//! and memory that stays flat under distinct session keys and churning peers.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;
use rmpv::Value as M;
use serde_json::{json, Value};

/// The limit these tests configure (the smallest allowed is 256).
const LIMIT: usize = 1024;
/// libzmq's own limit on the bound sockets: the configured one plus 64 KiB.
const BACKSTOP: usize = LIMIT + (64 << 10);

/// `pairs` plus a binary `pad` making the encoding exactly `len` bytes.
fn padded(pairs: &[(&str, M)], len: usize) -> Vec<u8> {
    let with = |n: usize| {
        let mut p = pairs.to_vec();
        p.push(("pad", M::Binary(vec![7; n])));
        map(&p)
    };
    // Measured at `len`: the pad's header grows past 255 and 65,535 bytes.
    let overhead = with(len).len() - len;
    let out = with(len - overhead);
    assert_eq!(out.len(), len);
    out
}

/// A config file with `[limits] max_message_bytes = LIMIT` and liveness far out.
fn limited(dir: &tempfile::TempDir, extra: &[&str]) -> Daemon {
    let cfg = dir.path().join("limits.toml");
    std::fs::write(&cfg, format!("[limits]\nmax_message_bytes = {LIMIT}\n")).unwrap();
    let mut args = vec!["--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    Daemon::frozen("2", &args)
}

fn malformed(d: &Daemon) -> f64 {
    d.metric("dpcoord_stats_messages_total{result=\"malformed\"}").unwrap()
}

#[test]
fn a_configured_max_message_bytes_is_enforced_on_route_health_and_stats() {
    let dir = tempfile::tempdir().unwrap();
    let d = limited(&dir, &[]);
    let p = d.publisher();
    let seq = d.bring_up(&p, &[0]);
    let ping = [("v", M::from(1)), ("op", M::from("ping")), ("id", M::from("edge"))];
    for c in [d.client(), d.health_client()] {
        let pong =
            json!({"v": 1, "ok": true, "id": "edge", "epoch": 1, "instance": d.state()["instance"], "block_size": 16});
        assert_eq!(c.call_raw(&padded(&ping, LIMIT)), pong);
        let r = c.call_raw(&padded(&ping, LIMIT + 1));
        assert_eq!((&r["error"]["code"], &r["id"]), (&json!("too_large"), &json!("edge")), "{r}");
    }
    assert_eq!(d.metric("dpcoord_route_errors_total{code=\"too_large\"}"), Some(2.0));

    // Stats: an update of exactly the limit is applied.
    let stats = |seq: u64, waiting: u64| Update::new(0, 1, seq).counts([waiting, 0, 0, 0, 0]).pairs();
    let before = malformed(&d);
    p.send_raw(&padded(&stats(seq, 1), LIMIT));
    d.await_counts(0, [1, 0, 0, 0, 0]);
    // One byte more is dropped and counted; the link stays up, so the very
    // next update applies. Were the big one applied, its seq would make the
    // next one stale.
    p.send_raw(&padded(&stats(seq + 100, 9), LIMIT + 1));
    p.send(&update(0, 1, seq + 1, [2, 0, 0, 0, 0]));
    d.await_counts(0, [2, 0, 0, 0, 0]);
    assert_eq!(malformed(&d), before + 1.0);
    // Beyond libzmq's backstop (the limit + 64 KiB) the publisher's connection is
    // closed without dpcoord seeing the update (not counted); the publisher
    // reconnects by itself and later updates apply.
    p.send_raw(&padded(&stats(seq + 200, 9), BACKSTOP + 1));
    d.publish_until_shown(p.socket(), 0, &mut (seq + 2), [3, 0, 0, 0, 0]);
    assert_eq!(malformed(&d), before + 1.0);
}

/// dpcoord with the limit, connected (`--stats-connect`) to an engine PUB
/// that binds, with rank 0 up through that link; returns the engine's
/// socket and its next seq.
fn connected_engine(dir: &tempfile::TempDir) -> (Daemon, zmq::Socket, u64) {
    let engine = format!("ipc://{}/engine", dir.path().display());
    let d = limited(dir, &["--stats-connect", &engine]);
    let ctx = zmq::Context::new();
    let p = ctx.socket(zmq::PUB).unwrap();
    p.set_linger(0).unwrap();
    p.bind(&engine).unwrap();
    let mut seq = 1;
    d.publish_until_shown(&p, 0, &mut seq, [1, 0, 0, 0, 0]);
    (d, p, seq)
}

#[test]
fn an_oversized_update_from_an_engine_dpcoord_connects_to_is_dropped_and_the_link_stays_up() {
    // Here it is dpcoord that connects: a link libzmq closes on its side is
    // never reconnected, so dpcoord itself must drop the update.
    let dir = tempfile::tempdir().unwrap();
    let (d, p, mut seq) = connected_engine(&dir);
    let before = malformed(&d);
    let big = Update::new(0, 1, seq + 100).without("counts").pairs();
    p.send(padded(&big, LIMIT + 1), 0).unwrap();
    p.send(padded(&big, 16 * LIMIT), 0).unwrap();
    // A lost link fails here.
    d.publish_until_shown(&p, 0, &mut seq, [2, 0, 0, 0, 0]);
    assert_eq!(malformed(&d), before + 2.0);
    assert_eq!(d.ranks()[0]["status"], json!("up"));
}

#[test]
fn an_update_beyond_the_backstop_from_an_engine_dpcoord_connects_to_does_not_cut_the_link() {
    // libzmq closes a link over a frame above ZMQ_MAXMSGSIZE as a protocol
    // error and, on the connecting side, never reconnects it: with a libzmq
    // limit on these links the engine's rank would go down for good.
    let dir = tempfile::tempdir().unwrap();
    let (d, p, mut seq) = connected_engine(&dir);
    let big = Update::new(0, 1, seq + 100).without("counts").pairs();
    p.send(padded(&big, 16 * LIMIT + 1), 0).unwrap();
    // A lost link fails here.
    d.publish_until_shown(&p, 0, &mut seq, [2, 0, 0, 0, 0]);
}

#[test]
fn a_stats_allowlist_guards_the_bind_and_not_the_engines_dpcoord_connects_to() {
    // On one socket libzmq would check dpcoord's own outgoing links against
    // the allowlist too, refusing every engine not listed (and retrying forever).
    let dir = tempfile::tempdir().unwrap();
    let (bind, engine) = (format!("tcp://127.0.0.1:{}", free_port()), format!("tcp://127.0.0.1:{}", free_port()));
    let cfg = dir.path().join("allow.toml");
    std::fs::write(&cfg, format!("[server]\nstats_bind = \"{bind}\"\nstats_allow = [\"127.0.0.2\"]\n")).unwrap();
    let ep = |name: &str| ipc(&dir, name);
    let metrics = free_addr();
    let child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(["--config", cfg.to_str().unwrap(), "--dp-size", "2", "--stats-connect", &engine])
        .args(["--route-bind", &ep("route"), "--health-bind", &ep("health"), "--metrics-bind", &metrics.to_string()])
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let child = Spawned::from(child);
    let ctx = zmq::Context::new();
    let c = Client::connect(&ctx, &ep("route"));
    let publisher = |connect: bool, ep: &str| {
        let p = ctx.socket(zmq::PUB).unwrap();
        p.set_linger(0).unwrap();
        if connect { p.connect(ep) } else { p.bind(ep) }.unwrap();
        p
    };
    // Rank 0's engine binds; dpcoord connects to it: not subject to the allowlist.
    let linked = publisher(false, &engine);
    publish_until("rank 0 up through the link dpcoord opened", &linked, 0, &mut 1, [0; 5], || {
        c.call(json!({"v": 1, "op": "state"}))["ranks"][0]["status"] == "up"
    });
    // Rank 1's publisher connects to the bind from 127.0.0.1, which is not listed: refused.
    let refused = publisher(true, &bind);
    let denied = || metric(metrics, "dpcoord_access_denied_total{socket=\"stats\"}").unwrap();
    eventually("the refused publisher counted", || {
        refused.send(encode(&update(1, 1, 1, [0; 5])), 0).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        (denied() >= 1.0).then_some(())
    });
    assert_eq!(c.call(json!({"v": 1, "op": "state"}))["ranks"][1]["status"], json!("unknown"));
    assert_eq!(child.stop().code(), Some(0));
}

#[test]
fn a_query_beyond_the_libzmq_backstop_costs_only_its_sender_the_connection() {
    // The decoder answers `too_large` up to max_message_bytes + 64 KiB; beyond
    // that libzmq drops the connection without reading the query, so there
    // is no reply to it (a REQ peer would wait forever: the documented limit).
    let dir = tempfile::tempdir().unwrap();
    let d = limited(&dir, &[]);
    let bystander = d.client();
    let s = d.socket(zmq::DEALER, &d.route);
    let huge = padded(&[("v", M::from(1)), ("op", M::from("ping")), ("id", M::from("huge"))], BACKSTOP + 1);
    s.send_multipart([&b""[..], &huge[..]], 0).unwrap();
    assert_eq!(bystander.call(json!({"v": 1, "op": "ping", "id": 1}))["id"], json!(1));
    // The DEALER reconnects by itself; pings sent meanwhile may be lost, so
    // it pings until answered. The first reply is a ping's: the huge query
    // was never answered (replies on one connection keep their order).
    let mut k = 0;
    let first = eventually("the DEALER served again", || {
        k += 1;
        let ping = encode(&json!({"v": 1, "op": "ping", "id": k}));
        s.send_multipart([&b""[..], &ping[..]], 0).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        s.recv_multipart(zmq::DONTWAIT).ok()
    });
    let r: Value = rmp_serde::from_slice(&first[1]).unwrap();
    assert_eq!(r["ok"], json!(true), "{r}");
    assert!(r["id"].as_u64().is_some(), "{r}");
    // dpcoord never saw it: nothing counted, nothing changed.
    assert_eq!(d.metric("dpcoord_route_errors_total{code=\"too_large\"}"), Some(0.0));
    assert_eq!(bystander.call(json!({"v": 1, "op": "ping", "id": 2}))["id"], json!(2));
    assert_eq!(d.stop().code(), Some(0));
}

/// A sender's right to send one more query: `None` once `halt` is set. While
/// the returned guard lives, `stop` waits, so after `halt` is set and `stop`
/// has returned every query a sender will ever send is on its way (both sides
/// use SeqCst: either the sender sees `halt` or `stop` sees it sending).
struct Gate {
    halt: AtomicBool,
    sending: AtomicU64,
}

struct Sending<'a>(&'a Gate);

impl Gate {
    fn enter(&self) -> Option<Sending<'_>> {
        self.sending.fetch_add(1, Ordering::SeqCst);
        let guard = Sending(self);
        (!self.halt.load(Ordering::SeqCst)).then_some(guard)
    }

    fn stop(&self) {
        self.halt.store(true, Ordering::SeqCst);
        eventually("every sender to finish its last send", || (self.sending.load(Ordering::SeqCst) == 0).then_some(()));
    }
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        self.0.sending.fetch_sub(1, Ordering::SeqCst);
    }
}

#[test]
fn sigterm_with_queries_in_flight_answers_every_one_and_exits_zero_within_two_seconds() {
    const REQS: usize = 32;
    const DEALERS: usize = 4;
    /// Outstanding queries per DEALER (below the 1000-message high-water mark).
    const WINDOW: usize = 256;
    let d = Daemon::frozen_up("4", &[0, 1, 2, 3]);
    let route = d.route.clone();
    // One context (one I/O thread) for every client: on a loaded 2-core
    // machine a thread per client only adds scheduling delay.
    let ctx = zmq::Context::new();
    let gate = Gate { halt: AtomicBool::new(false), sending: AtomicU64::new(0) };
    let (sent, answered) = (AtomicU64::new(0), AtomicU64::new(0));
    let (status, elapsed) = std::thread::scope(|s| {
        for _ in 0..REQS {
            s.spawn(|| {
                let c = Client::connect(&ctx, &route);
                for i in 0u64.. {
                    let Some(sending) = gate.enter() else { break };
                    c.send(&encode(&json!({"v": 1, "op": "route", "id": i})));
                    sent.fetch_add(1, Ordering::SeqCst);
                    drop(sending);
                    // `recv` fails the test if the reply does not come.
                    let r = c.recv();
                    assert_eq!((&r["ok"], &r["id"]), (&json!(true), &json!(i)), "{r}");
                    answered.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        for _ in 0..DEALERS {
            s.spawn(|| {
                let p = ctx.socket(zmq::DEALER).unwrap();
                p.set_linger(0).unwrap();
                p.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
                p.connect(&route).unwrap();
                let q = encode(&json!({"v": 1, "op": "route", "n": 8}));
                let mut halted = false;
                while !halted {
                    let mut out = 0;
                    while out < WINDOW {
                        let Some(_sending) = gate.enter() else {
                            halted = true;
                            break;
                        };
                        p.send_multipart([&b""[..], &q[..]], 0).unwrap();
                        sent.fetch_add(1, Ordering::SeqCst);
                        out += 1;
                    }
                    for _ in 0..out {
                        let reply = p.recv_multipart(0).expect("a DEALER's query was not answered");
                        let r: Value = rmp_serde::from_slice(&reply[1]).unwrap();
                        assert_eq!(r["ok"], json!(true), "{r}");
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        }
        eventually("every client busy", || (answered.load(Ordering::SeqCst) >= 20 * REQS as u64).then_some(()));
        // Every query counted in `sent` was sent before the signal; many are
        // still unanswered (REQ clients waiting, DEALER windows open).
        gate.stop();
        let signalled = Instant::now();
        let status = d.stop_with("TERM");
        (status, signalled.elapsed())
    });
    println!("{} queries, all answered; exit {status} {elapsed:?} after SIGTERM", sent.load(Ordering::SeqCst));
    assert_eq!(answered.load(Ordering::SeqCst), sent.load(Ordering::SeqCst));
    assert_eq!(status.code(), Some(0), "{status}");
    assert!(elapsed < Duration::from_secs(2), "exited {elapsed:?} after SIGTERM");
}

#[test]
fn sigterm_exits_within_two_seconds_even_with_a_stalled_http_client() {
    let d = Daemon::start(&["--dp-size", "1"]);
    // A client that sends half a request and then nothing.
    let mut stalled = std::net::TcpStream::connect(d.metrics).unwrap();
    write!(stalled, "GET /metrics HTTP/1.1\r\nHost: dpcoord\r\n").unwrap();
    assert_eq!(d.http_get("/healthz").0, 200, "the server read the stalled request's first bytes by now");
    let signalled = Instant::now();
    let status = d.stop_with("TERM");
    let elapsed = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "{status}");
    assert!(elapsed < Duration::from_secs(2), "exited {elapsed:?} after SIGTERM");
    drop(stalled);
}

/// The three causes of a dropped update, and for each a flood message and a
/// distinguishable probe (its `reason` differs from the flood's).
const CAUSES: [&str; 3] = ["malformed", "stale", "unknown_rank"];

fn flood_message(cause: usize, k: u64) -> Vec<u8> {
    match cause {
        0 => vec![0xc1, k as u8],
        1 => encode(&update(0, 0, k, [0; 5])),
        _ => encode(&update(9, 1, k, [0; 5])),
    }
}

fn probe_message(cause: usize) -> Vec<u8> {
    match cause {
        0 => map(&[("v", 1.into()), ("rank", 0.into())]),
        1 => encode(&update(0, 1, 1, [0; 5])),
        _ => encode(&update(7, 1, 1, [0; 5])),
    }
}

/// Says whether a logged reason is a probe's, for each cause.
fn is_probe(cause: usize, reason: &str) -> bool {
    match cause {
        0 => reason.contains("missing"),
        1 => reason.contains("seq"),
        _ => reason.contains("rank 7"),
    }
}

#[test]
fn a_flood_of_bad_stats_logs_at_most_one_line_per_second_per_cause_and_counts_every_drop() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let args = [&["--log-format", "json", "--dp-size", "2"][..], &FROZEN].concat();
    let (child, lines) = spawn_on_ipc(&dir, &args, "warn");
    let ctx = zmq::Context::new();
    let c = Client::connect(&ctx, &ipc(&dir, "route"));
    let p = ctx.socket(zmq::PUB).unwrap();
    p.set_sndhwm(0).unwrap();
    p.set_linger(0).unwrap();
    p.connect(&ipc(&dir, "stats")).unwrap();
    // Rank 0 up at boot 1 (so boot 0 is stale); the subscription is in place.
    publish_until("rank 0 up", &p, 0, &mut 2, [0; 5], || {
        c.call(json!({"v": 1, "op": "state"}))["ranks"][0]["status"] == "up"
    });

    let mut sent = [0u64; 3];
    let until = Instant::now() + Duration::from_millis(1500);
    let mut k = 0;
    while Instant::now() < until && k < 60_000 {
        let cause = (k % 3) as usize;
        p.send(flood_message(cause, k), 0).unwrap();
        sent[cause] += 1;
        k += 1;
    }
    // Probes until each cause has logged a probe's line: that line's
    // `suppressed` covers the rest of the flood, which came before it.
    let mut logged: Vec<Value> = Vec::new();
    let mut flushed = [false; 3];
    let probing = Instant::now();
    while flushed.contains(&false) {
        assert!(probing.elapsed() < DEADLINE, "no probe line for some cause: {flushed:?}");
        for (cause, _) in CAUSES.iter().enumerate().filter(|&(c, _)| !flushed[c]) {
            p.send(probe_message(cause), 0).unwrap();
            sent[cause] += 1;
        }
        std::thread::sleep(Duration::from_millis(50));
        for line in lines.try_iter() {
            let v: Value = serde_json::from_str(&line).unwrap_or_else(|_| panic!("not a JSON log line: {line}"));
            let f = &v["fields"];
            assert_eq!((&v["level"], &f["message"]), (&json!("WARN"), &json!("dropped a stats update")), "{line}");
            let cause = CAUSES.iter().position(|c| f["result"] == *c).unwrap_or_else(|| panic!("{line}"));
            flushed[cause] |= is_probe(cause, f["reason"].as_str().unwrap());
            logged.push(v);
        }
    }
    let status = child.stop();
    let elapsed = started.elapsed().as_secs();
    assert_eq!(status.code(), Some(0));
    logged.extend(lines.iter().map(|l| serde_json::from_str(&l).unwrap()));

    let mut per_cause: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for v in &logged {
        let f = &v["fields"];
        let e = per_cause.entry(CAUSES.iter().find(|c| f["result"] == **c).unwrap()).or_default();
        e.0 += 1;
        e.1 += 1 + f["suppressed"].as_u64().unwrap();
    }
    println!("sent {sent:?} in {elapsed} s; (lines, lines + suppressed) per cause: {per_cause:?}");
    for (cause, name) in CAUSES.iter().enumerate() {
        let (lines, counted) = per_cause[name];
        assert!(lines <= elapsed + 1, "{name}: {lines} lines in {elapsed} s");
        assert_eq!(counted, sent[cause], "{name}: every drop is a line or in a line's suppressed count");
    }
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn distinct_long_session_keys_and_churning_peers_leave_memory_flat() {
    const KEY_BYTES: usize = 30_000;
    const SESSIONS: usize = 4_000;
    const PEERS: usize = 1_000;
    let d = Daemon::frozen("2", &[]);
    d.bring_up(&d.publisher(), &[0, 1]);
    let c = d.client();
    let session = |i: usize| format!("{i:08}{}", "s".repeat(KEY_BYTES - 8));
    // Warm up: allocator pools and buffers reach their working size.
    for i in 0..200 {
        c.call(json!({"v": 1, "op": "route", "session": session(i)}));
    }
    let before = rss_kib(d.pid());
    // 4000 distinct 30 kB keys: 120 MB if the table kept them; it keeps 8-byte hashes.
    for i in 200..SESSIONS {
        let r = c.call(json!({"v": 1, "op": "route", "session": session(i)}));
        assert_eq!(r["ok"], json!(true), "{r}");
    }
    // 1000 peers that connect, ask once and go: no state stays behind in dpcoord.
    let ctx = zmq::Context::new();
    for i in 0..PEERS {
        let peer = Client::connect(&ctx, &d.route);
        assert_eq!(peer.call(json!({"v": 1, "op": "ping", "id": i}))["id"], json!(i));
    }
    // A session's rank is still remembered (the table did its job).
    let r1 = c.call(json!({"v": 1, "op": "route", "session": session(SESSIONS - 1)}));
    let r2 = c.call(json!({"v": 1, "op": "route", "session": session(SESSIONS - 1)}));
    assert_eq!(r1["ranks"], r2["ranks"]);
    let after = rss_kib(d.pid());
    println!("dpcoord RSS {before} KiB -> {after} KiB after {SESSIONS} sessions of {KEY_BYTES} B and {PEERS} peers");
    assert!(after < before + 24 * 1024, "RSS grew from {before} KiB to {after} KiB");
    assert_eq!(d.stop().code(), Some(0));
}
