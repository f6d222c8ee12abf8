//! [`Daemon`]: one dpcoord on private endpoints, and what tests ask of it.

use std::net::SocketAddr;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use super::{
    connected, eventually, free_addr, http, ipc, metric, publish_until, update, Client, Publisher, Spawned, FROZEN,
};

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
        self.child = Some(Spawned::from(child));
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
        Publisher::connect(&self.ctx, &self.stats)
    }

    /// A raw socket of any type connected to one of the daemon's endpoints.
    pub fn socket(&self, kind: zmq::SocketType, endpoint: &str) -> zmq::Socket {
        connected(&self.ctx, kind, endpoint)
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
    /// and per rank its rank, status, counts, boot, `routed`, `pending` and
    /// `kv_usage`.
    pub fn books(&self) -> Value {
        let s = self.state();
        let keys = ["rank", "status", "counts", "boot", "routed", "pending", "kv_usage"];
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
