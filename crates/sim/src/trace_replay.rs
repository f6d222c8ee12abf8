//! A trace turned into requests the simulator sends: token ids for every
//! row, arrival times in virtual microseconds.
//!
//! Each `hash_ids` block becomes the trace's block size of token ids drawn
//! from a generator seeded by the id, so equal ids give equal tokens and the
//! engines' own blocks (16 tokens) share exactly what the trace's blocks
//! share. The prompt is cut (or filled with tokens of its own) to
//! `input_length`; the answer, `output_length` tokens of its own, follows.
//! A row whose `hash_ids` cover less than its `input_length` and whose
//! `parent_chat_id` names an earlier row carries only its new blocks: its
//! context is the parent's prompt and answer, then those blocks.

use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::model::Micros;
use super::prompts::{draw, Prompt};
use super::trace_file::Trace;

/// Seeds the tokens of a trace block (any value: it only has to be fixed).
const BLOCK_SALT: u64 = 0x7ace_b10c;
/// Seeds the tokens that belong to one row only.
const ROW_SALT: u64 = 0x7ace_0a0a;

/// The requests of a replay, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    pub requests: Vec<(Micros, Arc<Prompt>)>,
}

fn block_tokens(id: u64, len: u32, out: &mut Vec<u32>) {
    draw(&mut SmallRng::seed_from_u64(id ^ BLOCK_SALT), len, out);
}

impl Replay {
    /// The first `limit` rows of `trace` (by arrival), arrivals divided by
    /// `time_scale`, prompts in blocks of `engine_block` tokens. `unshared`:
    /// every row's tokens are its own (the same lengths and times, nothing
    /// shared).
    pub fn new(trace: &Trace, limit: usize, time_scale: f64, engine_block: u32, unshared: bool) -> Replay {
        let mut order: Vec<usize> = (0..trace.rows.len()).collect();
        order.sort_by(|&a, &b| trace.rows[a].at_ms.total_cmp(&trace.rows[b].at_ms));
        order.truncate(limit);
        let start = order.first().map_or(0.0, |&i| trace.rows[i].at_ms);
        let mut by_chat: HashMap<i64, Arc<Prompt>> = HashMap::new();
        let mut requests = Vec::with_capacity(order.len());
        for (n, &i) in order.iter().enumerate() {
            let row = &trace.rows[i];
            let mut rng = SmallRng::seed_from_u64(ROW_SALT ^ (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut t = Vec::with_capacity((row.input_length + row.output_length) as usize);
            if !unshared {
                let covered = row.hash_ids.len() as u64 * u64::from(trace.block);
                if let Some(parent) = row.parent_chat_id.and_then(|p| by_chat.get(&p)) {
                    if covered < u64::from(row.input_length) {
                        t.extend_from_slice(&parent.tokens);
                    }
                }
                for &id in &row.hash_ids {
                    block_tokens(id, trace.block, &mut t);
                }
            }
            t.truncate(row.input_length as usize);
            draw(&mut rng, row.input_length - t.len() as u32, &mut t);
            draw(&mut rng, row.output_length, &mut t);
            let p = Arc::new(Prompt::new(t, row.input_length, engine_block, None));
            if let Some(c) = row.chat_id {
                by_chat.insert(c, Arc::clone(&p));
            }
            let at = ((row.at_ms - start).max(0.0) * 1000.0 / time_scale.max(1e-9)).round() as Micros;
            requests.push((at, p));
        }
        Replay { requests }
    }

    /// Frontend `f` of `of`'s share: every `of`-th request from the `f`-th.
    pub fn frontend(&self, f: u32, of: u32) -> Vec<(Micros, Arc<Prompt>)> {
        self.requests.iter().skip(f as usize).step_by(of.max(1) as usize).cloned().collect()
    }

    /// The last arrival.
    pub fn last_arrival(&self) -> Micros {
        self.requests.last().map_or(0, |(t, _)| *t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace_file::parse;

    #[test]
    fn equal_ids_share_engine_blocks_and_cut_to_length() {
        let text = r#"{"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [7, 8, 9]}
{"timestamp": 2, "input_length": 20, "output_length": 1, "hash_ids": [7, 5]}
"#;
        let mut t = parse(text, "t").unwrap();
        t.block = 16;
        let r = Replay::new(&t, 10, 2.0, 16, false);
        let (a, b) = (&r.requests[0].1, &r.requests[1].1);
        assert_eq!((r.requests[1].0, a.tokens.len(), a.prompt_len, b.tokens.len()), (1000, 43, 40, 21));
        // Block 7 is both prompts' first 16 tokens: one engine block in common.
        assert_eq!((a.hashes[0], b.hashes.len()), (b.hashes[0], 1));
        let none = Replay::new(&t, 10, 1.0, 16, true);
        assert_ne!(none.requests[0].1.hashes[0], none.requests[1].1.hashes[0]);
        assert_eq!((none.requests[0].1.tokens.len(), none.requests[1].0), (43, 2000));
        assert_eq!(r.frontend(1, 2), vec![r.requests[1].clone()]);
    }

    #[test]
    fn a_row_of_new_blocks_only_continues_its_parent() {
        let text = r#"{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 32, "output_length": 16, "hash_ids": [1, 2]}
{"chat_id": 2, "parent_chat_id": 1, "timestamp": 1.0, "input_length": 64, "output_length": 1, "hash_ids": [3]}
{"chat_id": 3, "parent_chat_id": 1, "timestamp": 2.0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}
"#;
        let r = Replay::new(&parse(text, "b").unwrap(), 10, 1.0, 16, false);
        let (parent, child, whole) = (&r.requests[0].1, &r.requests[1].1, &r.requests[2].1);
        // The parent's prompt and answer (48 tokens), then block 3.
        assert_eq!(&child.tokens[..48], &parent.tokens[..]);
        assert_eq!(&child.hashes[..3], &parent.hashes[..3]);
        // A row covering its whole input is taken as it is.
        assert_eq!(&whole.tokens[..32], &parent.tokens[..32]);
    }
}
