//! Query bytes on both sockets -> coordinator: nothing may panic, and every
//! query gets a reply that is a MessagePack map with `"v": 1` and a boolean
//! `ok`. One coordinator (3 of 4 ranks up) lives across inputs.
#![no_main]

use std::cell::RefCell;
use std::time::Instant;

use dpcoord_daemon::config::Config;
use dpcoord_daemon::observability::metrics::Metrics;
use dpcoord_daemon::routing::Coordinator;
use dpcoord_daemon::wire::{Channel, SourceKind};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

fn coordinator() -> Coordinator {
    let mut cfg = Config::default();
    cfg.settings.engines.dp_size = 4;
    cfg.settings.routing.pending_ttl = std::time::Duration::from_millis(50);
    let now = Instant::now();
    let mut coord = Coordinator::new(&cfg.settings, Metrics::new(4), now);
    for rank in 0..3 {
        let update = json!({"v": 1, "rank": rank, "boot": 1, "seq": 1, "counts": [0, 0, 0, 0, 0]});
        let bytes = rmp_serde::to_vec_named(&update).expect("encodes");
        coord.on_source(SourceKind::Stats, Some(&[&bytes[..]][..]), now);
    }
    coord
}

thread_local! {
    static COORD: RefCell<(Coordinator, Vec<u8>)> = RefCell::new((coordinator(), Vec::new()));
}

fuzz_target!(|data: &[u8]| {
    COORD.with_borrow_mut(|(coord, out)| {
        let now = Instant::now();
        for ch in [Channel::Route, Channel::Health] {
            coord.on_query(ch, data, now, out);
            let reply: Value = rmp_serde::from_slice(out).expect("every reply decodes");
            assert_eq!(reply["v"], json!(1), "{reply}");
            assert!(reply["ok"].is_boolean(), "{reply}");
        }
        if now >= coord.next_tick() {
            coord.tick(now);
        }
    });
});
