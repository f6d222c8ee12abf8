//! The Kubernetes gateway's endpoint picker (issue 28). On this branch only
//! the prompt encoder and the two types it reads; the ext_proc server owns
//! this file once merged.

pub mod prompt;

/// The prompt of an OpenAI request body: a completion's text, or a chat's
/// messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptText {
    Completion(String),
    Chat(Vec<ChatMessage>),
}

/// One chat message, its content as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}
