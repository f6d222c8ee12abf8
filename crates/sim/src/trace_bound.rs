//! The bound of a trace replay: for every request, the least TTFT, the
//! earliest completion and the most cached tokens that any placement could
//! give it on the simulator's engines, whatever their caches hold; and for
//! the run, the shortest makespan. No arm can do better on any of them.
//!
//! Why. Let `h` be the number of leading prompt blocks of request `i` found
//! in some other request that arrived no later than `i` (its prompt or its
//! answer). A rank queues in arrival order and looks a prompt up when the
//! prompt joins its batch, so the blocks it finds were computed for
//! requests that arrived before `i`, or with it: at most `h`. It then
//! prefills at least `n = prompt - min(h x block, prompt - 1)` tokens, at
//! most `chunk` a step, and a step of `k` tokens lasts `overhead + k x
//! token_cost`: TTFT >= ceil(n / chunk) x overhead + n x token_cost. Each of
//! the remaining `output - 1` tokens takes a step of its own, so the request
//! is done no sooner than arrival + that TTFT + (output - 1) x (overhead +
//! token_cost). The blocks counted in `n` are found in no earlier request,
//! so they are computed at least once each; with the decode tokens that is
//! at least `W = sum n + sum (output - 1)` tokens over all ranks, which take
//! at least `W x (overhead / chunk + token_cost) / ranks` of time. The
//! makespan is at least the larger of the two, and every percentile of the
//! bound's TTFTs is at most the same percentile of any arm's.

use std::collections::HashMap;

use super::model::{Micros, StepCost};
use super::record::{Recorder, Request};
use super::summary::ArmResult;
use super::trace_replay::Replay;

/// The bound as an arm result, labelled `bound` at `frontends` frontends.
pub fn bound(replay: &Replay, block: u32, chunk: u32, cost: StepCost, ranks: u32, frontends: u32) -> ArmResult {
    let step = |tokens: u64| cost.overhead_us + tokens * cost.token_ns / 1000;
    let chunk = u64::from(chunk.max(1));
    let reqs = &replay.requests;
    let mut seen: HashMap<u64, u32> = HashMap::new();
    let mut rec = Recorder::new(ranks);
    let mut work = 0u64;
    let mut i = 0;
    while i < reqs.len() {
        // Requests arriving together: each may find the others' blocks.
        let end = i + reqs[i..].iter().take_while(|(t, _)| *t == reqs[i].0).count();
        for (_, p) in &reqs[i..end] {
            for h in &p.hashes {
                *seen.entry(*h).or_default() += 1;
            }
        }
        for (t, p) in &reqs[i..end] {
            let blocks = &p.hashes[..p.prompt_blocks(block)];
            let h = blocks.iter().take_while(|h| seen.get(h).copied().unwrap_or(0) > 1).count() as u32;
            let prompt = p.prompt_len.max(1);
            let output = p.output_len().max(1);
            let cached = (h * block).min(prompt - 1);
            let n = u64::from(prompt - cached);
            let ttft = n.div_ceil(chunk) * cost.overhead_us + n * cost.token_ns / 1000;
            let done = t + ttft + u64::from(output - 1) * step(1);
            work += n + u64::from(output - 1);
            rec.requests.push(Request {
                prompt,
                output,
                issued: *t,
                first_token: Some(t + ttft),
                done: Some(done),
                cached,
                ..Request::default()
            });
        }
        i = end;
    }
    let busy = work as f64 * (cost.overhead_us as f64 / chunk as f64 + cost.token_ns as f64 / 1000.0);
    let by_work = (busy / f64::from(ranks.max(1))).ceil() as Micros;
    let mut r = rec.summarize(&format!("bound/{frontends}"), "bound", 0);
    r.makespan = r.makespan.max(by_work);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DEFAULT_COST;
    use crate::prompts::Prompt;
    use std::sync::Arc;

    #[test]
    fn only_blocks_of_earlier_requests_count_and_work_bounds_the_makespan() {
        let p = |tokens: Vec<u32>, prompt| Arc::new(Prompt::new(tokens, prompt, 4, None));
        // Two requests at 0 share their first block; the third, later, repeats the first's prompt.
        let a = p((1..=10).collect(), 8);
        let b = p(vec![1, 2, 3, 4, 9, 9, 9, 9, 9], 8);
        let c = p((1..=9).collect(), 8);
        let replay = Replay { requests: vec![(0, a), (0, b), (5_000_000, c)] };
        let r = bound(&replay, 4, 4, DEFAULT_COST, 2, 1);
        // a and b each find one block (4 tokens), prefill 4 in one step of 20 ms + 4 x 80 us;
        // c finds both blocks of a and prefills its last token only (20 ms + 80 us).
        assert_eq!((r.completed, r.input_tokens, r.cached_tokens), (3, 24, 4 + 4 + 7));
        assert_eq!((r.ttft_p50, r.ttft_p99), (20_320, 20_320));
        // c, done with its first token, is last; by work it would be far sooner.
        assert_eq!(r.makespan, 5_000_000 + 20_080);
        let lone = Replay { requests: (0..100).map(|_| (0, p((0..40).collect(), 39))).collect() };
        let w = bound(&lone, 4, 8, DEFAULT_COST, 1, 1);
        // Every one finds the others' 9 blocks, so prefills 3 tokens; 300 tokens of work at
        // 20 ms / 8 + 80 us a token: 774 ms on one rank.
        assert_eq!(w.makespan, 774_000);
    }
}
