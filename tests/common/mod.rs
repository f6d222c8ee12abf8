//! Test harness: spawns the real `dpcoord` binary on private ipc:// endpoints
//! and talks to it with real ZeroMQ sockets (and real HTTP).
#![allow(dead_code)] // each test file uses a different part of the harness

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rmpv::Value as M;
use serde_json::{json, Value};

/// How long any single wait in a test may take before it fails.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Polls `f` until it returns `Some`, failing the test after [`DEADLINE`].
pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A free `127.0.0.1:port` for `--metrics-bind`.
pub fn free_addr() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

/// The private ipc:// endpoint `name` in `dir`.
pub fn ipc(dir: &tempfile::TempDir, name: &str) -> String {
    format!("ipc://{}/{name}", dir.path().display())
}

/// Liveness and pending expiry far out, so frozen stats stay `up` and
/// placements stay pending for a whole test: only queries change state.
pub const FROZEN: [&str; 6] =
    ["--stale-after-ms", "600000", "--down-after-ms", "1200000", "--pending-ttl-ms", "3600000"];

/// A dpcoord process, killed if the test ends early (a failing assert).
pub struct Spawned(Child);

impl From<Child> for Spawned {
    fn from(child: Child) -> Spawned {
        Spawned(child)
    }
}

impl Spawned {
    pub fn id(&self) -> u32 {
        self.0.id()
    }

    /// SIGTERM, then the exit status.
    pub fn stop(self) -> ExitStatus {
        self.stop_with("TERM")
    }

