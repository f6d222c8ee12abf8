//! Tests of `model`: step times, chunked prefill, the batch cap, deaths, hangs, aborts, TTFT, the prefix cache.

use super::*;

fn engine(chunk: u32) -> SimEngine {
    SimEngine::new(chunk, 256, DEFAULT_COST, 100)
}

/// Runs steps back to back until idle; returns (step end times, advances).
fn drain(e: &mut SimEngine) -> (Vec<Micros>, Vec<(Micros, Advance)>) {
    let (mut now, mut ends, mut seen, mut out) = (0, Vec::new(), Vec::new(), Vec::new());
    while e.has_work() {
        let tokens = e.plan();
        now += e.step_us(tokens);
        e.finish(now, &mut out);
        ends.push(now);
        seen.extend(out.drain(..).map(|a| (now, a)));
    }
    (ends, seen)
}

#[test]
fn step_time_is_proportional_to_tokens_and_speed() {
    let e = engine(8192);
    assert_eq!(e.step_us(0), 0);
    assert_eq!(e.step_us(8192), 20_000 + 655_360);
    assert_eq!(e.step_us(1), 20_080);
    let slow = SimEngine::new(8192, 256, DEFAULT_COST, 50);
    assert_eq!(slow.step_us(8192), 2 * 675_360);
}

#[test]
fn a_60k_prompt_takes_eight_chunks_and_its_first_token_ends_it() {
    let mut e = engine(8192);
    assert!(e.admit(Job::new(7, 60_000, 1, 0)));
    assert_eq!(e.counts(), [1, 0, 1, 0, 0]);
    assert_eq!(e.tokens(), [60_000, 0]);
    assert_eq!(e.plan(), 8192);
    assert_eq!((e.counts(), e.tokens()), ([0, 1, 1, 0, 0], [0, 60_001]));
    let mut out = Vec::new();
    e.finish(675_360, &mut out);
    assert!(out.is_empty());
    assert_eq!(e.tokens(), [0, 60_000 - 8192 + 1]);
    let (ends, seen) = drain(&mut e);
    // Six more full chunks, then 60000 - 7 * 8192 = 2656 tokens.
    assert_eq!(ends.len(), 7);
    let last = 6 * 675_360 + 20_000 + 2656 * 80;
    assert_eq!(seen, [(last, Advance { id: 7, first_token: true, finished: true, cached: 0 })]);
    assert_eq!((e.counts(), e.prefilled()), ([0, 0, 1, 1, 0], 60_000));
}

#[test]
fn chunks_spill_into_the_next_job_and_decode_goes_first() {
    let mut e = engine(8192);
    e.admit(Job::new(1, 60_000, 3, 0));
    e.admit(Job::new(2, 60_000, 1, 0));
    let (ends, seen) = drain(&mut e);
    // 120000 prefill tokens = 14 full chunks + 5312; job 1's two decode
    // tokens ride in steps 9 and 10 ahead of job 2's prefill.
    assert_eq!(ends.len(), 15);
    let ids: Vec<(usize, u64, bool, bool)> = seen
        .iter()
        .map(|(t, a)| (ends.iter().position(|e| e == t).unwrap() + 1, a.id, a.first_token, a.finished))
        .collect();
    assert_eq!(ids, [(8, 1, true, false), (10, 1, false, true), (15, 2, true, true)]);
    let step9 = ends[8] - ends[7];
    assert_eq!(step9, 20_000 + 8192 * 80);
}

#[test]
fn a_bounded_cache_holds_a_job_back_until_its_blocks_fit() {
    let spec = CacheSpec { block: 4, capacity: 10, bounded: true };
    let mut e = engine(8192).with_cache(Some(spec));
    // Each job: 20 prompt and 2 answer tokens, 5 whole blocks; 6 with the partial one.
    let job = |id: u64, first: u32| {
        Job::with_content(id, Arc::new(Prompt::new((first..first + 22).collect(), 20, 4, None)), 0)
    };
    e.admit(job(1, 1));
    e.admit(job(2, 100));
    assert_eq!(e.plan(), 20, "job 1 joins the empty batch; job 2's 6 blocks do not fit beside its 5");
    assert_eq!(e.counts()[..2], [1, 1]);
    drain(&mut e);
    assert_eq!(e.counts()[3], 2, "job 2 ran once job 1 let go of its blocks");
    // Unbounded, both join at once.
    let mut free = engine(8192).with_cache(Some(CacheSpec { bounded: false, ..spec }));
    free.admit(job(1, 1));
    free.admit(job(2, 100));
    assert_eq!(free.plan(), 40);
}

