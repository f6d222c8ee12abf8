//! Gateway prompts: what turning an ~8k-token prompt
//! into a route query's `tokens` or `block_keys` costs, in process, with
//! Qwen3's real tokenizer (crates/gateway/testdata/tokenizers): tokenizer
//! mode (a completion; a chat through its template), text mode (keys over
//! the bytes), and the block keys the daemon computes from given ids
//! (what a `tokens` query costs it), all in the same run, so the ratios
//! hold on any machine.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use dpcoord_daemon::engines::prefix::keys::{chain_keys, chain_seed};
use dpcoord_gateway::prompt::{Encoded, PromptEncoder};
use dpcoord_gateway::{ChatMessage, PromptText};

use crate::report::{num, Report, Table};
use crate::support::Latencies;
use crate::Mode;

/// Tokens per KV block (vLLM's default).
const BLOCK: u32 = 16;

pub(crate) fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/gateway/testdata/tokenizers/qwen3")
}

/// Qwen3's tokenizer.json, unzipped into `dir`.
pub(crate) fn unzip(dir: &Path) -> PathBuf {
    let gz = std::fs::read(data().join("tokenizer.json.gz")).expect("the Qwen3 fixture");
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut json).expect("a gzipped tokenizer.json");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).expect("a temporary tokenizer.json");
    path
}

/// English-like text of about `paragraphs * 20` tokens.
pub(crate) fn text(paragraphs: usize) -> String {
    (0..paragraphs)
        .map(|i| format!("Paragraph {i}: the quick brown fox jumps over the lazy dog, {} times.\n", i * 7))
        .collect()
}

/// `f` timed `n` times (after one warm-up call).
fn time<T>(n: usize, mut f: impl FnMut() -> T) -> Latencies {
    std::hint::black_box(f());
    let mut lat = Latencies::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        std::hint::black_box(f());
        lat.push(t.elapsed());
    }
    lat
}

pub fn run(mode: Mode, report: &mut Report) {
    let (paragraphs, slow_n, fast_n) = match mode {
        Mode::Full => (400, 60, 2000),
        Mode::Smoke => (20, 2, 2),
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let t = Instant::now();
    let enc = PromptEncoder::from_files(Some(&unzip(dir.path())), Some(&data().join("tokenizer_config.json")), BLOCK)
        .expect("Qwen3's tokenizer loads");
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    let text_enc = PromptEncoder::from_files(None, None, BLOCK).expect("a text encoder");

    let body = text(paragraphs);
    let completion = PromptText::Completion(body.clone());
    let chat = PromptText::Chat(vec![
        ChatMessage { role: "system".into(), content: "You are a careful reader.".into() },
        ChatMessage { role: "user".into(), content: body },
    ]);
    let ids = match enc.encode(&completion, usize::MAX) {
        Encoded::Tokens { ids, .. } => ids,
        other => panic!("tokenizer mode expected, got {}", other.mode()),
    };
    assert_eq!(enc.encode(&chat, usize::MAX).mode(), "tokenizer");
    let seed = chain_seed(None, None);
    let mut keys = Vec::with_capacity(ids.len() / BLOCK as usize);

    let mut rows = vec![
        ("tokenizer", "completion", time(slow_n, || enc.encode(&completion, usize::MAX))),
        ("tokenizer", "chat (template + encode)", time(slow_n, || enc.encode(&chat, usize::MAX))),
        ("text", "completion", time(fast_n, || text_enc.encode(&completion, usize::MAX))),
        ("text", "chat", time(fast_n, || text_enc.encode(&chat, usize::MAX))),
    ];
    let from_ids = time(fast_n, || {
        keys.clear();
        chain_keys(seed, &ids, BLOCK as usize, &mut keys);
        keys.len()
    });
    rows.push(("daemon", "block keys from the ids", from_ids));

    let title = format!(
        "gateway_prompt: one prompt of {} tokens ({} bytes), Qwen3's tokenizer (loaded in {} ms), blocks of {BLOCK}",
        ids.len(),
        text(paragraphs).len(),
        num(load_ms, 0)
    );
    let mut table = Table::new(title, &["mode", "prompt", "p50 us", "p99 us", "ns/token", "vs tokenizer completion"])
        .text_columns(2);
    let base = rows[0].2.quantile_us(0.5);
    let mut p50 = Vec::new();
    for (m, what, lat) in &mut rows {
        let (a, b) = (lat.quantile_us(0.5), lat.quantile_us(0.99));
        p50.push(a);
        let per_token = a * 1e3 / ids.len().max(1) as f64;
        table.row(vec![m.to_string(), what.to_string(), num(a, 1), num(b, 1), num(per_token, 1), ratio(a, base)]);
    }
    table.print();
    // The text mode is the fallback that must stay negligible beside the
    // tokenizer; the tokenizer's own cost is the engine's too (it runs the
    // same HF code: docs/benchmarks.md compares it with Python's).
    let (tok, text_cost) = (p50[0], p50[2]);
    report.target(
        "gateway text keys vs tokenizing (8k-token completion)",
        "<= 0.05x",
        ratio(text_cost, tok),
        tok > 0.0 && text_cost / tok <= 0.05,
    );
}

/// `a / b` with four decimals (the text mode is thousands of times cheaper).
fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.4}x", a / b)
    } else {
        "n/a".into()
    }
}
