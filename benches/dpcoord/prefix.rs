//! The prefix index (docs/PROTOCOL.md §11a): key computation and the
//! leading-match scan for an 8,192-token prompt, bytes per indexed block,
//! and KV event ingest, in process and through the daemon while it routes.
//!
//! Baselines, measured in the same run: xxh3 over the prompt's bytes in one
//! call (keys), the same number of probes into a `std` `HashMap` with its
//! default SipHash (lookup), decoding the same batches without applying
//! them (ingest), and route p99 with no KV events (ingest under routing).

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use dpcoord_daemon::config::{Config, PolicyKind};
use dpcoord_daemon::engines::kv::{KvBatch, KvBody, KvEvent, KvMessage, Medium, Stored};
use dpcoord_daemon::engines::prefix::keys::{chain_keys, chain_seed};
use dpcoord_daemon::engines::prefix::PrefixIndex;
use dpcoord_daemon::engines::{EngineEvent, LoadReport};
use dpcoord_daemon::observability::metrics::Metrics;
use dpcoord_daemon::routing::Coordinator;
use dpcoord_daemon::wire::{decode_kv_batch, Channel, SourceKind};

use crate::report::{num, rate, ratio, Report, Table};
use crate::support::{Daemon, Mp};
use crate::transport::load;
use crate::Mode;

const PROMPT_TOKENS: usize = 8192;
const BLOCK: usize = 16;
/// Blocks per `BlockStored` event, as a 256-token request stores them.
const EVENT_BLOCKS: usize = 16;
/// Events per batch (one engine step).
const BATCH_EVENTS: usize = 8;

/// A small deterministic generator (xorshift), so runs compare.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 150_000) as u32).collect()
    }
}

