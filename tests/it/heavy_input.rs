//! Nothing heavy on the routing thread, against the real binary: route
//! queries keep being answered while 8 `/metrics` URLs serve the largest
//! bodies dpcoord reads (read on the scrapers' threads), and while a KV
//! batch of 310,000 blocks is applied (decoded on the decoder's thread,
//! applied a slice per poll round), which then shows in the index exactly.
//! Each query must be answered within a generous deadline; no latency is
//! judged here (`cargo bench --bench dpcoord -- heavy` measures it).

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use dpcoord_daemon::wire::{VLLM_FAMILIES, VLLM_MAX_BODY_BYTES, VLLM_MAX_SAMPLES};
use rmpv::Value as M;
use serde_json::{json, Value};

/// A route query left unanswered this long fails the test (a quiet query
/// takes well under a millisecond; before, the heavy input held the
/// routing thread for seconds).
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// A route client whose every query must be answered within [`ANSWER_WITHIN`].
fn route_client(d: &Daemon) -> zmq::Socket {
    let s = zmq::Context::new().socket(zmq::REQ).unwrap();
    s.set_linger(0).unwrap();
    s.set_rcvtimeo(ANSWER_WITHIN.as_millis() as i32).unwrap();
    s.connect(&d.route).unwrap();
    s
}

/// Asks `op` (`route`, `state`) on `s`; the reply, an answer or a refusal.
fn ask(s: &zmq::Socket, op: &str) -> Value {
    s.send(msgpack(&M::Map(vec![("v".into(), 1.into()), ("op".into(), op.into())])), 0).unwrap();
    let reply = s.recv_bytes(0).unwrap_or_else(|e| panic!("a {op} query unanswered within {ANSWER_WITHIN:?}: {e}"));
    let v: Value = rmp_serde::from_slice(&reply).unwrap();
    assert_eq!(v["v"], json!(1), "{v}");
    v
}

/// A route query, answered with a rank.
fn route(s: &zmq::Socket) -> Value {
    let v = ask(s, "route");
    assert_eq!(v["ok"], json!(true), "{v}");
    v
}

/// Serves `body` on a free loopback port to every request; its URL.
fn serve(body: Arc<Vec<u8>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let h = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = s.write_all(h.as_bytes()).and_then(|()| s.write_all(&body));
        }
    });
    url
}

/// A valid body of `bytes` bytes with every sample dpcoord allows:
/// 1 waiting per sample of `vllm:num_requests_waiting`, label sets padded.
fn padded_body(bytes: usize) -> Vec<u8> {
    let mut out = String::with_capacity(bytes);
    for i in 0..VLLM_MAX_SAMPLES {
        let head = format!("{}{{engine=\"{i}\",model_name=\"", VLLM_FAMILIES[i % VLLM_FAMILIES.len()]);
        let tail = if i % VLLM_FAMILIES.len() == 0 { "\"} 1.0\n" } else { "\"} 0.0\n" };
        // Two bytes stay for the closing comment line.
        let left = bytes - 2 - out.len();
        let pad = (left / (VLLM_MAX_SAMPLES - i)).saturating_sub(head.len() + tail.len());
        out.push_str(&head);
        out.push_str(&"m".repeat(pad));
        out.push_str(tail);
    }
    out.push_str(&"#".repeat(bytes.saturating_sub(out.len() + 1)));
    out.push('\n');
    assert_eq!(out.len(), bytes);
    out.into_bytes()
}

