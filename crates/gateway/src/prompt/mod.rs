//! A gateway request's prompt turned into what a `route` query carries for
//! `cache_aware` (docs/prefix-cache.md, "Through the
//! gateway"):
//!
//! - **tokenizer** mode, with the model's `tokenizer.json`: the token ids
//!   the engine computes, so they match its KV events. A completion is
//!   encoded with its special tokens (vLLM: `add_special_tokens=True`, the
//!   tokenizer.json's post-processor adds a BOS or not); a chat is rendered
//!   with the model's chat template (`add_generation_prompt=true`, the BOS
//!   is in the template's text) and encoded without them, as vLLM's
//!   `apply_chat_template` does.
//! - **text** mode, without one (or when the chat template cannot be
//!   rendered): chained keys over the prompt's bytes (text.rs), which match
//!   only dpcoord's own placements, never an engine's KV events.

mod config;
mod template;
#[cfg(test)]
mod tests;
mod text;

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use self::template::ChatTemplate;
use super::PromptText;

/// A prompt longer than this many bytes per token wanted is tokenized up
/// to there only: no tokenizing beyond what a route query can carry.
const CUT_BYTES_PER_TOKEN: usize = 8;
/// Token ids dropped at the end of a cut prompt's leading part: the last
/// word's tokens (and a special token a post-processor appends) may differ
/// from the whole prompt's.
const CUT_TAIL: usize = 8;

/// The mode label of [`Encoded::Tokens`], for metrics.
pub const MODE_TOKENIZER: &str = "tokenizer";
/// The mode label of [`Encoded::TextKeys`], for metrics.
pub const MODE_TEXT: &str = "text";

/// What a `route` query carries for a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Encoded {
    /// The engine's token ids, the leading ones of a long prompt: the
    /// query's `tokens`; and the whole prompt's length in tokens.
    Tokens { ids: Vec<u32>, whole: u64 },
    /// Text-approximate block keys: the query's `block_keys`.
    TextKeys(Vec<u64>),
}

impl Encoded {
    /// `"tokenizer"` or `"text"`.
    pub fn mode(&self) -> &'static str {
        match self {
            Encoded::Tokens { .. } => MODE_TOKENIZER,
            Encoded::TextKeys(_) => MODE_TEXT,
        }
    }
}

/// Why a tokenizer could not be loaded or a prompt tokenized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    #[error("cannot read {}: {message}", path.display())]
    Read { path: PathBuf, message: String },
    #[error("{} is not a tokenizer.json the tokenizers crate loads: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
    #[error("{} is not a valid tokenizer_config.json: {message}", path.display())]
    Config { path: PathBuf, message: String },
    #[error("a tokenizer_config.json is given without its tokenizer.json")]
    ConfigWithoutTokenizer,
    #[error("kv_block_size must be at least 1")]
    BlockSize,
    #[error("no tokenizer is configured")]
    NoTokenizer,
    #[error("the model has no chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja)")]
    NoTemplate,
    #[error("the chat template cannot be rendered: {0}")]
    Template(String),
    #[error("tokenizing the prompt failed: {0}")]
    Encode(String),
}

/// A model's tokenizer and chat template, loaded once.
struct Model {
    tokenizer: Tokenizer,
    /// The compiled chat template, or why there is none.
    chat: Result<ChatTemplate, PromptError>,
}

/// Turns prompts into token ids (with a tokenizer) or text keys (without).
/// Built once per model; `encode` takes `&self` and may run on any thread.
pub struct PromptEncoder {
    model: Option<Model>,
    block_size: usize,
    text_seed: u64,
}

impl std::fmt::Debug for PromptEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptEncoder")
            .field("tokenizer", &self.model.is_some())
            .field("chat_template", &self.model.as_ref().map(|m| m.chat.is_ok()))
            .field("block_size", &self.block_size)
            .finish()
    }
}

impl PromptEncoder {
    /// The encoder of a model: with `tokenizer_json`, tokenizer mode
    /// (chats with the template of `tokenizer_config_json`, if it has one);
    /// without, text mode, its keys in blocks of `kv_block_size`
    /// pseudo-tokens. A chat template that does not compile is not an
    /// error here: chats fall back to text mode, and
    /// [`chat_template_problem`](Self::chat_template_problem) says why.
    pub fn from_files(
        tokenizer_json: Option<&Path>,
        tokenizer_config_json: Option<&Path>,
        kv_block_size: u32,
    ) -> Result<Self, PromptError> {
        if kv_block_size == 0 {
            return Err(PromptError::BlockSize);
        }
        let model = match (tokenizer_json, tokenizer_config_json) {
            (None, None) => None,
            (None, Some(_)) => return Err(PromptError::ConfigWithoutTokenizer),
            (Some(tok), config) => Some(Model::load(tok, config)?),
        };
        Ok(PromptEncoder { model, block_size: kv_block_size as usize, text_seed: text::text_seed() })
    }

