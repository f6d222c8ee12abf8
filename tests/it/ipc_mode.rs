//! `server.ipc_mode`: the file mode of the ipc:// sockets dpcoord binds.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use crate::common::Daemon;

/// A config file holding `text`, in its own temp dir (kept alive by the caller).
fn config(text: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dpcoord.toml");
    std::fs::write(&path, text).unwrap();
    let path = path.display().to_string();
    (dir, path)
}

fn mode(endpoint: &str) -> u32 {
    let path = endpoint.strip_prefix("ipc://").expect("an ipc endpoint");
    std::fs::metadata(Path::new(path)).unwrap().permissions().mode() & 0o777
}

#[test]
fn every_bound_ipc_socket_gets_the_mode() {
    for (text, want) in [("0660", 0o660), ("0606", 0o606)] {
        let (_keep, file) = config(&format!("[server]\nipc_mode = \"{text}\"\n"));
        let d = Daemon::start(&["--config", &file]);
        for ep in [&d.route, &d.health, &d.stats] {
            assert_eq!(mode(ep), want, "{ep} with ipc_mode {text}");
        }
        assert!(d.stop().success());
    }
}

#[test]
fn a_bad_mode_exits_2_naming_the_key() {
    let (_keep, file) = config("[server]\nipc_mode = \"rw-rw----\"\n");
    let out = Command::new(env!("CARGO_BIN_EXE_dpcoord")).args(["--config", &file]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("dpcoord: error: server.ipc_mode: `rw-rw----` is not a file mode"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}
