//! Nothing heavy on the routing thread: route p99 while the largest valid
//! `/metrics` bodies come from 8 URLs, and while SGLang page-size-1 KV
//! batches of a 131,072-token and of a 310,000-token prompt arrive one
//! after another, each beside route p99 on the same daemon with real-size
//! bodies and no KV traffic (quiet), in the same run.
//!
//! The `/metrics` servers and the KV publisher are this process, on
//! 127.0.0.1 and ipc://; their own CPU (serving 8 MiB of bodies a second
//! at the largest size) shares the machine's cores with dpcoord and the
//! routing clients, as an attacker's would.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use dpcoord_daemon::engines::kv::{KvEvent, Medium, Stored};
use dpcoord_daemon::engines::prefix::{PrefixIndex, Progress};
use dpcoord_daemon::wire::{read_vllm_metrics, VLLM_FAMILIES, VLLM_MAX_BODY_BYTES, VLLM_MAX_SAMPLES};

use crate::report::{num, rate, Report, Table};
use crate::support::{eventually, Daemon, Mp};
use crate::transport::load;
use crate::Mode;

const DP: u32 = 8;
/// Text rendered by vLLM's own PrometheusStatLogger for one engine.
const REAL_BODY: &str = include_str!("../../tests/fixtures/vllm_metrics_rank3.prom");
/// Tokens of the largest KV batches: a 128k prompt, and what fits the
/// default 4 MiB batch limit at SGLang's 13 bytes per token. Eight of each
/// are sent in turn (8 x 310,000 blocks pass the 2^20 cap: its sweep runs).
const PROMPTS: [usize; 2] = [131_072, 310_000];
const OK_BATCHES: &str = "dpcoord_kv_batches_total{result=\"ok\"}";

/// The body every `/metrics` server answers with; the bench swaps it.
type Body = Arc<RwLock<Arc<Vec<u8>>>>;

fn answer(mut s: TcpStream, body: &[u8]) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let h = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    let _ = s.write_all(h.as_bytes()).and_then(|()| s.write_all(body));
}

/// One `/metrics` server on 127.0.0.1 per rank; their URLs. The threads
/// live as long as the bench process.
fn metrics_servers(body: &Body) -> Vec<String> {
    (0..DP)
        .map(|_| {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind a /metrics server");
            let url = format!("http://{}/metrics", l.local_addr().expect("its address"));
            let body = Arc::clone(body);
            std::thread::spawn(move || {
                for s in l.incoming().flatten() {
                    let b = Arc::clone(&body.read().expect("body lock"));
                    answer(s, &b);
                }
            });
            url
        })
        .collect()
}

/// The largest body dpcoord reads: as many gauge samples as it takes, each
/// label set padded so the whole is just under the cap. (A smoke run, on a
/// debug build, serves a sixteenth of it: a debug scraper reads the whole
/// in about 90 ms, and eight of them would wait past their 1 s timeout.)
fn largest_body(mode: Mode) -> Vec<u8> {
    let part = if mode == Mode::Full { 1 } else { 16 };
    let (bytes, samples) = (VLLM_MAX_BODY_BYTES / part, VLLM_MAX_SAMPLES / part);
    let per_line = bytes / samples;
    let mut out = String::with_capacity(bytes);
    for i in 0..samples {
        let head = format!("{}{{engine=\"{i}\",model_name=\"", VLLM_FAMILIES[i % VLLM_FAMILIES.len()]);
        let tail = "\"} 0.0\n";
        out.push_str(&head);
        out.push_str(&"m".repeat(per_line.saturating_sub(head.len() + tail.len())));
        out.push_str(tail);
    }
    assert!(out.len() <= VLLM_MAX_BODY_BYTES && read_vllm_metrics(out.as_bytes()).is_ok(), "a valid body");
    out.into_bytes()
}

