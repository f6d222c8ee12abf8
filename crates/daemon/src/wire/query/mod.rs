//! Decoding of frontend and prober queries (route and health sockets).
//!
//! A query is one MessagePack map with string keys. Decoding checks every
//! rule of the contract that needs no engine state (size, version, op, types,
//! ranges) and turns a violation into a [`WireError`] with the contract's code
//! and a message a person can act on. Routability is judged later, by the
//! dispatchers.

use super::msgpack::{Reader, Value};
use super::prompt::{decode_prompt, scan_array, ArrayKind, Prompt, PromptFields};
use super::{ErrorCode, Id, WireError};
use crate::config::keys::{check_query_work, DP_SIZE, MAX_DP_SIZE as MAX_DP_SIZE_KEY};
use crate::engines::{RankSet, Target};

/// The largest rank count a `resize` may ask for (`engines.dp_size`'s bound).
const MAX_DP_SIZE: u32 = DP_SIZE.max as u32;
/// The longest string `id`, in bytes: an id is echoed in its reply, so its
/// size bounds what a peer that never reads can make dpcoord hold.
pub const MAX_ID_BYTES: usize = 128;
/// How much of a peer's op name an error message quotes.
const SHOWN_OP_BYTES: usize = 64;

crate::names! {
    /// Which socket a query arrived on; decides which ops are served.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Channel {
        Route => "route",
        Health => "health",
    }
}

/// A query on the route socket, its op-specific fields checked.
// A route's `among` is a fixed 128-byte rank set, so `Route` is the large
// variant; a query lives on the stack once, and a box would allocate per query.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum RouteOp<'a> {
    Ping,
    State,
    Route(RouteRequest<'a>),
    /// `delivered`: what an engine delivered of a prediction.
    Delivered(Delivered),
    /// `finished`: requests served by a rank ended.
    Finished(Finished),
}

/// A `finished` report **(ext)**: `n` requests that `placed` was charged
/// with were served by `rank` and have ended (their response is over), or,
/// with no `rank`, reached no rank dpcoord counts (the caller sent them by
/// its own rule, or nowhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// Served by `rank`; `placed` is the rank they were booked on when
    /// another served them (a gateway's retry), `None`: `rank` itself.
    Served { rank: u32, n: u32, placed: Option<u32> },
    /// `n` of `placed`'s newest placements are withdrawn.
    Withdrawn { placed: u32, n: u32 },
}

/// A `delivered` report: the prompt tokens predicted cached on `rank` (as
/// an `explain` reply gave them) and those the engine served from its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    pub rank: u32,
    pub predicted: u64,
    pub delivered: u64,
}

/// A query on the health socket. A different type from [`RouteOp`], so a
/// health query cannot reach the code that answers user routes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HealthOp<'a> {
    Ping,
    State,
    Probe(Probe),
    Admin(Admin),
    /// `prefix`: which ranks hold a prompt's leading KV blocks (read only).
    Prefix(Prompt<'a>),
}

/// An operator's change to the running daemon (health socket only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admin {
    /// `resize`: the new rank count.
    Resize(u32),
    /// `reload`: re-read the configuration.
    Reload,
}

/// What only the health channel serves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Probe {
    /// `health_route`: a rank for one probe.
    Route(Target),
    /// `health_report`: a probe's outcome.
    Report { rank: u32, ok: bool },
}

/// A user routing request.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRequest<'a> {
    pub n: u32,
    pub prompt_tokens: Option<u64>,
    pub target: Target,
    pub session: Option<&'a str>,
    /// The prompt, for `cache_aware` (and its length when `prompt_tokens` is absent).
    pub prompt: Option<Prompt<'a>>,
    /// `explain`: the reply carries what the policy predicted was cached.
    pub explain: bool,
    /// `among` **(ext)**: the policy and sessions pick only from these ranks.
    pub among: Option<RankSet>,
    /// `fallbacks` **(ext)**: how many next-best ranks the reply lists
    /// after the placement (`0..=MAX_FALLBACKS`).
    pub fallbacks: u8,
    /// `shed_waiting` **(ext)**: a policy or session placement is refused
    /// (`saturated`) when every candidate rank has at least this many
    /// requests queued.
    pub shed_waiting: Option<u64>,
}

