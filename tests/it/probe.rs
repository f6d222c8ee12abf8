//! `dpcoord probe` against the real binary: a live daemon's /healthz and
//! /readyz, a closed port, a listener that never answers, a bad URL.

use std::net::TcpListener;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::{eventually, free_port, Daemon};

/// Runs `dpcoord probe ARGS` without `DPCOORD_HEALTH_URL` from the test's environment.
fn probe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .arg("probe")
        .args(args)
        .env_remove("DPCOORD_HEALTH_URL")
        .output()
        .expect("run dpcoord probe")
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("an exit code")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn healthz_of_a_live_daemon_is_0() {
    let d = Daemon::start(&[]);
    let out = probe(&["--url", &format!("http://{}/healthz", d.metrics)]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains(": 200"));
}

#[test]
fn the_url_can_come_from_the_environment() {
    let d = Daemon::start(&[]);
    let status = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .arg("probe")
        .env("DPCOORD_HEALTH_URL", format!("http://{}/healthz", d.metrics))
        .output()
        .expect("run dpcoord probe")
        .status;
    assert!(status.success());
}

#[test]
fn readyz_is_1_until_an_engine_publishes_then_0() {
    let d = Daemon::start(&["--dp-size", "2"]);
    let url = format!("http://{}/healthz", d.metrics);
    let out = probe(&["--url", &url, "--ready"]);
    assert_eq!(code(&out), 1);
    let err = stderr(&out);
    assert!(err.contains("/readyz: HTTP 503: not ready"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    d.bring_up(&d.publisher(), &[0]);
    // /readyz reads the snapshot published at the next tick.
    eventually("probe --ready to pass", || (code(&probe(&["--url", &url, "--ready"])) == 0).then_some(()));
}

#[test]
fn a_closed_port_is_1() {
    let out = probe(&["--url", &format!("http://127.0.0.1:{}/healthz", free_port())]);
    assert_eq!(code(&out), 1);
    assert!(stderr(&out).contains("connection refused"), "{}", stderr(&out));
}

#[test]
fn a_listener_that_never_answers_is_1_within_the_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // Accept and hold the connection open without a word.
    let holder =
        std::thread::spawn(move || listener.accept().map(|(_conn, _)| std::thread::sleep(Duration::from_secs(5))));
    let start = Instant::now();
    let out = probe(&["--url", &format!("http://{addr}/healthz"), "--timeout-ms", "300"]);
    let took = start.elapsed();
    assert_eq!(code(&out), 1);
    assert!(stderr(&out).contains("timed out after 300 ms"), "{}", stderr(&out));
    assert!(took < Duration::from_secs(2), "took {took:?}");
    drop(holder);
}

#[test]
fn a_malformed_url_is_2() {
    for bad in ["localhost:9570/healthz", "http://127.0.0.1/healthz", "https://127.0.0.1:9570/healthz", "http://h:1"] {
        let out = probe(&["--url", bad]);
        assert_eq!(code(&out), 2, "{bad}");
        assert!(stderr(&out).starts_with("dpcoord: error: --url: "), "{}", stderr(&out));
    }
}
