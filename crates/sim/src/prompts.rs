//! What requests say, for the prefix-cache runs: token ids, seeded so a run
//! repeats exactly. Three workloads:
//!
//! - `Shared`: many tenants, each with a long system prompt shared by its
//!   requests, then a short distinct question (llm-d's 150 tenants x 6k
//!   prefix + 1.2k question, scaled down);
//! - `Chat`: conversations whose every turn's prompt is the previous
//!   turn's prompt, its answer and a new user message;
//! - `Random`: prompts that share nothing.

use std::collections::VecDeque;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Token ids are drawn below this (a 50k vocabulary).
const VOCAB: u32 = 50_000;
/// The engine-side hash chain starts here (any value: dpcoord keys blocks itself).
const ENGINE_SEED: u64 = 0x5eed_b10c;

/// A request's tokens: its prompt, then the answer it will generate.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    pub prompt_len: u32,
    /// The engine-side hash of every whole block of `tokens`, each chained on the one before.
    pub hashes: Vec<u64>,
    /// `(conversation, turn)` of a chat request.
    pub turn: Option<(u64, u32)>,
}

impl Prompt {
    pub fn new(tokens: Vec<u32>, prompt_len: u32, block: u32, turn: Option<(u64, u32)>) -> Prompt {
        let mut parent = ENGINE_SEED;
        let hashes = tokens
            .chunks_exact(block.max(1) as usize)
            .map(|b| {
                let bytes: Vec<u8> = b.iter().flat_map(|t| t.to_le_bytes()).collect();
                parent = xxh3_64_with_seed(&bytes, parent);
                parent
            })
            .collect();
        Prompt { tokens, prompt_len, hashes, turn }
    }

    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len as usize]
    }

    pub fn output_len(&self) -> u32 {
        self.tokens.len() as u32 - self.prompt_len
    }

    /// Whole blocks of the prompt.
    pub fn prompt_blocks(&self, block: u32) -> usize {
        (self.prompt_len / block.max(1)) as usize
    }
}

/// A workload's shape (token counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    Shared { tenants: u32, prefix: u32, question: u32, output: u32 },
    Chat { turns: u32, first: u32, user: u32, answer: u32 },
    Random { prompt: u32, output: u32 },
}

impl Workload {
    pub fn name(&self) -> &'static str {
        match self {
            Workload::Shared { .. } => "shared-prefix",
            Workload::Chat { .. } => "multi-turn-chat",
            Workload::Random { .. } => "no-sharing",
        }
    }

    pub fn describe(&self) -> String {
        match *self {
            Workload::Shared { tenants, prefix, question, output } => format!(
                "{tenants} tenants, each a {prefix}-token shared system prompt, + a distinct {question}-token \
                 question, {output} output tokens; tenant drawn uniformly per request"
            ),
            Workload::Chat { turns, first, user, answer } => format!(
                "conversations of {turns} turns: a {first}-token first message, then each turn extends the \
                 last prompt + its {answer}-token answer by a {user}-token message"
            ),
            Workload::Random { prompt, output } => {
                format!("random {prompt}-token prompts sharing nothing, {output} output tokens")
            }
        }
    }
}

/// The workloads of `sim prefix` (and `sim vllm-dp`), scaled from llm-d's
/// 150 tenants x 6k + 1.2k to runs of seconds; `--workload` names one.
pub fn workloads() -> [Workload; 3] {
    [
        Workload::Shared { tenants: 48, prefix: 3072, question: 640, output: 32 },
        Workload::Chat { turns: 6, first: 1024, user: 256, answer: 128 },
        Workload::Random { prompt: 3712, output: 32 },
    ]
}

/// Appends `n` token ids drawn from `rng`.
pub(super) fn draw(rng: &mut SmallRng, n: u32, out: &mut Vec<u32>) {
    out.extend((0..n).map(|_| rng.random_range(1..VOCAB)));
}