/// Median duration of `f` over `runs` runs, in microseconds.
fn median_us(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Stores `blocks` chained blocks of `tokens` on `rank`, engine hashes from `hash0`.
fn store_chain(ix: &mut PrefixIndex, rank: u32, tokens: &[u32], hash0: u64) {
    let mut parent = None;
    for (i, chunk) in tokens.chunks(BLOCK * EVENT_BLOCKS).enumerate() {
        let first = hash0 + (i * EVENT_BLOCKS) as u64;
        let hashes: Vec<u64> = (0..chunk.len() / BLOCK).map(|b| first + b as u64).collect();
        let last = *hashes.last().expect("a whole block");
        let ev = KvEvent::Stored(Stored {
            hashes,
            parent,
            tokens: chunk.to_vec(),
            block_size: BLOCK as u32,
            medium: Medium::Gpu,
            lora: None,
            salt: None,
            unmatchable: None,
            group: 0,
        });
        ix.apply(rank, &[ev]);
        parent = Some(last);
    }
}

/// RSS of this process, in bytes.
fn self_rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// Keys for the prompt, and the lookup at `ranks` ranks where every rank
/// holds the whole prompt (the scan's worst case) among `per_rank` blocks.
fn keys_and_lookup(mode: Mode, report: &mut Report) {
    let runs = if mode == Mode::Full { 2001 } else { 11 };
    let mut rng = Rng(7);
    let prompt = rng.tokens(PROMPT_TOKENS);
    let seed = chain_seed(None, None);
    let mut keys = Vec::with_capacity(PROMPT_TOKENS / BLOCK);
    let keys_us = median_us(runs, || {
        keys.clear();
        chain_keys(seed, black_box(&prompt), BLOCK, &mut keys);
    });
    let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
    let raw_us = median_us(runs, || {
        black_box(xxhash_rust::xxh3::xxh3_64(black_box(&bytes)));
    });
    let mut t = Table::new(
        "prefix index: an 8,192-token prompt, block 16 (512 keys), every rank holding it",
        &["ranks", "blocks per rank", "keys us", "keys / one xxh3 call", "lookup us", "lookup / std HashMap probes"],
    );
    let cases: &[(u32, usize)] = match mode {
        Mode::Full => &[(8, 1 << 20), (64, 1 << 17)],
        Mode::Smoke => &[(8, 1024)],
    };
    for &(dp, per_rank) in cases {
        let mut ix = PrefixIndex::new(dp, usize::MAX);
        let mut naive: HashMap<u64, u64> = HashMap::new();
        for rank in 0..dp {
            store_chain(&mut ix, rank, &prompt, 1);
            let filler = rng.tokens((per_rank - keys.len()) * BLOCK);
            store_chain(&mut ix, rank, &filler, 1 << 40);
        }
        for (i, &k) in keys.iter().enumerate() {
            naive.insert(k, i as u64);
        }
        // The naive map as large as the index's holders map.
        while naive.len() < ix.distinct_keys() {
            naive.insert(rng.next(), 0);
        }
        let mut out = Vec::new();
        ix.leading(&keys, &mut out);
        assert!(out.iter().all(|&m| m as usize == keys.len()), "every rank holds the whole prompt");
        let lookup_us = median_us(runs, || ix.leading(black_box(&keys), &mut out));
        let naive_us = median_us(runs, || {
            for k in &keys {
                black_box(naive.get(k));
            }
        });
        t.row(vec![
            dp.to_string(),
            rate(per_rank as f64),
            num(keys_us, 2),
            ratio(keys_us, raw_us),
            num(lookup_us, 2),
            ratio(lookup_us, naive_us),
        ]);
        report.target(
            format!("prefix lookup: 8,192 tokens at {dp} ranks"),
            "<= 5 us",
            format!("{lookup_us:.2} us"),
            lookup_us <= 5.0,
        );
    }
    t.print();
}

/// Bytes per indexed block, from this process's RSS: `per_rank` distinct
/// blocks on each of 8 ranks, then the same blocks shared by all 8.
fn memory(mode: Mode, report: &mut Report) {
    // 2^20, and 7/8 of it: hash tables double when 7/8 full, so bytes per
    // block move in a sawtooth between about these two points.
    let sizes: &[usize] = if mode == Mode::Full { &[1 << 20, 917_504] } else { &[1 << 12] };
    let mut t = Table::new("prefix index memory: 8 ranks", &["blocks per rank", "layout", "MiB", "bytes per block"]);
    let mut rng = Rng(11);
    for &per_rank in sizes {
        for shared in [false, true] {
            let before = self_rss();
            let mut ix = PrefixIndex::new(8, usize::MAX);
            let common = rng.tokens(per_rank * BLOCK);
            for rank in 0..8 {
                let tokens = if shared { common.clone() } else { rng.tokens(per_rank * BLOCK) };
                store_chain(&mut ix, rank, &tokens, u64::from(rank) << 40);
            }
            let bytes = self_rss().saturating_sub(before) as f64;
            let per_block = bytes / (8 * per_rank) as f64;
            let layout = if shared { "every rank the same prompts" } else { "distinct per rank" };
            t.row(vec![rate(per_rank as f64), layout.into(), num(bytes / 1048576.0, 1), num(per_block, 1)]);
            if !shared && per_rank == sizes[0] {
                report.target(
                    "prefix memory: bytes per block, 1M per rank x 8",
                    "<= 64 B",
                    format!("{per_block:.1} B"),
                    per_block <= 64.0,
                );
            }
            drop(ix);
        }
    }
    t.print();
}

/// Encoded `KVEventBatch`es of `BATCH_EVENTS` events, each storing a fresh
/// chain of `EVENT_BLOCKS` blocks and removing the previous batch's blocks
/// (so the index stays the same size), for rank 0.
fn batches(n: usize) -> Vec<Vec<u8>> {
    let mut rng = Rng(3);
    let mut hash = 1u64;
    (0..n)
        .map(|_| {
            let mut b = Vec::new();
            let mut mp = Mp(&mut b);
            mp.array(3).f64(0.0).array(2 * BATCH_EVENTS as u32);
            for _ in 0..BATCH_EVENTS {
                mp.map(5).str("type").str("BlockStored").str("block_hashes").array(EVENT_BLOCKS as u32);
                for _ in 0..EVENT_BLOCKS {
                    mp.uint(hash);
                    hash += 1;
                }
                mp.str("parent_block_hash").nil().str("token_ids").array((EVENT_BLOCKS * BLOCK) as u32);
                for t in rng.tokens(EVENT_BLOCKS * BLOCK) {
                    mp.uint(u64::from(t));
                }
                mp.str("block_size").uint(BLOCK as u64);
            }
            // The previous batch's blocks (none before the first).
            let previous = hash.saturating_sub((2 * BATCH_EVENTS * EVENT_BLOCKS) as u64).max(1);
            for e in 0..BATCH_EVENTS as u64 {
                mp.map(2).str("type").str("BlockRemoved").str("block_hashes").array(EVENT_BLOCKS as u32);
                let first = previous + e * EVENT_BLOCKS as u64;
                for h in first..first + EVENT_BLOCKS as u64 {
                    mp.uint(h);
                }
            }
            mp.uint(0);
            b
        })
        .collect()
}

/// Stored blocks per second through `Coordinator::on_source` (decode and
/// apply), against decoding alone.
fn ingest_in_process(mode: Mode, report: &mut Report) {
    let n = if mode == Mode::Full { 4000 } else { 20 };
    let bodies = batches(n);
    let cfg = Config::default();
    let mut c = Coordinator::new(&cfg.settings, Metrics::new(8), Instant::now()).with_kv_endpoints(&[
        dpcoord_daemon::config::KvEndpoint { connect: "tcp://127.0.0.1:1".into(), replay: None, rank: None },
    ]);
    let kind = SourceKind::KvEvents { stream: 0, replay: false };
    let blocks = (n * BATCH_EVENTS * EVENT_BLOCKS) as f64;
    let t0 = Instant::now();
    for (seq, body) in bodies.iter().enumerate() {
        let seq = (seq as u64).to_be_bytes();
        c.on_source(kind, Some(&[&b""[..], &seq[..], &body[..]][..]), t0);
    }
    let applied = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for body in &bodies {
        black_box(decode_kv_batch(body).expect("a valid batch"));
    }
    let decoded = t1.elapsed().as_secs_f64();
    let mut t = Table::new(
        "KV event ingest in process (rank 0, 16-block stores and removals)",
        &["path", "stored blocks/s", "vs decode only"],
    );
    t.row(vec!["decode only".into(), rate(blocks / decoded), "1.00x".into()]);
    t.row(vec!["decode + index".into(), rate(blocks / applied), ratio(decoded, applied)]);
    t.print();
    report.target(
        "KV ingest in process",
        ">= 1,000,000 blocks/s",
        format!("{}/s", rate(blocks / applied)),
        blocks / applied >= 1e6,
    );
}

/// A coordinator over `dp` ranks, all up and publishing KV events, under
/// `policy`; rank `dp / 2` holds `prompt` (block size 16).
fn fleet(dp: u32, policy: PolicyKind, prompt: &[u32]) -> Coordinator {
    let cfg = crate::decision::config(dp, policy);
    let now = Instant::now();
    let kv = dpcoord_daemon::config::KvEndpoint { connect: "tcp://127.0.0.1:1".into(), replay: None, rank: None };
    let mut c = Coordinator::new(&cfg.settings, Metrics::new(dp), now).with_kv_endpoints(&[kv]);
    for rank in 0..dp {
        let report = LoadReport::new(rank, 1, 1).counts(crate::decision::counts(rank, 0));
        c.on_event(EngineEvent::Load(report), now);
    }
    let stored = KvEvent::Stored(Stored {
        hashes: (1..=(prompt.len() / BLOCK) as u64).collect(),
        parent: None,
        tokens: prompt.to_vec(),
        block_size: BLOCK as u32,
        medium: Medium::Gpu,
        lora: None,
        salt: None,
        unmatchable: None,
        group: 0,
    });
    let batch = Ok(KvBatch { rank: Some(dp / 2), events: vec![stored] });
    c.on_event(
        EngineEvent::Kv(KvMessage { stream: 0, from_replay: false, body: KvBody::Batch { seq: 0, batch } }),
        now,
    );
    // Every other rank publishes too (an empty batch): all matches come from events.
    for (seq, rank) in (1..).zip((0..dp).filter(|&r| r != dp / 2)) {
        let batch = Ok(KvBatch { rank: Some(rank), events: vec![] });
        c.on_event(
            EngineEvent::Kv(KvMessage { stream: 0, from_replay: false, body: KvBody::Batch { seq, batch } }),
            now,
        );
    }
    c
}

/// Median µs of one whole route query (decode, lookup, pick, reply) on `c`.
fn query_us(c: &mut Coordinator, query: &[u8], chunks: usize) -> f64 {
    let mut out = Vec::with_capacity(256);
    let mut per: Vec<f64> = (0..chunks)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..50 {
                c.on_query(Channel::Route, black_box(query), t, &mut out);
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / 50.0;
            c.tick(Instant::now() + Duration::from_secs(3)); // pending placements expire
            us
        })
        .collect();
    per.sort_by(f64::total_cmp);
    per[per.len() / 2]
}

