//! What the parts share: child processes, /proc readings, the daemon under
//! test on private endpoints, MessagePack messages, latency summaries.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The longest any single wait may take before the bench gives up.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// A child process that is killed when dropped, so no bench leaves one behind.
pub struct Proc {
    child: Child,
}

impl Proc {
    pub fn spawn(cmd: &mut Command) -> std::io::Result<Proc> {
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).spawn().map(|child| Proc { child })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// True while the process has not exited.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// User + system CPU time the process has used so far.
    pub fn cpu(&self) -> Duration {
        cpu_time(self.pid())
    }

    /// Resident set size (VmRSS) and its peak (VmHWM), in KiB.
    pub fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Clock ticks per second of /proc/<pid>/stat times (`getconf CLK_TCK`, else 100).
fn clk_tck() -> u64 {
    static TCK: OnceLock<u64> = OnceLock::new();
    *TCK.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .filter(|&t| t > 0)
            .unwrap_or(100)
    })
}

/// utime + stime of `pid` (fields 14 and 15 of /proc/<pid>/stat).
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name may hold spaces; the fields after it start at field 3.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    Duration::from_micros(ticks * 1_000_000 / clk_tck())
}

/// `nproc` and the CPU model, for the report.
pub fn machine_line() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map_or("unknown", |m| m.trim_start_matches([' ', '\t', ':']));
    format!("machine: {cpus} CPUs, {model}; {}\ndaemon: {}", load_line(), daemon_bin())
}

/// The 1/5/15-minute load averages.
pub fn load_line() -> String {
    let avg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let parts: Vec<&str> = avg.split_whitespace().take(3).collect();
    format!("load average {}", parts.join(" "))
}

/// Waits until `f` returns `Some`, panicking after [`DEADLINE`].
pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A MessagePack writer for the few message shapes the bench sends.
pub struct Mp<'a>(pub &'a mut Vec<u8>);

impl Mp<'_> {
    pub fn map(&mut self, len: u32) -> &mut Self {
        rmp::encode::write_map_len(self.0, len).expect("writing to a Vec cannot fail");
        self
    }

    pub fn array(&mut self, len: u32) -> &mut Self {
        rmp::encode::write_array_len(self.0, len).expect("writing to a Vec cannot fail");
        self
    }

    pub fn str(&mut self, s: &str) -> &mut Self {
        rmp::encode::write_str(self.0, s).expect("writing to a Vec cannot fail");
        self
    }

    pub fn bool(&mut self, v: bool) -> &mut Self {
        rmp::encode::write_bool(self.0, v).expect("writing to a Vec cannot fail");
        self
    }

    pub fn uint(&mut self, v: u64) -> &mut Self {
        rmp::encode::write_uint(self.0, v).expect("writing to a Vec cannot fail");
        self
    }

    pub fn f64(&mut self, v: f64) -> &mut Self {
        rmp::encode::write_f64(self.0, v).expect("writing to a Vec cannot fail");
        self
    }

    pub fn nil(&mut self) -> &mut Self {
        rmp::encode::write_nil(self.0).expect("writing to a Vec cannot fail");
        self
    }
}

/// The route query every transport server gets: `{"v":1,"op":"route","id":1}`.
pub fn route_query() -> Vec<u8> {
    let mut b = Vec::new();
    Mp(&mut b).map(3).str("v").uint(1).str("op").str("route").str("id").uint(1);
    b
}

/// A valid `StatsUpdate` into `buf` (cleared first).
pub fn stats_update(buf: &mut Vec<u8>, rank: u32, seq: u64, counts: [u64; 5]) {
    buf.clear();
    let mut m = Mp(buf);
    m.map(5).str("v").uint(1).str("rank").uint(rank.into()).str("boot").uint(1).str("seq").uint(seq);
    m.str("counts").array(5);
    for c in counts {
        m.uint(c);
    }
}

/// A REQ socket whose every call is answered within [`DEADLINE`].
pub fn req_socket(ctx: &zmq::Context, endpoint: &str) -> zmq::Socket {
    let s = ctx.socket(zmq::REQ).expect("REQ socket");
    s.set_linger(0).expect("linger");
    s.set_rcvtimeo(DEADLINE.as_millis() as i32).expect("rcvtimeo");
    s.connect(endpoint).expect("connect");
    s
}

/// Sends one query and decodes the reply (None when no reply came in time).
pub fn call(s: &zmq::Socket, query: &[u8]) -> Option<Value> {
    s.send(query, 0).ok()?;
    let reply = s.recv_bytes(0).ok()?;
    rmp_serde::from_slice(&reply).ok()
}

