//! A rank that hangs is taken out even while it keeps reporting, against
//! the real binary: work and no progress for `engines.stall_after_ms`, or
//! `engines.probe_failures` failed probes in a row, make it `stalled`
//! (never routed, its cause in `state`, counted); progress or a probe that
//! succeeds brings it back.

use crate::common::*;
use serde_json::{json, Value};

fn daemon(extra: &str) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stalls.toml");
    std::fs::write(&path, format!("[engines]\nstall_after_ms = 300\n{extra}")).unwrap();
    let d = Daemon::frozen("2", &["--config", path.to_str().unwrap()]);
    // The daemon has read its configuration; the file may go.
    drop(dir);
    d
}

/// Rank 0 keeps `running` 4 with `progress` at `p`; rank 1 is busy and moving.
fn report(p: &Publisher, seq: u64, progress0: u64) {
    p.send(&Update::new(0, 1, seq).counts([0, 4, 4, 0, 0]).set("progress", progress0.into()).value());
    p.send(&Update::new(1, 1, seq).counts([0, 4, 4, 0, 0]).set("progress", seq.into()).value());
}

/// Gauges and engine counters are exported at the next tick.
fn metric_is(d: &Daemon, series: &str, want: f64) {
    eventually(&format!("{series} to be {want}"), || (d.metric(series) == Some(want)).then_some(()));
}

fn rank(d: &Daemon, r: usize) -> Value {
    d.ranks()[r].clone()
}

#[test]
fn a_rank_that_reports_work_and_no_progress_is_taken_out_until_it_moves() {
    let d = daemon("");
    let p = d.publisher();
    let mut seq = 0;
    // The engine's API server keeps reporting; the engine core is wedged.
    let stalled = eventually("rank 0 stalled", || {
        seq += 1;
        report(&p, seq, 100);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let r = rank(&d, 0);
        (r["status"] == "stalled").then_some(r)
    });
    assert_eq!((&stalled["stall"], &rank(&d, 1)["status"]), (&json!("progress"), &json!("up")));
    metric_is(&d, r#"dpcoord_rank_stalls_total{cause="progress",dp_rank="0"}"#, 1.0);
    metric_is(&d, r#"dpcoord_engine_up{dp_rank="0"}"#, 0.0);
    let c = d.client();
    for i in 0..8 {
        let r = c.call(json!({"v": 1, "op": "route", "id": i}));
        assert_eq!(r["ranks"], json!([1]), "nothing goes to the stalled rank: {r}");
    }
    // Progress again, for readmit_updates (2) updates in a row.
    seq += 1;
    report(&p, seq, 101);
    seq += 1;
    report(&p, seq, 102);
    let back = eventually("rank 0 readmitted", || {
        let r = rank(&d, 0);
        (r["status"] == "up").then_some(r)
    });
    assert_eq!(back["stall"], Value::Null);
    metric_is(&d, r#"dpcoord_engine_routable_changes_total{change="readmitted",dp_rank="0"}"#, 1.0);
}

#[test]
fn progress_going_backwards_is_dropped_as_malformed() {
    let d = daemon("");
    let p = d.publisher();
    let mut seq = 0;
    eventually("rank 0 up", || {
        seq += 1;
        p.send(&Update::new(0, 1, seq).set("progress", 10.into()).value());
        (rank(&d, 0)["status"] == "up").then_some(())
    });
    let before = d.metric(r#"dpcoord_stats_messages_total{result="malformed"}"#).unwrap();
    p.send(&Update::new(0, 1, seq + 1).set("progress", 9.into()).value());
    eventually("the backwards update counted", || {
        let now = d.metric(r#"dpcoord_stats_messages_total{result="malformed"}"#)?;
        (now == before + 1.0).then_some(())
    });
    let r = d.health_client().call(json!({"v": 1, "op": "state"}));
    assert_eq!(r["ranks"][0]["status"], json!("up"));
}

#[test]
fn failed_probes_in_a_row_stall_a_rank_and_a_success_brings_it_back() {
    let d = daemon(""); // engines.probe_failures at its default, 3
    d.bring_up(&d.publisher(), &[0, 1]);
    let h = d.health_client();
    let report = |ok: bool| h.call(json!({"v": 1, "op": "health_report", "rank": 1, "ok": ok}));
    assert_eq!(report(false)["ok"], json!(true));
    report(false);
    assert_eq!(rank(&d, 1)["status"], json!("up"), "two failures");
    report(false);
    assert_eq!((&rank(&d, 1)["status"], &rank(&d, 1)["stall"]), (&json!("stalled"), &json!("probe")));
    metric_is(&d, r#"dpcoord_rank_stalls_total{cause="probe",dp_rank="1"}"#, 1.0);
    // A prober may still reach it, to find it working again.
    let r = h.call(json!({"v": 1, "op": "health_route", "rank": 1}));
    assert_eq!(r["rank"], json!(1), "{r}");
    let r = d.client().call(json!({"v": 1, "op": "route", "rank": 1}));
    assert_eq!(r["ok"], json!(false), "users cannot: {r}");
    report(true);
    assert_eq!((&rank(&d, 1)["status"], &rank(&d, 1)["stall"]), (&json!("up"), &Value::Null));
}
