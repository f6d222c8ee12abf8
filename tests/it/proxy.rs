//! `dpcoord proxy` (`server.proxy_bind`): the real binary in front of small
//! OpenAI-style engines ([`OpenAiServer`]) whose `/metrics` it scrapes as vLLM's,
//! driven over real HTTP. Each request reaches the rank dpcoord decided and
//! is booked until its response ends; streams pass through as they come; a
//! server that refuses connections is retried on the next-best rank once
//! and reported until it is back; bodies past the bounds get a clear answer
//! and book nothing; SIGTERM drains within the 2 s promise.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::*;

/// A completion request body.
const BODY: &str = r#"{"model":"m","prompt":"Say hello to the proxy"}"#;

/// A daemon with the proxy on, over `endpoints` (rank i's server) whose
/// load is scraped from `metrics` (rank i's `/metrics`), with `extra` (TOML)
/// merged in, key by key.
struct Proxied {
    d: Daemon,
    addr: SocketAddr,
    _config: tempfile::TempDir,
}

fn proxied(endpoints: &[SocketAddr], metrics: &[SocketAddr], policy: &str, extra: &str) -> Proxied {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let list = |a: &[SocketAddr], f: &dyn Fn(&SocketAddr) -> String| {
        a.iter().map(|x| format!("\"{}\"", f(x))).collect::<Vec<_>>().join(", ")
    };
    let text = format!(
        "[server]\nproxy_bind = \"{addr}\"\n\
         [engines]\ndp_size = {}\nvllm_metrics_url = [{}]\nvllm_metrics_interval_ms = 50\n\
         [gateway]\nendpoints = [{}]\n\
         [routing]\npolicy = \"{policy}\"\n",
        endpoints.len(),
        list(metrics, &|m| format!("http://{m}/metrics")),
        list(endpoints, &|e| e.to_string()),
    );
    let mut table: toml::Table = text.parse().unwrap();
    for (section, keys) in extra.parse::<toml::Table>().unwrap() {
        let toml::Value::Table(keys) = keys else { panic!("`{section}` is not a section") };
        let into = table.entry(section).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        into.as_table_mut().unwrap().extend(keys);
    }
    let path = dir.path().join("proxy.toml");
    std::fs::write(&path, table.to_string()).unwrap();
    let d = Daemon::start(&["--config", path.to_str().unwrap()]);
    for rank in 0..endpoints.len() {
        d.wait_status(rank, "up");
    }
    Proxied { d, addr, _config: dir }
}

/// The engines' own servers as both endpoints and load sources.
fn over(engines: &[&OpenAiServer], policy: &str, extra: &str) -> Proxied {
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
    proxied(&addrs, &addrs, policy, extra)
}

/// A whole response: status, lowercased headers, body (chunks joined).
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The rank the proxy says served the request.
    fn rank(&self) -> u32 {
        let rank = self.header("x-dpcoord-rank");
        rank.unwrap_or_else(|| panic!("no x-dpcoord-rank: {} {}", self.status, self.body)).parse().unwrap()
    }
}

/// One request with `Connection: close`, read to its end.
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse(&String::from_utf8_lossy(&raw))
}

fn parse(raw: &str) -> Reply {
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a response head");
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)?.parse().ok()).expect("a status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v == "chunked");
    let body = if chunked { dechunk(rest) } else { rest.to_owned() };
    Reply { status, headers, body }
}

fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        body.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    body
}

fn post(addr: SocketAddr, body: &str) -> Reply {
    post_to(addr, "/v1/completions", body)
}

fn post_to(addr: SocketAddr, path: &str, body: &str) -> Reply {
    request(addr, "POST", path, body)
}

