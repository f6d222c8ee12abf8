//! Test harness: spawns the real `dpcoord` binary on private ipc:// endpoints
//! and talks to it with real ZeroMQ sockets (and real HTTP).

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long any single wait in a test may take before it fails.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Polls `f` until it returns `Some`, failing the test after [`DEADLINE`].
pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A free `127.0.0.1:port` for `--metrics-bind`.
pub fn free_addr() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

/// The private ipc:// endpoint `name` in `dir`.
pub fn ipc(dir: &tempfile::TempDir, name: &str) -> String {
    format!("ipc://{}/{name}", dir.path().display())
}

/// Liveness and pending expiry far out, so frozen stats stay `up` and
/// placements stay pending for a whole test: only queries change state.
pub const FROZEN: [&str; 6] =
    ["--stale-after-ms", "600000", "--down-after-ms", "1200000", "--pending-ttl-ms", "3600000"];

/// Sets the flag when dropped, so helper threads end even if an assert fails.
pub struct SetOnDrop<'a>(pub &'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// `resources.limits.memory` of deploy/kubernetes/base/deployment.yaml: the
/// default `limits.memory_budget_bytes` (480 MiB) and 32 MiB for the
/// process itself.
pub const LIMIT_KIB: u64 = 512 * 1024;

/// What attacks on the sockets, the HTTP port and the sources stay under:
/// they grow nothing the memory budget's indexes hold, and a quarter of
/// [`LIMIT_KIB`] is far more than they reach.
pub const CEILING_KIB: u64 = 128 * 1024;

/// `VmRSS` or `VmHWM` of a process, in KiB.
pub fn status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

mod daemon;
mod engines;
mod http;
mod messages;
mod openai;
mod peers;
mod process;

// Each test file uses a different part of the harness, so some re-exports go unused in each.
#[allow(unused_imports)]
pub use {daemon::*, engines::*, http::*, messages::*, openai::*, peers::*, process::*};
