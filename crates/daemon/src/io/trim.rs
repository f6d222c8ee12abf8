//! Gives memory that the C allocator holds but nobody uses back to the kernel.
//!
//! libzmq allocates each connection's buffers and pipes (about 38 KB per
//! connected peer) with glibc's malloc, on its I/O thread. glibc keeps freed
//! memory in its arenas: after 2,000 peers had connected and left, RSS stayed
//! at their peak (92 MB), and a second wave of 2,000 grew it to 137 MB instead
//! of reusing it, past the 128 MiB container limit. `malloc_trim(0)` hands the
//! free pages of every arena back (measured: 92 MB -> 17 MB), so one thread
//! calls it every [`EVERY`]; with nothing to return it costs microseconds.
//! (tests/it/memory_ceiling.rs, `two_thousand_connected_peers_...`.)

use std::time::Duration;

/// How often freed memory is handed back.
pub const EVERY: Duration = Duration::from_secs(1);

/// Starts the process-wide trimming thread, once: the simulator and the demo
/// start several daemons in one process.
pub fn start() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new().name("malloc-trim".into()).spawn(|| loop {
            std::thread::sleep(EVERY);
            release();
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the malloc-trim thread; memory freed by closed connections stays with the allocator");
        }
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn release() {
    // SAFETY: malloc_trim(3) takes an integer by value, touches no memory of
    // the caller's and has no preconditions; glibc takes each arena's lock
    // while trimming it, so any thread may call it at any time, concurrently
    // with malloc and free elsewhere.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Other C libraries have no `malloc_trim`; their allocators keep what they keep.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release() {}
