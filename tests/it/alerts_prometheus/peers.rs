//! Simulated engines, frontends and KV-event publishers feeding one scenario's dpcoord.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rmpv::Value as M;
use serde_json::json;

use crate::common::*;

/// What one simulated engine publishes: an update every `every` (none while
/// `None`), each finishing `finish` and failing `fail` more requests, plus
/// `burst` extra updates as fast as dpcoord takes them.
#[derive(Clone, Debug)]
pub(crate) struct Feed {
    pub(crate) rank: u32,
    pub(crate) every: Option<Duration>,
    pub(crate) finish: u64,
    pub(crate) fail: u64,
    pub(crate) burst: u64,
    pub(crate) seq: u64,
    pub(crate) finished: u64,
    pub(crate) failed: u64,
    pub(crate) last: Option<Instant>,
}

pub(crate) const HEALTHY: Option<Duration> = Some(Duration::from_millis(100));

/// Engines publishing `StatsUpdate`s to one dpcoord from a thread.
pub(crate) struct Engines {
    feeds: Arc<Mutex<Vec<Feed>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Engines {
    /// Ranks `0..dp` (and any in `extra`), publishing every 100 ms if in `live`, else silent.
    pub(crate) fn start(d: &Daemon, dp: u32, live: &[u32]) -> Engines {
        let feeds: Vec<Feed> = (0..dp)
            .map(|rank| Feed {
                rank,
                every: if live.contains(&rank) { HEALTHY } else { None },
                finish: 1,
                fail: 0,
                burst: 0,
                seq: 0,
                finished: 0,
                failed: 0,
                last: None,
            })
            .collect();
        let feeds = Arc::new(Mutex::new(feeds));
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = d.publisher();
        let (f, s) = (feeds.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let send = |f: &mut Feed| {
                f.seq += 1;
                f.finished += f.finish;
                f.failed += f.fail;
                let counts = [0, 0, f.finished + f.failed, f.finished, f.failed];
                publisher.send(&Update::new(f.rank, 1, f.seq).counts(counts).kv_usage(0.25).value());
            };
            while !s.load(Ordering::Relaxed) {
                let now = Instant::now();
                for feed in f.lock().unwrap().iter_mut() {
                    if feed.every.is_some_and(|p| feed.last.is_none_or(|t| now - t >= p)) {
                        send(feed);
                        feed.last = Some(now);
                    }
                    while feed.burst > 0 {
                        send(feed);
                        feed.burst -= 1;
                        if feed.burst % 100 == 0 {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Engines { feeds, stop, thread: Some(thread) }
    }

    /// Changes the feed of `rank` (adding it if it is not there).
    pub(crate) fn set(&self, rank: u32, change: impl FnOnce(&mut Feed)) {
        let mut feeds = self.feeds.lock().unwrap();
        if !feeds.iter().any(|f| f.rank == rank) {
            let mut f = feeds[0].clone();
            (f.rank, f.every, f.seq, f.finished, f.failed, f.last, f.burst) = (rank, None, 0, 0, 0, None, 0);
            feeds.push(f);
        }
        change(feeds.iter_mut().find(|f| f.rank == rank).unwrap());
    }

    pub(crate) fn pace(&self, rank: u32, every: Option<Duration>) {
        self.set(rank, |f| f.every = every);
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.take().unwrap().join();
    }
}

/// What a frontend sends every tick.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Traffic {
    /// A route query placed by the policy.
    pub(crate) route: bool,
    /// A route query pinned to this rank.
    pub(crate) pin: Option<u64>,
    /// A query with an unknown op (refused as `unknown_op`).
    pub(crate) bad: bool,
    /// A route query with one of two prompts and `explain: true`, then a
    /// `delivered` report of its prediction (one block of 16 short, as
    /// vLLM delivers a fully cached prompt; nothing when none is predicted).
    pub(crate) explain: bool,
}

/// What an explaining frontend sent and was told, summed: the `predicted`
/// and `best` of every explained placement, and the reports it sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Explained {
    pub(crate) predicted: u64,
    pub(crate) best: u64,
    pub(crate) reports: u64,
    pub(crate) delivered: u64,
}

impl Explained {
    /// Asks for one explained placement of `prompt` and reports it delivered.
    fn ask(&mut self, c: &Client, prompt: &[u32]) {
        let r = c.call(json!({"v": 1, "op": "route", "tokens": prompt, "explain": true}));
        let explain = &r["explain"];
        let [rank, predicted] = ["rank", "predicted"].map(|k| explain["chosen"][0][k].as_u64().unwrap());
        self.predicted += predicted;
        self.best += explain["best"].as_u64().unwrap();
        let delivered = predicted.saturating_sub(16);
        let report = json!({"v": 1, "op": "delivered", "rank": rank, "predicted": predicted, "delivered": delivered});
        assert_eq!(c.call(report)["ok"], json!(true));
        self.reports += 1;
        self.delivered += delivered;
    }
}

/// A frontend asking one dpcoord from a thread; a refused route fails the test.
pub(crate) struct Frontend {
    traffic: Arc<Mutex<Traffic>>,
    explained: Arc<Mutex<Explained>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Frontend {
    pub(crate) fn start(d: &Daemon, every: Duration, traffic: Traffic) -> Frontend {
        let traffic = Arc::new(Mutex::new(traffic));
        let stop = Arc::new(AtomicBool::new(false));
        let explained = Arc::new(Mutex::new(Explained::default()));
        let c = d.client();
        let (t, s, e) = (traffic.clone(), stop.clone(), explained.clone());
        // Two prompts of 2 blocks of 16 tokens, so both ranks get traffic.
        let prompts: [Vec<u32>; 2] = [(1..=32).collect(), (101..=132).collect()];
        let thread = std::thread::spawn(move || {
            let mut turn = 0;
            while !s.load(Ordering::Relaxed) {
                let now = *t.lock().unwrap();
                if now.route {
                    c.route(json!({"v": 1, "op": "route"}));
                }
                if let Some(rank) = now.pin {
                    assert_eq!(c.route(json!({"v": 1, "op": "route", "rank": rank})), [rank]);
                }
                if now.explain {
                    e.lock().unwrap().ask(&c, &prompts[turn % 2]);
                    turn += 1;
                }
                if now.bad {
                    assert_eq!(c.error_code(json!({"v": 1, "op": "fly"})), "unknown_op");
                }
                std::thread::sleep(every);
            }
        });
        Frontend { traffic, explained, stop, thread: Some(thread) }
    }

    /// What the frontend's explained placements summed to so far.
    pub(crate) fn explained(&self) -> Explained {
        *self.explained.lock().unwrap()
    }

    pub(crate) fn set(&self, traffic: Traffic) {
        *self.traffic.lock().unwrap() = traffic;
    }
}

impl Drop for Frontend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let failed = self.thread.take().unwrap().join().is_err();
        if failed && !std::thread::panicking() {
            panic!("a frontend thread failed (see its panic above)");
        }
    }
}

/// An engine side's KV-cache events (docs/PROTOCOL.md §11a) in vLLM's
/// format, from a thread: one PUB the test binds for all ranks (each batch
/// names its `dp_rank`), sending every 100 ms, for each rank that is on, a
/// batch that stores one new block, as an engine serving requests does. An
/// idle engine stores nothing, so it publishes nothing.
pub(crate) struct KvEvents {
    on: Arc<Mutex<BTreeSet<u32>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl KvEvents {
    /// Binds the PUB on a free loopback port; returns it and its endpoint.
    pub(crate) fn bind(zmq: &zmq::Context) -> (KvEvents, String) {
        let publisher = zmq.socket(zmq::PUB).unwrap();
        publisher.set_linger(0).unwrap();
        let endpoint = loop {
            let e = format!("tcp://127.0.0.1:{}", free_port());
            if publisher.bind(&e).is_ok() {
                break e;
            }
        };
        let on = Arc::new(Mutex::new(BTreeSet::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (o, s) = (on.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let (mut seq, mut block) = (0u64, 0u64);
            while !s.load(Ordering::Relaxed) {
                let ranks: Vec<u32> = o.lock().unwrap().iter().copied().collect();
                for rank in ranks {
                    block += 1;
                    let stored = M::Map(vec![
                        ("type".into(), "BlockStored".into()),
                        ("block_hashes".into(), M::Array(vec![M::from(block)])),
                        ("parent_block_hash".into(), M::Nil),
                        ("token_ids".into(), M::Array(vec![M::from(block), M::from(rank)])),
                        ("block_size".into(), M::from(2)),
                        ("lora_id".into(), M::Nil),
                        ("medium".into(), "GPU".into()),
                    ]);
                    let ts = std::time::SystemTime::UNIX_EPOCH.elapsed().unwrap().as_secs_f64();
                    let batch = msgpack(&M::Array(vec![M::F64(ts), M::Array(vec![stored]), M::from(rank)]));
                    publisher.send_multipart([&b""[..], &seq.to_be_bytes(), &batch], 0).unwrap();
                    seq += 1;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        (KvEvents { on, stop, thread: Some(thread) }, endpoint)
    }

    pub(crate) fn publish(&self, rank: u32, on: bool) {
        let mut ranks = self.on.lock().unwrap();
        if on {
            ranks.insert(rank);
        } else {
            ranks.remove(&rank);
        }
    }
}

impl Drop for KvEvents {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.take().unwrap().join();
    }
}
