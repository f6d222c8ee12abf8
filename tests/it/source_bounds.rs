//! The sources dpcoord connects to are bounded by bytes: each
//! link has libzmq's per-frame limit (the source's own limit plus 64 KiB)
//! and a high-water mark derived from a byte budget. A frame a little over
//! the source's limit is read and refused by dpcoord (the link kept); one
//! above libzmq's limit closes the link, which libzmq 4.3 never reconnects,
//! so dpcoord connects it again (`crates/daemon/src/io/links.rs`). The engine side here
//! binds a PUB (and a replay ROUTER) as the engines' publishers do.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use rmpv::Value as M;
use serde_json::json;

/// What libzmq reads beyond a source's own limit (`BACKSTOP_SLACK`).
const SLACK: usize = 64 << 10;
/// The least `kv_events.max_batch_bytes`, to keep the frames small.
const KV_MAX: usize = 1024;
/// libzmq's own retry interval (`ZMQ_RECONNECT_IVL`, 100 ms by default).
const RETRY_IVL: Duration = Duration::from_millis(100);

fn event_id(frame: &[u8]) -> u16 {
    u16::from_ne_bytes([frame[0], frame[1]])
}

/// The events of `monitor` until `done` holds for them (or the deadline).
fn events_until(monitor: &zmq::Socket, mut done: impl FnMut(&[u16]) -> bool) -> Vec<u16> {
    let mut seen = Vec::new();
    eventually("libzmq's monitor events", || {
        while let Ok(f) = monitor.recv_multipart(zmq::DONTWAIT) {
            seen.push(event_id(&f[0]));
        }
        done(&seen).then_some(())
    });
    seen
}

/// A SUB with `maxmsgsize` that connects to a PUB: an oversized frame ends
/// the link with `DISCONNECTED` and nothing after it (libzmq does not retry:
/// ten of its retry intervals pass without an event, and nothing sent later
/// arrives); the same link ended by the publisher going away is followed by
/// `CONNECT_RETRIED` and comes back by itself. `zmq_disconnect` + `zmq_connect`
/// of the endpoint brings back the closed link. This is what `io::links` relies on.
#[test]
fn libzmq_retries_a_lost_link_but_never_one_closed_over_an_oversized_frame() {
    let ctx = zmq::Context::new();
    let port = free_port();
    let bind = format!("tcp://127.0.0.1:{port}");
    let publ = ctx.socket(zmq::PUB).unwrap();
    publ.bind(&bind).unwrap();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(b"").unwrap();
    sub.set_maxmsgsize(1000).unwrap();
    sub.monitor("inproc://links", zmq::SocketEvent::ALL as i32).unwrap();
    let monitor = ctx.socket(zmq::PAIR).unwrap();
    monitor.connect("inproc://links").unwrap();
    let ep = format!("tcp://localhost:{port}");
    sub.connect(&ep).unwrap();
    let handshake = zmq::SocketEvent::HANDSHAKE_SUCCEEDED as u16;
    let disconnected = zmq::SocketEvent::DISCONNECTED as u16;
    let retried = zmq::SocketEvent::CONNECT_RETRIED as u16;
    events_until(&monitor, |e| e.contains(&handshake));
    let receive = |sub: &zmq::Socket| {
        eventually("a message through the link", || {
            publ.send("hello", 0).unwrap();
            std::thread::sleep(Duration::from_millis(10));
            sub.recv_bytes(zmq::DONTWAIT).ok()
        })
    };
    assert_eq!(receive(&sub), b"hello");
    while sub.recv_bytes(zmq::DONTWAIT).is_ok() {}

    publ.send(vec![0u8; 1001], 0).unwrap();
    assert_eq!(events_until(&monitor, |e| !e.is_empty()), [disconnected]);
    std::thread::sleep(RETRY_IVL * 10);
    publ.send("after", 0).unwrap();
    std::thread::sleep(RETRY_IVL);
    assert_eq!(monitor.recv_multipart(zmq::DONTWAIT).err(), Some(zmq::Error::EAGAIN), "libzmq did something");
    assert_eq!(sub.recv_bytes(zmq::DONTWAIT).err(), Some(zmq::Error::EAGAIN), "the closed link delivered");

    sub.disconnect(&ep).unwrap();
    sub.connect(&ep).unwrap();
    assert_eq!(receive(&sub), b"hello", "disconnect + connect brings the link back");

    // The publisher goes away and comes back: libzmq retries on its own.
    drop(publ);
    let seen = events_until(&monitor, |e| e.contains(&retried));
    let gone = seen.iter().position(|&e| e == disconnected).expect("DISCONNECTED");
    assert!(seen[gone..].contains(&retried), "{seen:?}");
    let publ = ctx.socket(zmq::PUB).unwrap();
    publ.bind(&bind).unwrap();
    let hello = eventually("libzmq's own reconnect", || {
        publ.send("again", 0).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        sub.recv_bytes(zmq::DONTWAIT).ok()
    });
    assert_eq!(hello, b"again");
}

