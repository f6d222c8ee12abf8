//! Transport: one load generator (concurrent REQ clients, fixed duration)
//! against three servers in the same run, all sent the same query bytes:
//!
//! * `echo`: a bare libzmq ROUTER answering a fixed reply, the transport's
//!   limit (this binary re-executed with `--echo-server`);
//! * `dpcoord`: the daemon, 8 ranks up, round_robin, answering route queries;
//! * `python`: `python_peer.py`, a pyzmq + msgpack routing loop modeled on
//!   today's Python DP controllers.
//!
//! Server CPU is utime + stime of the server process over the measured
//! window, from /proc/<pid>/stat.

use std::process::{Command, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::report::{num, rate, ratio, Report, Table};
use crate::support::{call, req_socket, route_query, Daemon, Latencies, Mp, Proc, DEADLINE};
use crate::Mode;

/// An idle echo server exits after this long, so an orphan cannot linger.
const IDLE_EXIT_MS: i32 = 30_000;
/// Frames kept of one request (a REQ peer sends identity, delimiter, payload).
const MAX_FRAMES: usize = 8;
const DP: u32 = 8;

/// The echo's fixed reply, shaped like dpcoord's answer to the route query.
fn fixed_reply() -> Vec<u8> {
    let mut b = Vec::new();
    Mp(&mut b).map(5).str("v").uint(1).str("ok").bool(true).str("id").uint(1);
    Mp(&mut b).str("ranks").array(1).uint(0).str("epoch").uint(1);
    b
}

/// The bare ROUTER echo: every request is answered with [`fixed_reply`]
/// along its envelope. Runs until idle for `IDLE_EXIT_MS` (or killed).
pub fn echo_server(endpoint: &str) {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::ROUTER).expect("ROUTER socket");
    s.set_linger(0).expect("linger");
    s.set_rcvtimeo(IDLE_EXIT_MS).expect("rcvtimeo");
    s.bind(endpoint).expect("bind the echo endpoint");
    let reply = fixed_reply();
    let mut frames: Vec<zmq::Message> = (0..MAX_FRAMES).map(|_| zmq::Message::new()).collect();
    loop {
        let mut n = 0;
        loop {
            if s.recv(&mut frames[n], 0).is_err() {
                return; // idle: the bench is gone
            }
            let more = frames[n].get_more();
            n += 1;
            if !more || n == MAX_FRAMES {
                break;
            }
        }
        for f in &frames[..n - 1] {
            let _ = s.send(&f[..], zmq::SNDMORE | zmq::DONTWAIT);
        }
        let _ = s.send(&reply[..], zmq::DONTWAIT);
    }
}

/// A server under load: its endpoint and the process whose CPU is counted.
struct Server {
    name: &'static str,
    endpoint: String,
    /// The echo or Python process (dpcoord's lives in `daemon`).
    proc: Option<Proc>,
    daemon: Option<Daemon>,
}

impl Server {
    fn process(&self) -> &Proc {
        match (&self.proc, &self.daemon) {
            (Some(p), _) => p,
            (None, Some(d)) => d.proc(),
            (None, None) => unreachable!("every server has a process"),
        }
    }
}

/// Waits until `endpoint` answers the route query with `ok: true`; false
/// when the process exits first (e.g. Python without pyzmq).
fn answers(ctx: &zmq::Context, endpoint: &str, proc: &mut Proc) -> bool {
    let start = Instant::now();
    while start.elapsed() < DEADLINE {
        if !proc.running() {
            return false;
        }
        let s = req_socket(ctx, endpoint);
        s.set_rcvtimeo(200).expect("rcvtimeo");
        if let Some(reply) = call(&s, &route_query()) {
            assert_eq!(reply["ok"], Value::Bool(true), "{endpoint} answered {reply}");
            return true;
        }
    }
    false
}

