//! Proxy: `dpcoord proxy` (`server.proxy_bind`, one OpenAI-compatible
//! server per rank) against the load spread by the client itself and
//! against vLLM Ascend's own load-balance proxy for external DP, in the
//! same run, on the same fake engines.
//!
//! The engines are OpenAI-style servers in this process (one thread):
//! `POST /v1/completions` and `/v1/chat/completions` answer at once, a
//! small JSON completion or, with `"stream": true`, a short SSE stream (5
//! events, then `data: [DONE]`); `GET /metrics` serves vLLM's gauges with
//! the engine's real requests in flight, which dpcoord scrapes for load.
//! A closed-loop client (keep-alive connections, each sending streamed
//! completions of a 1.5 KB prompt back to back) times each request to the
//! end of its body. The arms:
//!
//! - `direct`: the client sends each request to the next engine in turn
//!   (one connection per engine per client connection): the baseline;
//! - `dpcoord proxy`: the dpcoord binary with `proxy_bind`, the engines'
//!   `/metrics` and `gateway.endpoints`, `least_load`;
//! - `vllm-ascend proxy`: `dp_load_balance_proxy_server.py` of vLLM
//!   Ascend 0.23.0 (examples/external_online_dp), unmodified, fetched and
//!   run by `benches/ascend_proxy.py` in a virtualenv under `target/`
//!   (Full mode only).
//!
//! Per arm and connection count: requests/s, latency p50 and p99, the
//! latency the proxy adds to direct's, the proxy process's CPU time over
//! the measured requests (/proc/PID/stat), requests per CPU-second and its
//! peak RSS (VmHWM), and how evenly the engines were loaded.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Command;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::report::{num, rate, ratio, Report, Table};
use crate::support::{call, eventually, req_socket, Daemon, Latencies, Mp, Proc, DEADLINE};
use crate::Mode;

/// Engines (DP ranks) behind every arm.
const DP: usize = 4;
/// How long vLLM Ascend's proxy (Python: imports, then uvicorn) may take to answer.
const PYTHON_START: Duration = Duration::from_secs(60);
/// The end of every streamed response.
const DONE: &[u8] = b"data: [DONE]\n\n";
const LABELS: &str = "{engine=\"0\",model_name=\"m\"}";

// ---------------------------------------------------------------- engines

/// One engine's counters: its `/metrics` and the spread across engines.
#[derive(Default)]
struct Counters {
    in_flight: AtomicU64,
    served: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
}

/// A request in flight on an engine, until its response body is dropped.
struct InFlight(Arc<Counters>);

