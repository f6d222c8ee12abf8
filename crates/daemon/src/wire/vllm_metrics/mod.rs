//! vLLM's Prometheus `/metrics` (one API server per rank, external load
//! balancing), read into the gauges and counters dpcoord uses and then into a
//! gauge-only load report.
//!
//! The scraper (`io::scrape`) reads each body on its own thread
//! ([`read_vllm_metrics`]) and sends the coordinator three frames: the
//! rank (4 bytes, big-endian: the URL's place in
//! `engines.vllm_metrics_url`), its scrape counter (8 bytes, big-endian,
//! from 1, rising by one per body read) and the gauges
//! ([`VllmGauges::to_frame`], 24 bytes), which [`decode_vllm_gauges`]
//! turns into a report. The routing thread never sees a body. vLLM's
//! `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) exports the gauges
//! read here with the labels `model_name` and `engine`; where a server
//! runs several engines, their series are summed (the KV usage is their
//! mean). vLLM exports no token load, so the report has none. The prompt
//! and generation token counters, summed, are the rank's `progress`: they
//! move each time the engine steps with work, and stop when it hangs.

use std::fmt;
use std::time::Duration;

use crate::engines::{Counts, LoadReport, Sequence};

/// The most of a body the scraper reads (a larger one is refused there,
/// counted `too_large`). vLLM 0.33 renders about 55 KB per engine with
/// every family it has (442,511 B for 8 engines, 4 LoRAs, the hidden and
/// KV-cache families, a 128k context; 56,702 B for one engine): 1 MiB is 2.37x the 8-engine
/// body, about 18 engines behind one server (docs/engines.md).
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Samples of the families read here together that a body may carry: one
/// per engine each, and a server has at most `engines.dp_size` (1,024)
/// engines. Past it the body is refused before the samples are parsed.
pub const MAX_SAMPLES: usize = FAMILIES.len() * 1024;
/// The rank and the scrape counter ahead of the gauges.
pub const HEADER_BYTES: usize = 4 + 8;
/// The gauges frame: waiting and running (u64 BE), the KV usage (f64 BE
/// bits, NaN for none), the progress (u64 BE, `u64::MAX` for none).
pub const GAUGES_BYTES: usize = 32;

const WAITING: &str = "vllm:num_requests_waiting";
const RUNNING: &str = "vllm:num_requests_running";
const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
/// The families read: the three gauges, then the two token counters.
pub const FAMILIES: [&str; 5] = [WAITING, RUNNING, KV_USAGE, PROMPT_TOKENS, GENERATION_TOKENS];

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
    /// More samples of the gauges than [`MAX_SAMPLES`].
    TooManySamples,
    /// The gauges frame is not [`GAUGES_BYTES`] long, or its KV usage is
    /// not in [0, 1].
    Gauges(usize),
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
            VllmMetricsError::TooManySamples => {
                write!(f, "vLLM metrics: more than {MAX_SAMPLES} samples of the gauges dpcoord reads")
            }
            VllmMetricsError::Gauges(n) => write!(f, "vLLM metrics: a gauges frame of {n} bytes, or out of range"),
        }
    }
}

/// Whether `line` is a sample (`Some(true)`), `# HELP` or `# TYPE` line
/// (`Some(false)`) of a gauge read here.
fn wanted(line: &str) -> Option<bool> {
    let line = line.trim_start();
    let (name, sample) = match line.strip_prefix('#') {
        Some(comment) => {
            let mut words = comment.split_ascii_whitespace();
            match words.next() {
                Some("HELP" | "TYPE") => (words.next().unwrap_or(""), false),
                _ => return None,
            }
        }
        None => (line.split(|c: char| c == '{' || c.is_ascii_whitespace()).next().unwrap_or(""), true),
    };
    FAMILIES.contains(&name).then_some(sample)
}