/// One frontend's source of prompts.
#[derive(Debug)]
pub struct Source {
    workload: Workload,
    block: u32,
    seed: u64,
    rng: SmallRng,
    /// Chat: finished turns whose conversation goes on, oldest first.
    ready: VecDeque<Arc<Prompt>>,
    next_conversation: u64,
    frontend: u32,
}

impl Source {
    pub fn new(workload: Workload, block: u32, seed: u64, frontend: u32) -> Source {
        let rng = SmallRng::seed_from_u64(seed ^ 0x70_6b_75_73 ^ (u64::from(frontend) << 32));
        Source { workload, block, seed, rng, ready: VecDeque::new(), next_conversation: 0, frontend }
    }

    /// The next request's tokens.
    pub fn next_prompt(&mut self) -> Arc<Prompt> {
        let mut t = Vec::new();
        let p = match self.workload {
            Workload::Shared { tenants, prefix, question, output } => {
                let tenant = self.rng.random_range(0..tenants.max(1));
                let mut trng = SmallRng::seed_from_u64(self.seed.wrapping_mul(31) ^ (u64::from(tenant) << 20));
                draw(&mut trng, prefix, &mut t);
                draw(&mut self.rng, question + output, &mut t);
                Prompt::new(t, prefix + question, self.block, None)
            }
            Workload::Random { prompt, output } => {
                draw(&mut self.rng, prompt + output, &mut t);
                Prompt::new(t, prompt, self.block, None)
            }
            Workload::Chat { first, user, answer, .. } => match self.ready.pop_front() {
                Some(last) => {
                    let (c, turn) = last.turn.unwrap_or_default();
                    t.extend_from_slice(&last.tokens);
                    draw(&mut self.rng, user, &mut t);
                    let prompt_len = t.len() as u32;
                    draw(&mut self.rng, answer, &mut t);
                    Prompt::new(t, prompt_len, self.block, Some((c, turn + 1)))
                }
                None => {
                    let c = (u64::from(self.frontend) << 32) | self.next_conversation;
                    self.next_conversation += 1;
                    draw(&mut self.rng, first + answer, &mut t);
                    Prompt::new(t, first, self.block, Some((c, 0)))
                }
            },
        };
        Arc::new(p)
    }

    /// A request of this source completed: its conversation may go on.
    pub fn completed(&mut self, p: &Arc<Prompt>) {
        if let (Workload::Chat { turns, .. }, Some((_, turn))) = (self.workload, p.turn) {
            if turn + 1 < turns {
                self.ready.push_back(Arc::clone(p));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_share_prefixes_and_hashes_and_streams_repeat() {
        let w = Workload::Shared { tenants: 1, prefix: 32, question: 8, output: 4 };
        let (mut a, mut b) = (Source::new(w, 16, 7, 0), Source::new(w, 16, 7, 1));
        let (x, y) = (a.next_prompt(), b.next_prompt());
        assert_eq!((x.prompt_len, x.output_len(), x.hashes.len()), (40, 4, 2));
        assert_eq!(x.hashes, y.hashes, "two whole prefix blocks, the same tenant");
        assert_ne!(x.tokens, y.tokens);
        assert_eq!(Source::new(w, 16, 7, 0).next_prompt(), x);
    }

    #[test]
    fn a_chat_turn_extends_the_last_prompt_and_answer() {
        let w = Workload::Chat { turns: 2, first: 20, user: 5, answer: 3 };
        let mut s = Source::new(w, 4, 1, 0);
        let t0 = s.next_prompt();
        s.completed(&t0);
        let t1 = s.next_prompt();
        assert_eq!((t1.prompt_len, t1.turn), (28, Some((0, 1))));
        assert_eq!(&t1.tokens[..23], &t0.tokens[..]);
        assert_eq!(&t1.hashes[..5], &t0.hashes[..5]);
        s.completed(&t1);
        assert_eq!(s.next_prompt().turn, Some((1, 0)), "two turns done: a new conversation");
    }
}