/// The most `fallbacks` a route may ask for.
pub const MAX_FALLBACKS: u8 = 16;

/// A decoded query: its id and its op (`RouteOp` or `HealthOp`).
#[derive(Debug, Clone, PartialEq)]
pub struct Query<'a, O> {
    pub id: Option<Id<'a>>,
    pub op: O,
}

/// The limits a query is checked against.
#[derive(Debug, Clone, Copy)]
pub struct QueryLimits {
    pub dp_size: u32,
    /// The largest `dp_size` a `resize` may set (`engines.max_dp_size`, or
    /// the `dp_size` of the start).
    pub max_dp_size: u32,
    pub max_batch: u32,
    pub max_message_bytes: usize,
    /// `limits.max_prompt_tokens`.
    pub max_prompt_tokens: u32,
}

/// The keys a query may carry, as read from the map (nil = absent).
#[derive(Default)]
struct Fields<'a> {
    v: Option<Value<'a>>,
    op: Option<Value<'a>>,
    id: Option<Value<'a>>,
    n: Option<Value<'a>>,
    prompt_tokens: Option<Value<'a>>,
    rank: Option<Value<'a>>,
    bootstrap_room: Option<Value<'a>>,
    session: Option<Value<'a>>,
    ok: Option<Value<'a>>,
    dp_size: Option<Value<'a>>,
    explain: Option<Value<'a>>,
    predicted: Option<Value<'a>>,
    delivered: Option<Value<'a>>,
    placed: Option<Value<'a>>,
    fallbacks: Option<Value<'a>>,
    shed_waiting: Option<Value<'a>>,
    /// The whole encoded array of `among` (read later).
    among: Option<&'a [u8]>,
    /// `tokens` (its count; the ids are in the decoder's buffer) and the
    /// whole encoded value of `block_keys` (read later).
    prompt: PromptFields<'a>,
}

/// A decode failure, with the id when it could still be read.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejected<'a> {
    pub id: Option<Id<'a>>,
    pub error: WireError,
}

fn bad(message: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::BadRequest, message)
}

/// Reads the map into `f`. On an error, `f` keeps what was read before
/// it, so the refusal can still carry the `id`; a non-string key is skipped
/// (with its value) and reported once the map has been read to its end.
/// Token ids are read into `tokens`, at most `max_tokens`.
fn read_fields<'a>(
    bytes: &'a [u8],
    f: &mut Fields<'a>,
    tokens: &mut Vec<u32>,
    max_tokens: u32,
) -> Result<(), WireError> {
    let mut r = Reader::new(bytes);
    let undecodable = |e| bad(format!("query is not valid MessagePack: {e}"));
    let len = match r.read().map_err(undecodable)? {
        Value::Map(n) => n,
        other => {
            return Err(bad(format!("query must be a MessagePack map with string keys, got {}", other.type_name())))
        }
    };
    let mut odd_key = None;
    for _ in 0..len {
        let key = match r.read().map_err(undecodable)? {
            Value::Str(k) => k,
            other => {
                r.skip_rest(other).map_err(undecodable)?;
                let value = r.read().map_err(undecodable)?;
                r.skip_rest(value).map_err(undecodable)?;
                odd_key.get_or_insert(other.type_name());
                continue;
            }
        };
        let start = r.position();
        let value = r.read().map_err(undecodable)?;
        // A prompt's arrays are checked while they are skipped: one pass.
        let kind = match key {
            "tokens" => Some(ArrayKind::Tokens),
            "block_keys" => Some(ArrayKind::Keys),
            _ => None,
        };
        if key == "among" {
            r.skip_rest(value).map_err(undecodable)?;
            f.among = (value != Value::Nil).then(|| &bytes[start..r.position()]);
            continue;
        }
        let scanned = match kind {
            Some(kind) if value != Value::Nil => {
                Some(scan_array(&mut r, value, kind, tokens, max_tokens).map_err(undecodable)?)
            }
            _ => {
                r.skip_rest(value).map_err(undecodable)?;
                None
            }
        };
        if let Some(scanned) = scanned {
            if kind == Some(ArrayKind::Tokens) {
                f.prompt.tokens = Some(scanned);
            } else {
                f.prompt.block_keys = Some(scanned.map(|count| (&bytes[start..r.position()], count)));
            }
            continue;
        }
        let slot = match key {
            "v" => &mut f.v,
            "op" => &mut f.op,
            "id" => &mut f.id,
            "n" => &mut f.n,
            "prompt_tokens" => &mut f.prompt_tokens,
            "rank" => &mut f.rank,
            "bootstrap_room" => &mut f.bootstrap_room,
            "session" => &mut f.session,
            "ok" => &mut f.ok,
            "dp_size" => &mut f.dp_size,
            "explain" => &mut f.explain,
            "predicted" => &mut f.predicted,
            "delivered" => &mut f.delivered,
            "placed" => &mut f.placed,
            "fallbacks" => &mut f.fallbacks,
            "shed_waiting" => &mut f.shed_waiting,
            "lora" => &mut f.prompt.lora,
            "salt" => &mut f.prompt.salt,
            _ => continue, // unknown keys are ignored
        };
        *slot = (value != Value::Nil).then_some(value);
    }
    if let Some(kind) = odd_key {
        return Err(bad(format!("map keys must be strings, got {kind}")));
    }
    if !r.at_end() {
        return Err(bad("trailing bytes after the query map"));
    }
    Ok(())
}

