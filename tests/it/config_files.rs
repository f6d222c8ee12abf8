//! Configuration files are read bounded: only regular files, at most
//! 1 MiB (`config::MAX_FILE_BYTES`). A device or a FIFO used to grow memory
//! without end or hang the command.

use std::process::Command;

use crate::common::*;

#[test]
fn devices_fifos_and_oversized_files_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let big = dir.path().join("big.toml");
    // 1 MiB + 1 byte of comments: valid TOML, one byte too many.
    std::fs::write(&big, format!("#{}\n", "x".repeat((1 << 20) - 1))).unwrap();
    let ok = dir.path().join("ok.toml");
    std::fs::write(&ok, "[engines]\ndp_size = 2\n").unwrap();
    let cases = [
        ("/dev/zero", "/dev/zero is not a regular file".to_owned()),
        (fifo.to_str().unwrap(), format!("{} is not a regular file", fifo.display())),
        (big.to_str().unwrap(), format!("{} is larger than 1048576 bytes", big.display())),
    ];
    for (path, why) in &cases {
        let (code, err) = run_to_end(&["check-config", path]);
        assert_eq!(code, Some(2), "{path}: {err}");
        assert!(err.contains(why), "{path}: {err}");
        // The daemon refuses it the same way, before binding anything.
        let (code, err) = run_to_end(&["--config", path, "--metrics-bind", &free_addr().to_string()]);
        assert_eq!(code, Some(2), "{path}: {err}");
        assert!(err.contains(why), "{path}: {err}");
    }
    assert_eq!(run_to_end(&["check-config", ok.to_str().unwrap()]).0, Some(0));
}