impl InFlight {
    fn enter(c: &Arc<Counters>) -> InFlight {
        c.in_flight.fetch_add(1, Relaxed);
        InFlight(Arc::clone(c))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

/// A response body of ready frames: one (with its length) or an SSE stream.
struct Reply {
    frames: VecDeque<Bytes>,
    exact: Option<u64>,
    _in_flight: Option<InFlight>,
}

impl Reply {
    fn whole(body: impl Into<Bytes>, in_flight: Option<InFlight>) -> Reply {
        let body = body.into();
        Reply { exact: Some(body.len() as u64), frames: VecDeque::from([body]), _in_flight: in_flight }
    }

    fn stream(events: &[&'static str], in_flight: InFlight) -> Reply {
        let frames = events.iter().map(|e| Bytes::from_static(e.as_bytes())).collect();
        Reply { frames, exact: None, _in_flight: Some(in_flight) }
    }
}

impl Body for Reply {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.get_mut().frames.pop_front().map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        self.exact.map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

const COMPLETION: &str = concat!(
    r#"{"id":"cmpl-bench","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"#,
    r#""text":" the quick brown fox jumps over the lazy dog again","logprobs":null,"finish_reason":"length"}],"#,
    r#""usage":{"prompt_tokens":400,"completion_tokens":16,"total_tokens":416}}"#
);
const CHAT: &str = concat!(
    r#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"#,
    r#""message":{"role":"assistant","content":"the quick brown fox jumps over the lazy dog again"},"#,
    r#""finish_reason":"length"}],"usage":{"prompt_tokens":400,"completion_tokens":16,"total_tokens":416}}"#
);
const COMPLETION_EVENTS: [&str; 6] = [
    "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" the quick\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" brown fox\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" jumps over\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" the lazy\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" dog\",\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\n",
    "data: [DONE]\n\n",
];
const CHAT_EVENTS: [&str; 6] = [
    "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"the quick\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" brown fox\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" jumps\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
    "data: [DONE]\n\n",
];
const MODELS: &str = r#"{"object":"list","data":[{"id":"m","object":"model","created":0,"owned_by":"bench"}]}"#;

/// Whether a request body asks for a stream: `"stream"`, a colon, `true`.
fn wants_stream(body: &[u8]) -> bool {
    let key = b"\"stream\"";
    let Some(at) = body.windows(key.len()).position(|w| w == key) else { return false };
    let rest = body[at + key.len()..].iter().skip_while(|b| b.is_ascii_whitespace() || **b == b':');
    rest.take(4).copied().eq(b"true".iter().copied())
}

/// vLLM's gauges and token counters, as its PrometheusStatLogger names them.
fn metrics_text(c: &Counters) -> String {
    let running = c.in_flight.load(Relaxed);
    let kv = (running as f64 / 256.0).min(1.0);
    let (prompt, generation) = (c.prompt_tokens.load(Relaxed), c.generation_tokens.load(Relaxed));
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{LABELS} {running}.0\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{LABELS} 0.0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{LABELS} {kv}\n\
         # TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{LABELS} {prompt}.0\n\
         # TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{LABELS} {generation}.0\n"
    )
}

fn respond(status: StatusCode, kind: &'static str, body: Reply) -> Response<Reply> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(kind));
    r
}

async fn answer(c: Arc<Counters>, req: Request<Incoming>) -> Result<Response<Reply>, hyper::Error> {
    const JSON: &str = "application/json";
    let chat = match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/completions") => false,
        (&Method::POST, "/v1/chat/completions") => true,
        (&Method::GET, "/metrics") => {
            return Ok(respond(StatusCode::OK, "text/plain; version=0.0.4", Reply::whole(metrics_text(&c), None)))
        }
        (&Method::GET, "/v1/models") => return Ok(respond(StatusCode::OK, JSON, Reply::whole(MODELS, None))),
        (&Method::GET, "/health") => return Ok(respond(StatusCode::OK, JSON, Reply::whole("", None))),
        _ => return Ok(respond(StatusCode::NOT_FOUND, JSON, Reply::whole(r#"{"error":"not found"}"#, None))),
    };
    let in_flight = InFlight::enter(&c);
    let body = req.into_body().collect().await?.to_bytes();
    c.served.fetch_add(1, Relaxed);
    c.prompt_tokens.fetch_add(body.len() as u64 / 4, Relaxed);
    c.generation_tokens.fetch_add(16, Relaxed);
    Ok(match (wants_stream(&body), chat) {
        (true, false) => respond(StatusCode::OK, "text/event-stream", Reply::stream(&COMPLETION_EVENTS, in_flight)),
        (true, true) => respond(StatusCode::OK, "text/event-stream", Reply::stream(&CHAT_EVENTS, in_flight)),
        (false, false) => respond(StatusCode::OK, JSON, Reply::whole(COMPLETION, Some(in_flight))),
        (false, true) => respond(StatusCode::OK, JSON, Reply::whole(CHAT, Some(in_flight))),
    })
}

async fn serve_engine(listener: tokio::net::TcpListener, c: Arc<Counters>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors, say: try again shortly rather than spin.
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let c = Arc::clone(&c);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(Arc::clone(&c), req));
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// `DP` fake engines on loopback ports, served by one thread until dropped.
struct Engines {
    addrs: Vec<SocketAddr>,
    counters: Vec<Arc<Counters>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Engines {
    fn start() -> Engines {
        let listeners: Vec<std::net::TcpListener> = (0..DP)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an engine");
                l.set_nonblocking(true).expect("nonblocking listener");
                l
            })
            .collect();
        let addrs = listeners.iter().map(|l| l.local_addr().expect("engine address")).collect();
        let counters: Vec<Arc<Counters>> = (0..DP).map(|_| Arc::default()).collect();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = counters.clone();
        let thread = std::thread::Builder::new()
            .name("engines".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("engines runtime");
                rt.block_on(async move {
                    for (l, c) in listeners.into_iter().zip(served) {
                        tokio::spawn(serve_engine(tokio::net::TcpListener::from_std(l).expect("listener"), c));
                    }
                    let _ = stopped.await;
                });
                // Dropping the runtime ends every connection's task.
            })
            .expect("engines thread");
        Engines { addrs, counters, stop: Some(stop), thread: Some(thread) }
    }

    fn served(&self) -> Vec<u64> {
        self.counters.iter().map(|c| c.served.load(Relaxed)).collect()
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------- client

/// One keep-alive HTTP/1.1 connection of the load generator.
struct Conn {
    send: SendRequest<Full<Bytes>>,
    host: String,
}

async fn connect(addr: SocketAddr) -> std::io::Result<Conn> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (send, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Conn { send, host: addr.to_string() })
}

/// One request: its status and whole body.
async fn send(conn: &mut Conn, path: &str, body: Bytes) -> Result<(StatusCode, Bytes), hyper::Error> {
    conn.send.ready().await?;
    let req = Request::post(path)
        .header(HOST, conn.host.as_str())
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .expect("a valid request");
    let response = conn.send.send_request(req).await?;
    let status = response.status();
    Ok((status, response.into_body().collect().await?.to_bytes()))
}

/// What one phase of load shares: when it ends, the requests left, the
/// next engine in turn (direct) and the request body.
struct Phase {
    until: Instant,
    budget: AtomicI64,
    next: AtomicUsize,
    body: Bytes,
}

/// One client connection's requests back to back: its latencies, answered
/// and failed counts, and its connections unless one broke.
async fn worker(mut conns: Vec<Conn>, phase: Arc<Phase>) -> (Option<Vec<Conn>>, Latencies, u64, u64) {
    let (mut lat, mut ok, mut failed) = (Latencies::default(), 0, 0);
    while Instant::now() < phase.until && phase.budget.fetch_sub(1, Relaxed) > 0 {
        let i = if conns.len() == 1 { 0 } else { phase.next.fetch_add(1, Relaxed) % conns.len() };
        let start = Instant::now();
        match tokio::time::timeout(DEADLINE, send(&mut conns[i], "/v1/completions", phase.body.clone())).await {
            Ok(Ok((StatusCode::OK, body))) if body.ends_with(DONE) => {
                lat.push(start.elapsed());
                ok += 1;
            }
            Ok(Ok(_)) => failed += 1,
            // The connection is unusable: this worker stops.
            Ok(Err(_)) | Err(_) => return (None, lat, ok, failed + 1),
        }
    }
    (Some(conns), lat, ok, failed)
}

/// What one phase measured.
#[derive(Default)]
struct Sample {
    lat: Latencies,
    ok: u64,
    failed: u64,
    elapsed: Duration,
}

/// `workers` send at most `budget` requests in all, for at most `limit`.
fn drive(
    rt: &tokio::runtime::Runtime,
    workers: Vec<Vec<Conn>>,
    body: &Bytes,
    budget: u64,
    limit: Duration,
) -> (Vec<Vec<Conn>>, Sample) {
    let phase = Arc::new(Phase {
        until: Instant::now() + limit,
        budget: AtomicI64::new(budget as i64),
        next: AtomicUsize::new(0),
        body: body.clone(),
    });
    let start = Instant::now();
    let mut sample = Sample::default();
    let mut alive = Vec::new();
    rt.block_on(async {
        let tasks: Vec<_> = workers.into_iter().map(|w| tokio::spawn(worker(w, Arc::clone(&phase)))).collect();
        for t in tasks {
            let (conns, lat, ok, failed) = t.await.expect("a load worker");
            sample.lat.extend(lat);
            (sample.ok, sample.failed) = (sample.ok + ok, sample.failed + failed);
            alive.extend(conns);
        }
    });
    sample.elapsed = start.elapsed();
    (alive, sample)
}

/// The request the load sends: a streamed completion of a ~1.5 KB prompt.
fn load_body() -> Bytes {
    let prompt = "You are a helpful assistant. Summarize the following passage in one sentence. ".repeat(19);
    Bytes::from(serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 16, "stream": true}).to_string())
}

/// [`send`] within [`DEADLINE`]; the error as text.
async fn timed_send(conn: &mut Conn, path: &str, body: Bytes) -> Result<(StatusCode, Bytes), String> {
    match tokio::time::timeout(DEADLINE, send(conn, path, body)).await {
        Ok(answered) => answered.map_err(|e| e.to_string()),
        Err(_) => Err(format!("{path}: no answer within {DEADLINE:?}")),
    }
}

/// One streamed completion and one whole chat completion through `addr`,
/// both checked; the error says what was wrong.
fn check(rt: &tokio::runtime::Runtime, addr: SocketAddr) -> Result<(), String> {
    rt.block_on(async {
        let mut conn = connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        let (status, body) = timed_send(&mut conn, "/v1/completions", load_body()).await?;
        if status != StatusCode::OK || !body.ends_with(DONE) {
            return Err(format!("streamed completion: {status}, {:?}", String::from_utf8_lossy(&body)));
        }
        let chat =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16});
        let (status, body) = timed_send(&mut conn, "/v1/chat/completions", Bytes::from(chat.to_string())).await?;
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        if status != StatusCode::OK || !v["choices"][0]["message"]["content"].is_string() {
            return Err(format!("chat completion: {status}, {:?}", String::from_utf8_lossy(&body)));
        }
        Ok(())
    })
}