fn uint(name: &str, v: Value<'_>) -> Result<u64, WireError> {
    match v {
        Value::Int(i) => u64::try_from(i).map_err(|_| bad(format!("`{name}` must be a non-negative integer, got {i}"))),
        other => Err(bad(format!("`{name}` must be an integer, got {}", other.type_name()))),
    }
}

fn decode_id(v: Option<Value<'_>>) -> Result<Option<Id<'_>>, WireError> {
    match v {
        None => Ok(None),
        Some(Value::Str(s)) if s.len() <= MAX_ID_BYTES => Ok(Some(Id::Str(s))),
        Some(Value::Str(s)) => {
            Err(bad(format!("`id` is a string of {} bytes; at most {MAX_ID_BYTES} are allowed", s.len())))
        }
        Some(Value::Int(i)) => i64::try_from(i)
            .map(Id::Int)
            .or_else(|_| u64::try_from(i).map(Id::UInt))
            .map(Some)
            .map_err(|_| bad("`id` is out of the 64-bit range")),
        Some(other) => Err(bad(format!("`id` must be a string or an integer, got {}", other.type_name()))),
    }
}

fn decode_rank(v: Value<'_>, dp_size: u32) -> Result<u32, WireError> {
    match v {
        Value::Int(i) if (0..i128::from(dp_size)).contains(&i) => Ok(i as u32),
        Value::Int(i) => Err(WireError::new(
            ErrorCode::InvalidRank,
            format!("`rank` {i} is out of range: dp_size is {dp_size}, so ranks are 0..={}", dp_size - 1),
        )),
        other => Err(bad(format!("`rank` must be an integer, got {}", other.type_name()))),
    }
}

fn decode_target(f: &Fields<'_>, dp_size: u32) -> Result<Target, WireError> {
    // `rank` wins over `bootstrap_room` when both are present.
    if let Some(v) = f.rank {
        return decode_rank(v, dp_size).map(Target::Pinned);
    }
    match f.bootstrap_room {
        Some(v) => uint("bootstrap_room", v).map(Target::Room),
        None => Ok(Target::Policy),
    }
}

fn decode_route<'a>(f: &Fields<'a>, lim: &QueryLimits, tokens: &'a [u32]) -> Result<RouteRequest<'a>, WireError> {
    let n = match f.n {
        None => 1,
        Some(v) => match uint("n", v)? {
            0 => return Err(bad("`n` must be at least 1")),
            n if n > u64::from(lim.max_batch) => {
                return Err(WireError::new(
                    ErrorCode::TooLarge,
                    format!("`n` is {n}, above max_batch {}; split the batch", lim.max_batch),
                ))
            }
            n => n as u32,
        },
    };
    let prompt_tokens = f.prompt_tokens.map(|v| uint("prompt_tokens", v)).transpose()?;
    let target = decode_target(f, lim.dp_size)?;
    let session = match f.session {
        None => None,
        Some(Value::Str(s)) => Some(s),
        Some(other) => return Err(bad(format!("`session` must be a string, got {}", other.type_name()))),
    };
    let prompt = decode_prompt(&f.prompt, lim.max_prompt_tokens, tokens)?;
    let explain = match f.explain {
        None => false,
        Some(Value::Bool(b)) => b,
        Some(other) => return Err(bad(format!("`explain` must be a boolean, got {}", other.type_name()))),
    };
    let among = f.among.map(|raw| decode_among(raw, lim.dp_size)).transpose()?;
    let fallbacks = match f.fallbacks.map(|v| uint("fallbacks", v)).transpose()? {
        None => 0,
        Some(k) if k <= u64::from(MAX_FALLBACKS) => k as u8,
        Some(k) => return Err(bad(format!("`fallbacks` is {k}; at most {MAX_FALLBACKS} are listed"))),
    };
    let shed_waiting = match f.shed_waiting.map(|v| uint("shed_waiting", v)).transpose()? {
        Some(0) => return Err(bad("`shed_waiting` must be at least 1 (leave it out to never shed)")),
        other => other,
    };
    Ok(RouteRequest { n, prompt_tokens, target, session, prompt, explain, among, fallbacks, shed_waiting })
}

/// `among`: an array of ranks, each `0..dp_size`.
fn decode_among(raw: &[u8], dp_size: u32) -> Result<RankSet, WireError> {
    let mut r = Reader::new(raw);
    let len = match r.read() {
        Ok(Value::Array(n)) => n,
        Ok(other) => return Err(bad(format!("`among` must be an array of ranks, got {}", other.type_name()))),
        Err(e) => return Err(bad(format!("`among` is not valid MessagePack: {e}"))),
    };
    let mut set = RankSet::default();
    for _ in 0..len {
        match r.read() {
            Ok(v @ Value::Int(_)) => set.insert(decode_rank(v, dp_size)?),
            Ok(other) => return Err(bad(format!("`among` must hold ranks (integers), got {}", other.type_name()))),
            Err(e) => return Err(bad(format!("`among` is not valid MessagePack: {e}"))),
        }
    }
    Ok(set)
}

fn decode_finished(f: &Fields<'_>, lim: &QueryLimits) -> Result<Finished, WireError> {
    let rank = f.rank.map(|v| decode_rank(v, lim.dp_size)).transpose()?;
    let n = match f.n.map(|v| uint("n", v)).transpose()? {
        None => 1,
        Some(n) if (1..=u64::from(lim.max_batch)).contains(&n) => n as u32,
        Some(n) => return Err(bad(format!("`n` must be 1..={}, got {n}", lim.max_batch))),
    };
    let placed = f.placed.map(|v| decode_rank(v, lim.dp_size)).transpose()?;
    match (rank, placed) {
        (Some(rank), placed) => Ok(Finished::Served { rank, n, placed }),
        (None, Some(placed)) => Ok(Finished::Withdrawn { placed, n }),
        (None, None) => Err(bad("`finished` needs `rank`, or `placed` alone to withdraw placements")),
    }
}

fn needed<'a>(name: &str, v: Option<Value<'a>>) -> Result<Value<'a>, WireError> {
    v.ok_or_else(|| bad(format!("`delivered` needs `{name}`")))
}