fn start_echo(ctx: &zmq::Context, dir: &std::path::Path) -> Server {
    let endpoint = format!("ipc://{}/echo", dir.display());
    let exe = std::env::current_exe().expect("the bench's own path");
    let mut proc = Proc::spawn(Command::new(exe).args(["--echo-server", &endpoint])).expect("spawn the echo");
    assert!(answers(ctx, &endpoint, &mut proc), "the echo server did not answer");
    Server { name: "echo", endpoint, proc: Some(proc), daemon: None }
}

fn start_dpcoord() -> Server {
    let d = Daemon::start(DP, &["--policy", "round_robin"]);
    d.bring_up(&[d.publisher(&d.ctx)], DP);
    Server { name: "dpcoord", endpoint: d.route.clone(), proc: None, daemon: Some(d) }
}

/// The Python interpreter for the peer: `$DPCOORD_PYTHON`, else the project
/// virtualenv's (`.venv`, which `bash .ci/test` makes with pyzmq and
/// msgpack), else `python3`.
fn python() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("DPCOORD_PYTHON") {
        return p.into();
    }
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if venv.exists() {
        venv
    } else {
        "python3".into()
    }
}

/// The Python peer, or None (with the reason printed) when python3, pyzmq
/// or msgpack is missing.
fn start_python(ctx: &zmq::Context, dir: &std::path::Path) -> Option<Server> {
    let endpoint = format!("ipc://{}/python", dir.display());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/python_peer.py");
    let python = python();
    let spawned = Proc::spawn(Command::new(&python).args([script, &endpoint, &DP.to_string()]).stderr(Stdio::null()));
    if let Ok(mut proc) = spawned {
        if answers(ctx, &endpoint, &mut proc) {
            return Some(Server { name: "python", endpoint, proc: Some(proc), daemon: None });
        }
    }
    println!(
        "  (python peer skipped: {} has no pyzmq and msgpack; `bash .ci/test` makes .venv with them, or set DPCOORD_PYTHON)",
        python.display()
    );
    None
}

/// What one server did under load.
#[derive(Default)]
pub struct Measured {
    queries: u64,
    secs: f64,
    cpu: Duration,
    pub failures: u64,
    pub lat: Latencies,
}

impl Measured {
    pub fn qps(&self) -> f64 {
        self.queries as f64 / self.secs.max(1e-9)
    }

    /// A row of a route-latency table: `what`, q/s, p50, p99, max, p99
    /// against `quiet_p99`, failures, then `last`; returns the p99.
    pub fn latency_row(&mut self, t: &mut Table, what: String, quiet_p99: f64, last: String) -> f64 {
        let p99 = self.lat.quantile_us(0.99);
        t.row(vec![
            what,
            rate(self.qps()),
            num(self.lat.quantile_us(0.5), 1),
            num(p99, 1),
            num(self.lat.quantile_us(1.0), 1),
            ratio(p99, quiet_p99),
            self.failures.to_string(),
            last,
        ]);
        p99
    }

    fn cpu_us_per_query(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / (self.queries.max(1) as f64)
    }

    fn add(&mut self, other: Measured) {
        self.queries += other.queries;
        self.secs += other.secs;
        self.cpu += other.cpu;
        self.failures += other.failures;
        self.lat.extend(other.lat);
    }
}

/// One client: warm up, wait for the others, then query until `dur` is up.
fn client(ctx: &zmq::Context, endpoint: &str, start: &Barrier, dur: Duration) -> (Latencies, u64) {
    let s = req_socket(ctx, endpoint);
    s.set_rcvtimeo(2000).expect("rcvtimeo");
    let query = route_query();
    let mut reply = zmq::Message::new();
    for _ in 0..50 {
        if s.send(&query[..], 0).is_err() || s.recv(&mut reply, 0).is_err() {
            start.wait();
            return (Latencies::default(), 1);
        }
    }
    let mut lat = Latencies::with_capacity(1 << 16);
    start.wait();
    let end = Instant::now() + dur;
    loop {
        let t = Instant::now();
        if t >= end {
            return (lat, 0);
        }
        // A lost reply leaves a REQ socket stuck: count it and stop this client.
        if s.send(&query[..], 0).is_err() || s.recv(&mut reply, 0).is_err() || reply.is_empty() {
            return (lat, 1);
        }
        lat.push(t.elapsed());
    }
}