// ---------------------------------------------------------------- arms

/// Where an arm's load goes and the process that is measured.
struct Arm {
    name: &'static str,
    addrs: Vec<SocketAddr>,
    holder: Holder,
}

enum Holder {
    Nothing,
    Dpcoord(Daemon),
    /// The proxy and the folder of its log.
    Python {
        proc: Proc,
        _log: tempfile::TempDir,
    },
}

impl Arm {
    fn proc(&self) -> Option<&Proc> {
        match &self.holder {
            Holder::Nothing => None,
            Holder::Dpcoord(d) => Some(d.proc()),
            Holder::Python { proc, .. } => Some(proc),
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port()
}

/// The status of `GET path` on `addr` (None when it does not answer).
fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

fn quoted(items: impl Iterator<Item = String>) -> String {
    items.map(|i| format!("{i:?}")).collect::<Vec<_>>().join(", ")
}

/// dpcoord with its proxy in front of `engines`, every rank up.
fn start_dpcoord(dir: &Path, engines: &Engines) -> Arm {
    let port = free_port();
    let cfg = dir.join("proxy.toml");
    let urls = quoted(engines.addrs.iter().map(|a| format!("http://{a}/metrics")));
    let endpoints = quoted(engines.addrs.iter().map(|a| a.to_string()));
    std::fs::write(
        &cfg,
        format!(
            "[server]\nproxy_bind = \"127.0.0.1:{port}\"\n[engines]\ndp_size = {DP}\nvllm_metrics_url = [{urls}]\n\
             [gateway]\nendpoints = [{endpoints}]\n[routing]\npolicy = \"least_load\"\n"
        ),
    )
    .expect("write the config");
    let d = Daemon::start(DP as u32, &["--config", cfg.to_str().expect("utf-8 path")]);
    eventually("dpcoord /readyz 200", || (http_status(d.metrics, "/readyz") == Some(200)).then_some(()));
    // Ready is one rank routable; the load starts once every rank is up.
    let client = req_socket(&d.ctx, &d.route);
    let mut state = Vec::new();
    Mp(&mut state).map(2).str("v").uint(1).str("op").str("state");
    eventually("every rank scraped and up", || {
        let s = call(&client, &state)?;
        s["ranks"].as_array()?.iter().all(|r| r["status"] == "up").then_some(())
    });
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    Arm { name: "dpcoord proxy", addrs: vec![addr], holder: Holder::Dpcoord(d) }
}

/// Where the bench keeps vLLM Ascend's proxy and its virtualenv.
fn ascend_dir() -> PathBuf {
    let target = option_env!("CARGO_TARGET_DIR")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"), PathBuf::from);
    target.join("bench-ascend-proxy")
}

/// vLLM Ascend's proxy in front of `engines`, answering; Err says why not.
fn start_ascend(engines: &Engines) -> Result<Arm, String> {
    let helper = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/ascend_proxy.py");
    let prepared = Command::new("python3")
        .args([helper, "prepare"])
        .arg(ascend_dir())
        .output()
        .map_err(|e| format!("python3: {e}"))?;
    let out = String::from_utf8_lossy(&prepared.stdout);
    if !prepared.status.success() {
        let err = String::from_utf8_lossy(&prepared.stderr);
        return Err(format!("ascend_proxy.py prepare failed: {}", err.lines().last().unwrap_or("").trim()));
    }
    let field = |name: &str| out.lines().find_map(|l| l.strip_prefix(name)).map(str::to_owned);
    let (python, script) = field("python=").zip(field("script=")).ok_or("ascend_proxy.py prepare printed no paths")?;
    println!(
        "  (vllm-ascend proxy: examples/external_online_dp/dp_load_balance_proxy_server.py of vllm-ascend 0.23.0, \
         from its sdist; {})",
        field("versions=").unwrap_or_default()
    );
    let port = free_port();
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let log_path = dir.path().join("ascend-proxy.log");
    let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(python);
    cmd.args([helper, "serve", &script, "--host", "127.0.0.1", "--port", &port.to_string(), "--dp-hosts"]);
    cmd.args(engines.addrs.iter().map(|a| a.ip().to_string())).arg("--dp-ports");
    cmd.args(engines.addrs.iter().map(|a| a.port().to_string())).stderr(log);
    let mut proc = Proc::spawn(&mut cmd).map_err(|e| format!("spawn the proxy: {e}"))?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let start = Instant::now();
    while http_status(addr, "/healthcheck") != Some(200) {
        if !proc.running() || start.elapsed() > PYTHON_START {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            return Err(format!(
                "the proxy did not answer /healthcheck: {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Arm { name: "vllm-ascend proxy", addrs: vec![addr], holder: Holder::Python { proc, _log: dir } })
}

// ---------------------------------------------------------------- runs

/// How much load each arm gets.
struct Plan {
    conns: Vec<usize>,
    warmup: (u64, Duration),
    measured: (u64, Duration),
}

/// One arm at one connection count.
struct Row {
    arm: &'static str,
    conns: usize,
    sample: Sample,
    cpu: Option<Duration>,
    peak_kib: Option<u64>,
    /// Requests each engine served during the measured phase.
    served: Vec<u64>,
}

fn measure(rt: &tokio::runtime::Runtime, arm: &Arm, conns: usize, plan: &Plan, engines: &Engines) -> Row {
    let body = load_body();
    let workers: Vec<Vec<Conn>> = rt.block_on(async {
        let mut workers = Vec::with_capacity(conns);
        for _ in 0..conns {
            let mut w = Vec::with_capacity(arm.addrs.len());
            for a in &arm.addrs {
                w.push(connect(*a).await.unwrap_or_else(|e| panic!("{}: connect to {a}: {e}", arm.name)));
            }
            workers.push(w);
        }
        workers
    });
    let (workers, _) = drive(rt, workers, &body, plan.warmup.0, plan.warmup.1);
    let cpu0 = arm.proc().map(Proc::cpu);
    let served0 = engines.served();
    let (workers, sample) = drive(rt, workers, &body, plan.measured.0, plan.measured.1);
    let cpu = arm.proc().map(|p| p.cpu().saturating_sub(cpu0.unwrap_or_default()));
    let served = engines.served().iter().zip(served0).map(|(a, b)| a - b).collect();
    drop(workers);
    Row { arm: arm.name, conns, sample, cpu, peak_kib: arm.proc().map(|p| p.rss_kib().1), served }
}

fn print(rows: &mut [Row]) {
    let mut t = Table::new(
        format!("proxy: {DP} fake OpenAI engines, streamed completions of a 1.5 KB prompt, closed loop, same run"),
        &[
            "arm",
            "conns",
            "requests",
            "req/s",
            "vs direct",
            "p50 us",
            "p99 us",
            "+p50 us",
            "+p99 us",
            "proxy CPU s",
            "req/CPU-s",
            "peak RSS MiB",
            "rank max/min",
            "failed",
        ],
    )
    .text_columns(1);
    let mut direct: Vec<(usize, f64, f64, f64)> = Vec::new();
    for r in rows.iter_mut() {
        let rps = r.sample.ok as f64 / r.sample.elapsed.as_secs_f64();
        let (p50, p99) = (r.sample.lat.quantile_us(0.5), r.sample.lat.quantile_us(0.99));
        if r.arm == "direct" {
            direct.push((r.conns, rps, p50, p99));
        }
        let base = direct.iter().find(|d| d.0 == r.conns).copied();
        let added = |x: f64, b: f64| if r.arm == "direct" { "-".into() } else { format!("{:+.0}", x - b) };
        let (min, max) = (r.served.iter().min().copied().unwrap_or(0), r.served.iter().max().copied().unwrap_or(0));
        t.row(vec![
            r.arm.into(),
            r.conns.to_string(),
            rate(r.sample.ok as f64),
            rate(rps),
            base.map_or("n/a".into(), |b| ratio(rps, b.1)),
            num(p50, 0),
            num(p99, 0),
            base.map_or("n/a".into(), |b| added(p50, b.2)),
            base.map_or("n/a".into(), |b| added(p99, b.3)),
            r.cpu.map_or("-".into(), |c| num(c.as_secs_f64(), 2)),
            r.cpu.map_or("-".into(), |c| rate(r.sample.ok as f64 / c.as_secs_f64().max(1e-3))),
            r.peak_kib.map_or("-".into(), |k| num(k as f64 / 1024.0, 1)),
            if min > 0 { format!("{:.2}", max as f64 / min as f64) } else { "n/a".into() },
            r.sample.failed.to_string(),
        ]);
    }
    t.print();
}

pub fn run(mode: Mode, report: &mut Report) {
    let plan = match mode {
        Mode::Full => Plan {
            conns: vec![16, 64],
            warmup: (1_000, Duration::from_secs(1)),
            measured: (20_000, Duration::from_secs(10)),
        },
        Mode::Smoke => {
            Plan { conns: vec![4], warmup: (0, Duration::ZERO), measured: (100, Duration::from_millis(500)) }
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("client runtime");
    let engines = Engines::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut arms = vec![Arm { name: "direct", addrs: engines.addrs.clone(), holder: Holder::Nothing }];
    arms.push(start_dpcoord(dir.path(), &engines));
    if mode == Mode::Full {
        match start_ascend(&engines) {
            Ok(arm) => arms.push(arm),
            Err(why) => println!("  (vllm-ascend proxy skipped: {why})"),
        }
    } else {
        println!("  (vllm-ascend proxy: Full mode only)");
    }
    for arm in &arms {
        check(&rt, arm.addrs[0]).unwrap_or_else(|e| panic!("{} answers wrong: {e}", arm.name));
    }
    let mut rows = Vec::new();
    for (i, &c) in plan.conns.iter().enumerate() {
        // Direct first (each row's baseline), the proxies in alternating order.
        let mut order: Vec<&Arm> = arms.iter().skip(1).collect();
        if i % 2 == 1 {
            order.reverse();
        }
        for arm in std::iter::once(&arms[0]).chain(order) {
            rows.push(measure(&rt, arm, c, &plan, &engines));
        }
    }
    rows.sort_by_key(|r| (r.conns, arms.iter().position(|a| a.name == r.arm)));
    print(&mut rows);

    let failed: u64 = rows.iter().map(|r| r.sample.failed).sum();
    report.target("proxy: every request answered (200, whole stream)", "0 failed", failed.to_string(), failed == 0);
    let at = |arm: &str| rows.iter().rev().find(|r| r.arm == arm);
    if let (Some(ours), Some(theirs)) = (at("dpcoord proxy"), at("vllm-ascend proxy")) {
        let per_cpu = |r: &Row| r.sample.ok as f64 / r.cpu.unwrap_or_default().as_secs_f64().max(1e-3);
        report.target(
            format!("proxy: dpcoord requests per CPU-second vs vLLM Ascend's proxy ({} conns)", ours.conns),
            "measured (no target yet)",
            ratio(per_cpu(ours), per_cpu(theirs)),
            true,
        );
    }
}