#[test]
fn route_queries_are_answered_while_eight_urls_serve_the_largest_bodies() {
    let body = Arc::new(padded_body(VLLM_MAX_BODY_BYTES));
    let urls: Vec<String> = (0..8).map(|_| serve(Arc::clone(&body))).collect();
    let over = serve(Arc::new(padded_body(VLLM_MAX_BODY_BYTES + 1)));
    let mut args = vec!["--dp-size", "9", "--policy", "least_load"];
    for u in urls.iter().chain([&over]) {
        args.extend(["--vllm-metrics-url", u.as_str()]);
    }
    args.extend(FROZEN);
    let d = Daemon::start(&args);
    let c = route_client(&d);
    // Until every rank shows the gauges of its body, a route query is
    // answered between any two looks. A debug build reads such a body in
    // about 90 ms on a scraper thread that yields to the routing thread
    // (nice 10), so on a loaded machine this takes a while: up to a minute.
    let waiting = json!(VLLM_MAX_SAMPLES / VLLM_FAMILIES.len());
    let started = std::time::Instant::now();
    let mut answered = 0;
    loop {
        ask(&c, "route");
        answered += 1;
        let state = ask(&c, "state");
        let ranks = state["ranks"].as_array().unwrap();
        if ranks[..8].iter().all(|r| r["counts"][0] == waiting && r["counts"][1] == 0) {
            break;
        }
        assert!(started.elapsed() < 6 * DEADLINE, "the largest bodies were not read within a minute: {state}");
    }
    assert!(answered >= 2, "{answered}");
    assert_eq!(d.ranks()[8]["status"], "unknown", "the body one byte over the cap is never read");
    assert!(d.metric(r#"dpcoord_scrapes_total{result="too_large"}"#) >= Some(1.0));
    assert_eq!(d.metric(r#"dpcoord_scrapes_total{result="malformed"}"#), Some(0.0));
    assert_eq!(d.http_get("/healthz").0, 200);
}

/// An SGLang page-size-1 batch storing `blocks` fresh blocks on rank 0,
/// one `BlockStored`, hashes from `first`.
fn page_size_1(first: u64, blocks: u64) -> Vec<u8> {
    let stored = M::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), M::Array((first..first + blocks).map(M::from).collect())),
        ("parent_block_hash".into(), M::Nil),
        ("token_ids".into(), M::Array((0..blocks).map(|i| M::from(i * 7919 % 150_000)).collect())),
        ("block_size".into(), M::from(1)),
        ("lora_id".into(), M::Nil),
        ("medium".into(), "GPU".into()),
    ]);
    batch(vec![stored])
}

fn batch(events: Vec<M>) -> Vec<u8> {
    msgpack(&M::Array(vec![M::F64(0.0), M::Array(events), M::from(0)]))
}

fn gpu_blocks(state: &Value) -> u64 {
    state["ranks"][0]["kv_blocks"]["GPU"].as_u64().unwrap_or(0)
}

#[test]
fn a_huge_kv_batch_is_applied_exactly_while_route_queries_are_answered_in_between() {
    const BLOCKS: u64 = 310_000;
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.set_linger(0).unwrap();
    let port = free_port();
    publisher.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let mut args = vec!["--dp-size", "2", "--policy", "least_load", "--kv-events-connect", &endpoint];
    args.extend(FROZEN);
    let d = Daemon::start(&args);
    let p = d.publisher();
    d.bring_up(&p, &[0, 1]);
    let mut seq = 0u64;
    let ok = |d: &Daemon| d.metric(r#"dpcoord_kv_batches_total{result="ok"}"#).unwrap_or(0.0);
    eventually("dpcoord to hear the publisher", || {
        publisher.send_multipart([&b""[..], &seq.to_be_bytes(), &batch(vec![])], 0).unwrap();
        seq += 1;
        std::thread::sleep(Duration::from_millis(10));
        (ok(&d) >= 1.0).then_some(())
    });
    let huge = page_size_1(1 << 40, BLOCKS);
    assert!(huge.len() <= 4 << 20, "{} bytes: within the default batch limit", huge.len());
    let c = route_client(&d);
    // Route queries answered while the index held part of a batch.
    let mut between = 0;
    let mut step = |from: u64, to: u64, payload: &[u8]| {
        publisher.send_multipart([&b""[..], &seq.to_be_bytes(), payload], 0).unwrap();
        seq += 1;
        eventually(&format!("{to} blocks on rank 0"), || {
            route(&c);
            let held = gpu_blocks(&ask(&c, "state"));
            between += usize::from(from.min(to) < held && held < from.max(to));
            (held == to).then_some(())
        });
    };
    step(0, BLOCKS, &huge);
    // Half of them removed in one event, then all cleared: exact each time.
    let half = M::Array((1u64 << 40..(1 << 40) + BLOCKS / 2).map(M::from).collect());
    let remove = batch(vec![M::Map(vec![("type".into(), "BlockRemoved".into()), ("block_hashes".into(), half)])]);
    step(BLOCKS, BLOCKS / 2, &remove);
    step(BLOCKS / 2, 0, &batch(vec![M::Map(vec![("type".into(), "AllBlocksCleared".into())])]));
    assert!(between >= 1, "no route query answered while a batch was being applied");
    // A clear empties the rank at once and is counted once its lookup
    // entries are gone too, a few slices later.
    let cleared = r#"dpcoord_kv_index_resets_total{cause="cleared",dp_rank="0"}"#;
    eventually("the clear counted", || (d.metric(cleared) == Some(1.0)).then_some(()));
    assert_eq!(ok(&d), seq as f64, "every batch applied");
    assert_eq!(d.metric(r#"dpcoord_kv_events_total{dp_rank="0",result="stored"}"#), Some(1.0));
    assert_eq!(d.metric(r#"dpcoord_kv_events_total{dp_rank="0",result="removed"}"#), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_event_gaps_total"), Some(0.0));
}
