//! Native engine sources (SGLang's load stream, a scraped vLLM `/metrics`
//! body, the engines' KV event stream live and replayed) -> coordinator: nothing may panic, and a message the decoder
//! rejects must leave the engine table unchanged. The input's first byte
//! picks the source; the rest is split into frames at each 0xff byte.
#![no_main]

mod shared;

use std::time::Duration;

use dpcoord_daemon::wire::SourceKind;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    // The low two bits pick the source; the next two an SGLang endpoint's
    // rank, or a KV publisher (0 names no rank, 1 is the `+rank` endpoint of rank 1).
    let (low, high) = (pick % 4, (pick >> 2) % 4);
    let kind = match low {
        0 => SourceKind::SglangLoad { rank: u32::from(high) },
        1 => SourceKind::VllmMetrics { interval: Duration::from_millis(250) },
        2 => SourceKind::KvEvents { stream: u16::from(high % 2), replay: false },
        _ => SourceKind::KvEvents { stream: u16::from(high % 2), replay: true },
    };
    let frames: Vec<&[u8]> = rest.split(|&b| b == 0xff).take(8).collect();
    shared::feed(kind, &frames);
});
