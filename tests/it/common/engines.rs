//! The engines' own publishers, bound as the engines bind them: a KV-event
//! PUB with its replay ROUTER per rank (vLLM's and SGLang's `+rank`
//! layout), and SGLang's scheduler load PUB; and what tests ask of dpcoord's
//! prefix index through the health socket.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rmpv::Value as M;
use serde_json::{json, Value};

use super::{eventually, free_port, msgpack, Daemon};

/// The batches a publisher keeps for replay: `(seq, payload)`.
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// One rank's publisher: a PUB, and a ROUTER answering replays from its
/// buffer on a thread (`[id, "", start]` -> every buffered seq >= start,
/// then the end marker).
pub struct Engine {
    /// The rank its batches name (a test may make it name another).
    pub rank: u32,
    pub publisher: zmq::Socket,
    buffer: Buffer,
    /// The `seq` of its next batch.
    pub next: u64,
    stop: Arc<AtomicBool>,
    replays: Option<JoinHandle<()>>,
}

impl Engine {
    pub fn bind(ctx: &zmq::Context, rank: u32, pub_port: u16, replay_port: u16) -> Result<Engine, zmq::Error> {
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
    pub fn emit(&mut self, events: Vec<M>, lost: bool) -> u64 {
        self.emit_naming(self.rank, events, lost)
    }

    /// As [`Engine::emit`], the batch naming `rank` as its `dp_rank`.
    pub fn emit_naming(&mut self, rank: u32, events: Vec<M>, lost: bool) -> u64 {
        let seq = self.next;
        self.next += 1;
        let payload = msgpack(&M::Array(vec![M::F64(0.0), M::Array(events), M::from(rank)]));
        if !lost {
            self.publisher.send_multipart([&b""[..], &seq.to_be_bytes(), &payload], 0).unwrap();
        }
        self.buffer.lock().unwrap().push((seq, payload));
        seq
    }

    pub fn publish(&mut self, events: Vec<M>) -> u64 {
        self.emit(events, false)
    }

    /// Drops every buffered batch up to `seq`, as a full replay buffer does.
    pub fn forget_through(&self, seq: u64) {
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
pub fn engines(ctx: &zmq::Context, ranks: u32) -> (Vec<Engine>, u16, u16) {
    loop {
        let (p, r) = (free_port(), free_port());
        let bound: Result<Vec<Engine>, _> =
            (0..ranks).map(|i| Engine::bind(ctx, i, p + i as u16, r + i as u16)).collect();
        if let Ok(e) = bound {
            return (e, p, r);
        }
    }
}

/// A `BlockStored` on GPU of blocks of 2 tokens.
pub fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> M {
    stored_sized(hashes, parent, tokens, 2)
}

/// A `BlockStored` on GPU of blocks of `block_size` tokens.
pub fn stored_sized(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) -> M {
    M::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), M::Array(hashes.iter().map(|&h| M::from(h)).collect())),
        ("parent_block_hash".into(), parent.map_or(M::Nil, M::from)),
        ("token_ids".into(), M::Array(tokens.iter().map(|&t| M::from(t)).collect())),
        ("block_size".into(), M::from(block_size)),
        ("lora_id".into(), M::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), M::Nil),
    ])
}

pub fn removed(hashes: &[u64]) -> M {
    M::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), M::Array(hashes.iter().map(|&h| M::from(h)).collect())),
        ("medium".into(), "GPU".into()),
    ])
}

pub fn cleared() -> M {
    M::Map(vec![("type".into(), "AllBlocksCleared".into())])
}

/// The `prefix` op's reply for `tokens`.
pub fn prefix(d: &Daemon, tokens: &[u32]) -> Value {
    let r = d.health_client().call(json!({"v": 1, "op": "prefix", "tokens": tokens}));
    assert_eq!(r["ok"], json!(true), "{r}");
    json!({"blocks": r["blocks"], "matched": r["matched"]})
}

pub fn await_prefix(d: &Daemon, tokens: &[u32], want: Value) {
    eventually(&format!("prefix {tokens:?} to be {want}"), || (prefix(d, tokens) == want).then_some(()));
}

/// Publishes empty batches until dpcoord has applied one from each engine
/// (SUB drops what comes before it joins; the replay from 0 dpcoord asks
/// for on a publisher's first batch brings those back anyway).
pub fn join(d: &Daemon, engines: &mut [Engine]) {
    eventually("dpcoord to hear every publisher", || {
        for e in engines.iter_mut() {
            e.publish(vec![]);
        }
        std::thread::sleep(Duration::from_millis(20));
        let ok = d.metric("dpcoord_kv_batches_total{result=\"ok\"}").unwrap_or(0.0);
        (ok >= engines.len() as f64).then_some(())
    });
}

/// A load PUB like SGLang's scheduler's: bound by the engine, dpcoord connects.
pub struct LoadPub {
    sock: zmq::Socket,
    pub seq: i64,
}

impl LoadPub {
    pub fn bind(ctx: &zmq::Context, endpoint: &str) -> LoadPub {
        let sock = ctx.socket(zmq::PUB).unwrap();
        sock.set_linger(0).unwrap();
        sock.bind(endpoint).unwrap();
        LoadPub { sock, seq: 0 }
    }

    /// `LoadStat` naming `rank`: running, waiting, KV tokens of 10 000, KV + queued.
    pub fn send(&mut self, rank: u32, running: u64, waiting: u64, kv: u64, total: u64) {
        let stat = ("LoadStat", running, waiting, kv, 10_000u64, rank, 0u64, total, 64u64, 0u64, 0u64);
        self.send_frames(&[b"load".to_vec(), self.seq.to_be_bytes().to_vec(), rmp_serde::to_vec(&stat).unwrap()]);
        self.seq += 1;
    }

    pub fn send_frames(&self, frames: &[Vec<u8>]) {
        self.sock.send_multipart(frames, 0).unwrap();
    }
}
