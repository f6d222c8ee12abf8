//! Test harness: spawns the real `dpcoord` binary on private ipc:// endpoints
//! and talks to it with real ZeroMQ sockets (and real HTTP).
#![allow(dead_code)] // each test file uses a different part of the harness

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

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

/// Liveness and pending expiry far out, so frozen stats stay `up` and
/// placements stay pending for a whole test: only queries change state.
pub const FROZEN: [&str; 6] =
    ["--stale-after-ms", "600000", "--down-after-ms", "1200000", "--pending-ttl-ms", "3600000"];

pub struct Daemon {
    child: Option<Child>,
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
        let ep = |name: &str| format!("ipc://{}/{name}", dir.path().display());
        let (health, stats) = (ep("health"), ep("stats"));
        let route = route.map_or_else(|| ep("route"), str::to_owned);
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut d = Daemon {
            child: None,
            args: args.iter().map(|a| a.to_string()).collect(),
            ready_on_health: custom_route,
            dir,
            route,
            health,
            stats,
            metrics,
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
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn dpcoord");
        self.child = Some(child);
        let c = if self.ready_on_health { self.health_client() } else { self.client() };
        assert_eq!(c.call(json!({"v": 1, "op": "ping"}))["ok"], json!(true));
    }

    /// Stops the process with `signal` ("TERM", "KILL", ...) and starts a
    /// new one with the same flags on the same endpoints (a fresh metrics
    /// port); returns the old process's exit status.
    pub fn restart(&mut self, signal: &str) -> ExitStatus {
        let status = self.signal_and_wait(signal);
        self.metrics = format!("127.0.0.1:{}", free_port()).parse().unwrap();
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

    /// The `state` reply's rank entries.
    pub fn ranks(&self) -> Vec<Value> {
        let s = self.client().call(json!({"v": 1, "op": "state"}));
        s["ranks"].as_array().unwrap().clone()
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
        let mut child = self.child.take().unwrap();
        let _ = Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]).status();
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(start.elapsed() < DEADLINE, "dpcoord did not exit after SIG{signal}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The value of one series as `/metrics` prints it, e.g.
    /// `dpcoord_route_errors_total{code="bad_request"}`; `None` if absent.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let (status, body) = self.http_get("/metrics");
        assert_eq!(status, 200, "{body}");
        body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    /// `(routed, pending)` of every rank, from `state`.
    pub fn routed_pending(&self) -> Vec<(u64, u64)> {
        let num = |v: &Value| v.as_u64().expect("a non-negative integer");
        self.ranks().iter().map(|r| (num(&r["routed"]), num(&r["pending"]))).collect()
    }

    /// Polls `state` until `rank` shows `counts` (an update was applied); returns its entry.
    pub fn await_counts(&self, rank: u32, counts: [u64; 5]) -> Value {
        eventually(&format!("rank {rank} to show counts {counts:?}"), || {
            let r = self.ranks().swap_remove(rank as usize);
            (r["counts"] == json!(counts)).then_some(r)
        })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One HTTP/1.1 request with `Connection: close`; returns (status, body).
pub fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let mut s = eventually("http connect", || TcpStream::connect(addr).ok());
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("HTTP status line");
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
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
        self.sock.send(bytes, 0).unwrap();
        let reply = self.sock.recv_bytes(0).expect("dpcoord did not answer in time");
        rmp_serde::from_slice(&reply).expect("reply is a MessagePack map")
    }

    pub fn call(&self, query: Value) -> Value {
        self.call_raw(&rmp_serde::to_vec_named(&query).unwrap())
    }

    /// The error code of a refused query (panics if it was answered ok).
    pub fn error_code(&self, query: Value) -> String {
        let r = self.call(query);
        assert_eq!(r["ok"], json!(false), "expected an error, got {r}");
        r["error"]["code"].as_str().unwrap().to_owned()
    }
}

pub struct Publisher {
    sock: zmq::Socket,
}

impl Publisher {
    pub fn send(&self, update: &Value) {
        self.send_raw(&rmp_serde::to_vec_named(update).unwrap());
    }

    pub fn send_raw(&self, bytes: &[u8]) {
        self.sock.send(bytes, 0).unwrap();
    }
}

/// Spawns the binary with exactly `args` and `RUST_LOG=rust_log`, stdout
/// discarded; returns it and its stderr lines as they come (read on a thread).
pub fn spawn_with_stderr(args: &[&str], rust_log: &str) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(args)
        .env("RUST_LOG", rust_log)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Encodes any MessagePack value, for messages JSON cannot express (NaN, binary, odd keys).
pub fn msgpack(v: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// A valid `StatsUpdate`.
pub fn update(rank: u32, boot: u64, seq: u64, counts: [u64; 5]) -> Value {
    json!({"v": 1, "rank": rank, "boot": boot, "seq": seq, "counts": counts})
}