/// The daemon binary under test: this build's, or `DPCOORD_BENCH_BIN` (to
/// compare another build against the same baselines).
pub fn daemon_bin() -> String {
    std::env::var("DPCOORD_BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dpcoord").into())
}

/// The `dpcoord` binary on private ipc:// endpoints and a free HTTP port.
pub struct Daemon {
    proc: Proc,
    /// Holds the ipc:// socket files; removed when the daemon is dropped.
    _dir: tempfile::TempDir,
    pub ctx: zmq::Context,
    pub route: String,
    pub health: String,
    pub stats: String,
    pub metrics: SocketAddr,
}

impl Daemon {
    /// Starts it with `--dp-size dp` plus `args`, stats that never go stale
    /// within a bench, and waits until it answers `ping`.
    pub fn start(dp: u32, args: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().expect("temp dir");
        let ep = |name: &str| format!("ipc://{}/{name}", dir.path().display());
        let (route, health, stats) = (ep("route"), ep("health"), ep("stats"));
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        let metrics = SocketAddr::from(([127, 0, 0, 1], port));
        let proc = Proc::spawn(
            Command::new(daemon_bin())
                .args(["--route-bind", &route, "--health-bind", &health, "--stats-bind", &stats])
                .args(["--metrics-bind", &metrics.to_string(), "--dp-size", &dp.to_string()])
                .args(["--stale-after-ms", "600000", "--down-after-ms", "1200000"])
                .args(args)
                .env("RUST_LOG", "warn"),
        )
        .expect("spawn dpcoord");
        let d = Daemon { proc, _dir: dir, ctx: zmq::Context::new(), route, health, stats, metrics };
        let ping = {
            let mut b = Vec::new();
            Mp(&mut b).map(2).str("v").uint(1).str("op").str("ping");
            b
        };
        let reply = call(&req_socket(&d.ctx, &d.route), &ping).expect("dpcoord answers ping");
        assert_eq!(reply["ok"], Value::Bool(true), "ping reply: {reply}");
        d
    }

    pub fn proc(&self) -> &Proc {
        &self.proc
    }

    /// A PUB socket in `ctx` connected to the daemon's stats endpoint.
    pub fn publisher(&self, ctx: &zmq::Context) -> zmq::Socket {
        let p = ctx.socket(zmq::PUB).expect("PUB socket");
        p.set_linger(0).expect("linger");
        p.connect(&self.stats).expect("connect stats");
        p
    }

    /// Publishes updates (seq 1, 2, ...) for every rank through `pubs`
    /// (rank r through `pubs[r % len]`) until `state` shows all of them up.
    /// Returns the next free seq.
    pub fn bring_up(&self, pubs: &[zmq::Socket], dp: u32) -> u64 {
        let client = req_socket(&self.ctx, &self.route);
        let mut state_q = Vec::new();
        Mp(&mut state_q).map(2).str("v").uint(1).str("op").str("state");
        let mut buf = Vec::new();
        let mut seq = 0;
        eventually("every rank up", || {
            seq += 1;
            for rank in 0..dp {
                // Bursts stay under a PUB's high-water mark (1000), which
                // would drop the same tail ranks every round.
                if rank > 0 && rank % 500 == 0 {
                    std::thread::sleep(Duration::from_millis(5));
                }
                stats_update(&mut buf, rank, seq, [0; 5]);
                pubs[rank as usize % pubs.len()].send(&buf[..], 0).expect("publish");
            }
            std::thread::sleep(Duration::from_millis(20));
            let state = call(&client, &state_q)?;
            let ranks = state["ranks"].as_array()?;
            ranks.iter().all(|r| r["status"] == "up").then_some(())
        });
        seq + 1
    }

    /// A sample of the Prometheus text at /metrics, e.g.
    /// `dpcoord_stats_messages_total{result="ok"}`; None when not served.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let mut s = TcpStream::connect(self.metrics).ok()?;
        s.set_read_timeout(Some(DEADLINE)).ok()?;
        write!(s, "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", self.metrics).ok()?;
        let mut raw = String::new();
        s.read_to_string(&mut raw).ok()?;
        raw.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse().ok())
    }
}

/// Latencies of many calls, in nanoseconds.
#[derive(Default)]
pub struct Latencies(Vec<u64>);

impl Latencies {
    pub fn with_capacity(n: usize) -> Latencies {
        Latencies(Vec::with_capacity(n))
    }

    pub fn push(&mut self, d: Duration) {
        self.0.push(d.as_nanos() as u64);
    }

    pub fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The `q`-quantile (0..=1) in microseconds; 0 when empty.
    pub fn quantile_us(&mut self, q: f64) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        self.0.sort_unstable();
        let i = ((self.0.len() - 1) as f64 * q).round() as usize;
        self.0[i] as f64 / 1000.0
    }
}
