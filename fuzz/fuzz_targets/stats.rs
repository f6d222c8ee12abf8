//! Engine stats bytes -> coordinator: nothing may panic, and an update the
//! decoder rejects must leave the engine table unchanged. One coordinator
//! lives across inputs, so accepted updates build up state for later ones.
#![no_main]

mod shared;

use dpcoord_daemon::wire::SourceKind;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| shared::feed(SourceKind::Stats, &[data]));
