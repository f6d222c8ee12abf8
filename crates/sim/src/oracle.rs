//! The oracle arm: places each request itself by reading every simulated
//! rank's true cache at decision time, with `cache_aware`'s cost
//! (docs/PROTOCOL.md §7) on true cached prefix lengths and true token
//! loads: what the policy would do with a perfect, instant index.

use super::model::SimEngine;
use super::prompts::Prompt;
use super::spec::CacheWeights;

/// The rank for `p` among the first `ranks` live engines, the scan
/// starting at `cursor` so ties rotate (as `least_load`); `None` when no
/// rank is alive.
pub fn pick(engines: &[SimEngine], ranks: u32, p: &Prompt, block: u32, w: CacheWeights, cursor: u32) -> Option<u32> {
    let n = (ranks as usize).min(engines.len());
    let live: Vec<usize> = (0..n).filter(|&r| engines[r].is_alive()).collect();
    let load = |r: usize| engines[r].tokens().iter().sum::<u64>() as f64;
    let (lo, hi) = live.iter().map(|&r| load(r)).fold((f64::INFINITY, 0.0f64), |(lo, hi), l| (lo.min(l), hi.max(l)));
    let guard = hi - lo > w.balance_abs && hi > w.balance_rel * lo;
    let blocks = p.prompt_blocks(block);
    let mut best: Option<(f64, u32)> = None;
    for i in 0..n {
        let r = (cursor as usize + i) % n;
        if !engines[r].is_alive() {
            continue;
        }
        let cached = engines[r].cached_blocks(&p.hashes[..blocks]) as u64 * u64::from(block);
        let uncached = u64::from(p.prompt_len).saturating_sub(cached) as f64;
        let cost = load(r) + if guard { 0.0 } else { w.prefill * uncached } + 1.0;
        if best.is_none_or(|(c, _)| cost < c) {
            best = Some((cost, r as u32));
        }
    }
    best.map(|(_, r)| r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Job, DEFAULT_COST};
    use crate::prefix_cache::CacheSpec;
    use std::sync::Arc;

    #[test]
    fn the_rank_holding_the_prefix_wins_until_the_guard_trips() {
        let spec = Some(CacheSpec { block: 4, capacity: 100, bounded: false });
        let mut e: Vec<SimEngine> =
            (0..3).map(|_| SimEngine::new(8192, 256, DEFAULT_COST, 100).with_cache(spec)).collect();
        let p = Arc::new(Prompt::new((1..=41).collect(), 40, 4, None));
        e[1].admit(Job::with_content(1, Arc::clone(&p), 0));
        e[1].plan();
        e[1].finish(1, &mut Vec::new());
        assert_eq!(e[1].cached_blocks(&p.hashes), 10);
        // Rank 1 now queues 10 tokens of other work, and holds the whole prompt.
        e[1].admit(Job::new(2, 10, 1, 0));
        let w = CacheWeights::default();
        assert_eq!(pick(&e, 3, &p, 4, w, 0), Some(1));
        let strict = CacheWeights { balance_abs: 0.0, balance_rel: 1.0, ..w };
        assert_eq!(pick(&e, 3, &p, 4, strict, 0), Some(0), "the guard: token load alone");
        assert_eq!(pick(&e, 3, &p, 4, strict, 2), Some(2), "ties rotate with the cursor");
    }
}
