//! What dpcoord reads of a model's `tokenizer_config.json`: the chat
//! template and the named special tokens the template may print.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::PromptError;

/// The named special tokens transformers hands a chat template
/// (`special_tokens_map`: `SPECIAL_TOKENS_ATTRIBUTES`, those set).
const SPECIAL_TOKENS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// The file transformers (v4.43 on) and vLLM read a template from when the
/// config has none, next to tokenizer_config.json.
const TEMPLATE_FILE: &str = "chat_template.jinja";

/// A model's chat settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatConfig {
    /// The default chat template, if the model has one.
    pub template: Option<String>,
    /// The special tokens set, by name (`bos_token`, ...).
    pub special: Vec<(&'static str, String)>,
}

fn read(path: &Path) -> Result<String, PromptError> {
    std::fs::read_to_string(path).map_err(|e| PromptError::Read { path: path.to_owned(), message: e.to_string() })
}

fn bad(path: &Path, message: impl Into<String>) -> PromptError {
    PromptError::Config { path: path.to_owned(), message: message.into() }
}

/// Reads `path` (a tokenizer_config.json).
pub fn read_config(path: &Path) -> Result<ChatConfig, PromptError> {
    let doc: Value = serde_json::from_str(&read(path)?).map_err(|e| bad(path, e.to_string()))?;
    let Value::Object(map) = doc else { return Err(bad(path, "not a JSON object")) };
    let mut special = Vec::new();
    for name in SPECIAL_TOKENS {
        match map.get(name) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => special.push((name, s.clone())),
            // An AddedToken, as saved by transformers: {"content": ..., "lstrip": ...}.
            Some(Value::Object(t)) => match t.get("content") {
                Some(Value::String(s)) => special.push((name, s.clone())),
                _ => return Err(bad(path, format!("`{name}` has no string `content`"))),
            },
            Some(_) => return Err(bad(path, format!("`{name}` must be a string or an AddedToken"))),
        }
    }
    let template = match map.get("chat_template") {
        None | Some(Value::Null) => sibling_template(path)?,
        Some(Value::String(s)) => Some(s.clone()),
        // Named templates ([{"name": "default", "template": ...}, {"name": "tool_use", ...}]):
        // the default one, as transformers picks without tools.
        Some(Value::Array(named)) => {
            let default = named.iter().find(|t| t.get("name").and_then(Value::as_str) == Some("default"));
            match default.and_then(|t| t.get("template")) {
                Some(Value::String(s)) => Some(s.clone()),
                _ => return Err(bad(path, "`chat_template` is a list without a `default` template")),
            }
        }
        Some(_) => return Err(bad(path, "`chat_template` must be a string or a list of named templates")),
    };
    Ok(ChatConfig { template, special })
}

/// `chat_template.jinja` beside the config, if there is one.
fn sibling_template(config: &Path) -> Result<Option<String>, PromptError> {
    let file: PathBuf = config.with_file_name(TEMPLATE_FILE);
    if file.is_file() {
        return read(&file).map(Some);
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> Result<ChatConfig, PromptError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(&path, json).unwrap();
        read_config(&path)
    }

    #[test]
    fn special_tokens_are_strings_or_added_tokens() {
        let c = config(
            r#"{"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>", "pad_token": null}"#,
        );
        let c = c.unwrap();
        assert_eq!(c.special, vec![("bos_token", "<s>".to_owned()), ("eos_token", "</s>".to_owned())]);
        assert_eq!(c.template, None);
    }

    #[test]
    fn the_default_named_template_is_taken() {
        let c = config(
            r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
        );
        assert_eq!(c.unwrap().template.as_deref(), Some("D"));
        let e = config(r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#).unwrap_err();
        assert!(e.to_string().contains("without a `default` template"), "{e}");
    }

    #[test]
    fn a_template_file_beside_the_config_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(&path, "{}").unwrap();
        std::fs::write(dir.path().join(TEMPLATE_FILE), "{{ messages[0].content }}").unwrap();
        assert_eq!(read_config(&path).unwrap().template.as_deref(), Some("{{ messages[0].content }}"));
    }

    #[test]
    fn bad_configs_say_what_is_wrong() {
        assert!(config("[1]").unwrap_err().to_string().contains("not a JSON object"));
        assert!(config(r#"{"bos_token": 3}"#).unwrap_err().to_string().contains("`bos_token` must be"));
        assert!(config("{").is_err());
    }
}
