//! vLLM's Prometheus `/metrics` (one API server per rank, external load
//! balancing), decoded into a gauge-only load report.
//!
//! The scraper (`io::scrape`) sends each body it fetched as three frames:
//! the rank (4 bytes, big-endian: the URL's place in
//! `engines.vllm_metrics_url`), its scrape counter (8 bytes, big-endian,
//! from 1, rising by one per body sent) and the body. vLLM's
//! `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) exports the gauges
//! read here with the labels `model_name` and `engine`; where a server
//! runs several engines, their series are summed (the KV usage is their
//! mean). vLLM exports no token load, so the report has none.

use std::fmt;
use std::time::Duration;

use crate::engines::{Counts, LoadReport, Sequence};

/// The most of a body the scraper reads (a larger one is refused there).
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// The rank and the scrape counter ahead of the body.
pub const HEADER_BYTES: usize = 4 + 8;

const WAITING: &str = "vllm:num_requests_waiting";
const RUNNING: &str = "vllm:num_requests_running";
const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
const GAUGES: [&str; 3] = [WAITING, RUNNING, KV_USAGE];

/// Why a scraped body could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum VllmMetricsError {
    RankBytes(usize),
    SeqBytes(usize),
    NotUtf8,
    /// The lines of the gauges read are not the Prometheus text format.
    Syntax,
    /// A sample of `name` is not a finite number in range.
    Value {
        name: &'static str,
        value: f64,
    },
    /// The body has no sample of `name`.
    Missing(&'static str),
}

impl fmt::Display for VllmMetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            VllmMetricsError::RankBytes(n) => write!(f, "vLLM metrics: the rank frame is {n} bytes, not 4"),
            VllmMetricsError::SeqBytes(n) => write!(f, "vLLM metrics: the seq frame is {n} bytes, not 8"),
            VllmMetricsError::NotUtf8 => write!(f, "vLLM metrics: the body is not UTF-8 text"),
            VllmMetricsError::Syntax => write!(f, "vLLM metrics: the body is not the Prometheus text format"),
            VllmMetricsError::Value { name, value } => write!(f, "vLLM metrics: `{name}` is {value}, out of range"),
            VllmMetricsError::Missing(name) => write!(f, "vLLM metrics: no `{name}` in the body (not a vLLM server?)"),
        }
    }
}

/// Whether `line` is a sample, `# HELP` or `# TYPE` line of a gauge read here.
fn wanted(line: &str) -> bool {
    let line = line.trim_start();
    let name = match line.strip_prefix('#') {
        Some(comment) => {
            let mut words = comment.split_ascii_whitespace();
            match words.next() {
                Some("HELP" | "TYPE") => words.next().unwrap_or(""),
                _ => return false,
            }
        }
        None => line.split(|c: char| c == '{' || c.is_ascii_whitespace()).next().unwrap_or(""),
    };
    GAUGES.contains(&name)
}

/// Per gauge, the sum of its samples and their count.
fn sums(body: &str) -> Result<[(f64, u32); 3], VllmMetricsError> {
    // Only the lines of the three gauges are parsed: a body is ~45 KiB of
    // which they are six lines, and this runs on the coordinator's thread.
    let text: String = body.lines().filter(|l| wanted(l)).flat_map(|l| [l, "\n"]).collect();
    let mut got = [(0.0, 0); 3];
    if text.is_empty() {
        return Ok(got);
    }
    // A family with no sample is a soft error of this parser; the samples
    // it did read are all here. A line it cannot read fails the body.
    let (metrics, error) = prom_text_format_parser::parse_scrape(&text);
    if let Some(prom_text_format_parser::ScrapeParseError::Parse(_)) = error {
        return Err(VllmMetricsError::Syntax);
    }
    for m in &metrics {
        let Some(i) = GAUGES.iter().position(|g| *g == m.name) else { continue };
        for s in &m.samples {
            let v: f64 = s.value.value.parse().map_err(|_| VllmMetricsError::Syntax)?;
            if !(v.is_finite() && v >= 0.0) {
                return Err(VllmMetricsError::Value { name: GAUGES[i], value: v });
            }
            got[i] = (got[i].0 + v, got[i].1 + 1);
        }
    }
    Ok(got)
}

/// A request count: the summed gauge, rounded.
fn count(name: &'static str, (sum, n): (f64, u32)) -> Result<u64, VllmMetricsError> {
    match n {
        0 => Err(VllmMetricsError::Missing(name)),
        _ if sum > u64::MAX as f64 => Err(VllmMetricsError::Value { name, value: sum }),
        _ => Ok(sum.round() as u64),
    }
}

/// Decodes one scrape (its three frames) into a report of its rank;
/// `heartbeat` is the scrape interval.
pub fn decode_vllm_metrics(
    rank: &[u8],
    seq: &[u8],
    body: &[u8],
    heartbeat: Duration,
) -> Result<LoadReport, VllmMetricsError> {
    let rank: [u8; 4] = rank.try_into().map_err(|_| VllmMetricsError::RankBytes(rank.len()))?;
    let seq: [u8; 8] = seq.try_into().map_err(|_| VllmMetricsError::SeqBytes(seq.len()))?;
    let body = std::str::from_utf8(body).map_err(|_| VllmMetricsError::NotUtf8)?;
    let [waiting, running, (kv, engines)] = sums(body)?;
    let kv_usage = (engines > 0).then(|| (kv / f64::from(engines)).min(1.0));
    Ok(LoadReport {
        rank: u32::from_be_bytes(rank).into(),
        sequence: Sequence::Restarting { seq: u64::from_be_bytes(seq) },
        counts: Counts { waiting: count(WAITING, waiting)?, running: count(RUNNING, running)?, ..Counts::default() },
        cumulative: false,
        heartbeat,
        tokens: None,
        kv_usage,
        ttft_ms: None,
        tpot_ms: None,
    })
}

#[cfg(test)]
#[path = "vllm_metrics_tests.rs"]
mod tests;