/// A config file in the daemon's scope: `[kv_events]` with the least batch
/// limit and a short replay timeout, plus `extra`.
fn config(dir: &tempfile::TempDir, extra: &str) -> String {
    let path = dir.path().join("bounds.toml");
    std::fs::write(&path, format!("[kv_events]\nmax_batch_bytes = {KV_MAX}\nreplay_timeout_ms = 300\n{extra}"))
        .unwrap();
    path.to_str().unwrap().to_owned()
}

/// A socket of `kind` as an engine binds it (linger 0, then `configure`)
/// on a fresh loopback port; with its endpoint.
fn bound(ctx: &zmq::Context, kind: zmq::SocketType, configure: impl FnOnce(&zmq::Socket)) -> (zmq::Socket, String) {
    let s = ctx.socket(kind).unwrap();
    s.set_linger(0).unwrap();
    configure(&s);
    let ep = format!("tcp://127.0.0.1:{}", free_port());
    s.bind(&ep).unwrap();
    (s, ep)
}

fn reconnects(d: &Daemon, source: &str, endpoint: &str) -> Option<f64> {
    d.metric(&format!("dpcoord_source_reconnects_total{{endpoint=\"{endpoint}\",source=\"{source}\"}}"))
}

#[test]
fn an_oversized_stats_frame_closes_the_link_and_dpcoord_connects_it_again() {
    let ctx = zmq::Context::new();
    let (publ, ep) = bound(&ctx, zmq::PUB, |_| {});
    let d = Daemon::frozen("1", &["--stats-connect", &ep]);
    let malformed = r#"dpcoord_stats_messages_total{result="malformed"}"#;
    assert_eq!(reconnects(&d, "stats", &ep), Some(0.0));
    let mut seq = 1;
    d.publish_until_shown(&publ, 0, &mut seq, [1, 0, 0, 0, 0]);

    // One byte over max_message_bytes: read, refused, counted; the link stays.
    publ.send(vec![0x90u8; 65_537], 0).unwrap();
    eventually("the message one byte over refused", || (d.metric(malformed) == Some(1.0)).then_some(()));
    publ.send(encode(&update(0, 1, seq, [2, 0, 0, 0, 0])), 0).unwrap();
    seq += 1;
    eventually("the next update applied on the same link", || {
        (d.ranks()[0]["counts"] == json!([2, 0, 0, 0, 0])).then_some(())
    });
    assert_eq!(reconnects(&d, "stats", &ep), Some(0.0));

    // Above max_message_bytes + 64 KiB: libzmq closes the link; dpcoord connects it again.
    publ.send(encode(&update(0, 1, seq, [9; 5])).into_iter().chain(vec![0u8; 65_536 + SLACK]).collect::<Vec<_>>(), 0)
        .unwrap();
    seq += 1;
    eventually("the link connected again", || (reconnects(&d, "stats", &ep) == Some(1.0)).then_some(()));
    d.publish_until_shown(&publ, 0, &mut seq, [3, 0, 0, 0, 0]);
    assert_eq!(d.metric(malformed), Some(1.0), "the oversized frame never reached dpcoord's decoder");
    assert_eq!(reconnects(&d, "stats", &ep), Some(1.0));
    assert_eq!(d.stop().code(), Some(0));
}

