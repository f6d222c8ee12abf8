//! Traces in Mooncake's format with the published shape of its FAST'25
//! workloads, for machines without the files (`dpcoord sim trace
//! --generate agentic|conversation FILE`). Seeded: a seed writes the same
//! file every time.
//!
//! - `conversation`: 12,031 requests an hour, 12,035 input and 343 output
//!   tokens on average, 40 % of tokens reusable (Mooncake FAST'25, Table 2).
//!   Its shape, measured on the published file: every prompt starts with
//!   one common 512-token block; input lengths lognormal (median 6,909,
//!   p90 27,367, p99 85,399); 39 % of requests continue an earlier one
//!   (the whole earlier prompt, then a median 2 new blocks), a median 147 s
//!   later (p90 552 s); output lengths p10 24, p50 350, p90 597, p99 1,115.
//! - `agentic` (Mooncake's tool&agent): 23,608 requests an hour, 8,596
//!   input and 182 output tokens on average, 59 % reusable, from "lengthy
//!   system prompts that are fully repetitive". Modelled as 32 tools'
//!   system prompts (popularity Zipf 1, median 4,096 tokens), a request's
//!   own part after it, and agent loops: half the requests are followed,
//!   a few seconds later, by a call that extends them with a tool's output.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::trace_file::{Row, MOONCAKE_BLOCK};

/// Longest prompt a session may grow to (Mooncake's traces stop at 128k).
const MAX_INPUT: u32 = 131_072;

/// A workload to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Shape {
    Agentic,
    Conversation,
}

/// Median and sigma of a lognormal length.
#[derive(Debug, Clone, Copy)]
struct LogNormal(f64, f64);

impl LogNormal {
    fn draw(self, rng: &mut SmallRng) -> f64 {
        // Box-Muller.
        let (u, v): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
        self.0 * (self.1 * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()).exp()
    }
}

/// Output lengths of the published conversation trace at quantiles 0, 10,
/// 25, 50, 75, 90, 99 and 100 %.
const OUTPUT_QUANTILES: [(f64, f64); 8] =
    [(0.0, 1.0), (0.1, 24.0), (0.25, 156.0), (0.5, 350.0), (0.75, 472.0), (0.9, 597.0), (0.99, 1115.0), (1.0, 1500.0)];

struct Params {
    /// Requests per second.
    rate: f64,
    /// Chance that a session's request is followed by another.
    goes_on: f64,
    /// Seconds from a request to the next of its session.
    gap: LogNormal,
    /// Tokens of a session's first request after the system prompt.
    first: LogNormal,
    /// Tokens a later request adds after the last one's answer.
    added: LogNormal,
    /// Scales `OUTPUT_QUANTILES`.
    output_scale: f64,
    /// `(tools, median tokens)`: system prompts chosen Zipf(1); else one common block.
    tools: Option<(usize, f64)>,
}

fn params(shape: Shape) -> Params {
    match shape {
        Shape::Conversation => Params {
            rate: 12_031.0 / 3600.0,
            goes_on: 0.39,
            gap: LogNormal(147.0, 1.03),
            first: LogNormal(5_000.0, 1.3),
            added: LogNormal(700.0, 1.2),
            output_scale: 1.0,
            tools: None,
        },
        Shape::Agentic => Params {
            rate: 23_608.0 / 3600.0,
            goes_on: 0.2,
            gap: LogNormal(4.0, 1.0),
            first: LogNormal(2_400.0, 1.0),
            added: LogNormal(500.0, 1.0),
            output_scale: 182.0 / 343.0,
            tools: Some((32, 4_096.0)),
        },
    }
}

/// The output length at quantile `q`, linear between the published points, times `scale`.
fn output_at(q: f64, scale: f64) -> u32 {
    let i = OUTPUT_QUANTILES.iter().position(|&(p, _)| p >= q).unwrap_or(7).max(1);
    let ((p0, v0), (p1, v1)) = (OUTPUT_QUANTILES[i - 1], OUTPUT_QUANTILES[i]);
    ((v0 + (v1 - v0) * (q - p0) / (p1 - p0)) * scale).round().max(1.0) as u32
}

fn output(rng: &mut SmallRng, scale: f64) -> u32 {
    output_at(rng.random(), scale)
}

/// Hands out fresh block ids.
struct Ids(u64);

impl Ids {
    fn take(&mut self, n: u32) -> Vec<u64> {
        let first = self.0;
        self.0 += u64::from(n);
        (first..self.0).collect()
    }
}

