//! Unit tests of `vllm_metrics/mod.rs`, on text rendered by vLLM's own
//! `PrometheusStatLogger` (tests/fixtures/vllm_metrics.py).

use super::*;

const RANK3: &str = include_str!("../../../../../tests/fixtures/vllm_metrics_rank3.prom");
const TWO_ENGINES: &str = include_str!("../../../../../tests/fixtures/vllm_metrics_two_engines.prom");
const BEAT: Duration = Duration::from_millis(250);

fn decode(rank: u32, seq: u64, body: &str) -> Result<LoadReport, VllmMetricsError> {
    decode_vllm_metrics(&rank.to_be_bytes(), &seq.to_be_bytes(), body.as_bytes(), BEAT)
}

#[test]
fn vllms_own_text_decodes_into_a_gauge_only_report() {
    let r = decode(3, 9, RANK3).unwrap();
    assert_eq!(r.rank, 3);
    assert_eq!(r.sequence, Sequence::Restarting { seq: 9 });
    // `vllm:num_requests_waiting` includes the deferred ones (5 + 2).
    assert_eq!(r.counts, Counts { waiting: 7, running: 5, ..Counts::default() });
    assert_eq!(r.kv_usage, Some(0.415));
    assert!(!r.cumulative);
    assert_eq!(r.heartbeat, BEAT);
    assert_eq!((r.tokens, r.ttft_ms, r.tpot_ms), (None, None, None));
}

#[test]
fn several_engines_behind_one_server_are_summed() {
    let r = decode(0, 1, TWO_ENGINES).unwrap();
    assert_eq!(r.counts, Counts { waiting: 5, running: 5, ..Counts::default() });
    assert_eq!(r.kv_usage, Some(0.5));
}

#[test]
fn only_the_gauges_lines_are_read() {
    // Timestamps, comments and blank lines are the format's; other families
    // may hold what this parser refuses.
    let body = "# a comment\n\nother{a=\"1\",} 1\nvllm:num_requests_waiting 2 1700000000000\n\
                vllm:num_requests_running{engine=\"0\",x=\"a}b\"} 1e1\n";
    let r = decode(1, 1, body).unwrap();
    assert_eq!(r.counts, Counts { waiting: 2, running: 10, ..Counts::default() });
    assert_eq!(r.kv_usage, None);
}

#[test]
fn bodies_without_the_gauges_or_with_bad_values_are_refused() {
    assert_eq!(decode(0, 1, ""), Err(VllmMetricsError::Missing(WAITING)));
    assert_eq!(decode(0, 1, "<html>\n<body>502 Bad Gateway</body>\n"), Err(VllmMetricsError::Missing(WAITING)));
    assert_eq!(decode(0, 1, "vllm:num_requests_waiting 1\n"), Err(VllmMetricsError::Missing(RUNNING)));
    assert_eq!(decode(0, 1, "vllm:num_requests_waiting{ 1\n"), Err(VllmMetricsError::Syntax));
    assert_eq!(decode(0, 1, "vllm:num_requests_waiting one\n"), Err(VllmMetricsError::Syntax));
    let negative = "vllm:num_requests_waiting -1\nvllm:num_requests_running 0\n";
    assert_eq!(decode(0, 1, negative), Err(VllmMetricsError::Value { name: WAITING, value: -1.0 }));
    let nan = "vllm:num_requests_waiting 1\nvllm:num_requests_running NaN\n";
    assert!(matches!(decode(0, 1, nan), Err(VllmMetricsError::Value { name: RUNNING, .. })));
    let huge = "vllm:num_requests_waiting 1e300\nvllm:num_requests_running 0\n";
    assert!(matches!(decode(0, 1, huge), Err(VllmMetricsError::Value { name: WAITING, .. })));
    assert_eq!(decode_vllm_metrics(&[0; 4], &[0; 8], b"\xff", BEAT), Err(VllmMetricsError::NotUtf8));
    assert_eq!(decode_vllm_metrics(&[0; 2], &[0; 8], b"", BEAT), Err(VllmMetricsError::RankBytes(2)));
    assert_eq!(decode_vllm_metrics(&[0; 4], &[0; 7], b"", BEAT), Err(VllmMetricsError::SeqBytes(7)));
}

