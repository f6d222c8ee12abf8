//! What the source fuzz targets share: one coordinator over 4 ranks that
//! lives across inputs (accepted messages build up state for later ones),
//! and the property they check for every message.

use std::cell::RefCell;
use std::time::Instant;

use dpcoord_daemon::config::{Config, KvEndpoint};
use dpcoord_daemon::observability::metrics::Metrics;
use dpcoord_daemon::routing::Coordinator;
use dpcoord_daemon::wire::{decode_source, SourceKind, SourceLimits};

thread_local! {
    static COORD: RefCell<Coordinator> = RefCell::new({
        let mut cfg = Config::default();
        cfg.settings.engines.dp_size = 4;
        // Two KV publishers with replay sockets, for the sources target: one
        // whose batches name their rank, and the `+rank` endpoint of rank 1.
        let kv = |rank, port: u16| KvEndpoint {
            connect: format!("tcp://127.0.0.1:{port}"),
            replay: Some(format!("tcp://127.0.0.1:{}", port + 1)),
            rank,
        };
        Coordinator::new(&cfg.settings, Metrics::new(4), Instant::now()).with_kv_endpoints(&[kv(None, 1), kv(Some(1), 3)])
    });
}

/// Feeds one message of `kind` to the coordinator: nothing may panic, and a
/// message the decoder rejects must leave the engine table unchanged.
pub fn feed(kind: SourceKind, frames: &[&[u8]]) {
    COORD.with_borrow_mut(|coord| {
        let now = Instant::now();
        let before = coord.state_view(now);
        coord.on_source(kind, Some(frames), now);
        if decode_source(kind, Some(frames), &SourceLimits::NONE).is_err() {
            assert_eq!(coord.state_view(now), before, "a rejected message changed state");
        }
        coord.tick(now);
    });
}