/// One `cache_aware` decision for an 8,192-token prompt, with `tokens` and
/// with `block_keys` on the wire, against `least_load` in the same run.
fn cache_aware_decision(mode: Mode, report: &mut Report) {
    let chunks = if mode == Mode::Full { 201 } else { 3 };
    let prompt = Rng(5).tokens(PROMPT_TOKENS);
    let mut keys = Vec::new();
    chain_keys(chain_seed(None, None), &prompt, BLOCK, &mut keys);
    let encode = |with: &str| {
        let mut b = Vec::new();
        let mut mp = Mp(&mut b);
        mp.map(4).str("v").uint(1).str("op").str("route").str("prompt_tokens").uint(PROMPT_TOKENS as u64);
        match with {
            "tokens" => {
                mp.str("tokens").array(prompt.len() as u32);
                for &t in &prompt {
                    mp.uint(u64::from(t));
                }
            }
            "keys" => {
                mp.str("block_keys").array(keys.len() as u32);
                for &k in &keys {
                    mp.uint(k);
                }
            }
            _ => {
                mp.str("n").uint(1);
            }
        }
        b
    };
    let (plain, with_tokens, with_keys) = (encode("none"), encode("tokens"), encode("keys"));
    let mut t = Table::new(
        "cache_aware: one route query with an 8,192-token prompt (decode, lookup, pick, reply)",
        &[
            "ranks",
            "least_load us",
            "block_keys us",
            "vs least_load",
            "tokens us",
            "vs least_load",
            "tokens / block_keys",
            "query bytes keys / tokens",
        ],
    );
    let mut with_tokens_us = Vec::new();
    for dp in [8u32, 64] {
        let base = query_us(&mut fleet(dp, PolicyKind::LeastLoad, &prompt), &plain, chunks);
        let mut c = fleet(dp, PolicyKind::CacheAware, &prompt);
        let k = query_us(&mut c, &with_keys, chunks);
        let tk = query_us(&mut c, &with_tokens, chunks);
        t.row(vec![
            dp.to_string(),
            num(base, 2),
            num(k, 2),
            ratio(k, base),
            num(tk, 2),
            ratio(tk, base),
            ratio(tk, k),
            format!("{} / {}", rate(with_keys.len() as f64), rate(with_tokens.len() as f64)),
        ]);
        if dp == 8 {
            report.target(
                "cache_aware decision, block_keys, 8,192 tokens at 8 ranks",
                "<= 10 us",
                format!("{k:.2} us"),
                k <= 10.0,
            );
        }
        report.target(
            format!("cache_aware route, 8,192 tokens at {dp} ranks: tokens against block_keys"),
            "<= 3x",
            format!("{} ({tk:.2} us / {k:.2} us)", ratio(tk, k)),
            tk <= 3.0 * k,
        );
        with_tokens_us.push(tk);
    }
    t.print();
    let (at8, at64) = (with_tokens_us[0], with_tokens_us[1]);
    report.target(
        "cache_aware route with tokens: 64 ranks against 8",
        "<= 2x",
        format!("{} ({at64:.2} us / {at8:.2} us)", ratio(at64, at8)),
        at64 <= 2.0 * at8,
    );
}