fn decode_delivered(f: &Fields<'_>, dp_size: u32) -> Result<Delivered, WireError> {
    let rank = decode_rank(needed("rank", f.rank)?, dp_size)?;
    let predicted = uint("predicted", needed("predicted", f.predicted)?)?;
    let delivered = uint("delivered", needed("delivered", f.delivered)?)?;
    Ok(Delivered { rank, predicted, delivered })
}

fn decode_prefix<'a>(f: &Fields<'a>, lim: &QueryLimits, tokens: &'a [u32]) -> Result<HealthOp<'a>, WireError> {
    match decode_prompt(&f.prompt, lim.max_prompt_tokens, tokens)? {
        Some(p) => Ok(HealthOp::Prefix(p)),
        None => Err(bad("`prefix` needs `tokens` (token ids) or `block_keys`")),
    }
}

fn decode_report<'a>(f: &Fields<'a>, dp_size: u32) -> Result<HealthOp<'a>, WireError> {
    let rank = f.rank.ok_or_else(|| bad("`health_report` needs `rank`"))?;
    let rank = decode_rank(rank, dp_size)?;
    let ok = match f.ok {
        Some(Value::Bool(b)) => b,
        None => return Err(bad("`health_report` needs `ok` (true or false)")),
        Some(other) => return Err(bad(format!("`ok` must be a boolean, got {}", other.type_name()))),
    };
    Ok(HealthOp::Probe(Probe::Report { rank, ok }))
}

