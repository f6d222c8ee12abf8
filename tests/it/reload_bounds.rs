//! A reload cannot hang routing: the configuration path swapped between a
//! regular file and a FIFO (which nobody writes) while `SIGHUP` and the
//! `reload` op arrive, again and again. Every route query is answered, a
//! FIFO is refused at once and counted, a good file still applies, and
//! SIGTERM still ends the process within its 2 s.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::{json, Value};

/// The configuration path, and a regular file and a FIFO beside it that
/// take its place by hard link and rename (each swap is atomic).
struct Swapper {
    path: PathBuf,
    file: PathBuf,
    fifo: PathBuf,
}

impl Swapper {
    fn new(dir: &Path) -> Swapper {
        let s = Swapper { path: dir.join("dpcoord.toml"), file: dir.join("good.toml"), fifo: dir.join("fifo") };
        assert!(Command::new("mkfifo").arg(&s.fifo).status().unwrap().success());
        s.write("round_robin");
        s.to(false);
        s
    }

    /// Writes the regular file with `policy` (beside the path, not through it).
    fn write(&self, policy: &str) {
        let tmp = self.file.with_extension("tmp");
        std::fs::write(&tmp, format!("[engines]\ndp_size = 2\n[routing]\npolicy = \"{policy}\"\n")).unwrap();
        std::fs::rename(&tmp, &self.file).unwrap();
    }

    /// Puts the FIFO (`true`) or the regular file at the path.
    fn to(&self, fifo: bool) {
        let link = self.path.with_extension("swap");
        let _ = std::fs::remove_file(&link);
        std::fs::hard_link(if fifo { &self.fifo } else { &self.file }, &link).unwrap();
        std::fs::rename(&link, &self.path).unwrap();
    }
}

const RELOADS: &str = "dpcoord_config_reloads_total";

fn reloads(d: &Daemon, result: &str) -> f64 {
    d.metric(&format!(r#"{RELOADS}{{result="{result}"}}"#)).unwrap()
}

fn sighup(d: &Daemon) {
    assert!(Command::new("kill").args(["-HUP", &d.pid().to_string()]).status().unwrap().success());
}

/// The refusal of a FIFO at the path.
fn fifo_refused(path: &Path) -> String {
    format!("config: {} is not a regular file; nothing changed", path.display())
}

#[test]
fn a_path_swapped_between_a_file_and_a_fifo_never_holds_routing() {
    let dir = tempfile::tempdir().unwrap();
    let swap = Swapper::new(dir.path());
    let mut args = vec!["--config", swap.path.to_str().unwrap()];
    args.extend_from_slice(&FROZEN);
    let d = Daemon::start(&args);
    d.bring_up(&d.publisher(), &[0, 1]);
    let (user, health) = (d.client(), d.health_client());
    // Two ranks up; no reload here changes the rank count, so the epoch stays.
    let epoch = d.state()["epoch"].clone();
    assert_eq!(epoch, json!(2));
    let (mut ok, mut invalid) = (0.0, 0.0);
    // Round by round: a FIFO, then a file with the other policy; the op
    // and SIGHUP in turn. Each outcome is known, so each count is exact.
    for round in 0..300u32 {
        let fifo = round % 2 == 0;
        let policy = if round % 4 == 1 { "least_load" } else { "round_robin" };
        if !fifo {
            swap.write(policy);
        }
        swap.to(fifo);
        if round % 3 == 0 {
            sighup(&d);
        } else {
            let r = health.call(json!({"v": 1, "op": "reload", "id": round}));
            let expected = match fifo {
                true => json!({"v": 1, "ok": false, "id": round, "epoch": epoch,
                    "error": {"code": "invalid_config", "message": fifo_refused(&swap.path)}}),
                false => json!({"v": 1, "ok": true, "id": round, "dp_size": 2, "dp_size_from": "file", "epoch": epoch}),
            };
            assert_eq!(r, expected, "round {round}");
        }
        if fifo {
            invalid += 1.0;
        } else {
            ok += 1.0;
        }
        eventually(&format!("round {round} counted"), || {
            (reloads(&d, "ok") == ok && reloads(&d, "invalid") == invalid).then_some(())
        });
        assert_eq!(user.call(json!({"v": 1, "op": "route", "id": round}))["ok"], json!(true), "round {round}");
        if !fifo {
            assert_eq!(d.state()["policy"], policy, "round {round}");
        }
    }
    // Racing: the path flips as fast as a thread can flip it while reload
    // ops arrive one after another; each is the file or the FIFO, never stuck.
    let stop = AtomicBool::new(false);
    let answered = std::thread::scope(|s| {
        let _stop = SetOnDrop(&stop);
        s.spawn(|| {
            let mut fifo = false;
            while !stop.load(Ordering::Relaxed) {
                fifo = !fifo;
                swap.to(fifo);
            }
        });
        let mut answered = [0.0, 0.0];
        for id in 0..400u32 {
            let r: Value = health.call(json!({"v": 1, "op": "reload", "id": id}));
            let applied = json!({"v": 1, "ok": true, "id": id, "dp_size": 2, "dp_size_from": "file", "epoch": epoch});
            let refused = json!({"v": 1, "ok": false, "id": id, "epoch": epoch,
                "error": {"code": "invalid_config", "message": fifo_refused(&swap.path)}});
            match r["ok"] == json!(true) {
                true => (assert_eq!(r, applied), answered[0] += 1.0),
                false => (assert_eq!(r, refused), answered[1] += 1.0),
            };
            assert_eq!(user.call(json!({"v": 1, "op": "route", "id": id}))["ok"], json!(true), "{id}");
        }
        answered
    });
    assert_eq!((reloads(&d, "ok"), reloads(&d, "invalid")), (ok + answered[0], invalid + answered[1]));
    // The file at the path again: it applies.
    swap.write("least_load");
    swap.to(false);
    assert_eq!(health.call(json!({"v": 1, "op": "reload"}))["ok"], json!(true));
    assert_eq!(d.state()["policy"], "least_load");
    swap.to(true);
    sighup(&d);
    eventually("the last SIGHUP counted", || (reloads(&d, "invalid") == invalid + answered[1] + 1.0).then_some(()));
    let started = Instant::now();
    let status = d.stop();
    let took = started.elapsed();
    assert_eq!(status.code(), Some(0), "{status}");
    assert!(took < Duration::from_secs(2), "exited {took:?} after SIGTERM");
}

/// Started without `--config` there is no file to re-read: the op is
/// refused as the contract says, and so is SIGHUP (counted); routing goes on.
#[test]
fn without_a_config_file_reload_is_refused() {
    let d = Daemon::frozen_up("2", &[0, 1]);
    let r = d.health_client().call(json!({"v": 1, "op": "reload", "id": "x"}));
    let message = "config: dpcoord was started without --config: there is no file to re-read; nothing changed";
    assert_eq!(
        r,
        json!({"v": 1, "ok": false, "id": "x", "epoch": 2,
            "error": {"code": "invalid_config", "message": message}})
    );
    assert_eq!(reloads(&d, "invalid"), 1.0);
    sighup(&d);
    eventually("SIGHUP counted", || (reloads(&d, "invalid") == 2.0).then_some(()));
    assert_eq!(reloads(&d, "ok"), 0.0);
    assert_eq!(d.client().route(json!({"v": 1, "op": "route", "n": 2})), [0, 1]);
}
