//! SIGTERM and SIGINT both stop the daemon cleanly: exit status 0; signals
//! whose default would end it otherwise are logged and ignored.

use crate::common::*;
use serde_json::json;

/// A daemon that has served user and health traffic and has engines up.
fn busy_daemon() -> Daemon {
    let d = Daemon::start(&["--dp-size", "2"]);
    let p = d.publisher();
    d.bring_up(&p, &[0, 1]);
    assert_eq!(d.client().call(json!({"v": 1, "op": "route", "n": 3}))["ranks"], json!([0, 1, 0]));
    assert_eq!(d.health_client().call(json!({"v": 1, "op": "health_route"}))["rank"], json!(0));
    d
}

#[test]
fn sigterm_exits_zero() {
    let status = busy_daemon().stop_with("TERM");
    assert_eq!(status.code(), Some(0), "{status}");
}

#[test]
fn sigint_exits_zero() {
    let status = busy_daemon().stop_with("INT");
    assert_eq!(status.code(), Some(0), "{status}");
}

/// SIGUSR1, SIGUSR2 and SIGALRM would end the process by default; dpcoord
/// logs each at warn with its name and keeps serving both sockets and HTTP.
#[test]
fn other_terminating_signals_are_logged_and_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = free_addr();
    let (route, health) = (ipc(&dir, "route"), ipc(&dir, "health"));
    let args = ["--route-bind", &route, "--health-bind", &health, "--stats-bind", ""];
    let metrics_flag = metrics.to_string();
    let (child, lines) =
        spawn_with_stderr(&[&args[..], &["--metrics-bind", &metrics_flag, "--dp-size", "2"]].concat(), "warn");
    // HTTP is served inside the wait that installs the handlers first, so a
    // /healthz answer means they are in place.
    eventually("/healthz to answer", || std::net::TcpStream::connect(metrics).ok());
    assert_eq!(http(metrics, "GET", "/healthz"), (200, "ok\n".to_owned()));
    let ctx = zmq::Context::new();
    for name in ["USR1", "USR2", "ALRM"] {
        let sent = std::process::Command::new("kill").args([&format!("-{name}"), &child.id().to_string()]).status();
        assert!(sent.unwrap().success());
        let line = eventually(&format!("a warning naming SIG{name}"), || {
            let line = lines.recv_timeout(std::time::Duration::from_millis(50)).ok()?;
            line.contains(&format!("SIG{name} received; dpcoord ignores it and keeps serving")).then_some(line)
        });
        assert!(line.contains("WARN"), "{line}");
        assert_eq!(Client::connect(&ctx, &route).call(json!({"v": 1, "op": "ping"}))["ok"], json!(true));
        assert_eq!(Client::connect(&ctx, &health).call(json!({"v": 1, "op": "ping"}))["ok"], json!(true));
        assert_eq!(http(metrics, "GET", "/healthz"), (200, "ok\n".to_owned()));
    }
    assert_eq!(child.stop().code(), Some(0));
}
