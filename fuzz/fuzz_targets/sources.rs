//! Native engine sources (SGLang's load stream, a scraped vLLM `/metrics`
//! body) -> coordinator: nothing may panic, and a message the decoder
//! rejects must leave the engine table unchanged. The input's first byte
//! picks the source; the rest is split into frames at each 0xff byte.
#![no_main]

use std::cell::RefCell;
use std::time::{Duration, Instant};

use dpcoord::config::Config;
use dpcoord::observability::metrics::Metrics;
use dpcoord::routing::Coordinator;
use dpcoord::wire::{decode_source, SourceKind};
use libfuzzer_sys::fuzz_target;

thread_local! {
    static COORD: RefCell<Coordinator> = RefCell::new({
        let mut cfg = Config::default();
        cfg.settings.engines.dp_size = 4;
        Coordinator::new(&cfg.settings, Metrics::new(4), Instant::now())
    });
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let kind = match pick % 2 {
        0 => SourceKind::SglangLoad,
        _ => SourceKind::VllmMetrics { interval: Duration::from_millis(250) },
    };
    let frames: Vec<&[u8]> = rest.split(|&b| b == 0xff).take(8).collect();
    COORD.with_borrow_mut(|coord| {
        let now = Instant::now();
        let before = coord.state_view(now);
        coord.on_source(kind, Some(&frames[..]), now);
        if decode_source(kind, Some(&frames[..]), usize::MAX).is_err() {
            assert_eq!(coord.state_view(now), before, "a rejected message changed state");
        }
        coord.tick(now);
    });
});