/// An SGLang page-size-1 `KVEventBatch` storing a fresh `tokens`-token
/// prompt on rank 0: one `BlockStored` with a block per token, its hashes
/// 64-bit as SGLang's are (9 bytes each on the wire).
fn sglang_batch(tokens: usize, n: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(tokens * 14 + 256);
    let mut m = Mp(&mut b);
    m.array(3).f64(0.0).array(1).map(7).str("type").str("BlockStored");
    m.str("block_hashes").array(tokens as u32);
    for i in 0..tokens as u64 {
        m.uint((1 << 63) | (n << 32) | i);
    }
    m.str("parent_block_hash").nil().str("token_ids").array(tokens as u32);
    let mut x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for _ in 0..tokens {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        m.uint(x % 150_000);
    }
    m.str("block_size").uint(1).str("lora_id").nil().str("medium").str("GPU").uint(0);
    b
}

/// Publishes `batches` in turn, each once the last is applied, for `dur`
/// (a prompt stored again once they are all sent); returns the batches
/// applied. They are built beforehand, so the bench's own CPU goes to
/// sending, not to encoding.
fn publish_kv(d: &Daemon, publisher: &zmq::Socket, seq: &mut u64, batches: &[Vec<u8>], dur: Duration) -> u64 {
    let before = d.metric(OK_BATCHES).unwrap_or(0.0) as u64;
    let t0 = Instant::now();
    let mut sent = 0u64;
    while t0.elapsed() < dur {
        let batch = &batches[sent as usize % batches.len()];
        publisher.send_multipart([&b""[..], &seq.to_be_bytes(), batch], 0).expect("publish");
        *seq += 1;
        sent += 1;
        eventually("dpcoord to apply the batch", || {
            std::thread::sleep(Duration::from_millis(10));
            (d.metric(OK_BATCHES)? as u64 >= before + sent).then_some(())
        });
    }
    sent
}

pub fn run(mode: Mode, report: &mut Report) {
    steps(mode, report);
    let full = mode == Mode::Full;
    let dur = if full { Duration::from_secs(4) } else { Duration::from_millis(200) };
    let body: Body = Arc::new(RwLock::new(Arc::new(REAL_BODY.as_bytes().to_vec())));
    let urls = metrics_servers(&body);
    let dir = tempfile::tempdir().expect("temp dir");
    let kv_ep = format!("ipc://{}/kv", dir.path().display());
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).expect("PUB");
    publisher.bind(&kv_ep).expect("bind the KV publisher");
    let mut args = vec!["--policy", "least_load", "--kv-events-connect", &kv_ep];
    for u in &urls {
        args.extend(["--vllm-metrics-url", u.as_str()]);
    }
    let d = Daemon::start(DP, &args);
    let scrapes = |d: &Daemon| d.metric("dpcoord_scrapes_total{result=\"ok\"}").unwrap_or(0.0);
    eventually("every rank scraped", || (scrapes(&d) >= f64::from(DP) * 2.0).then_some(()));
    let mut seq = 0u64;
    eventually("dpcoord to hear the KV publisher", || {
        publisher.send_multipart([&b""[..], &seq.to_be_bytes(), &sglang_batch(0, seq)], 0).expect("send");
        seq += 1;
        std::thread::sleep(Duration::from_millis(10));
        (d.metric(OK_BATCHES).unwrap_or(0.0) >= 1.0).then_some(())
    });

    let mut quiet = load(&d.ctx, &d.route, d.proc(), 2, dur);
    let quiet_p99 = quiet.lat.quantile_us(0.99);
    let mut t = Table::new(
        format!("heavy input: route p99 while it arrives ({DP} ranks, least_load, 2 REQ clients, the same daemon)"),
        &["input", "route q/s", "p50 us", "p99 us", "max us", "p99 vs quiet", "failed", "what dpcoord took in"],
    );
    let real = format!("{DP} URLs, real {} B bodies, no KV", REAL_BODY.len());
    quiet.latency_row(&mut t, format!("quiet: {real}"), quiet_p99, "-".into());

    let largest = largest_body(mode);
    let largest_len = largest.len();
    *body.write().expect("body lock") = Arc::new(largest);
    let ok0 = scrapes(&d);
    eventually("a largest body read", || (scrapes(&d) > ok0 + f64::from(DP)).then_some(()));
    let ok0 = scrapes(&d);
    let mut big = load(&d.ctx, &d.route, d.proc(), 2, dur);
    let read = (scrapes(&d) - ok0) / big.lat.len().max(1) as f64 * big.qps();
    let what = format!("/metrics: {DP} URLs, the largest valid body, {largest_len} B");
    let p99 = big.latency_row(&mut t, what, quiet_p99, format!("{} bodies/s read", num(read, 1)));
    report.target(
        "route p99, 8 URLs serving the largest valid /metrics",
        "<= 10x quiet, none failed",
        format!("{:.2}x, {} failed", p99 / quiet_p99, big.failures),
        p99 <= 10.0 * quiet_p99 && big.failures == 0,
    );
    *body.write().expect("body lock") = Arc::new(REAL_BODY.as_bytes().to_vec());

    for tokens in PROMPTS.map(|p| if full { p } else { p / 64 }) {
        let batches: Vec<Vec<u8>> = (0..8).map(|n| sglang_batch(tokens, 1_000 + n)).collect();
        let size = batches[0].len();
        let (mut busy, applied) = std::thread::scope(|s| {
            let routing = s.spawn(|| load(&d.ctx, &d.route, d.proc(), 2, dur));
            let published = publish_kv(&d, &publisher, &mut seq, &batches, dur);
            (routing.join().expect("routing clients"), published)
        });
        let blocks = applied as f64 * tokens as f64 / dur.as_secs_f64();
        let what = format!("KV: SGLang page size 1, {tokens} tokens a batch ({size} B)");
        let p99 = busy.latency_row(&mut t, what, quiet_p99, format!("{applied} batches, {} blocks/s", rate(blocks)));
        report.target(
            format!("route p99 while {tokens}-token KV batches are applied"),
            "<= 20x quiet, none failed",
            format!("{:.2}x, {} failed", p99 / quiet_p99, busy.failures),
            p99 <= 20.0 * quiet_p99 && busy.failures == 0,
        );
    }
    t.print();
}

