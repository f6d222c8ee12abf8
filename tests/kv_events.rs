//! The engines' KV-cache events through the real binary (docs/PROTOCOL.md
//! §11a): per-rank publishers found by `tcp://HOST:PORT+rank`, stores,
//! removals and clears seen through the health socket's `prefix` op,
//! `state` and `/metrics`; a lost batch recovered by replay, one that replay
//! cannot recover, and a rank that goes down. The engine side here binds a
//! PUB and a replay ROUTER per rank, as vLLM's and SGLang's publishers do
//! (their real classes are driven in clients/python/tests/compat).
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;
use rmpv::Value as M;
use serde_json::{json, Value};

/// The batches a publisher keeps for replay: `(seq, payload)`.
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// One rank's publisher: a PUB, and a ROUTER answering replays from its
/// buffer on a thread (`[id, "", start]` -> every buffered seq >= start,
/// then the end marker).
struct Engine {
    rank: u32,
    publisher: zmq::Socket,
    buffer: Buffer,
    next: u64,
    stop: Arc<AtomicBool>,
    replays: Option<JoinHandle<()>>,
}

impl Engine {
    fn bind(ctx: &zmq::Context, rank: u32, pub_port: u16, replay_port: u16) -> Result<Engine, zmq::Error> {
        let publisher = ctx.socket(zmq::PUB)?;
        publisher.set_linger(0)?;
        publisher.bind(&format!("tcp://127.0.0.1:{pub_port}"))?;
        let router = ctx.socket(zmq::ROUTER)?;
        router.set_linger(0)?;
        router.set_rcvtimeo(20)?;
        router.bind(&format!("tcp://127.0.0.1:{replay_port}"))?;
        let buffer: Buffer = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (buf, halt) = (Arc::clone(&buffer), Arc::clone(&stop));
        let replays = std::thread::spawn(move || {
            while !halt.load(Ordering::SeqCst) {
                let Ok(req) = router.recv_multipart(0) else { continue };
                let [id, _, start] = &req[..] else { panic!("a replay request is [id, \"\", seq]: {req:?}") };
                let start = u64::from_be_bytes(start[..].try_into().unwrap());
                for (seq, payload) in buf.lock().unwrap().iter().filter(|(s, _)| *s >= start) {
                    router.send_multipart([&id[..], b"", b"", &seq.to_be_bytes(), payload], 0).unwrap();
                }
                router.send_multipart([&id[..], b"", b"", &[0xff; 8], b""], 0).unwrap();
            }
        });
        Ok(Engine { rank, publisher, buffer, next: 0, stop, replays: Some(replays) })
    }

    /// Buffers the next batch of `events` and sends it unless `lost`.
    fn emit(&mut self, events: Vec<M>, lost: bool) -> u64 {
        let seq = self.next;
        self.next += 1;
        let payload = msgpack(&M::Array(vec![M::F64(0.0), M::Array(events), M::from(self.rank)]));
        if !lost {
            self.publisher.send_multipart([&b""[..], &seq.to_be_bytes(), &payload], 0).unwrap();
        }
        self.buffer.lock().unwrap().push((seq, payload));
        seq
    }

    fn publish(&mut self, events: Vec<M>) -> u64 {
        self.emit(events, false)
    }

    /// Drops every buffered batch up to `seq`, as a full replay buffer does.
    fn forget_through(&self, seq: u64) {
        self.buffer.lock().unwrap().retain(|(s, _)| *s > seq);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.replays.take() {
            let _ = t.join();
        }
    }
}

/// Publishers for `ranks` ranks at consecutive ports (retried until a
/// free run is found): returns them and the two base ports.
fn engines(ctx: &zmq::Context, ranks: u32) -> (Vec<Engine>, u16, u16) {
    loop {
        let (p, r) = (free_port(), free_port());
        let bound: Result<Vec<Engine>, _> =
            (0..ranks).map(|i| Engine::bind(ctx, i, p + i as u16, r + i as u16)).collect();
        if let Ok(e) = bound {
            return (e, p, r);
        }
    }
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> M {
    M::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), M::Array(hashes.iter().map(|&h| M::from(h)).collect())),
        ("parent_block_hash".into(), parent.map_or(M::Nil, M::from)),
        ("token_ids".into(), M::Array(tokens.iter().map(|&t| M::from(t)).collect())),
        ("block_size".into(), M::from(2)),
        ("lora_id".into(), M::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), M::Nil),
    ])
}

fn removed(hashes: &[u64]) -> M {
    M::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), M::Array(hashes.iter().map(|&h| M::from(h)).collect())),
        ("medium".into(), "GPU".into()),
    ])
}

fn cleared() -> M {
    M::Map(vec![("type".into(), "AllBlocksCleared".into())])
}

/// The `prefix` op's reply for `tokens`.
fn prefix(d: &Daemon, tokens: &[u32]) -> Value {
    let r = d.health_client().call(json!({"v": 1, "op": "prefix", "tokens": tokens}));
    assert_eq!(r["ok"], json!(true), "{r}");
    json!({"blocks": r["blocks"], "matched": r["matched"]})
}

fn await_prefix(d: &Daemon, tokens: &[u32], want: Value) {
    eventually(&format!("prefix {tokens:?} to be {want}"), || (prefix(d, tokens) == want).then_some(()));
}

/// Publishes empty batches until dpcoord has applied one from each engine
/// (SUB drops what comes before it joins; the replay from 0 dpcoord asks
/// for on a publisher's first batch brings those back anyway).
fn join(d: &Daemon, engines: &mut [Engine]) {
    eventually("dpcoord to hear every publisher", || {
        for e in engines.iter_mut() {
            e.publish(vec![]);
        }
        std::thread::sleep(Duration::from_millis(20));
        let ok = d.metric("dpcoord_kv_batches_total{result=\"ok\"}").unwrap_or(0.0);
        (ok >= engines.len() as f64).then_some(())
    });
}

