//! Signals whose default action would end the daemon without a log line or a
//! drain. `main` handles SIGTERM and SIGINT (stop, draining) and SIGHUP
//! (reload); [`ignore_the_rest`] takes every other one that can be caught
//! and would terminate, logs its first arrival at warn and ignores it.
//!
//! Left at their defaults on purpose (docs/failure-behaviour.md, "Signals"):
//! SIGKILL and SIGSTOP (cannot be caught); SIGQUIT and SIGABRT (asked-for
//! core dumps); SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP and SIGSYS (faults:
//! going on after one is unsound); SIGPIPE, which the Rust runtime already
//! ignores, so a write to a closed peer is an error, not a signal.

use tokio::signal::unix::{signal, SignalKind};

/// The caught-and-ignored signals with their names, as `kill -l` prints them.
fn ignored() -> Vec<(String, SignalKind)> {
    let mut named: Vec<(String, SignalKind)> = [
        ("SIGUSR1", SignalKind::user_defined1()),
        ("SIGUSR2", SignalKind::user_defined2()),
        ("SIGALRM", SignalKind::alarm()),
        ("SIGIO", SignalKind::io()),
        ("SIGPROF", SignalKind::from_raw(libc::SIGPROF)),
        ("SIGVTALRM", SignalKind::from_raw(libc::SIGVTALRM)),
        // Past the soft CPU-time limit the kernel sends SIGXCPU each second
        // and SIGKILL at the hard one; past the file-size limit a write fails
        // with EFBIG instead of ending the process.
        ("SIGXCPU", SignalKind::from_raw(libc::SIGXCPU)),
        ("SIGXFSZ", SignalKind::from_raw(libc::SIGXFSZ)),
    ]
    .into_iter()
    .map(|(name, kind)| (name.to_owned(), kind))
    .collect();
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        named.push(("SIGPWR".into(), SignalKind::from_raw(libc::SIGPWR)));
        named.push(("SIGSTKFLT".into(), SignalKind::from_raw(libc::SIGSTKFLT)));
        // Real-time signals terminate by default too; the C library keeps
        // the ones below SIGRTMIN() for itself.
        let (min, max) = (libc::SIGRTMIN(), libc::SIGRTMAX());
        named.extend((min..=max).map(|s| (format!("SIGRTMIN+{}", s - min), SignalKind::from_raw(s))));
    }
    named
}

/// Installs a handler for each signal of [`ignored`] (synchronously, before
/// the caller's first await) and a task per signal on the current runtime
/// that logs the first arrival at warn, later ones at debug.
pub fn ignore_the_rest() -> std::io::Result<()> {
    for (name, kind) in ignored() {
        let mut stream = signal(kind)?;
        tokio::spawn(async move {
            if stream.recv().await.is_some() {
                tracing::warn!(signal = %name, "{name} received; dpcoord ignores it and keeps serving");
            }
            while stream.recv().await.is_some() {
                tracing::debug!(signal = %name, "{name} received again; ignored");
            }
        });
    }
    Ok(())
}