pub fn run(mode: Mode, report: &mut Report) {
    keys_and_lookup(mode, report);
    cache_aware_decision(mode, report);
    memory(mode, report);
    ingest_in_process(mode, report);
    ingest_daemon(mode, report);
}

/// Through the daemon over ipc://: one publisher paced at `RATE` stored
/// blocks/s while two REQ clients route, against routing alone; loss is
/// dpcoord's own gap count and the stored-blocks counter.
fn ingest_daemon(mode: Mode, report: &mut Report) {
    const RATE: f64 = 1_200_000.0;
    let dur = if mode == Mode::Full { Duration::from_secs(3) } else { Duration::from_millis(200) };
    let dir = tempfile::tempdir().expect("temp dir");
    let ep = format!("ipc://{}/kv", dir.path().display());
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).expect("PUB");
    publisher.set_sndhwm(100_000).expect("hwm");
    publisher.bind(&ep).expect("bind the KV publisher");
    let d = Daemon::start(8, &["--kv-events-connect", &ep, "--policy", "least_load"]);
    let quiet = load(&d.ctx, &d.route, d.proc(), 2, dur);
    // Join: empty batches until dpcoord counts one.
    let mut seq = 0u64;
    let empty = {
        let mut b = Vec::new();
        Mp(&mut b).array(3).f64(0.0).array(0).uint(0);
        b
    };
    crate::support::eventually("dpcoord to hear the KV publisher", || {
        publisher.send_multipart([&b""[..], &seq.to_be_bytes(), &empty], 0).expect("send");
        seq += 1;
        std::thread::sleep(Duration::from_millis(10));
        (d.metric("dpcoord_kv_batches_total{result=\"ok\"}").unwrap_or(0.0) >= 1.0).then_some(())
    });
    let bodies = batches(512);
    let per_batch = (BATCH_EVENTS * EVENT_BLOCKS) as f64;
    let stored_before = d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"stored\"}").unwrap_or(0.0);
    let (busy, sent) = std::thread::scope(|s| {
        let routing = s.spawn(|| load(&d.ctx, &d.route, d.proc(), 2, dur));
        let t0 = Instant::now();
        let mut sent = 0u64;
        while t0.elapsed() < dur {
            let due = (t0.elapsed().as_secs_f64() * RATE / per_batch) as u64;
            while sent < due {
                let body = &bodies[sent as usize % bodies.len()];
                publisher.send_multipart([&b""[..], &seq.to_be_bytes(), body], 0).expect("send");
                seq += 1;
                sent += 1;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        (routing.join().expect("routing thread"), sent)
    });
    // The counter counts BlockStored events: EVENT_BLOCKS blocks each.
    let stored = crate::support::eventually("dpcoord to absorb the batches", || {
        let n = d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"stored\"}")? - stored_before;
        std::thread::sleep(Duration::from_millis(50));
        let again = d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"stored\"}")? - stored_before;
        (n == again).then_some(again * EVENT_BLOCKS as f64)
    });
    let gaps = d.metric("dpcoord_kv_event_gaps_total").unwrap_or(f64::NAN);
    let offered = sent as f64 * per_batch;
    let mut quiet = quiet;
    let mut busy = busy;
    let (p99_quiet, p99_busy) = (quiet.lat.quantile_us(0.99), busy.lat.quantile_us(0.99));
    let mut t = Table::new(
        "KV event ingest through the daemon while routing (2 REQ clients, least_load)",
        &[
            "KV stored blocks/s offered",
            "absorbed",
            "lost",
            "seq gaps",
            "route q/s",
            "route p99 us",
            "p99 vs no events",
        ],
    );
    t.row(vec![
        "none".into(),
        "-".into(),
        "-".into(),
        "-".into(),
        rate(quiet.qps()),
        num(p99_quiet, 1),
        "1.00x".into(),
    ]);
    t.row(vec![
        rate(offered / dur.as_secs_f64()),
        rate(stored / dur.as_secs_f64()),
        rate(offered - stored),
        num(gaps, 0),
        rate(busy.qps()),
        num(p99_busy, 1),
        ratio(p99_busy, p99_quiet),
    ]);
    t.print();
    report.target(
        "KV ingest through the daemon while routing, no loss",
        ">= 1,000,000 blocks/s, 0 lost",
        format!("{}/s, {} lost", rate(stored / dur.as_secs_f64()), rate(offered - stored)),
        stored >= offered && stored / dur.as_secs_f64() >= 1e6,
    );
    report.target(
        "route p99 while the daemon ingests those KV events",
        "<= 2x without events",
        format!("{} ({p99_busy:.1} us / {p99_quiet:.1} us)", ratio(p99_busy, p99_quiet)),
        p99_busy <= 2.0 * p99_quiet,
    );
}