    /// Sends `signal` (as `kill` names it: "TERM", "INT") and waits for the exit status.
    pub fn stop_with(mut self, signal: &str) -> ExitStatus {
        let _ = Command::new("kill").args([&format!("-{signal}"), &self.0.id().to_string()]).status();
        eventually(&format!("dpcoord to exit after SIG{signal}"), || self.0.try_wait().unwrap())
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for `child` to exit; kills it and fails the test after `deadline`.
pub fn wait_or_kill(child: &mut Child, deadline: Duration, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            panic!("{what} did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sets the flag when dropped, so helper threads end even if an assert fails.
pub struct SetOnDrop<'a>(pub &'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

pub struct Daemon {
    child: Option<Spawned>,
    /// The flags after the endpoints, kept for [`Daemon::restart`].
    args: Vec<String>,
    /// Readiness is checked on the health socket (the route socket was moved).
    ready_on_health: bool,
    pub dir: tempfile::TempDir,
    pub route: String,
    pub health: String,
    pub stats: String,
    pub metrics: SocketAddr,
    ctx: zmq::Context,
}

impl Daemon {
    /// Starts `dpcoord` with private endpoints plus `args`, and waits until it answers `ping`.
    pub fn start(args: &[&str]) -> Daemon {
        Daemon::start_with_route(None, args)
    }

    /// As [`Daemon::start`], with the route socket on `route` instead of a
    /// private ipc endpoint; then readiness is checked on the (ipc) health
    /// socket, since the test may be about who can reach the route socket.
    pub fn start_with_route(route: Option<&str>, args: &[&str]) -> Daemon {
        let custom_route = route.is_some();
        let dir = tempfile::tempdir().unwrap();
        let (health, stats) = (ipc(&dir, "health"), ipc(&dir, "stats"));
        let route = route.map_or_else(|| ipc(&dir, "route"), str::to_owned);
        let mut d = Daemon {
            child: None,
            args: args.iter().map(|a| a.to_string()).collect(),
            ready_on_health: custom_route,
            dir,
            route,
            health,
            stats,
            metrics: free_addr(),
            ctx: zmq::Context::new(),
        };
        d.spawn();
        d
    }

    /// Starts the binary on this daemon's endpoints and waits until it answers `ping`.
    fn spawn(&mut self) {
        let child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
            .args(["--route-bind", &self.route, "--health-bind", &self.health, "--stats-bind", &self.stats])
            .args(["--metrics-bind", &self.metrics.to_string()])
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(self.log_file())
            .spawn()
            .expect("spawn dpcoord");
        self.child = Some(Spawned(child));
        let c = if self.ready_on_health { self.health_client() } else { self.client() };
        assert_eq!(c.call(json!({"v": 1, "op": "ping"}))["ok"], json!(true));
    }

    /// The daemon's stderr goes to `dpcoord.log` in its directory (every
    /// process of a restart appends), so a passing test prints nothing and a
    /// failing one shows the log (see `Drop`).
    fn log_file(&self) -> std::fs::File {
        std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("dpcoord.log")).unwrap()
    }

    /// Stops the process with `signal` ("TERM", "KILL", ...) and starts a
    /// new one with the same flags on the same endpoints (a fresh metrics
    /// port); returns the old process's exit status.
    pub fn restart(&mut self, signal: &str) -> ExitStatus {
        let status = self.signal_and_wait(signal);
        self.metrics = free_addr();
        self.spawn();
        status
    }

    /// The running process's id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("a running dpcoord").id()
    }

    /// A daemon over `dp` ranks with [`FROZEN`] liveness, plus `extra` flags.
    pub fn frozen(dp: &str, extra: &[&str]) -> Daemon {
        let mut args = vec!["--dp-size", dp];
        args.extend_from_slice(&FROZEN);
        args.extend_from_slice(extra);
        Daemon::start(&args)
    }

    /// A [`Daemon::frozen`] daemon over `dp` ranks with `up` brought up.
    pub fn frozen_up(dp: &str, up: &[u32]) -> Daemon {
        let d = Daemon::frozen(dp, &[]);
        d.bring_up(&d.publisher(), up);
        d
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.ctx, &self.route)
    }

    pub fn health_client(&self) -> Client {
        Client::connect(&self.ctx, &self.health)
    }

    pub fn publisher(&self) -> Publisher {
        let sock = self.ctx.socket(zmq::PUB).unwrap();
        sock.set_linger(1000).unwrap();
        sock.connect(&self.stats).unwrap();
        Publisher { sock }
    }

    /// A raw socket of any type connected to one of the daemon's endpoints.
    pub fn socket(&self, kind: zmq::SocketType, endpoint: &str) -> zmq::Socket {
        let s = self.ctx.socket(kind).unwrap();
        s.set_linger(0).unwrap();
        s.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
        s.connect(endpoint).unwrap();
        s
    }

    /// The `state` reply.
    pub fn state(&self) -> Value {
        self.client().call(json!({"v": 1, "op": "state"}))
    }

    /// The `state` reply's rank entries.
    pub fn ranks(&self) -> Vec<Value> {
        self.state()["ranks"].as_array().unwrap().clone()
    }

    /// Everything in `state` but the ages (which tick on their own): epoch,
    /// and per rank its rank, status, counts, boot, `routed` and `pending`.
    pub fn books(&self) -> Value {
        let s = self.state();
        let keys = ["rank", "status", "counts", "boot", "routed", "pending"];
        let ranks: Vec<Value> = s["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| keys.iter().map(|&k| (k.to_owned(), r[k].clone())).collect())
            .collect();
        json!({"epoch": s["epoch"], "ranks": ranks})
    }

    /// Polls `state` until `rank` is `status`; returns that state.
    pub fn wait_status(&self, rank: usize, status: &str) -> Value {
        eventually(&format!("rank {rank} to be {status}"), || {
            let s = self.state();
            (s["ranks"][rank]["status"] == status).then_some(s)
        })
    }

    /// Publishes `seq = 1, 2, ...` for `ranks` until all are `up` (PUB/SUB
    /// drops what is sent before the subscription is wired). Returns the
    /// next free `seq` of boot 1.
    pub fn bring_up(&self, p: &Publisher, ranks: &[u32]) -> u64 {
        let mut seq = 0;
        eventually("ranks up", || {
            seq += 1;
            for &r in ranks {
                p.send(&update(r, 1, seq, [0; 5]));
            }
            std::thread::sleep(Duration::from_millis(10));
            let state = self.ranks();
            ranks.iter().all(|&r| state[r as usize]["status"] == "up").then_some(())
        });
        seq + 1
    }

    /// [`publish_until`] `state` shows `counts` for `rank`.
    pub fn publish_until_shown(&self, sock: &zmq::Socket, rank: u32, seq: &mut u64, counts: [u64; 5]) {
        publish_until(&format!("rank {rank} to show counts {counts:?}"), sock, rank, seq, counts, || {
            self.ranks()[rank as usize]["counts"] == json!(counts)
        });
    }

    /// GET `path` over HTTP/1.1; returns (status, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        http(self.metrics, "GET", path)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn stop(self) -> ExitStatus {
        self.stop_with("TERM")
    }

    /// Sends `signal` (as `kill` names it: "TERM", "INT") and waits for the exit status.
    pub fn stop_with(mut self, signal: &str) -> ExitStatus {
        self.signal_and_wait(signal)
    }

    fn signal_and_wait(&mut self, signal: &str) -> ExitStatus {
        self.child.take().unwrap().stop_with(signal)
    }
}

impl Drop for Daemon {
    /// A failing test (a panic) shows what the daemon logged, through the
    /// test harness's captured output.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.path().join("dpcoord.log")).unwrap_or_default();
            eprintln!("--- dpcoord's log (RUST_LOG=warn) ---\n{log}--- end of dpcoord's log ---");
        }
    }
}

