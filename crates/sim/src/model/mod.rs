//! The simulated engine: one DP rank's scheduler and its step-time model.
//!
//! A rank keeps a FIFO of waiting jobs and a running batch. Each step gets a
//! token budget (`chunk`): running jobs past prefill decode one token each,
//! then prefill continues in chunks (running jobs first, then waiting jobs
//! admitted in order), the way vLLM and SGLang schedule chunked prefill. A
//! step costs `overhead + tokens * token_cost`, divided by the rank's speed.
//! The last prefill chunk of a job yields its first output token.
//! Pure state, no I/O, no clock: the caller passes virtual time in.

use std::collections::VecDeque;
use std::sync::Arc;

use super::prefix_cache::{CacheSpec, KvEvent, PrefixCache};
use super::prompts::Prompt;

/// Virtual time in microseconds since the start of a run.
pub type Micros = u64;

/// How long a step takes: `overhead_us + tokens * token_ns / 1000`, times
/// `100 / speed_pct` (a rank at 50 % takes twice as long).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCost {
    pub overhead_us: u64,
    pub token_ns: u64,
}

/// Calibrated so eight ranks with 8192-token chunks prefill about 97k
/// tokens/s, the scale of the documented deployment.
pub const DEFAULT_COST: StepCost = StepCost { overhead_us: 20_000, token_ns: 80_000 };

/// One request inside an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub id: u64,
    pub prompt: u32,
    pub output: u32,
    /// When the engine received it.
    pub arrived: Micros,
    prefilled: u32,
    generated: u32,
    /// Tokens of this job in the step in flight.
    scheduled: u32,
    /// Its tokens, when the engine has a prefix cache to look them up in.
    content: Option<Arc<Prompt>>,
    /// Blocks of `content` it references in the cache.
    held: usize,
    /// Prompt tokens found in the cache when it joined the batch.
    cached: u32,
}

impl Job {
    pub fn new(id: u64, prompt: u32, output: u32, arrived: Micros) -> Job {
        let (prompt, output) = (prompt.max(1), output.max(1));
        Job { id, prompt, output, arrived, prefilled: 0, generated: 0, scheduled: 0, content: None, held: 0, cached: 0 }
    }

    /// A job whose prompt and answer are `content`'s tokens.
    pub fn with_content(id: u64, content: Arc<Prompt>, arrived: Micros) -> Job {
        let mut job = Job::new(id, content.prompt_len, content.output_len(), arrived);
        job.content = Some(content);
        job
    }

    fn left(&self) -> u64 {
        u64::from(self.prompt - self.prefilled) + u64::from(self.output - self.generated)
    }
}

/// What a finished step did to one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advance {
    pub id: u64,
    /// The job produced its first output token in this step.
    pub first_token: bool,
    /// The job produced its last output token and left the engine.
    pub finished: bool,
    /// Prompt tokens it found in the prefix cache.
    pub cached: u32,
}

/// One simulated DP rank.
#[derive(Debug, Clone)]
pub struct SimEngine {
    chunk: u32,
    max_running: usize,
    cost: StepCost,
    speed_pct: u32,
    waiting: VecDeque<Job>,
    running: Vec<Job>,
    received: u64,
    finished: u64,
    failed: u64,
    /// Prompt tokens prefilled so far, over every job.
    prefilled: u64,
    alive: bool,
    /// Hung: it takes no step, queues nothing more, and its counts stand still.
    hung: bool,
    /// Steps it has taken with work in them (`StatsUpdate.progress`).
    steps: u64,
    /// Mean time to first token in ms, smoothed over recent jobs.
    ttft_ms: Option<f64>,
    cache: Option<PrefixCache>,
    /// `[prompt tokens, of them found cached]` over every job with tokens admitted to the batch
    /// (both 0 without a prefix cache).
    pub hits: [u64; 2],
}

impl SimEngine {
    pub fn new(chunk: u32, max_running: usize, cost: StepCost, speed_pct: u32) -> SimEngine {
        SimEngine {
            chunk: chunk.max(1),
            max_running: max_running.max(1),
            cost,
            speed_pct: speed_pct.max(1),
            waiting: VecDeque::new(),
            running: Vec::new(),
            received: 0,
            finished: 0,
            failed: 0,
            prefilled: 0,
            alive: true,
            hung: false,
            steps: 0,
            ttft_ms: None,
            cache: None,
            hits: [0; 2],
        }
    }