/// `requests` rows of `shape`, seeded, by arrival.
pub fn generate(shape: Shape, requests: usize, seed: u64) -> Vec<Row> {
    let p = params(shape);
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x6e6e_7261_6365);
    let block = MOONCAKE_BLOCK;
    let mut ids = Ids(0);
    // Each tool's system prompt, in whole blocks; or the one common block.
    let systems: Vec<Vec<u64>> = match p.tools {
        Some((n, median)) => {
            (0..n).map(|_| ids.take((LogNormal(median, 0.4).draw(&mut rng) as u32).div_ceil(block))).collect()
        }
        None => vec![ids.take(1)],
    };
    let zipf: Vec<f64> = (1..=systems.len()).map(|k| 1.0 / k as f64).collect();
    let total: f64 = zipf.iter().sum();
    let mut rows: Vec<Row> = Vec::new();
    let mut start_s = 0.0;
    let session_rate = p.rate * (1.0 - p.goes_on);
    while rows.iter().filter(|r| r.at_ms <= start_s * 1000.0).count() < requests {
        start_s += -rng.random_range(f64::EPSILON..1.0f64).ln() / session_rate;
        let mut pick = rng.random_range(0.0..total);
        let tool = zipf.iter().position(|w| {
            pick -= w;
            pick < 0.0
        });
        let mut context = systems[tool.unwrap_or(0)].clone();
        let mut tail = (p.first.draw(&mut rng) as u32).max(1);
        let mut at = start_s;
        loop {
            let input = context.len() as u32 * block + tail;
            if input > MAX_INPUT {
                break;
            }
            let mut hash_ids = context.clone();
            hash_ids.extend(ids.take(tail.div_ceil(block)));
            let out = output(&mut rng, p.output_scale);
            rows.push(Row {
                at_ms: (at * 1000.0).round(),
                input_length: input,
                output_length: out,
                hash_ids: hash_ids.clone(),
                chat_id: None,
                parent_chat_id: None,
            });
            if rng.random::<f64>() >= p.goes_on {
                break;
            }
            // The next request: this prompt's whole blocks, then the rest of it, its answer and what is added.
            context = hash_ids[..(input / block) as usize].to_vec();
            tail = input % block + out + (p.added.draw(&mut rng) as u32).max(1);
            at += p.gap.draw(&mut rng);
        }
    }
    rows.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    rows.truncate(requests);
    rows
}

/// What a trace is like, as its publishers count it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    pub requests: usize,
    /// From the first arrival to the last.
    pub seconds: f64,
    pub mean_input: f64,
    pub mean_output: f64,
    /// Share of prompt tokens in blocks an earlier request had: what an
    /// infinite cache shared by all ranks would hit.
    pub reusable: f64,
}

pub fn stats(rows: &[Row], block: u32) -> Stats {
    let mut seen = std::collections::HashSet::new();
    let (mut reused, mut input, mut output) = (0u64, 0u64, 0u64);
    for r in rows {
        let hit = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count() as u64 * u64::from(block);
        reused += hit.min(u64::from(r.input_length));
        input += u64::from(r.input_length);
        output += u64::from(r.output_length);
        seen.extend(r.hash_ids.iter().copied());
    }
    let n = rows.len().max(1) as f64;
    let span = rows.last().zip(rows.first()).map_or(0.0, |(l, f)| (l.at_ms - f.at_ms) / 1000.0);
    Stats {
        requests: rows.len(),
        seconds: span,
        mean_input: input as f64 / n,
        mean_output: output as f64 / n,
        reusable: reused as f64 / input.max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_writes_the_same_trace_and_lengths_match_the_ids() {
        let a = generate(Shape::Agentic, 300, 1);
        assert_eq!(a, generate(Shape::Agentic, 300, 1));
        assert_ne!(a, generate(Shape::Agentic, 300, 2));
        assert_eq!(a.len(), 300);
        for r in &a {
            assert_eq!(r.hash_ids.len() as u32, r.input_length.div_ceil(MOONCAKE_BLOCK), "{r:?}");
        }
        assert!(a.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    }

    #[test]
    fn output_quantiles_interpolate() {
        assert_eq!([0.0, 0.1, 0.5, 0.99].map(|q| output_at(q, 1.0)), [1, 24, 350, 1115]);
        // A fifth of the way from p25 (156) to p50 (350).
        assert_eq!(output_at(0.3, 1.0), 195);
        assert_eq!(output_at(0.5, 182.0 / 343.0), 186);
    }
}
