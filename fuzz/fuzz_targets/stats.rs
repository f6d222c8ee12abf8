//! Engine stats bytes -> coordinator: nothing may panic, and an update the
//! decoder rejects must leave the engine table unchanged. One coordinator
//! lives across inputs, so accepted updates build up state for later ones.
#![no_main]

use std::cell::RefCell;
use std::time::Instant;

use dpcoord::config::Config;
use dpcoord::routing::Coordinator;
use dpcoord::observability::metrics::Metrics;
use dpcoord::wire::SourceKind;
use libfuzzer_sys::fuzz_target;

thread_local! {
    static COORD: RefCell<Coordinator> = RefCell::new({
        let mut cfg = Config::default();
        cfg.settings.engines.dp_size = 4;
        Coordinator::new(&cfg.settings, Metrics::new(4), Instant::now())
    });
}

fuzz_target!(|data: &[u8]| {
    COORD.with_borrow_mut(|coord| {
        let now = Instant::now();
        let before = coord.state_view(now);
        coord.on_source(SourceKind::Stats, Some(&[data][..]), now);
        if dpcoord::wire::decode_stats(data).is_err() {
            assert_eq!(coord.state_view(now), before, "a rejected update changed state");
        }
        coord.tick(now);
    });
});
