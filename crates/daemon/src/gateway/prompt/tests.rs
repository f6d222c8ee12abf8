//! The encoder against transformers: crates/daemon/testdata/tokenizers holds
//! two real tokenizers (README.md there) and golden.json, the ids
//! transformers computes for fixed prompts, written and checked by
//! clients/python/tests/compat/test_gateway_tokens.py.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::*;
use crate::gateway::ChatMessage;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tokenizers")
}

/// The model's tokenizer.json, unzipped into `dir`.
fn unzip(model: &str, dir: &Path) -> PathBuf {
    let gz = std::fs::read(data().join(model).join("tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut json).unwrap();
    let path = dir.join(format!("{model}.tokenizer.json"));
    std::fs::write(&path, json).unwrap();
    path
}

fn encoder(model: &str, dir: &Path) -> PromptEncoder {
    let config = data().join(model).join("tokenizer_config.json");
    PromptEncoder::from_files(Some(&unzip(model, dir)), Some(&config), 16).unwrap()
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage { role: role.into(), content: content.into() }
}

fn case_prompt(case: &Value) -> PromptText {
    match case["kind"].as_str().unwrap() {
        "completion" => PromptText::Completion(case["prompt"].as_str().unwrap().to_owned()),
        _ => PromptText::Chat(
            case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| msg(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect(),
        ),
    }
}

#[test]
fn token_ids_are_what_transformers_computes() {
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(data().join("golden.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let models = golden["models"].as_object().unwrap();
    assert_eq!(models.len(), 2);
    for (model, cases) in models {
        let enc = encoder(model, dir.path());
        assert!(enc.has_tokenizer() && enc.chat_template_problem().is_none(), "{model}: {enc:?}");
        for (i, case) in cases.as_array().unwrap().iter().enumerate() {
            let prompt = case_prompt(case);
            let want: Vec<u32> =
                case["ids"].as_array().unwrap().iter().map(|v| u32::try_from(v.as_u64().unwrap()).unwrap()).collect();
            if let (PromptText::Chat(m), Some(text)) = (&prompt, case["text"].as_str()) {
                let rendered = enc.model.as_ref().unwrap().chat.as_ref().unwrap().render(m).unwrap();
                assert_eq!(rendered, text, "{model} case {i}: the rendered template");
            }
            let got = enc.encode(&prompt);
            assert_eq!(got.mode(), MODE_TOKENIZER);
            assert_eq!(got, Encoded::Tokens(want), "{model} case {i}");
        }
    }
}

#[test]
fn completions_get_the_post_processors_specials_and_chats_none_added() {
    let dir = tempfile::tempdir().unwrap();
    // DeepSeek-V3's template writes its BOS (id 0); its post-processor adds none.
    let ds = encoder("deepseek_v3", dir.path());
    let chat = ds.tokenize(&PromptText::Chat(vec![msg("user", "hi")])).unwrap();
    assert_eq!(chat.iter().filter(|&&t| t == 0).count(), 1);
    assert_eq!(chat[0], 0);
    let completion = ds.tokenize(&PromptText::Completion("hi".into())).unwrap();
    assert!(!completion.contains(&0), "{completion:?}");
}

#[test]
fn without_a_tokenizer_prompts_are_text_keys() {
    let enc = PromptEncoder::from_files(None, None, 4).unwrap();
    assert!(!enc.has_tokenizer());
    let text = "x".repeat(100); // 25 pseudo-tokens: 6 blocks of 4
    let got = enc.encode(&PromptText::Completion(text.clone()));
    assert_eq!(got.mode(), MODE_TEXT);
    let Encoded::TextKeys(keys) = got else { unreachable!() };
    assert_eq!(keys.len(), 6);
    let longer = enc.encode(&PromptText::Completion(text + "tail of the prompt, more blocks"));
    let Encoded::TextKeys(longer) = longer else { unreachable!() };
    assert_eq!(longer[..6], keys[..]);
    assert_eq!(enc.tokenize(&PromptText::Completion("a".into())), Err(PromptError::NoTokenizer));
    let chat = enc.encode(&PromptText::Chat(vec![msg("user", &"q".repeat(64))]));
    assert!(matches!(chat, Encoded::TextKeys(ref k) if k.len() == 4), "{chat:?}");
}

/// A config with `template` beside Qwen3's tokenizer.
fn with_template(dir: &Path, template: &str) -> PromptEncoder {
    let config = dir.join("tokenizer_config.json");
    let doc = serde_json::json!({ "chat_template": template, "eos_token": "<|im_end|>" });
    std::fs::write(&config, doc.to_string()).unwrap();
    PromptEncoder::from_files(Some(&unzip("qwen3", dir)), Some(&config), 16).unwrap()
}

#[test]
fn a_template_minijinja_cannot_compile_falls_back_to_text_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    // transformers' {% generation %} tag (assistant masks) is not Jinja's.
    let enc = with_template(
        dir.path(),
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    );
    let why = enc.chat_template_problem().expect("a problem").to_string();
    assert!(why.starts_with("the chat template cannot be rendered:") && why.contains("generation"), "{why}");
    assert_eq!(enc.encode(&PromptText::Chat(vec![msg("user", "hi")])).mode(), MODE_TEXT);
    assert_eq!(enc.encode(&PromptText::Completion("hi".into())).mode(), MODE_TOKENIZER);
}

#[test]
fn a_template_that_raises_or_fails_falls_back_for_that_request_only() {
    let dir = tempfile::tempdir().unwrap();
    let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}\
               {{ messages[0].content.upper() }}{{ eos_token }}";
    let enc = with_template(dir.path(), src);
    assert!(enc.chat_template_problem().is_none());
    let err = enc.tokenize(&PromptText::Chat(vec![msg("system", "s")])).unwrap_err().to_string();
    assert!(err.contains("first must be user"), "{err}");
    assert_eq!(enc.encode(&PromptText::Chat(vec![msg("system", "s")])).mode(), MODE_TEXT);
    assert_eq!(enc.encode(&PromptText::Chat(vec![])).mode(), MODE_TEXT);
    let ok = enc.tokenize(&PromptText::Chat(vec![msg("user", "hi")])).unwrap();
    assert_eq!(ok, enc.model.as_ref().unwrap().ids("HI<|im_end|>", false).unwrap());
}

#[test]
fn no_chat_template_means_text_mode_for_chats() {
    let dir = tempfile::tempdir().unwrap();
    let enc = PromptEncoder::from_files(Some(&unzip("qwen3", dir.path())), None, 16).unwrap();
    assert_eq!(enc.chat_template_problem(), Some(&PromptError::NoTemplate));
    assert_eq!(enc.encode(&PromptText::Chat(vec![msg("user", "hi")])).mode(), MODE_TEXT);
}

#[test]
fn tojson_and_strftime_write_as_python_does() {
    let dir = tempfile::tempdir().unwrap();
    let src = "{{ {'a': [1, 2.0, none, true], 'b': 'é\"\\n'} | tojson }}|{{ [1] | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}";
    let enc = with_template(dir.path(), src);
    let out = enc.model.as_ref().unwrap().chat.as_ref().unwrap().render(&[]).unwrap();
    assert_eq!(out, "{\"a\": [1, 2.0, null, true], \"b\": \"é\\\"\\n\"}|[\n  1\n]|4");
}

#[test]
fn loading_errors_are_plain() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let e = PromptEncoder::from_files(Some(&missing), None, 16).unwrap_err();
    assert!(matches!(e, PromptError::Read { .. }) && e.to_string().contains("nope.json"), "{e}");
    std::fs::write(&missing, "{}").unwrap();
    let e = PromptEncoder::from_files(Some(&missing), None, 16).unwrap_err();
    assert!(e.to_string().contains("is not a tokenizer.json"), "{e}");
    assert_eq!(PromptEncoder::from_files(None, Some(&missing), 16).unwrap_err(), PromptError::ConfigWithoutTokenizer);
    assert_eq!(PromptEncoder::from_files(None, None, 0).unwrap_err(), PromptError::BlockSize);
}
