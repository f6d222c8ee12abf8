//! A request body as a gateway forwards it -> the endpoint picker's OpenAI
//! body decoder (crates/gateway/src/body.rs), alone. Checked for
//! every input: decoding never panics and is deterministic; an accepted
//! body has a model, and its token estimate is at least 1 and never more
//! than a token per byte of the prompt's text.
#![no_main]

use dpcoord_gateway::body::parse;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = parse(data);
    assert_eq!(parse(data), decoded, "decoding is not deterministic");
    let Ok(req) = decoded else { return };
    assert!(!req.model.is_empty(), "a body without a model was accepted");
    let tokens = req.prompt.estimated_tokens();
    assert!(tokens >= 1 && tokens <= (req.prompt.text_bytes() as u64).max(1), "estimate {tokens}");
});
