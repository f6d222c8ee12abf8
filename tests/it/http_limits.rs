//! File descriptors are a budget: the real binary under a low
//! `nofile` limit raises its soft limit to the hard one, caps HTTP at a
//! quarter of it, closes the longest-silent connection to make room for a
//! new one, and closes slowloris and idle connections on their timeouts;
//! the gateway picker's TLS handshakes hold a sixteenth of it at most.
//! ZeroMQ clients and `/healthz` stay answered throughout.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

/// A dpcoord started by bash with the given `ulimit -n` hard and soft
/// limits, on private ipc endpoints, with `config` as its file.
struct Limited {
    child: Spawned,
    lines: Receiver<String>,
    route: String,
    health: String,
    metrics: SocketAddr,
    ctx: zmq::Context,
    _dir: tempfile::TempDir,
}

impl Limited {
    fn start(hard: u32, soft: u32, config: &str, rust_log: &str) -> Limited {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("dpcoord.toml");
        std::fs::write(&file, config).unwrap();
        let (route, health, stats) = (ipc(&dir, "route"), ipc(&dir, "health"), ipc(&dir, "stats"));
        let metrics = free_addr();
        let mut child = std::process::Command::new("bash")
            .args(["-c", &format!("ulimit -Sn {soft} && ulimit -Hn {hard} && exec \"$0\" \"$@\"")])
            .arg(env!("CARGO_BIN_EXE_dpcoord"))
            .args(["--config", file.to_str().unwrap(), "--route-bind", &route, "--health-bind", &health])
            .args(["--stats-bind", &stats, "--metrics-bind", &metrics.to_string(), "--dp-size", "2"])
            .env("RUST_LOG", rust_log)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let lines = lines_of(child.stderr.take().unwrap());
        let child = Spawned::from(child);
        let d = Limited { child, lines, route, health, metrics, ctx: zmq::Context::new(), _dir: dir };
        assert_eq!(d.ping(&d.route), json!(true));
        d
    }

    /// `ping` from a new REQ socket (a new connection to dpcoord).
    fn ping(&self, endpoint: &str) -> serde_json::Value {
        Client::connect(&self.ctx, endpoint).call(json!({"v": 1, "op": "ping"}))["ok"].clone()
    }

    /// The first stderr line containing `text`.
    fn logged(&self, text: &str) -> String {
        eventually(&format!("a log line with {text:?}"), || {
            let line = self.lines.recv_timeout(Duration::from_millis(50)).ok()?;
            line.contains(text).then_some(line)
        })
    }

    fn metric(&self, series: &str) -> Option<f64> {
        metric(self.metrics, series)
    }

    fn closed(&self, reason: &str) -> Option<f64> {
        self.metric(&format!("dpcoord_http_connections_closed_total{{reason=\"{reason}\"}}"))
    }
}

/// True once the server has closed `s` (end of stream or a reset); the
/// connections in these tests never get a byte they did not ask for.
fn closed_by_server(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let closed = match s.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => panic!("unexpected bytes from the server"),
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        Err(_) => true,
    };
    s.set_nonblocking(false).unwrap();
    closed
}

#[test]
fn idle_connections_past_the_cap_leave_routing_and_healthz_answered() {
    // Soft 128, hard 256: dpcoord raises the soft limit to 256, and HTTP
    // may hold a quarter of it (the default cap, 256, is above that).
    let d = Limited::start(256, 128, "", "info");
    let line = d.logged("file descriptors: ");
    assert!(line.contains("file descriptors: nofile soft limit 256 (was 128), hard limit 256"), "{line}");
    // 300 idle connections: more than the cap, and more than the whole
    // descriptor budget (they pinned every descriptor before the cap).
    let idle: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(d.metrics).unwrap()).collect();
    let closed = || idle.iter().filter(|s| closed_by_server(s)).count();
    // Past the listen backlog some are accepted late (the kernel retries
    // their handshake), so wait until all are: 64 served, 236 evicted.
    eventually("all 300 accepted", || (closed() == 236).then_some(()));
    for _ in 0..3 {
        assert_eq!(d.ping(&d.route), json!(true));
        assert_eq!(d.ping(&d.health), json!(true));
        assert_eq!(http(d.metrics, "GET", "/healthz"), (200, "ok\n".to_owned()));
    }
    // The first /healthz took the slot of the longest-silent idle one;
    // the later requests found that slot free again.
    assert_eq!(d.metric("dpcoord_http_connections_max"), Some(64.0));
    assert_eq!(d.metric("dpcoord_http_connections"), Some(64.0), "63 idle ones and this scrape");
    assert_eq!(d.closed("evicted"), Some(237.0));
    assert_eq!(d.closed("refused"), Some(0.0));
    assert_eq!(closed(), 237);
    assert_eq!(d.child.stop().code(), Some(0));
}