impl Daemon {
    /// The value of one series as `/metrics` prints it, e.g.
    /// `dpcoord_route_errors_total{code="bad_request"}`; `None` if absent.
    pub fn metric(&self, series: &str) -> Option<f64> {
        metric(self.metrics, series)
    }

    /// `(routed, pending)` of every rank, from `state`.
    pub fn routed_pending(&self) -> Vec<(u64, u64)> {
        let num = |v: &Value| v.as_u64().expect("a non-negative integer");
        self.ranks().iter().map(|r| (num(&r["routed"]), num(&r["pending"]))).collect()
    }

    /// `routed` of every rank, from `state`.
    pub fn routed(&self) -> Vec<u64> {
        self.routed_pending().iter().map(|&(r, _)| r).collect()
    }

    /// Polls `state` until `rank` shows `counts` (an update was applied); returns its entry.
    pub fn await_counts(&self, rank: u32, counts: [u64; 5]) -> Value {
        eventually(&format!("rank {rank} to show counts {counts:?}"), || {
            let r = self.ranks().swap_remove(rank as usize);
            (r["counts"] == json!(counts)).then_some(r)
        })
    }
}

/// `resources.limits.memory` of deploy/kubernetes/deployment.yaml.
pub const LIMIT_KIB: u64 = 128 * 1024;

/// `VmRSS` or `VmHWM` of a process, in KiB.
pub fn status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Runs `dpcoord ARGS` to its end (killed after 10 s); its exit code and stderr.
pub fn run_to_end(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_or_kill(&mut child, Duration::from_secs(10), "dpcoord");
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code(), err)
}

/// Spawns the binary with exactly `args` and `RUST_LOG=rust_log`, stdout
/// discarded; returns it and its stderr lines as they come (read on a thread).
pub fn spawn_with_stderr(args: &[&str], rust_log: &str) -> (Spawned, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(args)
        .env("RUST_LOG", rust_log)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = lines_of(child.stderr.take().unwrap());
    (Spawned(child), rx)
}

