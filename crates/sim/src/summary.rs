//! One arm of a scenario, summarized: the numbers a report shows, taken
//! from what the run recorded (`record`) and cut at each resize (`phase`).

use super::model::Micros;
use super::phase::{phases, Phase};
use super::record::{percentile, std_dev, Death, Mark, PendingError, Recorder, Request, Sample};

impl Recorder {
    /// The numbers of a finished run.
    pub fn summarize(&self, name: &str, policy: &str, sync_timeouts: u64) -> ArmResult {
        let done: Vec<&Request> = self.requests.iter().filter(|r| r.done.is_some()).collect();
        let mut ttft: Vec<Micros> =
            done.iter().filter_map(|r| r.first_token.map(|t| t.saturating_sub(r.issued))).collect();
        ttft.sort_unstable();
        let makespan = done.iter().filter_map(|r| r.done).max().unwrap_or(0);
        ArmResult {
            name: name.to_owned(),
            policy: policy.to_owned(),
            completed: done.len() as u64,
            lost: (self.requests.len() - done.len()) as u64,
            retries: self.requests.iter().map(|r| u64::from(r.attempts.saturating_sub(1))).sum(),
            input_tokens: done.iter().map(|r| u64::from(r.prompt)).sum(),
            makespan,
            ttft_p50: percentile(&ttft, 50),
            ttft_p90: percentile(&ttft, 90),
            ttft_p99: percentile(&ttft, 99),
            cached_tokens: done.iter().map(|r| u64::from(r.cached)).sum(),
            output_tokens: done.iter().map(|r| u64::from(r.output)).sum(),
            hits: self.hits.clone(),
            placements: self.placements.clone(),
            probes: self.probes.clone(),
            probe_failures: self.probe_failures,
            refusals: self.refusals,
            sync_timeouts,
            samples: self.samples.clone(),
            marks: self.marks.clone(),
            phases: phases(self, makespan),
            pending: self.pending,
            late: self.late,
            death: self.death,
            hang: self.hang,
            timeouts: self.timeouts,
            off_node: self.off_node,
        }
    }
}

/// One arm of a scenario, summarized.
#[derive(Debug, Clone)]
pub struct ArmResult {
    pub name: String,
    pub policy: String,
    pub completed: u64,
    /// Requests sent but never completed.
    pub lost: u64,
    pub retries: u64,
    pub input_tokens: u64,
    /// Virtual time of the last completion.
    pub makespan: Micros,
    pub ttft_p50: Micros,
    pub ttft_p90: Micros,
    pub ttft_p99: Micros,
    /// Prompt tokens of completed requests their engine found cached.
    pub cached_tokens: u64,
    pub output_tokens: u64,
    /// Per rank, `[prompt tokens, of them cached]`.
    pub hits: Vec<[u64; 2]>,
    /// User requests handed to each rank.
    pub placements: Vec<u64>,
    pub probes: Vec<u64>,
    pub probe_failures: u64,
    pub refusals: u64,
    pub sync_timeouts: u64,
    pub samples: Vec<Sample>,
    pub marks: Vec<Mark>,
    /// The run cut at each resize of dpcoord's table.
    pub phases: Vec<Phase>,
    pub pending: PendingError,
    pub late: u64,
    pub death: Option<Death>,
    pub hang: Option<Death>,
    pub timeouts: u64,
    /// Over nodes: user placements outside the asking API server's node.
    pub off_node: u64,
}

impl ArmResult {
    /// Input tokens per virtual second.
    pub fn input_tps(&self) -> f64 {
        if self.makespan == 0 {
            return 0.0;
        }
        self.input_tokens as f64 / (self.makespan as f64 / 1e6)
    }

    pub fn placement_std(&self) -> f64 {
        std_dev(&self.placements)
    }

    /// Cached prompt tokens / prompt tokens, over completed requests.
    pub fn hit_rate(&self) -> f64 {
        self.cached_tokens as f64 / self.input_tokens.max(1) as f64
    }
}