/// ZeroMQ peers are on the budget too: under `nofile` 256 the route
/// socket holds at most a fifth of it (51), whatever `route_max_peers`
/// says (1024 here, and a warning says so), so 100 connections from one
/// process leave descriptors for the health socket and `/healthz`.
#[test]
fn zeromq_peers_hold_their_share_of_descriptors() {
    let d = Limited::start(256, 256, "", "info");
    let line = d.logged("route_max_peers 1024 is above");
    assert!(line.contains("it holds at most 51 peers"), "{line}");
    let route_peers = || d.metric(r#"dpcoord_peers_connected{socket="route"}"#);
    eventually("the start-up client gone", || (route_peers() == Some(0.0)).then_some(()));
    let peers: Vec<zmq::Socket> = (0..100)
        .map(|i| {
            let s = d.ctx.socket(zmq::DEALER).unwrap();
            s.set_linger(0).unwrap();
            s.set_reconnect_ivl(-1).unwrap();
            s.connect(&d.route).unwrap();
            dealer_send(&s, vec![query("ping", i, &[])]);
            s
        })
        .collect();
    let mut answered = [false; 100];
    let refused = || d.metric(r#"dpcoord_peers_refused_total{reason="socket_full",socket="route"}"#);
    let held = eventually("the connections settled", || {
        for (s, seen) in peers.iter().zip(answered.iter_mut()) {
            *seen |= s.recv_multipart(zmq::DONTWAIT).is_ok();
        }
        let n = answered.iter().filter(|&&a| a).count();
        let settled = route_peers() == Some(n as f64) && refused() >= Some((100 - n) as f64);
        settled.then_some(n)
    });
    assert!(held <= 51, "{held} route peers held, over a fifth of nofile 256");
    assert_eq!(d.ping(&d.health), json!(true));
    assert_eq!(http(d.metrics, "GET", "/healthz"), (200, "ok\n".to_owned()));
    drop(peers);
    assert_eq!(d.child.stop().code(), Some(0));
}

/// The picker's TLS handshakes are on the budget too: under `nofile` 256,
/// 300 connections that never say hello hold at most a sixteenth of the
/// descriptors (the rest closed at once), and ZeroMQ clients and
/// `/healthz` are answered meanwhile.
#[test]
fn silent_picker_connections_hold_a_fronts_share_of_descriptors() {
    let epp = free_addr();
    let config = format!("[server]\nepp_bind = \"{epp}\"\n[gateway]\nendpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\n");
    let d = Limited::start(256, 256, &config, "warn");
    let started = Instant::now();
    let silent: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(epp).unwrap()).collect();
    let line = d.logged("too many TLS handshakes in flight");
    assert!(line.contains("error=16"), "a sixteenth of nofile 256: {line}");
    let closed = eventually("all but the share closed", || {
        let n = silent.iter().filter(|s| closed_by_server(s)).count();
        (n >= 300 - 16).then_some(n)
    });
    // At once, not at the 5 s handshake deadline.
    assert!(started.elapsed() < Duration::from_secs(4), "closed only after {:?}", started.elapsed());
    assert!(closed >= 284, "{closed}");
    assert_eq!(d.ping(&d.route), json!(true));
    assert_eq!(d.ping(&d.health), json!(true));
    assert_eq!(http(d.metrics, "GET", "/healthz"), (200, "ok\n".to_owned()));
    drop(silent);
    assert_eq!(d.child.stop().code(), Some(0));
}

/// Reads one response with a `content-length` body; (status, body).
fn response(s: &mut TcpStream) -> (u16, String) {
    let mut raw = Vec::new();
    let mut b = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut b).unwrap(), 1, "connection closed mid-response");
        raw.push(b[0]);
    }
    let head = String::from_utf8(raw).unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(|v| v.trim().parse().unwrap()))
        .expect("content-length");
    let mut body = vec![0u8; length];
    s.read_exact(&mut body).unwrap();
    (head.split(' ').nth(1).unwrap().parse().unwrap(), String::from_utf8(body).unwrap())
}