/// In process: each step of applying page-size-1 batches 64 blocks at a
/// time on one rank, as the routing thread does, past the per-rank cap (so
/// the maps grow and the cap's sweep runs); the longest step is what a
/// query may wait for beyond the 200 us budget.
fn steps(mode: Mode, report: &mut Report) {
    let (tokens, batches) = if mode == Mode::Full { (131_072u64, 20u64) } else { (2048, 4) };
    let mut ix = PrefixIndex::new(8, 1 << 20);
    let mut us: Vec<f64> = Vec::new();
    for n in 0..batches {
        let ev = KvEvent::Stored(Stored {
            hashes: (0..tokens).map(|i| (n << 32) | i).collect(),
            parent: None,
            tokens: (0..tokens).map(|i| ((i * 7919 + n) % 150_000) as u32).collect(),
            block_size: 1,
            medium: Medium::Gpu,
            lora: None,
            salt: None,
            unmatchable: None,
            group: 0,
        });
        let events = [ev];
        let mut at = Progress::default();
        loop {
            let t = Instant::now();
            let (_, done) = ix.apply_some(0, &events, &mut at, 64);
            us.push(t.elapsed().as_secs_f64() * 1e6);
            if done {
                break;
            }
        }
    }
    us.sort_by(f64::total_cmp);
    let q = |f: f64| us[((us.len() - 1) as f64 * f) as usize];
    let mut t = Table::new(
        format!("KV apply in process: {batches} batches of {tokens} page-size-1 blocks on one rank, cap 2^20, 64 blocks a step"),
        &["steps", "p50 us", "p99 us", "p99.9 us", "max us", "evicted"],
    );
    let evicted = (batches * tokens).saturating_sub(ix.blocks(0, Medium::Gpu) as u64);
    t.row(vec![
        us.len().to_string(),
        num(q(0.5), 1),
        num(q(0.99), 1),
        num(q(0.999), 1),
        num(q(1.0), 1),
        rate(evicted as f64),
    ]);
    t.print();
    report.target("KV apply steps of 64 blocks, p99", "<= 1 ms", format!("{:.0} us", q(0.99)), q(0.99) <= 1000.0);
}