/// Runs `clients` concurrent REQ clients against `server` for `dur`.
pub fn load(ctx: &zmq::Context, endpoint: &str, proc: &Proc, clients: usize, dur: Duration) -> Measured {
    let start = Barrier::new(clients + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients).map(|_| scope.spawn(|| client(ctx, endpoint, &start, dur))).collect();
        start.wait();
        let (t0, cpu0) = (Instant::now(), proc.cpu());
        let mut m = Measured::default();
        for h in handles {
            let (lat, failed) = h.join().expect("client thread");
            m.queries += lat.len() as u64;
            m.failures += failed;
            m.lat.extend(lat);
        }
        m.secs = t0.elapsed().as_secs_f64();
        m.cpu = proc.cpu().saturating_sub(cpu0);
        m
    })
}

/// Prints one row per server, with ratios against the echo (the first).
fn print_table(title: String, servers: &[Server], results: &mut [Measured]) {
    let header = ["server", "queries/s", "p50 us", "p99 us", "CPU us/query", "failed", "q/s vs echo", "CPU vs echo"];
    let mut t = Table::new(title, &header);
    let (echo_qps, echo_cpu) = (results[0].qps(), results[0].cpu_us_per_query());
    for (s, m) in servers.iter().zip(results) {
        let (qps, cpu) = (m.qps(), m.cpu_us_per_query());
        t.row(vec![
            s.name.into(),
            rate(qps),
            num(m.lat.quantile_us(0.5), 1),
            num(m.lat.quantile_us(0.99), 1),
            num(cpu, 2),
            m.failures.to_string(),
            ratio(qps, echo_qps),
            ratio(cpu, echo_cpu),
        ]);
    }
    t.print();
}

pub fn run(mode: Mode, report: &mut Report) {
    let (clients, dur, rounds) = match mode {
        Mode::Full => (8, Duration::from_secs(2), 4),
        Mode::Smoke => (2, Duration::from_millis(50), 1),
    };
    let ctx = zmq::Context::new();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut servers = vec![start_echo(&ctx, dir.path()), start_dpcoord()];
    servers.extend(start_python(&ctx, dir.path()));
    let mut results: Vec<Measured> = servers.iter().map(|_| Measured::default()).collect();
    // Alternate the order between rounds so drift in machine load evens out.
    for round in 0..rounds {
        let order: Vec<usize> =
            if round % 2 == 0 { (0..servers.len()).collect() } else { (0..servers.len()).rev().collect() };
        for i in order {
            let s = &servers[i];
            results[i].add(load(&ctx, &s.endpoint, s.process(), clients, dur));
        }
    }
    let title = format!(
        "transport: {clients} REQ clients, {rounds} round(s) of {:.2} s per server (order alternating), same query bytes, ipc://",
        dur.as_secs_f64()
    );
    print_table(title, &servers, &mut results);

    let (echo_qps, echo_cpu) = (results[0].qps(), results[0].cpu_us_per_query());
    let (qps, cpu) = (results[1].qps(), results[1].cpu_us_per_query());
    report.target("transport: dpcoord q/s vs echo", ">= 0.90x", ratio(qps, echo_qps), qps >= 0.9 * echo_qps);
    report.target("transport: dpcoord CPU/query vs echo", "<= 1.15x", ratio(cpu, echo_cpu), cpu <= 1.15 * echo_cpu);
    if let Some(py) = results.get(2) {
        let (py_qps, py_cpu) = (py.qps(), py.cpu_us_per_query());
        report.target("transport: dpcoord q/s vs python", "> 1x", ratio(qps, py_qps), qps > py_qps);
        report.target("transport: dpcoord CPU/query vs python", "< 1x", ratio(cpu, py_cpu), cpu < py_cpu);
    }
    let failed: u64 = results.iter().map(|m| m.failures).sum();
    report.target("transport: every query answered", "0 failed", failed.to_string(), failed == 0);
}