/// A rank count within `engines.dp_size`'s bounds and the ceiling of the
/// start, whose work with the current `max_batch` stays within
/// [`crate::config::keys::MAX_QUERY_WORK`].
fn decode_resize(f: &Fields<'_>, lim: &QueryLimits) -> Result<u32, WireError> {
    let max = u64::from(MAX_DP_SIZE);
    match f.dp_size.map(|v| uint("dp_size", v)).transpose()? {
        Some(n) if n > u64::from(lim.max_dp_size) && n <= max => Err(bad(format!(
            "`dp_size` {n} is above {} = {}: the reply queues are sized for it at start; \
             raise it and restart to grow further",
            MAX_DP_SIZE_KEY.key.path(),
            lim.max_dp_size
        ))),
        Some(n) if (1..=max).contains(&n) => {
            check_query_work(n as u32, lim.max_batch).map_err(|why| bad(format!("`dp_size`: {why}")))?;
            Ok(n as u32)
        }
        Some(n) => Err(bad(format!("`dp_size` must be between 1 and {max}, got {n}"))),
        None => Err(bad("`resize` needs `dp_size`")),
    }
}

fn wrong_socket(name: &str, on: Channel, served_on: Channel) -> WireError {
    WireError::new(
        ErrorCode::UnknownOp,
        format!("op `{name}` is served on the {} socket, not the {} socket", served_on.as_str(), on.as_str()),
    )
}

/// A peer's op name as an error message quotes it: at most
/// [`SHOWN_OP_BYTES`], so a refusal never echoes a long string.
fn shown(name: &str) -> std::borrow::Cow<'_, str> {
    if name.len() <= SHOWN_OP_BYTES {
        return name.into();
    }
    let end = (0..=SHOWN_OP_BYTES).rev().find(|&i| name.is_char_boundary(i)).unwrap_or(0);
    format!("{}... ({} bytes)", &name[..end], name.len()).into()
}

fn unknown_op(name: &str, ch: Channel) -> WireError {
    let served = match ch {
        Channel::Route => "route, delivered, finished, ping, state",
        Channel::Health => "health_route, health_report, resize, reload, prefix, ping, state",
    };
    WireError::new(
        ErrorCode::UnknownOp,
        format!("unknown op `{}`; the {} socket serves: {served}", shown(name), ch.as_str()),
    )
}

fn route_op<'a>(name: &str, f: &Fields<'a>, lim: &QueryLimits, tokens: &'a [u32]) -> Result<RouteOp<'a>, WireError> {
    match name {
        "ping" => Ok(RouteOp::Ping),
        "state" => Ok(RouteOp::State),
        "route" => decode_route(f, lim, tokens).map(RouteOp::Route),
        "delivered" => decode_delivered(f, lim.dp_size).map(RouteOp::Delivered),
        "finished" => decode_finished(f, lim).map(RouteOp::Finished),
        "health_route" | "health_report" | "resize" | "reload" | "prefix" => {
            Err(wrong_socket(name, Channel::Route, Channel::Health))
        }
        _ => Err(unknown_op(name, Channel::Route)),
    }
}