/// Waits until the server closes `s`; how long that took from `since`.
fn closed_after(s: &mut TcpStream, since: Instant) -> Duration {
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => {}
        Ok(_) => panic!("unexpected bytes from the server"),
        Err(e) => assert_ne!(e.kind(), ErrorKind::WouldBlock, "not closed within {DEADLINE:?}"),
    }
    since.elapsed()
}

#[test]
fn slowloris_and_idle_connections_are_closed_by_their_timeouts() {
    let config = "[server]\nhttp_header_timeout_ms = 400\nhttp_idle_timeout_ms = 800\n";
    let d = Limited::start(1024, 1024, config, "warn");
    let header = Duration::from_millis(400);
    let idle = Duration::from_millis(800);

    // Slowloris: a head that never ends, one header line every 100 ms.
    let mut slow = TcpStream::connect(d.metrics).unwrap();
    let started = Instant::now();
    slow.write_all(b"GET /healthz HTTP/1.1\r\n").unwrap();
    let closed_at = loop {
        std::thread::sleep(Duration::from_millis(100));
        if slow.write_all(b"X-Slow: 1\r\n").is_err() || closed_by_server(&slow) {
            break started.elapsed();
        }
        assert!(started.elapsed() < DEADLINE, "slowloris connection still open");
    };
    assert!(closed_at >= header, "closed after {closed_at:?}, before the header timeout");
    assert_eq!(d.closed("header_timeout"), Some(1.0));

    // Keep-alive within the idle timeout is served; then silence closes it.
    // (Each `since` is taken before the server can have seen the bytes.)
    let mut kept = TcpStream::connect(d.metrics).unwrap();
    kept.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut sent = Instant::now();
    for i in 0..2 {
        if i > 0 {
            std::thread::sleep(idle / 2);
        }
        sent = Instant::now();
        kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(response(&mut kept), (200, "ok\n".to_owned()));
    }
    let after = closed_after(&mut kept, sent);
    assert!(after >= idle, "closed {after:?} after the last request");

    // A connection that never sends a byte is idle from the start.
    let opened = Instant::now();
    let mut silent = TcpStream::connect(d.metrics).unwrap();
    let after = closed_after(&mut silent, opened);
    assert!(after >= idle, "closed {after:?} after it was opened");
    assert_eq!(d.closed("idle_timeout"), Some(2.0));
    assert_eq!(d.closed("header_timeout"), Some(1.0));
    assert_eq!(d.closed("evicted"), Some(0.0));
    assert_eq!(d.child.stop().code(), Some(0));
}

#[test]
fn http_limit_keys_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("http_header_timeout_ms = 5", "server.http_header_timeout_ms: must be between 10 and 600000, got 5"),
        ("http_idle_timeout_ms = 0", "server.http_idle_timeout_ms: must be between 10 and 3600000, got 0"),
        ("http_max_connections = 0", "server.http_max_connections: must be between 1 and 1048576, got 0"),
    ];
    for (line, why) in cases {
        let file = dir.path().join("c.toml");
        std::fs::write(&file, format!("[server]\n{line}\n")).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dpcoord"))
            .args(["check-config", file.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!((out.status.code(), err.trim_end()), (Some(2), format!("dpcoord: error: {why}").as_str()));
    }
}
