//! Spawning the binary: a process killed if the test ends early, runs to the end, stderr as it comes.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{eventually, free_addr, ipc};

/// A dpcoord process, killed if the test ends early (a failing assert).
pub struct Spawned(Child);

impl From<Child> for Spawned {
    fn from(child: Child) -> Spawned {
        Spawned(child)
    }
}

impl Spawned {
    pub fn id(&self) -> u32 {
        self.0.id()
    }

    /// SIGTERM, then the exit status.
    pub fn stop(self) -> ExitStatus {
        self.stop_with("TERM")
    }

    /// Sends `signal` (as `kill` names it: "TERM", "INT") and waits for the exit status.
    pub fn stop_with(mut self, signal: &str) -> ExitStatus {
        let _ = Command::new("kill").args([&format!("-{signal}"), &self.0.id().to_string()]).status();
        eventually(&format!("dpcoord to exit after SIG{signal}"), || self.0.try_wait().unwrap())
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for `child` to exit; kills it and fails the test after `deadline`.
pub fn wait_or_kill(child: &mut Child, deadline: Duration, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            panic!("{what} did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `dpcoord ARGS` to its end (killed after 10 s); its exit code and stderr.
pub fn run_to_end(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_or_kill(&mut child, Duration::from_secs(10), "dpcoord");
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code(), err)
}

/// Spawns the binary with exactly `args` and `RUST_LOG=rust_log`, stdout
/// discarded; returns it and its stderr lines as they come (read on a thread).
pub fn spawn_with_stderr(args: &[&str], rust_log: &str) -> (Spawned, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(args)
        .env("RUST_LOG", rust_log)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = lines_of(child.stderr.take().unwrap());
    (Spawned(child), rx)
}

/// The lines of `pipe` as they come (read on a thread until EOF).
pub fn lines_of(pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// [`spawn_with_stderr`] on the ipc endpoints `route`, `health` and `stats`
/// in `dir` (see [`ipc`]) and a free metrics port, plus `args`.
pub fn spawn_on_ipc(dir: &tempfile::TempDir, args: &[&str], rust_log: &str) -> (Spawned, mpsc::Receiver<String>) {
    let (route, health, stats) = (ipc(dir, "route"), ipc(dir, "health"), ipc(dir, "stats"));
    let metrics = free_addr().to_string();
    let endpoints =
        ["--route-bind", &route, "--health-bind", &health, "--stats-bind", &stats, "--metrics-bind", &metrics];
    spawn_with_stderr(&[&endpoints[..], args].concat(), rust_log)
}