fn health_op<'a>(name: &str, f: &Fields<'a>, lim: &QueryLimits, tokens: &'a [u32]) -> Result<HealthOp<'a>, WireError> {
    match name {
        "ping" => Ok(HealthOp::Ping),
        "state" => Ok(HealthOp::State),
        "health_route" => decode_target(f, lim.dp_size).map(|t| HealthOp::Probe(Probe::Route(t))),
        "health_report" => decode_report(f, lim.dp_size),
        "resize" => decode_resize(f, lim).map(|n| HealthOp::Admin(Admin::Resize(n))),
        "reload" => Ok(HealthOp::Admin(Admin::Reload)),
        "prefix" => decode_prefix(f, lim, tokens),
        "route" | "delivered" | "finished" => Err(wrong_socket(name, Channel::Health, Channel::Route)),
        _ => Err(unknown_op(name, Channel::Health)),
    }
}

/// Decodes and checks one query of the route socket; a prompt's token ids
/// are read into `tokens` (a buffer the caller keeps, so nothing is
/// allocated once it has grown).
pub fn decode_route_query<'a>(
    bytes: &'a [u8],
    lim: &QueryLimits,
    tokens: &'a mut Vec<u32>,
) -> Result<Query<'a, RouteOp<'a>>, Rejected<'a>> {
    decode_query(bytes, lim, tokens, |name, f, tokens| route_op(name, f, lim, tokens))
}

/// Decodes and checks one query of the health socket, as [`decode_route_query`].
pub fn decode_health_query<'a>(
    bytes: &'a [u8],
    lim: &QueryLimits,
    tokens: &'a mut Vec<u32>,
) -> Result<Query<'a, HealthOp<'a>>, Rejected<'a>> {
    decode_query(bytes, lim, tokens, |name, f, tokens| health_op(name, f, lim, tokens))
}

/// The rules every query shares (size, map, id, version, op name); `op`
/// decodes what depends on the socket.
fn decode_query<'a, O>(
    bytes: &'a [u8],
    lim: &QueryLimits,
    tokens: &'a mut Vec<u32>,
    op: impl FnOnce(&str, &Fields<'a>, &'a [u32]) -> Result<O, WireError>,
) -> Result<Query<'a, O>, Rejected<'a>> {
    let mut f = Fields::default();
    let read = read_fields(bytes, &mut f, tokens, lim.max_prompt_tokens);
    // Any refusal carries the id when one was read before the fault and is
    // itself valid (the reader never allocates and stops at the bytes present).
    let id = decode_id(f.id);
    let readable = || id.clone().ok().flatten();
    if bytes.len() > lim.max_message_bytes {
        let msg = format!("query is {} bytes, above max_message_bytes {}", bytes.len(), lim.max_message_bytes);
        return Err(Rejected { id: readable(), error: WireError::new(ErrorCode::TooLarge, msg) });
    }
    if let Err(error) = read {
        return Err(Rejected { id: readable(), error });
    }
    let id = id.map_err(|error| Rejected { id: None, error })?;
    let fail = |error| Rejected { id, error };
    match f.v {
        None => return Err(fail(bad("missing `v` (protocol version, must be 1)"))),
        Some(Value::Int(1)) => {}
        Some(Value::Int(v)) => {
            let msg = format!("protocol version {v} is not supported; this dpcoord speaks version 1");
            return Err(fail(WireError::new(ErrorCode::UnsupportedVersion, msg)));
        }
        Some(other) => return Err(fail(bad(format!("`v` must be an integer, got {}", other.type_name())))),
    }
    let name = match f.op {
        Some(Value::Str(s)) => s,
        None => return Err(fail(bad("missing `op`"))),
        Some(other) => return Err(fail(bad(format!("`op` must be a string, got {}", other.type_name())))),
    };
    let tokens: &'a Vec<u32> = tokens;
    let op = op(name, &f, tokens).map_err(fail)?;
    Ok(Query { id, op })
}

#[cfg(test)]
mod tests;