#[test]
fn a_kv_usage_outside_0_to_1_or_not_a_number_is_refused() {
    // vLLM's usage is `1 - free / total`: 1.2 (a percent, another exporter) is not it.
    let body =
        |kv: &str| format!("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc {kv}\n");
    for (kv, value) in [("1.2", 1.2), ("1.000001", 1.000001), ("41.5", 41.5), ("-0.25", -0.25), ("+Inf", f64::INFINITY)]
    {
        assert_eq!(decode(0, 1, &body(kv)), Err(VllmMetricsError::Value { name: KV_USAGE, value }), "{kv}");
    }
    assert!(matches!(decode(0, 1, &body("NaN")), Err(VllmMetricsError::Value { name: KV_USAGE, .. })));
    assert_eq!(decode(0, 1, &body("1")).unwrap().kv_usage, Some(1.0));
    assert_eq!(decode(0, 1, &body("0")).unwrap().kv_usage, Some(0.0));
}

#[test]
fn the_gauges_frame_carries_what_the_body_said() {
    for body in [RANK3, TWO_ENGINES, "vllm:num_requests_waiting 0\nvllm:num_requests_running 3\n"] {
        let g = read_vllm_metrics(body.as_bytes()).unwrap();
        let r = decode_vllm_gauges(&3u32.to_be_bytes(), &9u64.to_be_bytes(), &g.to_frame(), BEAT).unwrap();
        assert_eq!(r, decode(3, 9, body).unwrap());
    }
    let mut frame = VllmGauges { waiting: 1, running: 2, kv_usage: Some(0.5), progress: Some(7) }.to_frame();
    let r = decode_vllm_gauges(&[0; 4], &[0; 8], &frame, BEAT).unwrap();
    assert_eq!((r.kv_usage, r.progress), (Some(0.5), Some(7)));
    frame[16..24].copy_from_slice(&1.5f64.to_bits().to_be_bytes());
    assert_eq!(decode_vllm_gauges(&[0; 4], &[0; 8], &frame, BEAT), Err(VllmMetricsError::Gauges(32)));
    assert_eq!(decode_vllm_gauges(&[0; 4], &[0; 8], &frame[..8], BEAT), Err(VllmMetricsError::Gauges(8)));
}

/// The prompt and generation token counters, summed over engines, are the
/// rank's progress; a body with neither has none; a negative one is refused.
#[test]
fn the_token_counters_are_the_progress() {
    assert_eq!(decode(3, 9, RANK3).unwrap().progress, Some(0), "vLLM's own text: both counters at 0");
    let body = "vllm:num_requests_waiting 0\nvllm:num_requests_running 3\n\
                vllm:prompt_tokens_total{engine=\"0\"} 100.0\nvllm:prompt_tokens_total{engine=\"1\"} 20.0\n\
                vllm:generation_tokens_total{engine=\"0\"} 7.0\n";
    assert_eq!(decode(0, 1, body).unwrap().progress, Some(127));
    let none = "vllm:num_requests_waiting 0\nvllm:num_requests_running 3\n";
    assert_eq!(decode(0, 1, none).unwrap().progress, None);
    let negative = format!("{none}vllm:generation_tokens_total -1\n");
    assert_eq!(
        decode(0, 1, &negative),
        Err(VllmMetricsError::Value { name: "vllm:generation_tokens_total", value: -1.0 })
    );
}

#[test]
fn a_body_with_more_gauge_samples_than_any_server_has_engines_is_refused() {
    let sample = |i: usize| format!("vllm:num_requests_waiting{{engine=\"{i}\"}} 1\n");
    let at_cap: String = (0..MAX_SAMPLES - 1).map(sample).collect::<String>() + "vllm:num_requests_running 1\n";
    assert_eq!(decode(0, 1, &at_cap).unwrap().counts.waiting, MAX_SAMPLES as u64 - 1);
    let over = at_cap + &sample(MAX_SAMPLES);
    assert_eq!(decode(0, 1, &over), Err(VllmMetricsError::TooManySamples));
}
