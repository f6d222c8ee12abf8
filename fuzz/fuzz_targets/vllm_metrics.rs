//! A vLLM `/metrics` body -> the Prometheus text decoder alone (no
//! coordinator). Seeded with the bodies vLLM's own PrometheusStatLogger
//! rendered in the compatibility suite (DPCOORD_RECORD_CORPUS). Checked for
//! every input: decoding never panics and is deterministic; a report
//! carries the frames' rank and seq and a KV usage in [0, 1]; and families
//! the decoder does not read, added before or after the body, change
//! nothing (a scrape of a server with more metrics routes the same); and
//! the gauges frame the scraper sends the routing thread decodes to the
//! same report as the body.
#![no_main]

use std::time::Duration;

use dpcoord_daemon::engines::Sequence;
use dpcoord_daemon::wire::{decode_vllm_gauges, decode_vllm_metrics, read_vllm_metrics};
use libfuzzer_sys::fuzz_target;

const RANK: [u8; 4] = 7u32.to_be_bytes();
const SEQ: [u8; 8] = 9u64.to_be_bytes();
const BEAT: Duration = Duration::from_millis(250);
/// Families of vLLM's that the decoder does not read, and a comment.
const OTHER: &str = "# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.\n\
    # TYPE vllm:num_requests_waiting_by_reason gauge\n\
    vllm:num_requests_waiting_by_reason{engine=\"0\",reason=\"capacity\"} 5.0\n\
    # a comment\n\
    vllm:kv_cache_usage_perc_total 9e999\n";

/// The decode of `body` as text to compare: a refused NaN sample carries
/// NaN, which is not equal to itself.
fn decode(body: &[u8]) -> String {
    format!("{:?}", decode_vllm_metrics(&RANK, &SEQ, body, BEAT))
}

fuzz_target!(|body: &[u8]| {
    let decoded = decode_vllm_metrics(&RANK, &SEQ, body, BEAT);
    let shown = format!("{decoded:?}");
    assert_eq!(decode(body), shown, "decoding is not deterministic");
    if let Ok(report) = &decoded {
        assert_eq!(report.rank, 7);
        assert_eq!(report.sequence, Sequence::Restarting { seq: 9 });
        assert_eq!(report.heartbeat, BEAT);
        if let Some(kv) = report.kv_usage {
            assert!((0.0..=1.0).contains(&kv), "KV usage {kv}");
        }
        let gauges = read_vllm_metrics(body).expect("read as the report was").to_frame();
        assert_eq!(decode_vllm_gauges(&RANK, &SEQ, &gauges, BEAT).as_ref(), Ok(report), "the frame says otherwise");
    }
    let Ok(text) = std::str::from_utf8(body) else { return };
    let before = format!("{OTHER}{text}");
    assert_eq!(decode(before.as_bytes()), shown, "families ahead changed it");
    if text.is_empty() || text.ends_with('\n') {
        let after = format!("{text}{OTHER}");
        assert_eq!(decode(after.as_bytes()), shown, "families after changed it");
    }
});
