//! What every phase of the soak bench shares: a dpcoord process, its
//! clients, eight engines publishing, latency quantiles.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// The longest any single wait may take.
pub const DEADLINE: Duration = Duration::from_secs(10);
pub const DP: u32 = 8;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Full,
    Smoke,
}

pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A dpcoord process on private ipc endpoints; killed when dropped.
pub struct Dpcoord {
    pub child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub route: String,
    pub health: String,
    pub stats: String,
    pub metrics: SocketAddr,
    pub args: Vec<String>,
    pub ctx: zmq::Context,
}

impl Dpcoord {
    pub fn start(args: &[&str]) -> Dpcoord {
        Dpcoord::start_on(None, args)
    }

    /// A dpcoord whose route socket is `route` (a tcp endpoint, say)
    /// instead of a private ipc one.
    pub fn start_on(route: Option<String>, args: &[&str]) -> Dpcoord {
        let dir = tempfile::tempdir().unwrap();
        let ep = |name: &str| format!("ipc://{}/{name}", dir.path().display());
        let (route, health, stats) = (route.unwrap_or_else(|| ep("route")), ep("health"), ep("stats"));
        let mut d = Dpcoord {
            child: None,
            route,
            health,
            stats,
            metrics: free_addr(),
            args: args.iter().map(|a| a.to_string()).collect(),
            dir,
            ctx: zmq::Context::new(),
        };
        d.spawn();
        d
    }

    /// Starts the process (warnings to `dpcoord.log` in its directory) and waits for `ping`.
    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("dpcoord.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
            .args(["--dp-size", &DP.to_string(), "--route-bind", &self.route, "--health-bind", &self.health])
            .args(["--stats-bind", &self.stats, "--metrics-bind", &self.metrics.to_string()])
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log.unwrap())
            .spawn()
            .expect("spawn dpcoord");
        self.child = Some(child);
        let c = self.req(&self.route, DEADLINE);
        call(&c, &json!({"v": 1, "op": "ping"})).expect("dpcoord answers ping");
    }

    /// Sends `signal` and waits for the exit; then starts a new process on the same endpoints.
    pub fn restart(&mut self, signal: &str) {
        let mut child = self.child.take().unwrap();
        let _ = Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]).status();
        let status = wait_for("dpcoord to exit", || child.try_wait().unwrap());
        assert!(signal == "KILL" || status.success(), "dpcoord exited {status} after SIG{signal}");
        self.metrics = free_addr();
        self.spawn();
    }

    pub fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// CPU time all of dpcoord's threads (its own and libzmq's) have used,
    /// from each thread's `/proc/PID/task/TID/schedstat` (nanoseconds on
    /// the CPU, first field); threads that ended are not counted.
    pub fn cpu(&self) -> Duration {
        let pid = self.child.as_ref().unwrap().id();
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
        let ns = tasks
            .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        Duration::from_nanos(ns)
    }

    /// A `/proc/PID/status` field in KiB (`VmRSS:`, `VmHWM:`), 0 if unread.
    pub fn status_kib(&self, field: &str) -> u64 {
        let pid = self.child.as_ref().unwrap().id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let kib = status.lines().find_map(|l| l.strip_prefix(field)).map(|v| v.trim().trim_end_matches("kB").trim());
        kib.and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    pub fn req(&self, ep: &str, timeout: Duration) -> zmq::Socket {
        let s = self.ctx.socket(zmq::REQ).unwrap();
        s.set_linger(0).unwrap();
        s.set_rcvtimeo(timeout.as_millis() as i32).unwrap();
        s.connect(ep).unwrap();
        s
    }

    pub fn statuses(&self) -> Vec<String> {
        let s = call(&self.req(&self.route, DEADLINE), &json!({"v": 1, "op": "state"})).expect("state");
        s["ranks"].as_array().unwrap().iter().map(|r| r["status"].as_str().unwrap_or("?").to_owned()).collect()
    }

    /// The daemon's stderr so far, in lines (warnings only: RUST_LOG=warn).
    pub fn log_lines(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("dpcoord.log")).map_or(0, |s| s.lines().count())
    }

    /// One series of `/metrics`, e.g. `dpcoord_stats_missed_total`.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let mut s = TcpStream::connect(self.metrics).ok()?;
        s.set_read_timeout(Some(DEADLINE)).ok()?;
        write!(s, "GET /metrics HTTP/1.1\r\nHost: dpcoord\r\nConnection: close\r\n\r\n").ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).ok()?;
        body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }
}

