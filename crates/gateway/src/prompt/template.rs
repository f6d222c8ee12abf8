//! A model's chat template rendered as transformers' `apply_chat_template`
//! renders it (transformers/utils/chat_template_utils.py): Jinja with
//! `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`,
//! `strftime_now` and a `tojson` that writes as Python's `json.dumps`; the
//! context is the messages, `tools` and `documents` none,
//! `add_generation_prompt` and the named special tokens. Python's string,
//! dict and list methods the templates call (`.strip()`, `.startswith()`,
//! `.items()`...) are minijinja-contrib's pycompat.
//!
//! What minijinja cannot do (the `{% generation %}` tag, Python methods
//! outside pycompat, Jinja extensions) fails to compile or render, plainly,
//! and the caller falls back to the text mode.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use crate::ChatMessage;

/// The template's name in its environment.
const NAME: &str = "chat";

/// A compiled chat template and the context values every render shares.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The named special tokens (`bos_token`, ...).
    special: Vec<(&'static str, Value)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("special", &self.special).finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; the error is minijinja's, with the line.
    pub fn new(source: String, special: &[(&'static str, String)]) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.map_err(|e| e.to_string())?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source).map_err(|e| describe(&e))?;
        let special = special.iter().map(|(k, v)| (*k, Value::from(v.as_str()))).collect();
        Ok(ChatTemplate { env, special })
    }

    /// The prompt text of `messages`, with the generation prompt.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, String> {
        let messages: Value = messages
            .iter()
            .map(|m| {
                let mut map = BTreeMap::new();
                map.insert("role", Value::from(m.role.as_str()));
                map.insert("content", Value::from(m.content.as_str()));
                Value::from(map)
            })
            .collect();
        let mut ctx: BTreeMap<&str, Value> = self.special.iter().cloned().collect();
        ctx.insert("messages", messages);
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        ctx.insert("add_generation_prompt", Value::from(true));
        let template = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        template.render(Value::from(ctx)).map_err(|e| describe(&e))
    }
}

/// minijinja's error with its line and cause, on one line.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let _ = write!(s, ": {cause}");
        source = cause.source();
    }
    s
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("the template raised: {message}")))
}

/// `strftime_now(format)`, UTC, for the directives templates use (Llama 3's
/// `"%d %b %Y"`); any other is an error.
fn strftime_now(format: String) -> Result<Value, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('d') => write!(out, "{day:02}"),
            Some('m') => write!(out, "{month:02}"),
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year % 100),
            Some('b') => write!(out, "{}", &name[..3]),
            Some('B') => write!(out, "{name}"),
            Some('H') => write!(out, "{:02}", rem / 3600),
            Some('M') => write!(out, "{:02}", rem / 60 % 60),
            Some('S') => write!(out, "{:02}", rem % 60),
            Some('%') => write!(out, "%"),
            other => {
                let msg = format!("strftime_now: `%{}` is not supported", other.unwrap_or(' '));
                return Err(Error::new(ErrorKind::InvalidOperation, msg));
            }
        };
    }
    Ok(Value::from(out))
}

/// `tojson(indent=None)` as transformers' (`json.dumps(x, ensure_ascii=False,
/// indent=indent)`): `", "` and `": "` between items, or `","` and newlines
/// with an indent; non-ASCII as is.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(out: &mut String, v: &Value, indent: Option<usize>, depth: usize) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => {
            let f = f64::try_from(v.clone())?;
            match f {
                f if f.is_nan() => out.push_str("NaN"),
                f if f.is_infinite() => out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" }),
                f if f.fract() == 0.0 && f.abs() < 1e16 => {
                    let _ = write!(out, "{f:.1}");
                }
                f => {
                    let _ = write!(out, "{f}");
                }
            }
        }
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                out.push_str(if i > 0 { sep } else { "" });
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                out.push_str(if i > 0 { sep } else { "" });
                newline(out, depth + 1);
                write_str(out, &key.to_string());
                out.push_str(": ");
                write_json(out, &v.get_item(key)?, indent, depth + 1)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        kind => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot write a {kind}"))),
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