    /// Gives the engine a prefix cache: prefill then costs only the
    /// prompt tokens after the cached prefix.
    pub fn with_cache(mut self, spec: Option<CacheSpec>) -> SimEngine {
        self.cache = spec.map(PrefixCache::new);
        self
    }

    /// The prefix cache's block size, if the engine has one.
    pub fn block_size(&self) -> Option<u32> {
        self.cache.as_ref().map(|c| c.spec.block)
    }

    /// Whole blocks of `hashes`, from the first, the cache holds now.
    pub fn cached_blocks(&self, hashes: &[u64]) -> usize {
        self.cache.as_ref().map_or(0, |c| c.matched(hashes))
    }

    /// The cache's stores and evictions since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.cache.as_mut().map_or_else(Vec::new, PrefixCache::take_events)
    }

    /// Looks a job's prompt up as it joins the batch (as vLLM's scheduler
    /// does): the prefix found is not computed again, though at least the
    /// last prompt token is.
    fn look_up(&mut self, job: &mut Job) {
        let (Some(c), Some(p)) = (self.cache.as_mut(), job.content.as_ref()) else { return };
        self.hits[0] += u64::from(job.prompt);
        let n = c.acquire(&p.hashes[..p.prompt_blocks(c.spec.block)]);
        job.held = n;
        job.prefilled = (n as u32 * c.spec.block).min(job.prompt - 1);
        job.cached = job.prefilled;
        self.hits[1] += u64::from(job.prefilled);
    }

    /// Whether `job` may join the batch: always, unless the cache is the
    /// rank's bounded KV memory and the blocks the job adds (those of its
    /// prompt and answer it does not find) do not fit beside those running
    /// jobs hold or are still to fill. A job joins an empty batch whatever
    /// its size.
    fn fits(&self, job: &Job) -> bool {
        let (Some(c), Some(p)) = (self.cache.as_ref(), job.content.as_ref()) else { return true };
        if !c.spec.bounded || self.running.is_empty() {
            return true;
        }
        let found = c.matched(&p.hashes[..p.prompt_blocks(c.spec.block)]);
        // What running jobs hold, and the blocks (and partial one) each is still to fill.
        let ahead: usize =
            self.running.iter().filter_map(|j| j.content.as_ref().map(|q| q.hashes.len() + 1 - j.held)).sum();
        c.referenced() + ahead + p.hashes.len() + 1 - found <= c.spec.capacity
    }

    pub fn is_alive(&self) -> bool {
        self.alive
    }

    /// Whether a request sent to it now would be answered (alive, not hung).
    pub fn answers(&self) -> bool {
        self.alive && !self.hung
    }

    /// Queues a job; `false` (and nothing queued) when the engine is dead.
    /// A hung engine takes the job and never queues it: its scheduler does
    /// not run, so its counts do not move.
    pub fn admit(&mut self, job: Job) -> bool {
        if self.alive && !self.hung {
            self.received += 1;
            self.waiting.push_back(job);
        }
        self.alive
    }

    pub fn has_work(&self) -> bool {
        self.alive && !self.hung && !(self.waiting.is_empty() && self.running.is_empty())
    }

    /// Schedules the next step and returns the tokens in it: one decode
    /// token per job past prefill, then prefill chunks within the budget.
    pub fn plan(&mut self) -> u32 {
        if !self.alive || self.hung {
            return 0;
        }
        let mut budget = self.chunk;
        for job in self.running.iter_mut().filter(|j| j.prefilled == j.prompt) {
            if budget == 0 {
                break;
            }
            job.scheduled = 1;
            budget -= 1;
        }
        for job in self.running.iter_mut().filter(|j| j.prefilled < j.prompt) {
            let take = budget.min(job.prompt - job.prefilled);
            job.scheduled = take;
            budget -= take;
        }
        while budget > 0 && self.running.len() < self.max_running && self.waiting.front().is_some_and(|j| self.fits(j))
        {
            let Some(mut job) = self.waiting.pop_front() else { break };
            self.look_up(&mut job);
            job.scheduled = budget.min(job.prompt - job.prefilled);
            budget -= job.scheduled;
            self.running.push(job);
        }
        self.chunk - budget
    }

    /// Virtual duration of a step holding `tokens` tokens (0 for none).
    pub fn step_us(&self, tokens: u32) -> Micros {
        if tokens == 0 {
            return 0;
        }
        let base = self.cost.overhead_us + u64::from(tokens) * self.cost.token_ns / 1000;
        base * 100 / u64::from(self.speed_pct)
    }

    /// Applies the planned step, which ended at `now`; reports each job it moved.
    pub fn finish(&mut self, now: Micros, out: &mut Vec<Advance>) {
        if self.hung {
            // The step in flight never ends.
            return;
        }
        self.steps += u64::from(self.running.iter().any(|j| j.scheduled > 0));
        for job in &mut self.running {
            if job.scheduled == 0 {
                continue;
            }
            let mut first_token = false;
            if job.prefilled < job.prompt {
                job.prefilled += job.scheduled;
                self.prefilled += u64::from(job.scheduled);
                if let (Some(c), Some(p)) = (self.cache.as_mut(), job.content.as_ref()) {
                    // Blocks fill as prefill goes; each whole one is stored.
                    let full = (job.prefilled / c.spec.block) as usize;
                    if full > job.held {
                        c.store(&p.hashes, &p.tokens, job.held, full);
                        job.held = full;
                    }
                }
                if job.prefilled == job.prompt {
                    job.generated = 1;
                    first_token = true;
                }
            } else {
                job.generated += 1;
            }
            job.scheduled = 0;
            if first_token {
                let ms = now.saturating_sub(job.arrived) as f64 / 1000.0;
                self.ttft_ms = Some(self.ttft_ms.map_or(ms, |m| 0.8 * m + 0.2 * ms));
            }
            let finished = job.generated >= job.output;
            if let (true, Some(c), Some(p)) = (finished, self.cache.as_mut(), job.content.as_ref()) {
                // The answer's whole blocks are stored too; then the job lets go.
                c.store(&p.hashes, &p.tokens, job.held, p.hashes.len());
                c.release(&p.hashes);
                job.held = 0;
            }
            if first_token || finished {
                out.push(Advance { id: job.id, first_token, finished, cached: job.cached });
            }
        }
        let before = self.running.len();
        self.running.retain(|j| j.generated < j.output);
        self.finished += (before - self.running.len()) as u64;
    }

    /// The rank dies: every job it holds fails and is returned.
    pub fn kill(&mut self) -> Vec<Job> {
        self.alive = false;
        let mut lost: Vec<Job> = self.running.drain(..).collect();
        lost.extend(self.waiting.drain(..));
        self.failed += lost.len() as u64;
        lost
    }

    /// The engine hangs: it never steps again, and what it holds stays.
    pub fn hang(&mut self) {
        self.hung = true;
    }

    /// The frontend gave up on job `id`: a live engine drops it (and lets
    /// go of its cached blocks); a hung one cannot, and keeps it.
    pub fn abort(&mut self, id: u64) {
        if self.hung {
            return;
        }
        let ran = self.running.iter().position(|j| j.id == id).map(|i| self.running.remove(i));
        let waited = self.waiting.iter().position(|j| j.id == id).and_then(|i| self.waiting.remove(i));
        for job in ran.into_iter().chain(waited) {
            if let (Some(c), Some(p)) = (self.cache.as_mut(), job.content.as_ref()) {
                c.release(&p.hashes[..job.held]);
            }
            self.failed += 1;
        }
    }

    /// Steps taken with work in them: the `progress` it reports.
    pub fn progress(&self) -> u64 {
        self.steps
    }

    /// `[waiting, running, received, finished, failed]`, as in `StatsUpdate`.
    pub fn counts(&self) -> [u64; 5] {
        [self.waiting.len() as u64, self.running.len() as u64, self.received, self.finished, self.failed]
    }

    /// `[waiting_tokens, running_tokens]`: prompt tokens queued, tokens left in the batch.
    pub fn tokens(&self) -> [u64; 2] {
        let waiting = self.waiting.iter().map(|j| u64::from(j.prompt)).sum();
        [waiting, self.running.iter().map(Job::left).sum()]
    }

    pub fn ttft_ms(&self) -> Option<f64> {
        self.ttft_ms
    }

    /// The share of the KV cache that running jobs hold (vLLM's
    /// `kv_cache_usage`); 0 for an engine without a prefix cache, which
    /// models no KV memory.
    pub fn kv_usage(&self) -> f64 {
        self.cache.as_ref().map_or(0.0, PrefixCache::usage)
    }

    /// Prompt tokens this rank has prefilled since it started.
    pub fn prefilled(&self) -> u64 {
        self.prefilled
    }
}

#[cfg(test)]
mod tests;