impl Drop for Dpcoord {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

pub fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub fn encode(v: &Value) -> Vec<u8> {
    rmp_serde::to_vec_named(v).unwrap()
}

/// One REQ round trip; `None` when no reply came within the socket's timeout.
pub fn call(s: &zmq::Socket, q: &Value) -> Option<Value> {
    s.send(encode(q), 0).unwrap();
    let reply = s.recv_bytes(0).ok()?;
    Some(rmp_serde::from_slice(&reply).expect("a MessagePack reply"))
}

/// Sets the flag when dropped, so helper threads end even when the bench fails.
pub struct SetOnDrop(pub Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Eight engines publishing every 50 ms from their own PUB sockets; when
/// `restart_every` is set, one engine at a time restarts (new socket, new
/// boot, seq from 1) at that period.
pub fn engines(stats: String, stop: Arc<AtomicBool>, restart_every: Option<Duration>) -> JoinHandle<u64> {
    std::thread::spawn(move || {
        let ctx = zmq::Context::new();
        let publisher = || {
            let p = ctx.socket(zmq::PUB).unwrap();
            p.set_linger(0).unwrap();
            p.connect(&stats).unwrap();
            p
        };
        let mut rng = SmallRng::seed_from_u64(1);
        let mut pubs: Vec<zmq::Socket> = (0..DP).map(|_| publisher()).collect();
        // Per rank: boot, seq, [waiting, running, received, finished, failed].
        let mut books: Vec<(u64, u64, [u64; 5])> = (0..DP).map(|_| (1, 0, [0; 5])).collect();
        let (mut last_restart, mut restarts, mut next) = (Instant::now(), 0u64, 0usize);
        while !stop.load(Ordering::Relaxed) {
            if restart_every.is_some_and(|every| last_restart.elapsed() >= every) {
                pubs[next] = publisher();
                books[next] = (books[next].0 + 1, 0, [0; 5]);
                (last_restart, restarts, next) = (Instant::now(), restarts + 1, (next + 1) % DP as usize);
            }
            for (rank, (p, (boot, seq, c))) in pubs.iter().zip(books.iter_mut()).enumerate() {
                *seq += 1;
                let done = rng.random_range(0..10);
                let failed = u64::from(rng.random_range(0..50) == 0);
                *c =
                    [rng.random_range(0..8), rng.random_range(0..16), c[2] + done + failed, c[3] + done, c[4] + failed];
                let mut u = json!({"v": 1, "rank": rank, "boot": *boot, "seq": *seq, "counts": *c});
                u["tokens"] = json!([c[0] * 500, c[1] * 800]);
                u["ttft_ms"] = json!(rng.random_range(80.0..120.0));
                let _ = p.send(encode(&u), zmq::DONTWAIT);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        restarts
    })
}

pub fn all_up(d: &Dpcoord) -> bool {
    d.statuses().iter().all(|s| s == "up")
}

/// Latencies in microseconds, kept whole for exact quantiles.
#[derive(Default)]
pub struct Latencies(pub Vec<u32>);

impl Latencies {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d.as_micros().min(u128::from(u32::MAX)) as u32);
    }

    /// The `q` quantile (nearest rank), in microseconds.
    pub fn quantile(&mut self, q: f64) -> u32 {
        if self.0.is_empty() {
            return 0;
        }
        self.0.sort_unstable();
        let i = ((q * self.0.len() as f64).ceil() as usize).clamp(1, self.0.len()) - 1;
        self.0[i]
    }
}

/// A closed-loop REQ client routing until `stop`; every query must be answered ok.
pub fn measure_routes(d: &Dpcoord, stop: &AtomicBool) -> Latencies {
    let c = d.req(&d.route, DEADLINE);
    let mut lat = Latencies::default();
    for i in 0u64.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let t = Instant::now();
        let r = call(&c, &json!({"v": 1, "op": "route", "id": i})).expect("a route query was not answered");
        lat.push(t.elapsed());
        assert_eq!(r["ok"], json!(true), "{r}");
    }
    lat
}
