//! SIGTERM and SIGINT both stop the daemon cleanly: exit status 0.
mod common;

use common::*;
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