/// Opens a streamed completion and reads until `until` has arrived; the
/// socket and what was read so far.
fn open_stream(addr: SocketAddr, until: &str) -> (TcpStream, String) {
    let body = r#"{"model":"m","prompt":"stream me","stream":true}"#;
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut got = String::new();
    let mut buf = [0u8; 4096];
    while !got.contains(until) {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    (s, got)
}

/// `routed` and `pending` of each rank.
fn books(d: &Daemon) -> Vec<(u64, u64)> {
    d.routed_pending()
}

fn proxy_metric(d: &Daemon, series: &str) -> f64 {
    d.metric(series).unwrap_or_else(|| panic!("{series} is not in /metrics"))
}

#[test]
fn each_request_reaches_the_rank_dpcoord_decided_and_its_end_is_booked() {
    let engines = [OpenAiServer::start(), OpenAiServer::start(), OpenAiServer::start()];
    let p = over(&engines.iter().collect::<Vec<_>>(), "round_robin", "");
    let mut ranks = Vec::new();
    for i in 0..6 {
        let r = post(p.addr, BODY);
        assert_eq!(r.status, 200, "request {i}: {}", r.body);
        assert_eq!(r.body, r#"{"choices":[{"text":"ok"}]}"#);
        ranks.push(r.rank());
    }
    assert_eq!(ranks, [0, 1, 2, 0, 1, 2], "round robin, as dpcoord decided");
    // Each engine received exactly the requests it was named for, as sent.
    for (rank, e) in engines.iter().enumerate() {
        let posts: Vec<Seen> = e.seen().into_iter().filter(|s| s.method == "POST").collect();
        assert_eq!(posts.len(), 2, "rank {rank}");
        assert!(posts.iter().all(|s| s.path == "/v1/completions" && s.body == BODY.as_bytes()));
        assert_eq!(posts[0].headers.get("content-type").map(String::as_str), Some("application/json"));
    }
    // Every response ended: nothing is left pending.
    eventually("every placement booked finished", || (books(&p.d) == vec![(2, 0); 3]).then_some(()));
    assert_eq!(proxy_metric(&p.d, "dpcoord_proxy_requests_total{outcome=\"routed\"}"), 6.0);
    assert_eq!(proxy_metric(&p.d, "dpcoord_proxy_prompts_total{mode=\"text\"}"), 6.0);
}

#[test]
fn a_stream_passes_through_as_it_comes_and_is_pending_until_it_ends() {
    let engine = OpenAiServer::start();
    // Snapshots never absorb a placement: only `finished` can end it.
    let p = over(&[&engine], "round_robin", "[routing]\npending_ttl_ms = 3600000\npending_transit_ms = 60000");
    engine.close_gate();
    // The first two events arrive while the engine holds the third.
    let (mut s, got) = open_stream(p.addr, r#"data: {"i":1}"#);
    assert!(!got.contains("[DONE]"));
    assert!(got.contains("x-dpcoord-rank: 0"), "{got}");
    assert!(got.contains("content-type: text/event-stream"), "{got}");
    assert_eq!(books(&p.d), [(1, 1)], "booked while the response is open");
    engine.open_gate();
    let mut rest = [0u8; 4096];
    let n = s.read(&mut rest).unwrap();
    assert!(String::from_utf8_lossy(&rest[..n]).contains("data: [DONE]"), "{got}");
    eventually("the stream's end booked", || (books(&p.d) == [(1, 0)]).then_some(()));
}

#[test]
fn a_client_gone_mid_stream_ends_the_placement_and_counts_a_reset() {
    let engine = OpenAiServer::start();
    let p = over(&[&engine], "round_robin", "[routing]\npending_ttl_ms = 3600000\npending_transit_ms = 60000");
    engine.close_gate();
    let (s, _) = open_stream(p.addr, r#"data: {"i":0}"#);
    assert_eq!(books(&p.d), [(1, 1)]);
    drop(s);
    eventually("the placement ended", || (books(&p.d) == [(1, 0)]).then_some(()));
    assert_eq!(proxy_metric(&p.d, "dpcoord_proxy_rank_errors_total{dp_rank=\"0\",kind=\"reset\"}"), 1.0);
    engine.open_gate();
}

#[test]
fn a_server_that_refuses_is_retried_on_the_next_best_reported_and_readmitted() {
    let up = OpenAiServer::start();
    // Rank 1's load comes from a server that answers; its endpoint refuses.
    let gauges = OpenAiServer::start();
    let refusing = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = refusing.local_addr().unwrap();
    drop(refusing);
    let p = proxied(&[up.addr, dead], &[up.addr, gauges.addr], "round_robin", "[engines]\nprobe_failures = 3");
    for i in 0..6 {
        let r = post(p.addr, BODY);
        assert_eq!((r.status, r.rank()), (200, 0), "request {i}: {}", r.body);
    }
    assert_eq!(up.completions(), 6);
    // Each refusal was counted and reported; three in a row stall rank 1.
    let refused = proxy_metric(&p.d, "dpcoord_proxy_rank_errors_total{dp_rank=\"1\",kind=\"connect\"}");
    assert!(refused >= 1.0);
    let state = p.d.wait_status(1, "stalled");
    assert_eq!(state["ranks"][1]["stall"], json!("probe"), "{state}");
    // Rank 1's placements were moved to rank 0, which served them.
    eventually("the moved placements booked", || (books(&p.d).iter().map(|b| b.1).sum::<u64>() == 0).then_some(()));
    assert_eq!(books(&p.d).iter().map(|b| b.0).collect::<Vec<_>>(), [6, 0]);
    // The server comes back on its port: the proxy's own probe readmits it.
    let back = OpenAiServer::on(TcpListener::bind(dead).unwrap());
    p.d.wait_status(1, "up");
    let ranks: Vec<u32> = (0..4).map(|_| post(p.addr, BODY).rank()).collect();
    assert!(ranks.contains(&1), "{ranks:?}");
    assert_eq!(back.completions(), ranks.iter().filter(|&&r| r == 1).count());
}

#[test]
fn a_rank_answering_5xx_leaves_rotation_and_returns_when_its_health_answers() {
    let (good, failing) = (OpenAiServer::start(), OpenAiServer::start());
    let p = over(&[&good, &failing], "round_robin", "[engines]\nprobe_failures = 3");
    failing.answer_status(503);
    // Each 503 passes through and is reported; three in a row stall rank 1.
    let mut failed = 0;
    for _ in 0..50 {
        let r = post(p.addr, BODY);
        assert_eq!(r.status, if r.rank() == 1 { 503 } else { 200 }, "{}", r.body);
        failed += usize::from(r.rank() == 1);
        if p.d.ranks()[1]["status"] == "stalled" {
            break;
        }
    }
    let state = p.d.wait_status(1, "stalled");
    assert_eq!(state["ranks"][1]["stall"], json!("probe"), "{state}");
    assert!((1..=3).contains(&failed), "stalled after {failed} 503s");
    // Its /health fails too: it stays out of rotation.
    for _ in 0..4 {
        assert_eq!(post(p.addr, BODY).rank(), 0);
    }
    // Healthy again: the proxy's probe of /health readmits it.
    failing.answer_status(0);
    p.d.wait_status(1, "up");
    let ranks: Vec<u32> = (0..4).map(|_| post(p.addr, BODY).rank()).collect();
    assert!(ranks.contains(&1), "{ranks:?}");
}

#[test]
fn with_one_endpoint_for_every_rank_the_rank_rides_in_the_header() {
    let engine = OpenAiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let text = format!(
        "[server]\nproxy_bind = \"{addr}\"\n[engines]\ndp_size = 2\n\
         [gateway]\nendpoints = [\"{}\"]\nrank_header = \"x-data-parallel-rank\"\n[routing]\npolicy = \"round_robin\"\n",
        engine.addr
    );
    let path = dir.path().join("c.toml");
    std::fs::write(&path, text).unwrap();
    let mut args = vec!["--config", path.to_str().unwrap()];
    args.extend_from_slice(&FROZEN);
    let d = Daemon::start(&args);
    d.bring_up(&d.publisher(), &[0, 1]);
    let ranks: Vec<u32> = (0..4).map(|_| post(addr, BODY).rank()).collect();
    assert_eq!(ranks, [0, 1, 0, 1]);
    let headers: Vec<String> =
        engine.seen().iter().filter_map(|s| s.headers.get("x-data-parallel-rank").cloned()).collect();
    assert_eq!(headers, ["0", "1", "0", "1"]);
}

#[test]
fn requests_without_a_prompt_go_to_routable_ranks_in_turn_and_book_nothing() {
    let engines = [OpenAiServer::start(), OpenAiServer::start()];
    let p = over(&engines.iter().collect::<Vec<_>>(), "round_robin", "");
    let ranks: Vec<u32> = (0..4).map(|_| request(p.addr, "GET", "/v1/models", "").rank()).collect();
    assert_eq!(ranks, [0, 1, 0, 1]);
    let r = request(p.addr, "POST", "/tokenize", r#"{"prompt":"x"}"#);
    assert_eq!((r.status, r.rank()), (200, 0));
    assert_eq!(books(&p.d), [(0, 0), (0, 0)]);
    assert_eq!(proxy_metric(&p.d, "dpcoord_proxy_requests_total{outcome=\"routed_bodyless\"}"), 5.0);
}

#[test]
fn bodies_past_the_bounds_get_a_clear_answer_and_book_nothing() {
    let engine = OpenAiServer::start();
    let p = over(&[&engine], "round_robin", "[proxy]\nbody_timeout_ms = 300\n[gateway]\nmax_body_bytes = 1048576");
    let said = |r: &Reply| -> String {
        let v: Value = serde_json::from_str(&r.body).unwrap();
        v["error"]["message"].as_str().unwrap().to_owned()
    };
    let r = post(p.addr, "not json");
    assert_eq!(r.status, 400);
    assert!(said(&r).starts_with("dpcoord: the request body is not JSON"), "{}", r.body);
    let r = post(p.addr, r#"{"prompt":"x"}"#);
    assert_eq!((r.status, said(&r).as_str()), (400, "dpcoord: the request body has no `model` (a string)"));
    // Too large by its length: answered at its head, before any byte of it.
    let mut big = TcpStream::connect(p.addr).unwrap();
    big.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(big, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1048577\r\n\r\n").unwrap();
    let mut raw = String::new();
    let _ = big.read_to_string(&mut raw);
    let r = parse(&raw);
    assert_eq!(r.status, 413);
    assert_eq!(said(&r), "dpcoord: the request body is above gateway.max_body_bytes = 1048576 bytes");
    // A body that stops coming: 408 at the timeout.
    let mut slow = TcpStream::connect(p.addr).unwrap();
    slow.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(slow, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{\"model\"").unwrap();
    let mut raw = String::new();
    let _ = slow.read_to_string(&mut raw);
    let r = parse(&raw);
    assert_eq!(r.status, 408);
    assert_eq!(said(&r), "dpcoord: the request body took longer than proxy.body_timeout_ms = 300 ms");
    assert_eq!(engine.completions(), 0);
    assert_eq!(books(&p.d), [(0, 0)]);
    for (outcome, n) in [("rejected_bad_request", 2.0), ("rejected_too_large", 1.0), ("rejected_timeout", 1.0)] {
        assert_eq!(proxy_metric(&p.d, &format!("dpcoord_proxy_requests_total{{outcome=\"{outcome}\"}}")), n);
    }
}

#[test]
fn a_body_past_the_buffer_budget_is_refused_until_room_is_made() {
    let engine = OpenAiServer::start();
    let p =
        over(&[&engine], "round_robin", "[proxy]\nmax_buffered_bytes = 1048576\n[gateway]\nmax_body_bytes = 1048576");
    // One body held at 900 KiB of the 1 MiB, its end never sent.
    let mut holder = TcpStream::connect(p.addr).unwrap();
    write!(holder, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n").unwrap();
    holder.write_all(&vec![b' '; 900 << 10]).unwrap();
    eventually("900 KiB held", || {
        (proxy_metric(&p.d, "dpcoord_proxy_buffered_bytes") == f64::from(900 << 10)).then_some(())
    });
    let second = format!(r#"{{"model":"m","prompt":"{}"}}"#, "b".repeat(200 << 10));
    let r = post(p.addr, &second);
    assert_eq!(r.status, 503);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        v["error"]["message"],
        json!("dpcoord: the proxy holds proxy.max_buffered_bytes = 1048576 bytes of request bodies; try again")
    );
    assert_eq!(
        proxy_metric(&p.d, "dpcoord_proxy_buffered_bytes"),
        f64::from(900 << 10),
        "the refused body gave its share back"
    );
    drop(holder);
    eventually("the share given back", || (proxy_metric(&p.d, "dpcoord_proxy_buffered_bytes") == 0.0).then_some(()));
    assert_eq!((post(p.addr, &second).status, engine.completions()), (200, 1));
    assert_eq!(proxy_metric(&p.d, "dpcoord_proxy_requests_total{outcome=\"rejected_busy\"}"), 1.0);
}

#[test]
fn sigterm_is_not_ready_at_once_ends_open_streams_within_the_promise_and_exits_zero() {
    let engine = OpenAiServer::start();
    let p = over(&[&engine], "round_robin", "");
    engine.close_gate();
    let (mut s, _) = open_stream(p.addr, r#"data: {"i":0}"#);
    assert_eq!(p.d.http_get("/readyz").0, 200);
    let started = Instant::now();
    let _ = std::process::Command::new("kill").args(["-TERM", &p.d.pid().to_string()]).status();
    // Not ready from the first instant, while the stream drains.
    eventually("/readyz to say stopping", || {
        (p.d.http_get("/readyz") == (503, "not ready: stopping\n".to_owned())).then_some(())
    });
    assert!(started.elapsed() < Duration::from_secs(1), "not ready only after {:?}", started.elapsed());
    let status = p.d.stop_with("TERM");
    let took = started.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    // The open stream was cut, not left hanging.
    let mut rest = String::new();
    let _ = s.read_to_string(&mut rest);
    assert!(!rest.contains("[DONE]"));
    engine.open_gate();
}

#[test]
fn the_proxy_command_scrapes_each_servers_metrics_and_routes() {
    let engines = [OpenAiServer::start(), OpenAiServer::start()];
    let dir = tempfile::tempdir().unwrap();
    let (addr, metrics) = (free_addr(), free_addr());
    let (route, health, stats) = (ipc(&dir, "route"), ipc(&dir, "health"), ipc(&dir, "stats"));
    let servers: Vec<String> = engines.iter().map(|e| format!("http://{}", e.addr)).collect();
    let (listen, metrics_bind) = (addr.to_string(), metrics.to_string());
    let mut args = vec!["proxy", "--listen", &listen, "--policy", "round_robin", "--metrics-bind", &metrics_bind];
    args.extend(["--route-bind", &route, "--health-bind", &health, "--stats-bind", &stats]);
    args.extend(servers.iter().map(String::as_str));
    let (_child, _stderr) = spawn_with_stderr(&args, "warn");
    eventually("both ranks ready", || (http(metrics, "GET", "/readyz").0 == 200).then_some(()));
    eventually("both ranks up", || {
        let (_, body) = http(metrics, "GET", "/state");
        let v: Value = serde_json::from_str(&body).ok()?;
        (v["ranks"].as_array()?.iter().all(|r| r["status"] == "up")).then_some(())
    });
    let ranks: Vec<u32> = (0..4).map(|_| post(addr, BODY).rank()).collect();
    assert_eq!(ranks, [0, 1, 0, 1]);
    assert!(engines.iter().all(|e| e.seen().iter().any(|s| s.path == "/metrics")));
    assert_eq!(engines.map(|e| e.completions()), [2, 2]);
}

#[test]
fn a_bad_proxy_configuration_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let check = |toml: &str, why: &str| {
        std::fs::write(&path, toml).unwrap();
        let (code, err) = run_to_end(&["check-config", path.to_str().unwrap()]);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains(why), "{err}");
    };
    check("[server]\nproxy_bind = \"nope\"\n", "server.proxy_bind: `nope` is not HOST:PORT");
    check(
        "[server]\nproxy_bind = \"127.0.0.1:8000\"\n",
        "gateway.endpoints: server.proxy_bind is set: name each rank's host:port here",
    );
    check(
        "[server]\nproxy_bind = \"127.0.0.1:8000\"\n[engines]\ndp_size = 1\n[gateway]\nendpoints = [\"a:1\"]\n\
         max_body_bytes = 8388608\n[proxy]\nmax_buffered_bytes = 4194304\n",
        "proxy.max_buffered_bytes: 4194304 is below gateway.max_body_bytes = 8388608",
    );
    check(
        "[server]\nproxy_bind = \"127.0.0.1:9570\"\n[engines]\ndp_size = 1\n[gateway]\nendpoints = [\"a:1\"]\n",
        "server.proxy_bind: `127.0.0.1:9570` clashes with server.metrics_bind",
    );
    let (code, err) = run_to_end(&["proxy", "https://a:1"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("https is not supported"), "{err}");
    // A busy port stops the start, naming the key.
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = busy.local_addr().unwrap().to_string();
    let (route, health) = (ipc(&dir, "route"), ipc(&dir, "health"));
    let metrics = free_addr().to_string();
    let args = ["proxy", "--listen", &at, "--metrics-bind", &metrics, "--route-bind", &route, "--health-bind", &health];
    let (code, err) = run_to_end(&[&args[..], &["a:1"]].concat());
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("cannot listen on {at} (server.proxy_bind)")), "{err}");
}

#[test]
fn an_error_from_the_rank_passes_through_counted_and_booked() {
    let engine = OpenAiServer::start();
    let p = over(&[&engine], "round_robin", "");
    engine.answer_status(503);
    let r = post(p.addr, BODY);
    assert_eq!((r.status, r.body.as_str(), r.rank()), (503, r#"{"error":"engine"}"#, 0));
    assert_eq!(proxy_metric(&p.d, "dpcoord_proxy_rank_errors_total{dp_rank=\"0\",kind=\"status_5xx\"}"), 1.0);
    eventually("its end booked", || (books(&p.d) == [(1, 0)]).then_some(()));
}

#[test]
fn prompts_are_tokenized_as_the_engine_does_and_a_shared_prefix_stays_on_its_rank() {
    let engines = [OpenAiServer::start(), OpenAiServer::start(), OpenAiServer::start()];
    let dir = tempfile::tempdir().unwrap();
    let qwen3 = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/gateway/testdata/tokenizers/qwen3");
    let gz = std::fs::read(qwen3.join("tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut json).unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::write(&tokenizer, json).unwrap();
    let extra = format!(
        "[gateway]\ntokenizer = {:?}\ntokenizer_config = {:?}",
        tokenizer.to_str().unwrap(),
        qwen3.join("tokenizer_config.json").to_str().unwrap()
    );
    let p = over(&engines.iter().collect::<Vec<_>>(), "cache_aware", &extra);
    let system = "You are a careful assistant who answers in one sentence. ".repeat(40);
    let chat = |q: &str| {
        json!({"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
            .to_string()
    };
    let first = post_to(p.addr, "/v1/chat/completions", &chat("What is 2 + 2?"));
    assert_eq!(first.status, 200, "{}", first.body);
    // The same system prompt, other questions: the rank that holds it.
    for q in ["Name a colour.", "Name a river.", "Name a city."] {
        assert_eq!(post_to(p.addr, "/v1/chat/completions", &chat(q)).rank(), first.rank(), "{q}");
    }
    assert_eq!(proxy_metric(&p.d, "dpcoord_proxy_prompts_total{mode=\"tokenizer\"}"), 4.0);
    assert_eq!(proxy_metric(&p.d, "dpcoord_proxy_prompts_total{mode=\"text\"}"), 0.0);
    let bodies: Vec<Vec<u8>> =
        engines[first.rank() as usize].seen().into_iter().filter(|s| s.method == "POST").map(|s| s.body).collect();
    assert_eq!(bodies[0], chat("What is 2 + 2?").as_bytes(), "the body reaches the engine unchanged");
}

#[test]
fn what_the_engine_served_from_its_cache_is_reported_against_the_prediction() {
    let engines = [OpenAiServer::start(), OpenAiServer::start()];
    for e in &engines {
        e.report_cached(48);
    }
    let p = over(&engines.iter().collect::<Vec<_>>(), "cache_aware", "");
    let reported = |rank: u32, kind: &str| {
        p.d.metric(&format!("dpcoord_prefix_reported_tokens_total{{dp_rank=\"{rank}\",kind=\"{kind}\"}}"))
            .unwrap_or(0.0)
    };
    let predicted = |rank: u32| {
        p.d.metric(&format!("dpcoord_prefix_predicted_tokens_total{{dp_rank=\"{rank}\",of=\"chosen\"}}")).unwrap_or(0.0)
    };
    // The same prompt twice (the second predicted cached where the first
    // went), and streamed: each response's count reported once.
    let prompt = format!("{{\"model\":\"m\",\"prompt\":\"{}\"", "Tell me about the proxy. ".repeat(20));
    let plain = format!("{prompt}}}");
    let streamed = format!("{prompt},\"stream\":true}}");
    let mut ranks = Vec::new();
    for (i, body) in [&plain, &plain, &streamed].into_iter().enumerate() {
        let r = post(p.addr, body);
        assert_eq!(r.status, 200, "{}", r.body);
        ranks.push(r.rank());
        let n = i as f64 + 1.0;
        eventually("the report counted", || {
            let delivered: f64 = (0..2).map(|r| reported(r, "delivered")).sum();
            (delivered == 48.0 * n).then_some(())
        });
    }
    assert_eq!(ranks[1], ranks[0], "the repeated prompt stays where its prefix was placed");
    for rank in 0..2 {
        assert_eq!(reported(rank, "predicted"), predicted(rank), "rank {rank}: every prediction carried back");
    }
    assert!(predicted(ranks[0]) > 0.0, "the repeat was predicted cached");
    // A refused request, and a response without a count: nothing reported.
    engines[ranks[0] as usize].answer_status(503);
    engines[1 - ranks[0] as usize].answer_status(503);
    assert_eq!(post(p.addr, &plain).status, 503);
    let quiet = OpenAiServer::start();
    let q = over(&[&quiet], "cache_aware", "");
    assert_eq!(post(q.addr, &plain).status, 200);
    eventually("both ends booked", || {
        (books(&p.d)[..].iter().all(|b| b.1 == 0) && books(&q.d) == [(1, 0)]).then_some(())
    });
    let delivered: f64 = (0..2).map(|r| reported(r, "delivered")).sum();
    assert_eq!(delivered, 48.0 * 3.0, "the 503 reported nothing");
    assert_eq!(q.d.metric("dpcoord_prefix_reported_tokens_total{dp_rank=\"0\",kind=\"predicted\"}"), Some(0.0));
}