#[test]
fn a_cached_prefix_is_not_prefilled_again() {
    let mut e = engine(8192).with_cache(Some(CacheSpec { block: 4, capacity: 100, bounded: false }));
    // 18 prompt tokens and 2 answer tokens: 5 whole blocks, 4 of them the prompt's.
    let p = Arc::new(Prompt::new((1..=20).collect(), 18, 4, None));
    e.admit(Job::with_content(1, Arc::clone(&p), 0));
    assert_eq!(e.plan(), 18);
    drain(&mut e);
    e.admit(Job::with_content(2, p, 0));
    assert_eq!(e.plan(), 2, "16 tokens cached, 2 to prefill");
    assert_eq!(e.hits, [36, 16]);
    let (_, seen) = drain(&mut e);
    assert_eq!(seen[0].1.cached, 16);
}

#[test]
fn batch_cap_keeps_jobs_waiting() {
    let mut e = SimEngine::new(100, 2, DEFAULT_COST, 100);
    for id in 0..3 {
        e.admit(Job::new(id, 10, 2, 0));
    }
    assert_eq!(e.plan(), 20);
    assert_eq!(e.counts(), [1, 2, 3, 0, 0]);
    let mut out = Vec::new();
    e.finish(1, &mut out);
    assert_eq!(out.len(), 2);
    // Two decode tokens; the third job still waits for a batch slot.
    assert_eq!(e.plan(), 2);
    e.finish(2, &mut out);
    assert_eq!(e.counts(), [1, 0, 3, 2, 0]);
    assert_eq!(e.plan(), 10);
}

#[test]
fn a_dead_engine_fails_its_jobs_and_refuses_more() {
    let mut e = engine(8192);
    e.admit(Job::new(1, 100, 1, 0));
    e.admit(Job::new(2, 100, 1, 0));
    e.plan();
    let lost: Vec<u64> = e.kill().iter().map(|j| j.id).collect();
    assert_eq!(lost, [1, 2]);
    assert_eq!(e.counts(), [0, 0, 2, 0, 2]);
    assert!(!e.admit(Job::new(3, 1, 1, 0)));
    assert_eq!((e.has_work(), e.plan()), (false, 0));
}

#[test]
fn ttft_is_smoothed() {
    let mut e = engine(100);
    let mut out = Vec::new();
    e.admit(Job::new(1, 100, 1, 0));
    e.plan();
    e.finish(10_000, &mut out);
    assert_eq!(e.ttft_ms(), Some(10.0));
    e.admit(Job::new(2, 100, 1, 10_000));
    e.plan();
    e.finish(30_000, &mut out);
    assert_eq!(e.ttft_ms(), Some(0.8 * 10.0 + 0.2 * 20.0));
}

#[test]
fn a_hung_engine_takes_no_step_and_its_counts_and_progress_stand_still() {
    let mut e = engine(8192);
    assert!(e.admit(Job::new(1, 20_000, 1, 0)));
    let mut out = Vec::new();
    e.plan();
    e.finish(675_360, &mut out);
    assert_eq!((e.progress(), e.counts()), (1, [0, 1, 1, 0, 0]));
    e.plan();
    e.hang();
    // The step in flight never ends; a job sent to it is taken and never queued.
    e.finish(1_350_720, &mut out);
    assert!(e.admit(Job::new(2, 100, 1, 0)));
    e.abort(1);
    assert_eq!((e.progress(), e.counts(), e.tokens()), (1, [0, 1, 1, 0, 0], [0, 11_809]));
    assert_eq!((e.has_work(), e.plan(), e.answers(), e.is_alive()), (false, 0, false, true));
}

#[test]
fn an_aborted_job_leaves_a_live_engine_as_failed() {
    let mut e = engine(8192);
    assert!(e.admit(Job::new(1, 20_000, 1, 0)));
    assert!(e.admit(Job::new(2, 20_000, 1, 0)));
    e.plan();
    e.abort(1);
    e.abort(2);
    e.abort(3);
    assert_eq!((e.counts(), e.tokens(), e.has_work()), ([0, 0, 2, 0, 2], [0, 0], false));
}
