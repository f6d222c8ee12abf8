//! The OpenAI request body a gateway forwards: `model` (required), the
//! prompt (`prompt` for completions, a string or an array; `messages` for
//! chat) and `user`. Parsed once the whole body is in; no I/O.

use serde_json::Value;

/// A prompt as the request carries it (what a tokenizer takes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptText {
    /// `/v1/completions`: the prompt, an array's strings joined.
    Completion(String),
    /// `/v1/chat/completions`: the messages, each content's text joined.
    Chat(Vec<ChatMessage>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// What the picker reads of a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiRequest {
    pub model: String,
    pub prompt: PromptText,
    /// `user`: the session key of the route query ([`session_key`]).
    pub user: Option<String>,
}

/// The longest `user` sent as the session key as it is; a longer one (a
/// route query holds at most `limits.max_message_bytes`) is keyed by its
/// 128-bit hash, so the same user still keeps its rank.
pub const MAX_SESSION_BYTES: usize = 256;

/// The session key of a request's `user`.
pub fn session_key(user: &str) -> String {
    if user.len() <= MAX_SESSION_BYTES {
        return user.to_owned();
    }
    format!("xxh3-128:{:032x}", xxhash_rust::xxh3::xxh3_128(user.as_bytes()))
}

/// Why a body cannot be routed; each reads as the gateway's 400 reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the request body is not JSON: {0}")]
    NotJson(String),
    #[error("the request body must be a JSON object")]
    NotObject,
    #[error("the request body has no `model` (a string)")]
    NoModel,
    #[error("the request body has neither `prompt` nor `messages`")]
    NoPrompt,
    #[error("`{0}` has an unexpected type")]
    BadField(&'static str),
}

impl PromptText {
    /// The prompt's bytes of text (roles and contents): what the estimate counts.
    pub fn text_bytes(&self) -> usize {
        match self {
            PromptText::Completion(s) => s.len(),
            PromptText::Chat(m) => m.iter().map(|m| m.role.len() + m.content.len()).sum(),
        }
    }

    /// A plain estimate of the prompt's tokens, without a tokenizer: a
    /// token is about 4 bytes of English text (at least 1).
    pub fn estimated_tokens(&self) -> u64 {
        (self.text_bytes() as u64).div_ceil(4).max(1)
    }
}

/// Parses a whole request body.
pub fn parse(body: &[u8]) -> Result<OpenAiRequest, BodyError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| BodyError::NotJson(e.to_string()))?;
    let obj = v.as_object().ok_or(BodyError::NotObject)?;
    let model = match obj.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => return Err(BodyError::NoModel),
    };
    let prompt = match (obj.get("messages"), obj.get("prompt")) {
        (Some(m), _) if !m.is_null() => PromptText::Chat(messages(m)?),
        (_, Some(p)) if !p.is_null() => PromptText::Completion(completion(p)?),
        _ => return Err(BodyError::NoPrompt),
    };
    let user = match obj.get("user") {
        None | Some(Value::Null) => None,
        Some(Value::String(u)) => Some(session_key(u)),
        Some(_) => return Err(BodyError::BadField("user")),
    };
    Ok(OpenAiRequest { model, prompt, user })
}

/// `prompt`: a string, an array of strings (joined by newlines), or token
/// ids (an array of integers, or of such arrays: kept as their text).
fn completion(p: &Value) -> Result<String, BodyError> {
    match p {
        Value::String(s) => Ok(s.clone()),
        Value::Array(items) => {
            let parts: Result<Vec<String>, _> = items
                .iter()
                .map(|i| match i {
                    Value::String(s) => Ok(s.clone()),
                    Value::Number(n) => Ok(n.to_string()),
                    Value::Array(ids) if ids.iter().all(Value::is_number) => Ok(Value::Array(ids.clone()).to_string()),
                    _ => Err(BodyError::BadField("prompt")),
                })
                .collect();
            Ok(parts?.join("\n"))
        }
        _ => Err(BodyError::BadField("prompt")),
    }
}

/// `messages`: objects with a `role` and a `content` that is a string or
/// an array of parts whose `text` counts (images and audio do not).
fn messages(m: &Value) -> Result<Vec<ChatMessage>, BodyError> {
    let items = m.as_array().ok_or(BodyError::BadField("messages"))?;
    items
        .iter()
        .map(|item| {
            let obj = item.as_object().ok_or(BodyError::BadField("messages"))?;
            let role = obj.get("role").and_then(Value::as_str).ok_or(BodyError::BadField("messages[].role"))?;
            let content = match obj.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n")
                }
                Some(_) => return Err(BodyError::BadField("messages[].content")),
            };
            Ok(ChatMessage { role: role.to_owned(), content })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_and_chats_are_read() {
        let r = parse(br#"{"model":"m","prompt":["ab","cd"],"user":"u1"}"#).unwrap();
        assert_eq!(r.prompt, PromptText::Completion("ab\ncd".into()));
        assert_eq!(r.user.as_deref(), Some("u1"));
        let r =
            parse(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#).unwrap();
        assert_eq!(r.prompt, PromptText::Chat(vec![ChatMessage { role: "user".into(), content: "hi".into() }]));
        assert_eq!(r.prompt.estimated_tokens(), 2);
    }

    #[test]
    fn bad_bodies_say_why() {
        assert!(matches!(parse(b"{"), Err(BodyError::NotJson(_))));
        assert_eq!(parse(b"[]"), Err(BodyError::NotObject));
        assert_eq!(parse(br#"{"prompt":"x"}"#), Err(BodyError::NoModel));
        assert_eq!(parse(br#"{"model":"m"}"#), Err(BodyError::NoPrompt));
        assert_eq!(parse(br#"{"model":"m","prompt":{}}"#), Err(BodyError::BadField("prompt")));
        assert_eq!(parse(br#"{"model":"m","prompt":"x","user":3}"#), Err(BodyError::BadField("user")));
    }

    #[test]
    fn a_long_user_is_keyed_by_its_hash_the_same_each_time() {
        let long = "u".repeat(70 << 10);
        let body = |u: &str| format!(r#"{{"model":"m","prompt":"p","user":"{u}"}}"#);
        let key = parse(body(&long).as_bytes()).unwrap().user.unwrap();
        assert_eq!(key.len(), "xxh3-128:".len() + 32);
        assert_eq!(parse(body(&long).as_bytes()).unwrap().user.unwrap(), key);
        assert_ne!(parse(body(&format!("{long}v")).as_bytes()).unwrap().user.unwrap(), key);
        let short = "u".repeat(MAX_SESSION_BYTES);
        assert_eq!(parse(body(&short).as_bytes()).unwrap().user.unwrap(), short);
    }
}
