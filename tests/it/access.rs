//! Peer allowlists on TCP sockets, enforced through libzmq's ZAP handler:
//! an allowed source address is served, any other is refused and counted.

use crate::common::*;
use serde_json::json;

fn scrape_denied(d: &Daemon, socket: &str) -> u64 {
    d.metric(&format!("dpcoord_access_denied_total{{socket=\"{socket}\"}}")).expect("access series") as u64
}

#[test]
fn route_allowlist_admits_listed_peers_and_refuses_others() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("dpcoord.toml");
    std::fs::write(&config, "[server]\nroute_allow = [\"127.0.0.2\"]\n").unwrap();
    let route = format!("tcp://127.0.0.1:{port}");
    let d = Daemon::start_with_route(Some(&route), &["--config", config.to_str().unwrap()]);
    let ctx = zmq::Context::new();
    // libzmq's "source;destination" form picks the client's source address.
    let allowed = Client::connect(&ctx, &format!("tcp://127.0.0.2:0;127.0.0.1:{port}"));
    assert_eq!(allowed.call(json!({"v": 1, "op": "ping", "id": 1}))["ok"], json!(true));
    assert_eq!(scrape_denied(&d, "route"), 0);

    let refused = ctx.socket(zmq::REQ).unwrap();
    refused.set_linger(0).unwrap();
    refused.connect(&route).unwrap();
    refused.send(encode(&json!({"v": 1, "op": "ping"})), 0).unwrap();
    eventually("the refused connection to be counted", || (scrape_denied(&d, "route") >= 1).then_some(()));
    // The handshake was rejected, so the query never reached dpcoord.
    assert_eq!(refused.recv_bytes(zmq::DONTWAIT), Err(zmq::Error::EAGAIN));
    assert_eq!(allowed.call(json!({"v": 1, "op": "ping", "id": 2}))["id"], json!(2));
    assert_eq!(scrape_denied(&d, "health"), 0);
}

#[test]
fn an_allowlist_on_an_ipc_socket_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "[server]\nhealth_bind = \"ipc:///tmp/x\"\nhealth_allow = [\"10.0.0.1\"]\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(["check-config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("dpcoord: error: server.health_allow: needs a tcp:// bind"), "{err}");
}
