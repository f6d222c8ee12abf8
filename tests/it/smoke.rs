//! The binary starts, answers, and stops cleanly on SIGTERM.

use crate::common::*;
use serde_json::json;

#[test]
fn starts_answers_ping_and_exits_zero_on_sigterm() {
    let d = Daemon::start(&["--dp-size", "2"]);
    let r = d.client().call(json!({"v": 1, "op": "ping", "id": "p1"}));
    assert_eq!(
        r,
        json!({"v": 1, "ok": true, "id": "p1", "epoch": 0, "instance": d.state()["instance"], "block_size": 16})
    );
    let p = d.publisher();
    d.bring_up(&p, &[0, 1]);
    let r = d.client().call(json!({"v": 1, "op": "route", "n": 4}));
    assert_eq!(r, json!({"v": 1, "ok": true, "ranks": [0, 1, 0, 1], "epoch": 2}));
    assert_eq!(d.stop().code(), Some(0));
}