/// Per family, the sum of its samples and their count.
fn sums(body: &str) -> Result<[(f64, u32); 5], VllmMetricsError> {
    // Only the lines of the five families are parsed: a body is ~55 KB per
    // engine of which they are a few lines per engine.
    let mut text = String::new();
    let mut samples = 0;
    for line in body.lines() {
        let Some(sample) = wanted(line) else { continue };
        samples += usize::from(sample);
        if samples > MAX_SAMPLES {
            return Err(VllmMetricsError::TooManySamples);
        }
        text.push_str(line);
        text.push('\n');
    }
    let mut got = [(0.0, 0); 5];
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
        let Some(i) = FAMILIES.iter().position(|g| *g == m.name) else { continue };
        for s in &m.samples {
            let v: f64 = s.value.value.parse().map_err(|_| VllmMetricsError::Syntax)?;
            // Counts are at least 0; vLLM's KV usage is a share, `0..=1`.
            let max = if FAMILIES[i] == KV_USAGE { 1.0 } else { f64::INFINITY };
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                return Err(VllmMetricsError::Value { name: FAMILIES[i], value: v });
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

/// What dpcoord reads of one body: the requests waiting and running
/// (summed over engines) and the KV usage (their mean; a sample above 1
/// fails the body).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VllmGauges {
    pub waiting: u64,
    pub running: u64,
    pub kv_usage: Option<f64>,
    /// Prompt and generation tokens processed, summed over engines; `None`
    /// when the body has neither counter.
    pub progress: Option<u64>,
}

impl VllmGauges {
    /// The frame the scraper sends the coordinator.
    pub fn to_frame(&self) -> [u8; GAUGES_BYTES] {
        let mut out = [0; GAUGES_BYTES];
        out[..8].copy_from_slice(&self.waiting.to_be_bytes());
        out[8..16].copy_from_slice(&self.running.to_be_bytes());
        out[16..24].copy_from_slice(&self.kv_usage.unwrap_or(f64::NAN).to_bits().to_be_bytes());
        out[24..].copy_from_slice(&self.progress.unwrap_or(u64::MAX).to_be_bytes());
        out
    }

    fn from_frame(frame: &[u8]) -> Result<VllmGauges, VllmMetricsError> {
        let bad = VllmMetricsError::Gauges(frame.len());
        let frame: &[u8; GAUGES_BYTES] = frame.try_into().map_err(|_| bad)?;
        let word = |i: usize| u64::from_be_bytes(frame[i..i + 8].try_into().unwrap_or_default());
        let kv = f64::from_bits(word(16));
        let kv_usage = match kv {
            _ if kv.is_nan() => None,
            _ if (0.0..=1.0).contains(&kv) => Some(kv),
            _ => return Err(bad),
        };
        let progress = Some(word(24)).filter(|&p| p != u64::MAX);
        Ok(VllmGauges { waiting: word(0), running: word(8), kv_usage, progress })
    }
}

/// Reads a `/metrics` body: the scraper's work, on its own thread.
pub fn read_vllm_metrics(body: &[u8]) -> Result<VllmGauges, VllmMetricsError> {
    let body = std::str::from_utf8(body).map_err(|_| VllmMetricsError::NotUtf8)?;
    let [waiting, running, (kv, engines), prompt, generation] = sums(body)?;
    // Token counters are whole numbers; past 2^63 they are not vLLM's.
    let progress = match (prompt.1, generation.1, prompt.0 + generation.0) {
        (0, 0, _) => None,
        (_, _, sum) if sum < (1u64 << 63) as f64 => Some(sum.round() as u64),
        (_, _, sum) => return Err(VllmMetricsError::Value { name: GENERATION_TOKENS, value: sum }),
    };
    Ok(VllmGauges {
        waiting: count(WAITING, waiting)?,
        running: count(RUNNING, running)?,
        // The mean of samples in 0..=1 stays in it; `min` only guards the rounding.
        kv_usage: (engines > 0).then(|| (kv / f64::from(engines)).min(1.0)),
        progress,
    })
}

/// The rank (4 bytes BE) and the scrape counter (8 bytes BE).
fn header(rank: &[u8], seq: &[u8]) -> Result<(u32, u64), VllmMetricsError> {
    let rank: [u8; 4] = rank.try_into().map_err(|_| VllmMetricsError::RankBytes(rank.len()))?;
    let seq: [u8; 8] = seq.try_into().map_err(|_| VllmMetricsError::SeqBytes(seq.len()))?;
    Ok((u32::from_be_bytes(rank), u64::from_be_bytes(seq)))
}

/// The report of `rank` at scrape `seq`; `heartbeat` is the scrape interval.
fn report((rank, seq): (u32, u64), g: VllmGauges, heartbeat: Duration) -> LoadReport {
    LoadReport {
        rank: rank.into(),
        sequence: Sequence::Restarting { seq },
        counts: Counts { waiting: g.waiting, running: g.running, ..Counts::default() },
        cumulative: false,
        heartbeat,
        tokens: None,
        kv_usage: g.kv_usage,
        ttft_ms: None,
        tpot_ms: None,
        progress: g.progress,
    }
}

/// Decodes the scraper's three frames (rank, seq, gauges) into a report:
/// the coordinator's side, a few dozen bytes whatever the body was.
pub fn decode_vllm_gauges(
    rank: &[u8],
    seq: &[u8],
    gauges: &[u8],
    heartbeat: Duration,
) -> Result<LoadReport, VllmMetricsError> {
    let header = header(rank, seq)?;
    Ok(report(header, VllmGauges::from_frame(gauges)?, heartbeat))
}

/// Reads a whole body into a report, as the scraper and the coordinator
/// do together (tests and the fuzz target).
pub fn decode_vllm_metrics(
    rank: &[u8],
    seq: &[u8],
    body: &[u8],
    heartbeat: Duration,
) -> Result<LoadReport, VllmMetricsError> {
    let header = header(rank, seq)?;
    Ok(report(header, read_vllm_metrics(body)?, heartbeat))
}

#[cfg(test)]
mod tests;