/// One `KVEventBatch` storing `blocks` blocks of 2 tokens from `first`.
fn stored(first: u32, blocks: u32) -> Vec<u8> {
    let tokens: Vec<M> = (first..first + 2 * blocks).map(M::from).collect();
    let hashes: Vec<M> = (first..first + blocks).map(|h| M::from(u64::from(h) + 1000)).collect();
    let event = M::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), M::Array(hashes)),
        ("parent_block_hash".into(), M::Nil),
        ("token_ids".into(), M::Array(tokens)),
        ("block_size".into(), M::from(2)),
        ("medium".into(), "GPU".into()),
    ]);
    msgpack(&M::Array(vec![M::F64(0.0), M::Array(vec![event]), M::from(0)]))
}

fn empty() -> Vec<u8> {
    msgpack(&M::Array(vec![M::F64(0.0), M::Array(vec![]), M::from(0)]))
}

/// How many leading blocks of `tokens` rank 0 holds, by the `prefix` op.
fn matched(d: &Daemon, tokens: &[u32]) -> serde_json::Value {
    d.health_client().call(json!({"v": 1, "op": "prefix", "tokens": tokens}))["matched"].clone()
}

fn kv(d: &Daemon, series: &str) -> f64 {
    d.metric(series).unwrap_or(0.0)
}

