//! A lower CPU priority for dpcoord's helper threads (the `/metrics`
//! scrapers, the KV decoder, the gateway's tokenizer), so that on a busy machine the routing thread
//! is scheduled first: their work can wait a few milliseconds, a route
//! query should not.

/// The nice value of a helper thread (the routing thread keeps 0).
const HELPER_NICE: i32 = 10;

/// Lowers the calling thread's priority to [`HELPER_NICE`]; on failure
/// (a seccomp profile, say) the thread keeps running at the normal one.
pub fn lower_this_thread() {
    if let Err(e) = set_nice(HELPER_NICE) {
        tracing::debug!(error = %e, "cannot lower a helper thread's CPU priority");
    }
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn set_nice(nice: i32) -> std::io::Result<()> {
    // SAFETY: setpriority(2) takes three integers by value and touches no
    // memory of the caller's. On Linux the nice value belongs to a thread,
    // and `who` 0 names the calling thread, so no other thread changes.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Elsewhere the nice value belongs to the whole process: left alone.
#[cfg(not(target_os = "linux"))]
fn set_nice(_nice: i32) -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The calling thread's nice value, from /proc.
    #[cfg(target_os = "linux")]
    fn nice() -> i32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        // Field 19 is the nice value; the name (field 2) may hold spaces, so count after its ')'.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        after.split(' ').nth(16).unwrap().parse::<i32>().unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn only_the_calling_thread_is_lowered() {
        let before = nice();
        let lowered = std::thread::spawn(|| {
            super::lower_this_thread();
            nice()
        });
        assert_eq!(lowered.join().unwrap(), (before + super::HELPER_NICE).min(19));
        assert_eq!(nice(), before);
    }
}