const PROMPT: [u32; 7] = [1, 2, 3, 4, 5, 6, 7];

#[test]
fn stores_removals_and_clears_reach_each_ranks_index() {
    let ctx = zmq::Context::new();
    let (mut e, p, r) = engines(&ctx, 2);
    let d = Daemon::frozen(
        "2",
        &[
            "--kv-events-connect",
            &format!("tcp://127.0.0.1:{p}+rank"),
            "--kv-events-replay",
            &format!("tcp://127.0.0.1:{r}+rank"),
        ],
    );
    assert_eq!(prefix(&d, &PROMPT), json!({"blocks": 0, "matched": [0, 0]}), "no block size known yet");
    join(&d, &mut e);
    e[0].publish(vec![stored(&[10, 11], None, &[1, 2, 3, 4]), stored(&[12], Some(11), &[5, 6])]);
    e[1].publish(vec![stored(&[20], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [3, 1]}));
    let s = d.state();
    assert_eq!(s["kv_block_size"], json!(2));
    assert_eq!((&s["ranks"][0]["kv_blocks"], &s["ranks"][1]["kv_blocks"]), (&json!({"GPU": 3}), &json!({"GPU": 1})));
    // The tail block evicted on rank 0; everything cleared on rank 1.
    e[0].publish(vec![removed(&[12])]);
    e[1].publish(vec![cleared()]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [2, 0]}));
    assert_eq!(d.metric("dpcoord_kv_index_resets_total{cause=\"cleared\",dp_rank=\"1\"}"), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"stored\"}"), Some(2.0), "events, not blocks");
    assert_eq!(d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"removed\"}"), Some(1.0));
    eventually("the block gauges at the next tick", || {
        let g = |r: &str| d.metric(&format!("dpcoord_kv_blocks{{dp_rank=\"{r}\",medium=\"GPU\"}}"));
        (g("0") == Some(2.0) && g("1") == Some(0.0)).then_some(())
    });
    // A LoRA or salt is another chain: nothing matches.
    let r = d.health_client().call(json!({"v": 1, "op": "prefix", "tokens": PROMPT, "salt": "tenant"}));
    assert_eq!(r["matched"], json!([0, 0]));
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn a_lost_batch_is_replayed_and_one_replay_cannot_cover_clears_the_rank() {
    let ctx = zmq::Context::new();
    let (mut e, p, r) = engines(&ctx, 1);
    let d = Daemon::frozen(
        "1",
        &[
            "--kv-events-connect",
            &format!("tcp://127.0.0.1:{p}+rank"),
            "--kv-events-replay",
            &format!("tcp://127.0.0.1:{r}+rank"),
        ],
    );
    join(&d, &mut e);
    e[0].publish(vec![stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [3]}));
    // Lost on the way (kept in the publisher's buffer): the next batch shows the gap.
    e[0].emit(vec![stored(&[30], None, &[7, 7])], true);
    e[0].publish(vec![stored(&[31], Some(30), &[8, 8])]);
    await_prefix(&d, &[7, 7, 8, 8], json!({"blocks": 2, "matched": [2]}));
    assert_eq!(d.metric("dpcoord_kv_replays_total{result=\"recovered\"}"), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_event_gaps_total"), Some(1.0));
    // Lost and gone from the buffer: the replay starts after it, so the rank is cleared.
    let gone = e[0].emit(vec![removed(&[10])], true);
    e[0].forget_through(gone);
    e[0].publish(vec![stored(&[40], None, &[5, 5])]);
    await_prefix(&d, &[5, 5], json!({"blocks": 1, "matched": [1]}));
    assert_eq!(prefix(&d, &PROMPT)["matched"], json!([0]), "no phantom of block 10");
    assert_eq!(d.metric("dpcoord_kv_replays_total{result=\"incomplete\"}"), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_index_resets_total{cause=\"gap\",dp_rank=\"0\"}"), Some(1.0));
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn bad_batches_are_counted_and_a_rank_that_goes_down_loses_its_index() {
    let ctx = zmq::Context::new();
    let (mut e, p, _) = engines(&ctx, 1);
    // Liveness short enough to see a rank go down; no replay endpoint.
    let d = Daemon::start(&[
        "--dp-size",
        "1",
        "--stale-after-ms",
        "300",
        "--down-after-ms",
        "600",
        "--kv-events-connect",
        &format!("tcp://127.0.0.1:{p}"),
    ]);
    let stats = d.publisher();
    let mut seq = d.bring_up(&stats, &[0]);
    join(&d, &mut e);
    // Not MessagePack, a rank out of range, then a good one: the daemon goes on.
    e[0].publisher.send_multipart([&b""[..], &e[0].next.to_be_bytes(), b"\xc1"], 0).unwrap();
    e[0].next += 1;
    e[0].rank = 5;
    e[0].publish(vec![cleared()]);
    e[0].rank = 0;
    e[0].publish(vec![stored(&[10], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1]}));
    assert_eq!(d.metric("dpcoord_kv_batches_total{result=\"malformed\"}"), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_batches_total{result=\"unknown_rank\"}"), Some(1.0));
    // Keep the rank up for a while, then let it go silent.
    publish_until("a stats update after the KV batch", stats.socket(), 0, &mut seq, [0; 5], || true);
    d.wait_status(0, "down");
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [0]}));
    assert_eq!(d.metric("dpcoord_kv_index_resets_total{cause=\"down\",dp_rank=\"0\"}"), Some(1.0));
    assert_eq!(d.stop().code(), Some(0));
}