/// The lines of `pipe` as they come (read on a thread until EOF).
pub fn lines_of(pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// [`spawn_with_stderr`] on the ipc endpoints `route`, `health` and `stats`
/// in `dir` (see [`ipc`]) and a free metrics port, plus `args`.
pub fn spawn_on_ipc(dir: &tempfile::TempDir, args: &[&str], rust_log: &str) -> (Spawned, mpsc::Receiver<String>) {
    let (route, health, stats) = (ipc(dir, "route"), ipc(dir, "health"), ipc(dir, "stats"));
    let metrics = free_addr().to_string();
    let endpoints =
        ["--route-bind", &route, "--health-bind", &health, "--stats-bind", &stats, "--metrics-bind", &metrics];
    spawn_with_stderr(&[&endpoints[..], args].concat(), rust_log)
}

/// One HTTP/1.1 request with `Connection: close`; returns the whole response as sent.
pub fn http_raw(addr: SocketAddr, method: &str, path: &str) -> String {
    let mut s = eventually("http connect", || TcpStream::connect(addr).ok());
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    raw
}

/// One HTTP/1.1 request with `Connection: close`; returns (status, body).
pub fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let raw = http_raw(addr, method, path);
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("HTTP status line");
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// The value of `series` in a `/metrics` body; `None` if absent.
pub fn series(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The value of `series` scraped from the `/metrics` server at `addr`; `None` if absent.
pub fn metric(addr: SocketAddr, name: &str) -> Option<f64> {
    let (status, body) = http(addr, "GET", "/metrics");
    assert_eq!(status, 200, "{body}");
    series(&body, name)
}

/// A REQ client; every call must be answered within [`DEADLINE`].
pub struct Client {
    sock: zmq::Socket,
}

impl Client {
    pub fn connect(ctx: &zmq::Context, endpoint: &str) -> Client {
        let sock = ctx.socket(zmq::REQ).unwrap();
        sock.set_linger(0).unwrap();
        sock.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
        sock.connect(endpoint).unwrap();
        Client { sock }
    }

    /// Sends raw bytes as one frame and decodes the reply.
    pub fn call_raw(&self, bytes: &[u8]) -> Value {
        self.send(bytes);
        self.recv()
    }

    /// The first half of [`Client::call_raw`].
    pub fn send(&self, bytes: &[u8]) {
        self.sock.send(bytes, 0).unwrap();
    }

    /// The second half of [`Client::call_raw`]: the decoded reply.
    pub fn recv(&self) -> Value {
        let reply = self.sock.recv_bytes(0).expect("dpcoord did not answer in time");
        rmp_serde::from_slice(&reply).expect("reply is a MessagePack map")
    }

    pub fn call(&self, query: Value) -> Value {
        self.call_raw(&encode(&query))
    }

    /// The error code of a refused query (panics if it was answered ok).
    pub fn error_code(&self, query: Value) -> String {
        let r = self.call(query);
        assert_eq!(r["ok"], json!(false), "expected an error, got {r}");
        r["error"]["code"].as_str().unwrap().to_owned()
    }

    /// The ranks a route query is answered with (fails the test on a refusal).
    pub fn route(&self, query: Value) -> Vec<u64> {
        let r = self.call(query.clone());
        assert_eq!(r["ok"], json!(true), "{query} -> {r}");
        ranks_of(&r)
    }

    /// The rank a `health_route` query is answered with (fails the test on a refusal).
    pub fn health_rank(&self, query: Value) -> u64 {
        let r = self.call(query.clone());
        assert_eq!(r["ok"], json!(true), "{query} -> {r}");
        r["rank"].as_u64().unwrap()
    }
}

/// The `ranks` of a route reply, as numbers.
pub fn ranks_of(reply: &Value) -> Vec<u64> {
    reply["ranks"]
        .as_array()
        .unwrap_or_else(|| panic!("no ranks in {reply}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The status of every rank in a `state` reply (or `/state` body), as an array.
pub fn statuses(state: &Value) -> Value {
    state["ranks"].as_array().unwrap().iter().map(|r| r["status"].clone()).collect()
}

/// How many of `ranks` went to each of `dp` ranks.
pub fn per_rank(ranks: &[u64], dp: usize) -> Vec<u64> {
    let mut count = vec![0; dp];
    ranks.iter().for_each(|&r| count[r as usize] += 1);
    count
}

/// Sends `body` from a DEALER (after the empty delimiter) and returns the
/// decoded reply, which must be the delimiter and one payload frame.
pub fn dealer_call(s: &zmq::Socket, body: Vec<Vec<u8>>) -> Value {
    dealer_send(s, body);
    dealer_reply(s)
}

/// Sends `body` from a DEALER, after the empty delimiter.
pub fn dealer_send(s: &zmq::Socket, body: Vec<Vec<u8>>) {
    let mut frames = vec![Vec::new()];
    frames.extend(body);
    s.send_multipart(frames, 0).unwrap();
}

/// The next reply to a DEALER: the empty delimiter, then one payload frame (decoded).
pub fn dealer_reply(s: &zmq::Socket) -> Value {
    let reply = s.recv_multipart(0).expect("dpcoord did not answer the DEALER in time");
    assert_eq!(reply.len(), 2, "reply is the empty delimiter and one payload frame");
    assert!(reply[0].is_empty(), "the delimiter comes back first");
    rmp_serde::from_slice(&reply[1]).unwrap()
}

pub struct Publisher {
    sock: zmq::Socket,
}

impl Publisher {
    pub fn send(&self, update: &Value) {
        self.send_raw(&encode(update));
    }

    pub fn send_raw(&self, bytes: &[u8]) {
        self.sock.send(bytes, 0).unwrap();
    }

    /// The PUB socket, for [`publish_until`].
    pub fn socket(&self) -> &zmq::Socket {
        &self.sock
    }
}

/// Publishes `update(rank, 1, seq, counts)` on `sock` with `seq` = `*seq`,
/// `*seq + 1`, ... every 10 ms until `done()` (PUB/SUB drops what is sent
/// before the subscription is wired); leaves `*seq` the next unsent one.
pub fn publish_until(
    what: &str,
    sock: &zmq::Socket,
    rank: u32,
    seq: &mut u64,
    counts: [u64; 5],
    mut done: impl FnMut() -> bool,
) {
    eventually(what, || {
        sock.send(encode(&update(rank, 1, *seq, counts)), 0).unwrap();
        *seq += 1;
        std::thread::sleep(Duration::from_millis(10));
        done().then_some(())
    });
}

/// A JSON value as the named MessagePack map dpcoord reads.
pub fn encode(v: &Value) -> Vec<u8> {
    rmp_serde::to_vec_named(v).unwrap()
}

/// Encodes any MessagePack value, for messages JSON cannot express (NaN, binary, odd keys).
pub fn msgpack(v: &M) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// A MessagePack map from (key, value) pairs, in that order.
pub fn map(pairs: &[(&str, M)]) -> Vec<u8> {
    msgpack(&M::Map(pairs.iter().map(|(k, v)| (M::from(*k), v.clone())).collect()))
}

/// A query `{v: 1, op, id}` plus `extra`, in that order.
pub fn query(op: &str, id: impl Into<M>, extra: &[(&str, M)]) -> Vec<u8> {
    let mut pairs = vec![("v", M::from(1)), ("op", M::from(op)), ("id", id.into())];
    pairs.extend_from_slice(extra);
    map(&pairs)
}

/// A MessagePack array of integers.
pub fn ints<T: Copy + Into<M>>(xs: &[T]) -> M {
    M::Array(xs.iter().map(|&x| x.into()).collect())
}

/// A valid `StatsUpdate`.
pub fn update(rank: u32, boot: u64, seq: u64, counts: [u64; 5]) -> Value {
    Update::new(rank, boot, seq).counts(counts).value()
}

/// A `StatsUpdate` built field by field, e.g.
/// `Update::new(rank, boot, seq).counts([..]).tokens([..]).ttft(x).value()`.
/// It starts as `{v: 1, rank, boot, seq, counts: [0; 5]}`; later fields
/// follow in the order they are set, and setting a key again replaces it.
#[derive(Clone, Debug)]
pub struct Update(Vec<(&'static str, M)>);

impl Update {
    pub fn new(rank: impl Into<i64>, boot: u64, seq: u64) -> Update {
        let (rank, zeros) = (rank.into(), ints(&[0u64; 5]));
        Update(vec![
            ("v", 1.into()),
            ("rank", rank.into()),
            ("boot", boot.into()),
            ("seq", seq.into()),
            ("counts", zeros),
        ])
    }

    /// Sets `key` to `v` (in place if present, else last): any value, valid or not.
    pub fn set(mut self, key: &'static str, v: M) -> Update {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = v,
            None => self.0.push((key, v)),
        }
        self
    }

    /// Leaves `key` out.
    pub fn without(mut self, key: &str) -> Update {
        self.0.retain(|(k, _)| *k != key);
        self
    }

    /// `[waiting, running, received, finished, failed]` (any length, for bad updates).
    pub fn counts<const N: usize>(self, counts: [u64; N]) -> Update {
        self.set("counts", ints(&counts))
    }

    /// `[waiting_tokens, running_tokens]`.
    pub fn tokens(self, tokens: [u64; 2]) -> Update {
        self.set("tokens", ints(&tokens))
    }

    pub fn ttft(self, ms: f64) -> Update {
        self.set("ttft_ms", ms.into())
    }

    pub fn tpot(self, ms: f64) -> Update {
        self.set("tpot_ms", ms.into())
    }

    pub fn kv_usage(self, usage: f64) -> Update {
        self.set("kv_usage", usage.into())
    }

    /// The fields in order, to pad or reshape.
    pub fn pairs(self) -> Vec<(&'static str, M)> {
        self.0
    }

    /// The update encoded as a map, fields in order.
    pub fn bytes(&self) -> Vec<u8> {
        map(&self.0)
    }

    /// The update as the JSON value [`Publisher::send`] takes.
    pub fn value(&self) -> Value {
        rmp_serde::from_slice(&self.bytes()).expect("an update JSON can hold")
    }
}
