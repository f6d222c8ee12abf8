//! What a health result may move, against the real binary: a failed
//! `health_report` raises that rank's penalty on the next tick, which moves
//! `least_load` placements and nothing else (liveness, epoch, `routed`,
//! `pending` and the round-robin rotation stay as they were).

use crate::common::*;
use serde_json::{json, Value};

fn daemon(policy: &str) -> (Daemon, Client, Client) {
    let mut args = vec!["--policy", policy, "--dp-size", "2", "--tick-ms", "20"];
    args.extend_from_slice(&FROZEN);
    let d = Daemon::start(&args);
    d.bring_up(&d.publisher(), &[0, 1]);
    let (user, health) = (d.client(), d.health_client());
    (d, user, health)
}

/// Reports a failed probe of rank 0 and waits for the tick that turns it into a penalty.
fn fail_rank_0(d: &Daemon, health: &Client) -> Value {
    let before = d.state();
    let reply = health.call(json!({"v": 1, "op": "health_report", "rank": 0, "ok": false}));
    assert_eq!(reply, json!({"v": 1, "ok": true}));
    eventually("rank 0 penalized", || (d.ranks()[0]["penalty"].as_f64() > Some(0.0)).then_some(()));
    before
}

fn route3(c: &Client) -> Vec<u64> {
    (0..3).flat_map(|_| c.route(json!({"v": 1, "op": "route"}))).collect()
}

#[test]
fn a_failed_report_moves_least_load_placements_and_nothing_else() {
    let (d, user, health) = daemon("least_load");
    let before = fail_rank_0(&d, &health);
    let after = d.state();
    assert_eq!(after["epoch"], before["epoch"]);
    for (b, a) in before["ranks"].as_array().unwrap().iter().zip(after["ranks"].as_array().unwrap()) {
        assert_eq!((&a["status"], &a["routed"], &a["pending"]), (&b["status"], &b["routed"], &b["pending"]));
    }
    // Idle rank 0 costs 1 + penalty (decaying, within (1, 2]) against rank 1's 1:
    // rank 1 first, then rank 0 (rank 1 now costs 5), then rank 1 again.
    // Without the report the cursor would start at rank 0: [0, 1, 0].
    assert_eq!(route3(&user), [1, 0, 1]);
}

#[test]
fn round_robin_ignores_health_results() {
    let (d, user, health) = daemon("round_robin");
    fail_rank_0(&d, &health);
    assert_eq!(route3(&user), [0, 1, 0]);
}
