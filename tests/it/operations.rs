//! Operations without restarts, against the real binary: `resize` up and
//! down under routing from several frontends, and `reload` (SIGHUP and the
//! op) changing the policy and a weight under load, or changing nothing;
//! a resize that holds across reloads until the file's `dp_size` changes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::common::*;
use serde_json::{json, Value};

/// One route answer: its epoch and ranks.
type Answer = (u64, Vec<u64>);

/// Routes until `stop`, recording every answer.
fn frontend(c: Client, stop: &AtomicBool, seen: &Mutex<Vec<Answer>>) {
    while !stop.load(Ordering::Relaxed) {
        let r = c.call(json!({"v": 1, "op": "route"}));
        assert_eq!(r["ok"], json!(true), "{r}");
        seen.lock().unwrap().push((r["epoch"].as_u64().unwrap(), ranks_of(&r)));
    }
}

fn resize(health: &Client, dp: u32) -> u64 {
    let r = health.call(json!({"v": 1, "op": "resize", "dp_size": dp}));
    assert_eq!((r["ok"].clone(), r["dp_size"].clone()), (json!(true), json!(dp)), "{r}");
    r["epoch"].as_u64().unwrap()
}

#[test]
fn resize_up_and_down_under_three_frontends_moves_the_epoch_once_each() {
    let d = Daemon::frozen("4", &["--max-dp-size", "6"]);
    d.bring_up(&d.publisher(), &[0, 1, 2, 3]);
    let (p, health) = (d.publisher(), d.health_client());
    let e0 = d.state()["epoch"].as_u64().unwrap();
    let (stop, seen) = (AtomicBool::new(false), Mutex::new(Vec::new()));
    let clients: Vec<Client> = (0..3).map(|_| d.client()).collect();
    let count = |pred: &dyn Fn(&Answer) -> bool| seen.lock().unwrap().iter().filter(|a| pred(a)).count();
    std::thread::scope(|s| {
        let _stop = SetOnDrop(&stop);
        for c in clients {
            s.spawn(|| frontend(c, &stop, &seen));
        }
        assert_eq!(resize(&health, 6), e0 + 1);
        assert_eq!(d.metric("dpcoord_dp_size"), Some(6.0));
        // The new ranks are unknown until they publish; then they take placements.
        d.bring_up(&p, &[4, 5]);
        eventually("placements on rank 5", || (count(&|(_, r)| r.contains(&5)) > 0).then_some(()));
        let shrunk = resize(&health, 2);
        assert_eq!(shrunk, e0 + 4, "one step per resize, one per rank that came up");
        eventually("answers after the shrink", || (count(&|(e, _)| *e >= shrunk) >= 50).then_some(()));
        assert_eq!(d.metric(r#"dpcoord_engine_up{dp_rank="3"}"#), None, "rank 3's series are gone");
        // Gauges are exported on the tick.
        eventually("rank 1 exported up", || (d.metric(r#"dpcoord_engine_up{dp_rank="1"}"#) == Some(1.0)).then_some(()));
        // Growing back: ranks 2 and 3 are unknown again (they must publish to return).
        assert_eq!(resize(&health, 4), shrunk + 1);
        assert_eq!(d.metric(r#"dpcoord_engine_up{dp_rank="3"}"#), Some(0.0));
        eventually("answers after the regrowth", || (count(&|(e, _)| *e > shrunk) >= 50).then_some(()));
    });
    let seen = seen.into_inner().unwrap();
    let late: Vec<&Answer> = seen.iter().filter(|(e, _)| *e >= e0 + 4).collect();
    assert!(late.len() >= 100);
    assert!(late.iter().all(|(_, r)| r.iter().all(|&rank| rank < 2)), "a placement on a removed rank: {late:?}");
    let pin = d.client().call(json!({"v": 1, "op": "route", "rank": 3}));
    assert_eq!(pin["error"]["code"], "rank_unavailable", "{pin}");
    assert_eq!(d.ranks().len(), 4);
}

fn write(path: &std::path::Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

/// Sends SIGHUP and waits until `dpcoord_config_reloads_total{result}` reaches `n`.
fn hup(d: &Daemon, result: &str, n: f64) {
    let status = std::process::Command::new("kill").args(["-HUP", &d.pid().to_string()]).status().unwrap();
    assert!(status.success());
    let series = format!(r#"dpcoord_config_reloads_total{{result="{result}"}}"#);
    eventually(&format!("{series} = {n}"), || (d.metric(&series) == Some(n)).then_some(()));
}

fn route1(c: &Client) -> Vec<u64> {
    c.route(json!({"v": 1, "op": "route"}))
}

#[test]
fn reload_changes_policy_and_weight_under_load_and_a_bad_file_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dpcoord.toml");
    // Room for the reload to 4 ranks at the end; later files leave the key out.
    write(&file, "[engines]\ndp_size = 3\nmax_dp_size = 4\n[routing]\npolicy = \"round_robin\"\n");
    let file_arg = file.to_str().unwrap();
    let mut args = vec!["--config", file_arg];
    args.extend_from_slice(&FROZEN);
    let d = Daemon::start(&args);
    d.bring_up(&d.publisher(), &[0, 1, 2]);
    let (user, health, load) = (d.client(), d.health_client(), d.client());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let _stop = SetOnDrop(&stop);
        // Load: pins to rank 2 the whole time (they leave the cursor alone).
        let stop = &stop;
        s.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                assert_eq!(load.route(json!({"v": 1, "op": "route", "rank": 2})), [2]);
            }
        });
        eventually("load on rank 2", || (d.routed()[2] > 0).then_some(()));
        assert_eq!(user.route(json!({"v": 1, "op": "route", "rank": 0, "n": 3})), [0, 0, 0]);
        assert_eq!(route1(&user), [0], "round robin from the cursor");
        write(&file, "[engines]\ndp_size = 3\n[routing]\npolicy = \"least_load\"\n");
        hup(&d, "ok", 1.0);
        assert_eq!(d.state()["policy"], "least_load");
        assert_eq!(route1(&user), [1], "least_load: rank 0 holds 4 pending, rank 2 the load");
        write(&file, "[engines]\ndp_size = 3\n[routing]\npolicy = \"least_load\"\nweight_pending = 0\n");
        hup(&d, "ok", 2.0);
        // Pending weighs nothing now: every rank costs 1 and the scan starts
        // at the cursor (rank 2); with weight 4 rank 1 would win again.
        assert_eq!(route1(&user), [2]);
        write(&file, "[routing]\npolicy = \"fastest\"\n");
        hup(&d, "invalid", 1.0);
        let r = health.call(json!({"v": 1, "op": "reload", "id": 7}));
        assert_eq!((r["error"]["code"].clone(), r["id"].clone()), (json!("invalid_config"), json!(7)), "{r}");
        assert!(r["error"]["message"].as_str().unwrap().starts_with("routing.policy: unknown policy"), "{r}");
        assert_eq!((d.state()["policy"].clone(), d.ranks().len()), (json!("least_load"), 3));
        assert_eq!(route1(&user), [0], "weight 0 still: the scan starts at the cursor (rank 0)");
        write(&file, "[server]\nlog_format = \"json\"\n[engines]\ndp_size = 3\n");
        let r = health.call(json!({"v": 1, "op": "reload"}));
        assert_eq!(r["error"]["message"], "server.log_format: cannot change without a restart; nothing changed");
        assert_eq!(d.metric(r#"dpcoord_config_reloads_total{result="restart_required"}"#), Some(1.0));
        // The size limits libzmq enforces on the sockets are set when they open.
        write(&file, "[engines]\ndp_size = 3\n[limits]\nmax_message_bytes = 1048576\n");
        let r = health.call(json!({"v": 1, "op": "reload"}));
        assert_eq!(r["error"]["message"], "limits.max_message_bytes: cannot change without a restart; nothing changed");
        write(&file, "[engines]\ndp_size = 3\n[kv_events]\nmax_batch_bytes = 1048576\n");
        let r = health.call(json!({"v": 1, "op": "reload"}));
        assert_eq!(
            r["error"]["message"],
            "kv_events.max_batch_bytes: cannot change without a restart; nothing changed"
        );
        assert_eq!(d.metric(r#"dpcoord_config_reloads_total{result="restart_required"}"#), Some(3.0));
        write(&file, "[engines]\ndp_size = 4\n");
        let r: Value = health.call(json!({"v": 1, "op": "reload"}));
        assert_eq!((r["ok"].clone(), r["dp_size"].clone()), (json!(true), json!(4)), "{r}");
        assert_eq!((d.state()["policy"].clone(), d.ranks().len()), (json!("round_robin"), 4));
    });
    // Counts survive every reload: what was placed is still there.
    assert_eq!(&d.routed()[..2], [5, 1]);
}

#[test]
fn a_reloaded_allowlist_applies_to_new_connections() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dpcoord.toml");
    write(&file, "");
    let route = format!("tcp://127.0.0.1:{port}");
    let d = Daemon::start_with_route(Some(&route), &["--config", file.to_str().unwrap()]);
    let ctx = zmq::Context::new();
    let before = Client::connect(&ctx, &route);
    assert_eq!(before.call(json!({"v": 1, "op": "ping"}))["ok"], json!(true));
    write(&file, "[server]\nroute_allow = [\"127.0.0.2\"]\n");
    assert_eq!(d.health_client().call(json!({"v": 1, "op": "reload"}))["ok"], json!(true));
    let refused = ctx.socket(zmq::REQ).unwrap();
    refused.set_linger(0).unwrap();
    refused.connect(&route).unwrap();
    refused.send(encode(&json!({"v": 1, "op": "ping"})), 0).unwrap();
    let denied = r#"dpcoord_access_denied_total{socket="route"}"#;
    eventually("the refused connection to be counted", || (d.metric(denied) >= Some(1.0)).then_some(()));
    assert_eq!(refused.recv_bytes(zmq::DONTWAIT), Err(zmq::Error::EAGAIN));
    // A listed peer connects; the connection made before the reload stays.
    let allowed = Client::connect(&ctx, &format!("tcp://127.0.0.2:0;127.0.0.1:{port}"));
    assert_eq!(allowed.call(json!({"v": 1, "op": "ping"}))["ok"], json!(true));
    assert_eq!(before.call(json!({"v": 1, "op": "ping"}))["ok"], json!(true));
}

/// The daemon's log so far (warnings and above).
fn logged(d: &Daemon) -> String {
    std::fs::read_to_string(d.dir.path().join("dpcoord.log")).unwrap()
}

/// The rank count, where it came from and the epoch, as a `resize` or
/// `reload` reply says them.
fn admin_reply(r: &Value) -> (Value, Value, Value) {
    assert_eq!(r["ok"], json!(true), "{r}");
    (r["dp_size"].clone(), r["dp_size_from"].clone(), r["epoch"].clone())
}

#[test]
fn a_resize_holds_across_reloads_until_the_files_dp_size_changes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dpcoord.toml");
    write(&file, "[engines]\ndp_size = 8\nmax_dp_size = 12\n");
    let mut args = vec!["--config", file.to_str().unwrap()];
    args.extend_from_slice(&FROZEN);
    let d = Daemon::start(&args);
    let health = d.health_client();
    let reload = || health.call(json!({"v": 1, "op": "reload"}));
    let e0 = d.state()["epoch"].as_u64().unwrap();
    let r = reload();
    assert_eq!(admin_reply(&r), (json!(8), json!("file"), json!(e0)));
    let r = health.call(json!({"v": 1, "op": "resize", "dp_size": 12}));
    assert_eq!(admin_reply(&r), (json!(12), json!("resize"), json!(e0 + 1)));
    // The file's dp_size is unchanged: the resize holds, and the log says why.
    assert_eq!(admin_reply(&reload()), (json!(12), json!("resize"), json!(e0 + 1)));
    let kept = "dp_size 12 set by a resize stays; engines.dp_size in the configuration is still 8";
    assert!(logged(&d).contains(kept), "{}", logged(&d));
    // So does SIGHUP, with another key of the file changed.
    write(&file, "[engines]\ndp_size = 8\n[routing]\npolicy = \"least_load\"\n");
    hup(&d, "ok", 3.0);
    assert_eq!((d.state()["policy"].clone(), d.ranks().len()), (json!("least_load"), 12));
    assert_eq!(d.metric("dpcoord_dp_size"), Some(12.0));
    // A larger max_batch than the reply queues were sized for changes nothing.
    write(&file, "[engines]\ndp_size = 8\n[limits]\nmax_batch = 30000\n");
    let r = reload();
    assert_eq!(
        r["error"]["message"],
        "limits.max_batch 30000 is above 1024, which the reply queues are sized for at start: cannot change \
         without a restart; nothing changed",
        "{r}"
    );
    assert_eq!((d.state()["policy"].clone(), d.ranks().len()), (json!("least_load"), 12));
    // The file's dp_size changes: the file wins, and the log says so.
    write(&file, "[engines]\ndp_size = 6\n");
    assert_eq!(admin_reply(&reload()), (json!(6), json!("file"), json!(e0 + 2)));
    assert_eq!((d.state()["policy"].clone(), d.ranks().len()), (json!("round_robin"), 6));
    let replaced = "engines.dp_size changed in the configuration from 8 to 6; it replaces dp_size 12 set by a resize";
    assert!(logged(&d).contains(replaced), "{}", logged(&d));
    // The same through SIGHUP: resize, then a new dp_size in the file.
    assert_eq!(admin_reply(&health.call(json!({"v": 1, "op": "resize", "dp_size": 10}))).1, json!("resize"));
    write(&file, "[engines]\ndp_size = 4\n");
    hup(&d, "ok", 5.0);
    assert_eq!((d.ranks().len(), d.metric("dpcoord_dp_size")), (4, Some(4.0)));
    assert_eq!(admin_reply(&reload()), (json!(4), json!("file"), json!(e0 + 4)));
    assert_eq!(d.metric(r#"dpcoord_config_reloads_total{result="restart_required"}"#), Some(1.0));
}