#[test]
fn an_oversized_kv_batch_closes_the_link_and_dpcoord_connects_it_again() {
    let ctx = zmq::Context::new();
    let (publ, ep) = bound(&ctx, zmq::PUB, |_| {});
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::frozen("1", &["--config", &config(&dir, ""), "--kv-events-connect", &ep]);
    let mut seq = 0u64;
    let mut send = |payload: &[u8]| {
        publ.send_multipart([&b""[..], &seq.to_be_bytes(), payload], 0).unwrap();
        seq += 1;
    };
    let (ok, malformed) =
        (r#"dpcoord_kv_batches_total{result="ok"}"#, r#"dpcoord_kv_batches_total{result="malformed"}"#);
    eventually("dpcoord to hear the publisher", || {
        send(&empty());
        std::thread::sleep(Duration::from_millis(10));
        (kv(&d, ok) >= 1.0).then_some(())
    });
    assert_eq!(reconnects(&d, "kv_events", &ep), Some(0.0));

    // One byte over max_batch_bytes: read, its seq counted, the batch dropped.
    let over: Vec<u8> = stored(1, 1).into_iter().chain(std::iter::repeat_n(0, KV_MAX)).collect();
    assert!(over.len() > KV_MAX && over.len() < KV_MAX + SLACK);
    send(&over);
    eventually("the batch over the limit dropped", || (kv(&d, malformed) == 1.0).then_some(()));
    send(&stored(1, 2));
    eventually("the next batch applied on the same link", || (matched(&d, &[1, 2, 3, 4]) == json!([2])).then_some(()));

    // Above libzmq's limit: the link closes and dpcoord connects it again;
    // the blocks that frame stores are never applied.
    let huge: Vec<u8> = stored(11, 1).into_iter().chain(std::iter::repeat_n(0, KV_MAX + SLACK)).collect();
    send(&huge);
    eventually("the link connected again", || (reconnects(&d, "kv_events", &ep) == Some(1.0)).then_some(()));
    let mut next = 21;
    eventually("a batch applied after the reconnect", || {
        send(&stored(next, 1));
        next += 2;
        std::thread::sleep(Duration::from_millis(10));
        (kv(&d, r#"dpcoord_kv_events_total{dp_rank="0",result="stored"}"#) >= 2.0).then_some(())
    });
    assert_eq!(matched(&d, &[11, 12]), json!([0]), "the oversized batch's block");
    assert_eq!(kv(&d, malformed), 1.0);
    assert_eq!(reconnects(&d, "kv_events", &ep), Some(1.0));
    assert_eq!(d.stop().code(), Some(0));
}

/// A replay socket's buffer: `(seq, payload)`.
type Buffer = Arc<std::sync::Mutex<Vec<(u64, Vec<u8>)>>>;

/// The replay DEALER: a replay ROUTER that answers dpcoord's first request
/// with a frame above libzmq's limit; dpcoord connects that link again,
/// and the next gap is replayed over it.
#[test]
fn an_oversized_replay_frame_closes_the_link_and_the_next_replay_uses_the_new_one() {
    let ctx = zmq::Context::new();
    let (publ, pub_ep) = bound(&ctx, zmq::PUB, |_| {});
    let (router, replay_ep) = bound(&ctx, zmq::ROUTER, |r| r.set_rcvtimeo(20).unwrap());
    let buffer: Buffer = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let replays = {
        let (buffer, stop) = (Arc::clone(&buffer), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut requests = 0;
            while !stop.load(Ordering::SeqCst) {
                let Ok(req) = router.recv_multipart(0) else { continue };
                let [id, _, from] = &req[..] else { panic!("a replay request is [id, \"\", seq]: {req:?}") };
                requests += 1;
                if requests == 1 {
                    let huge = vec![0u8; KV_MAX + SLACK + 1];
                    router.send_multipart([&id[..], b"", b"", &0u64.to_be_bytes(), &huge], 0).unwrap();
                    continue;
                }
                let from = u64::from_be_bytes(from[..].try_into().unwrap());
                for (seq, payload) in buffer.lock().unwrap().iter().filter(|(s, _)| *s >= from) {
                    router.send_multipart([&id[..], b"", b"", &seq.to_be_bytes(), payload], 0).unwrap();
                }
                router.send_multipart([&id[..], b"", b"", &[0xff; 8], b""], 0).unwrap();
            }
            requests
        })
    };
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::frozen(
        "1",
        &["--config", &config(&dir, ""), "--kv-events-connect", &pub_ep, "--kv-events-replay", &replay_ep],
    );
    // A publisher that published before dpcoord came: its first batch heard asks for a replay from 0.
    let mut seq = 5u64;
    let mut emit = |payload: Vec<u8>, lost: bool| {
        if !lost {
            publ.send_multipart([&b""[..], &seq.to_be_bytes(), &payload], 0).unwrap();
        }
        buffer.lock().unwrap().push((seq, payload));
        seq += 1;
    };
    // That first replay is answered with the huge frame.
    eventually("the replay link connected again", || {
        emit(empty(), false);
        std::thread::sleep(Duration::from_millis(10));
        (reconnects(&d, "kv_replay", &replay_ep) == Some(1.0)).then_some(())
    });
    let replays_of = |result: &str| kv(&d, &format!("dpcoord_kv_replays_total{{result=\"{result}\"}}"));
    // That replay times out (the first is not counted), then the live batches apply.
    eventually("the first replay over", || (kv(&d, r#"dpcoord_kv_batches_total{result="ok"}"#) >= 1.0).then_some(()));
    // A batch lost on the wire, then the next: replayed over the new link.
    emit(stored(1, 2), true);
    emit(stored(5, 1), false);
    eventually("the lost batch replayed", || (matched(&d, &[1, 2, 3, 4]) == json!([2])).then_some(()));
    assert_eq!((replays_of("recovered"), replays_of("timeout")), (1.0, 0.0));
    assert_eq!(reconnects(&d, "kv_replay", &replay_ep), Some(1.0));
    assert_eq!(reconnects(&d, "kv_events", &pub_ep), Some(0.0));
    assert_eq!(d.stop().code(), Some(0));
    stop.store(true, Ordering::SeqCst);
    assert_eq!(replays.join().unwrap(), 2, "the huge answer, then the replay");
}

/// The default `kv_events.max_batch_bytes`.
const KV_DEFAULT_MAX: usize = 4 << 20;

/// A `KVEventBatch` map of exactly `bytes` bytes: no events, rank 0, and a
/// `pad` field dpcoord skips (so the index does not grow: the bytes are the
/// transport's to hold).
fn padded(bytes: usize) -> Vec<u8> {
    let head = map(&[("events", M::Array(vec![])), ("dp_rank", M::from(0)), ("pad", M::Binary(vec![]))]);
    // bin32: the marker and a 4-byte length replace the empty bin8 (2 bytes).
    let pad = bytes - (head.len() - 2) - 5;
    let mut out = head[..head.len() - 2].to_vec();
    out.push(0xc6);
    out.extend_from_slice(&(pad as u32).to_be_bytes());
    out.resize(bytes, 0);
    out
}

/// A KV publisher and its replay socket flood dpcoord (at the defaults)
/// with batches of exactly `kv_events.max_batch_bytes` and, every tenth,
/// one above libzmq's limit: the live SUB's link and the replay DEALER's
/// (each replay request is answered with 3 such batches and an oversized
/// frame) are closed and connected again over and over. dpcoord's peak RSS
/// stays under the Kubernetes limit and a route client is answered throughout.
#[test]
fn a_kv_publisher_flooding_maximum_and_oversized_batches_stays_under_the_ceiling() {
    let ctx = zmq::Context::new();
    let (publ, pub_ep) = bound(&ctx, zmq::PUB, |p| p.set_sndhwm(4).unwrap());
    let (router, replay_ep) = bound(&ctx, zmq::ROUTER, |r| {
        r.set_sndhwm(4).unwrap();
        r.set_rcvtimeo(20).unwrap();
    });
    let (max, huge) = (padded(KV_DEFAULT_MAX), padded(KV_DEFAULT_MAX + SLACK + 1));
    let mut rest = &max[..];
    let decoded = rmpv::decode::read_value(&mut rest).unwrap();
    assert_eq!(
        (max.len(), rest.len(), decoded["pad"].as_slice().map(<[u8]>::len)),
        (KV_DEFAULT_MAX, 0, Some(KV_DEFAULT_MAX - 27))
    );
    let stop = Arc::new(AtomicBool::new(false));
    let replays = {
        let (stop, max, huge) = (Arc::clone(&stop), max.clone(), huge.clone());
        std::thread::spawn(move || {
            let mut requests = 0;
            while !stop.load(Ordering::SeqCst) {
                let Ok(req) = router.recv_multipart(0) else { continue };
                requests += 1;
                for seq in 0..4u64 {
                    let payload = if seq == 3 { &huge } else { &max };
                    // A full pipe drops (ROUTER): the flood goes on as fast as dpcoord reads.
                    let _ = router.send_multipart([&req[0][..], b"", b"", &seq.to_be_bytes(), payload], zmq::DONTWAIT);
                }
            }
            requests
        })
    };
    let d = Daemon::frozen("1", &["--kv-events-connect", &pub_ep, "--kv-events-replay", &replay_ep]);
    d.bring_up(&d.publisher(), &[0]);
    let before = status_kib(d.pid(), "VmRSS");
    let client = d.client();
    let links = |source: &str, ep: &str| reconnects(&d, source, ep).unwrap_or(0.0);
    let mut seq = 0u64;
    eventually("each link closed by an oversized frame and connected again, more than once", || {
        for _ in 0..10 {
            seq += 1;
            let payload = if seq.is_multiple_of(10) { &huge } else { &max };
            publ.send_multipart([&b""[..], &seq.to_be_bytes(), payload], 0).unwrap();
        }
        let r = client.call(json!({"v": 1, "op": "route", "id": seq}));
        assert_eq!(r["ok"], json!(true), "route during the flood: {r}");
        assert_eq!(d.http_get("/healthz").0, 200, "/healthz during the flood");
        (links("kv_events", &pub_ep) >= 3.0 && links("kv_replay", &replay_ep) >= 2.0).then_some(())
    });
    let peak = status_kib(d.pid(), "VmHWM");
    println!(
        "KV flood: RSS before {before} KiB, peak {peak} KiB; {} + {} reconnects; {} batches ok",
        links("kv_events", &pub_ep),
        links("kv_replay", &replay_ep),
        kv(&d, r#"dpcoord_kv_batches_total{result="ok"}"#)
    );
    assert!(peak < CEILING_KIB, "peak RSS {peak} KiB is over the {CEILING_KIB} KiB limit");
    assert_eq!(d.stop().code(), Some(0));
    stop.store(true, Ordering::SeqCst);
    assert!(replays.join().unwrap() >= 1);
}