    /// Whether prompts are tokenized (else every prompt is text mode).
    pub fn has_tokenizer(&self) -> bool {
        self.model.is_some()
    }

    /// Why chats fall back to text mode although a tokenizer is loaded: no
    /// chat template, or one minijinja cannot compile. Log it once.
    pub fn chat_template_problem(&self) -> Option<&PromptError> {
        self.model.as_ref().and_then(|m| m.chat.as_ref().err())
    }

    /// At most `most` of the token ids ([`tokenize`](Self::tokenize)), or
    /// text keys when there is no tokenizer or it fails on this prompt (a
    /// chat template that raises or uses what minijinja lacks);
    /// `tokenize` says why.
    pub fn encode(&self, p: &PromptText, most: usize) -> Encoded {
        match self.tokenize(p, most) {
            Ok((ids, whole)) => Encoded::Tokens { ids, whole },
            Err(_) => Encoded::TextKeys(self.text_keys(p)),
        }
    }

    /// At most `most` of the token ids the engine computes for `p`, its
    /// leading ones, and the prompt's whole length in tokens. A prompt of
    /// more than `most` * 8 bytes (after its chat template) is tokenized
    /// up to about there, cut where a run of whitespace starts, less its
    /// last few ids; its whole length is then the ids per byte of that part
    /// times its bytes. So a huge prompt costs no more tokenizing than a
    /// route query can carry ids.
    pub fn tokenize(&self, p: &PromptText, most: usize) -> Result<(Vec<u32>, u64), PromptError> {
        let model = self.model.as_ref().ok_or(PromptError::NoTokenizer)?;
        let (text, special) = match p {
            PromptText::Completion(text) => (std::borrow::Cow::Borrowed(text.as_str()), true),
            PromptText::Chat(messages) => {
                let chat = model.chat.as_ref().map_err(Clone::clone)?;
                (std::borrow::Cow::Owned(chat.render(messages).map_err(PromptError::Template)?), false)
            }
        };
        let cut = leading_cut(&text, most.saturating_mul(CUT_BYTES_PER_TOKEN));
        if cut == text.len() {
            let mut ids = model.ids(&text, special)?;
            let whole = ids.len() as u64;
            ids.truncate(most);
            return Ok((ids, whole));
        }
        let mut ids = model.ids(&text[..cut], special)?;
        let whole = (ids.len() as u128 * text.len() as u128 / cut.max(1) as u128) as u64;
        ids.truncate(ids.len().saturating_sub(CUT_TAIL).min(most));
        Ok((ids, whole))
    }

    /// The text-mode keys of `p`, whatever the mode.
    pub fn text_keys(&self, p: &PromptText) -> Vec<u64> {
        let mut keys = Vec::new();
        match p {
            PromptText::Completion(s) => text::text_keys(self.text_seed, s.as_bytes(), self.block_size, &mut keys),
            PromptText::Chat(m) => {
                text::text_keys(self.text_seed, &text::chat_bytes(m), self.block_size, &mut keys);
            }
        }
        keys
    }
}

/// Where to cut `text` to keep about `bytes` of it: the whole when it is
/// no longer; else the start of the last run of whitespace in the quarter
/// before `bytes` (so no word is split), or the char boundary at `bytes`.
fn leading_cut(text: &str, bytes: usize) -> usize {
    if text.len() <= bytes {
        return text.len();
    }
    let end = (0..=bytes).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
    let b = text.as_bytes();
    let from = end - end / 4;
    // `end < text.len()`: `b[end]` exists.
    (from.max(1)..=end).rev().find(|&i| b[i].is_ascii_whitespace() && !b[i - 1].is_ascii_whitespace()).unwrap_or(end)
}

impl Model {
    fn load(tokenizer_json: &Path, config: Option<&Path>) -> Result<Model, PromptError> {
        let bytes = std::fs::read(tokenizer_json)
            .map_err(|e| PromptError::Read { path: tokenizer_json.to_owned(), message: e.to_string() })?;
        let bad = |message: String| PromptError::Tokenizer { path: tokenizer_json.to_owned(), message };
        let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| bad(e.to_string()))?;
        // vLLM truncates and pads nothing here; a tokenizer.json may set either.
        tokenizer.with_truncation(None).map_err(|e| bad(e.to_string()))?;
        tokenizer.with_padding(None);
        let chat = match config {
            None => Err(PromptError::NoTemplate),
            Some(path) => {
                let c = config::read_config(path)?;
                match c.template {
                    None => Err(PromptError::NoTemplate),
                    Some(source) => ChatTemplate::new(source, &c.special).map_err(PromptError::Template),
                }
            }
        };
        Ok(Model { tokenizer, chat })
    }

    fn ids(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        let enc =
            self.tokenizer.encode_fast(text, add_special_tokens).map_err(|e| PromptError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }
}
