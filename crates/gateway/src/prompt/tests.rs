//! The encoder against transformers: crates/gateway/testdata/tokenizers holds
//! two real tokenizers (README.md there) and golden.json, the ids
//! transformers computes for fixed prompts, written and checked by
//! clients/python/tests/compat/test_gateway_tokens.py.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::*;
use crate::ChatMessage;

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
            let got = enc.encode(&prompt, usize::MAX);
            assert_eq!(got.mode(), MODE_TOKENIZER);
            let whole = want.len() as u64;
            assert_eq!(got, Encoded::Tokens { ids: want, whole }, "{model} case {i}");
        }
    }
}

#[test]
fn completions_get_the_post_processors_specials_and_chats_none_added() {
    let dir = tempfile::tempdir().unwrap();
    // DeepSeek-V3's template writes its BOS (id 0); its post-processor adds none.
    let ds = encoder("deepseek_v3", dir.path());
    let chat = ds.tokenize(&PromptText::Chat(vec![msg("user", "hi")]), usize::MAX).unwrap().0;
    assert_eq!(chat.iter().filter(|&&t| t == 0).count(), 1);
    assert_eq!(chat[0], 0);
    let completion = ds.tokenize(&PromptText::Completion("hi".into()), usize::MAX).unwrap().0;
    assert!(!completion.contains(&0), "{completion:?}");
}

#[test]
fn without_a_tokenizer_prompts_are_text_keys() {
    let enc = PromptEncoder::from_files(None, None, 4).unwrap();
    assert!(!enc.has_tokenizer());
    let text = "x".repeat(100); // 25 pseudo-tokens: 6 blocks of 4
    let got = enc.encode(&PromptText::Completion(text.clone()), usize::MAX);
    assert_eq!(got.mode(), MODE_TEXT);
    let Encoded::TextKeys(keys) = got else { unreachable!() };
    assert_eq!(keys.len(), 6);
    let longer = enc.encode(&PromptText::Completion(text + "tail of the prompt, more blocks"), usize::MAX);
    let Encoded::TextKeys(longer) = longer else { unreachable!() };
    assert_eq!(longer[..6], keys[..]);
    assert_eq!(enc.tokenize(&PromptText::Completion("a".into()), usize::MAX), Err(PromptError::NoTokenizer));
    let chat = enc.encode(&PromptText::Chat(vec![msg("user", &"q".repeat(64))]), usize::MAX);
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
    assert_eq!(enc.encode(&PromptText::Chat(vec![msg("user", "hi")]), usize::MAX).mode(), MODE_TEXT);
    assert_eq!(enc.encode(&PromptText::Completion("hi".into()), usize::MAX).mode(), MODE_TOKENIZER);
}

#[test]
fn a_template_that_raises_or_fails_falls_back_for_that_request_only() {
    let dir = tempfile::tempdir().unwrap();
    let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}\
               {{ messages[0].content.upper() }}{{ eos_token }}";
    let enc = with_template(dir.path(), src);
    assert!(enc.chat_template_problem().is_none());
    let err = enc.tokenize(&PromptText::Chat(vec![msg("system", "s")]), usize::MAX).unwrap_err().to_string();
    assert!(err.contains("first must be user"), "{err}");
    assert_eq!(enc.encode(&PromptText::Chat(vec![msg("system", "s")]), usize::MAX).mode(), MODE_TEXT);
    assert_eq!(enc.encode(&PromptText::Chat(vec![]), usize::MAX).mode(), MODE_TEXT);
    let (ok, _) = enc.tokenize(&PromptText::Chat(vec![msg("user", "hi")]), usize::MAX).unwrap();
    assert_eq!(ok, enc.model.as_ref().unwrap().ids("HI<|im_end|>", false).unwrap());
}

#[test]
fn no_chat_template_means_text_mode_for_chats() {
    let dir = tempfile::tempdir().unwrap();
    let enc = PromptEncoder::from_files(Some(&unzip("qwen3", dir.path())), None, 16).unwrap();
    assert_eq!(enc.chat_template_problem(), Some(&PromptError::NoTemplate));
    assert_eq!(enc.encode(&PromptText::Chat(vec![msg("user", "hi")]), usize::MAX).mode(), MODE_TEXT);
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

/// Prose with the places a tokenizer's chunks join across whitespace:
/// sentence ends before blank lines, numbers, runs of spaces.
fn long_text(paragraphs: usize) -> String {
    (0..paragraphs)
        .map(|i| format!("Paragraph {i} says the rank took {} tokens.\n\n  Then   more, 12345 of them; ", i * 37))
        .collect()
}

#[test]
fn a_long_prompt_is_tokenized_only_as_far_as_a_query_carries_and_its_ids_lead_the_whole() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["qwen3", "deepseek_v3"] {
        let enc = encoder(model, dir.path());
        let text = long_text(600);
        let prompts = [
            PromptText::Completion(text.clone()),
            PromptText::Chat(vec![msg("system", "be brief"), msg("user", &text)]),
        ];
        for p in &prompts {
            let (all, whole) = enc.tokenize(p, usize::MAX).unwrap();
            assert_eq!(whole, all.len() as u64, "{model}: not cut, exact");
            // Cuts at many places: each leading part is the whole's first ids.
            for most in [100, 257, 1000, 1999] {
                let (ids, estimate) = enc.tokenize(p, most).unwrap();
                assert_eq!(ids.len(), most, "{model}: about 8 bytes a token were read, more than enough");
                assert_eq!(ids[..], all[..most], "{model}, most {most}");
                // The whole length: the part read's ids per byte times the bytes.
                let (text, special) = match p {
                    PromptText::Completion(t) => (t.clone(), true),
                    PromptText::Chat(m) => {
                        (enc.model.as_ref().unwrap().chat.as_ref().unwrap().render(m).unwrap(), false)
                    }
                };
                let cut = leading_cut(&text, most * 8);
                let read = enc.model.as_ref().unwrap().ids(&text[..cut], special).unwrap().len();
                assert_eq!(estimate, (read * text.len() / cut) as u64, "{model}, most {most}");
                assert!((most as u64..2 * whole).contains(&estimate), "{model}, most {most}: {estimate} for {whole}");
            }
            // Not cut when the prompt is within 8 bytes a token of it.
            let (ids, estimate) = enc.tokenize(p, all.len()).unwrap();
            assert_eq!((ids, estimate), (all.clone(), whole));
        }
    }
}

#[test]
fn a_cut_falls_where_whitespace_starts_and_never_inside_a_char() {
    assert_eq!(leading_cut("short", 8), 5, "not cut");
    let words = "word ".repeat(100);
    assert_eq!(leading_cut(&words, 203), 199, "before the space ahead of the next word");
    assert_eq!(leading_cut(&words, 204), 204, "on it");
    let run = format!("{}{}{}", "x".repeat(100), " ".repeat(20), "y".repeat(100));
    assert_eq!(leading_cut(&run, 115), 100, "at the start of a run of spaces");
    // No whitespace near: the char boundary at or before the byte count.
    let cjk = "数据并行".repeat(10);
    assert_eq!(leading_cut(&cjk, 7), 6);
}
