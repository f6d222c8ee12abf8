//! Bytes <-> typed messages: queries, engine sources and replies.
//!
//! This module owns the wire contract (docs/PROTOCOL.md). It does no I/O and
//! holds no state: the transport hands it frames, it hands back typed
//! queries and engine events, and the coordinator hands it answers.

mod bounds;
mod kv_events;
pub mod msgpack;
mod prompt;
mod query;
mod reply;
mod sglang;
mod source;
mod stats;
mod vllm_metrics;

pub use crate::engines::Target;
pub use bounds::max_reply_bytes;
pub use kv_events::{
    decode_batch as decode_kv_batch, decode_kv_message, BatchError, KvFrameError, BAD_GROUP, LOOKAHEAD, OPAQUE_EXTRA,
    UNKNOWN_EXTRA,
};
pub use prompt::{Prompt, TOKENS_PER_KEY};
pub use query::{
    decode_health_query, decode_route_query, Admin, Channel, Delivered, Finished, HealthOp, Probe, Query, QueryLimits,
    Rejected, RouteOp, RouteRequest,
};
pub use reply::{
    encode_admin, encode_error, encode_health_rank, encode_ok, encode_ping, encode_prefix, encode_ranks, encode_state,
    Chosen, DpSizeFrom, Explain, Instance, PrefixSource, RankView, StateView,
};
pub use sglang::{decode_sglang_load, SglangError};
pub use source::{decode_source, SourceError, SourceKind, SourceLimits, SourceRequest};
pub use stats::{decode_stats, StatsError};
pub use vllm_metrics::{
    decode_vllm_gauges, decode_vllm_metrics, read_vllm_metrics, VllmGauges, VllmMetricsError,
    FAMILIES as VLLM_FAMILIES, MAX_BODY_BYTES as VLLM_MAX_BODY_BYTES, MAX_SAMPLES as VLLM_MAX_SAMPLES,
};

use crate::engines::Unroutable;

use serde::{Serialize, Serializer};

crate::names! {
    #[names(parse)]
    /// The contract's error codes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum ErrorCode {
        BadRequest => "bad_request",
        UnsupportedVersion => "unsupported_version",
        UnknownOp => "unknown_op",
        InvalidRank => "invalid_rank",
        RankUnavailable => "rank_unavailable",
        NoEngineAvailable => "no_engine_available",
        TooLarge => "too_large",
        /// A `reload` found a configuration it cannot apply.
        InvalidConfig => "invalid_config",
        /// A route asked to be shed (`shed_waiting`) found every candidate
        /// rank's queue at least that deep.
        Saturated => "saturated",
    }
}

/// A refused query: the code and a message a person can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        WireError { code, message: message.into() }
    }
}

/// A placement that cannot be made, as the contract's error.
impl From<Unroutable> for WireError {
    fn from(u: Unroutable) -> Self {
        let code = match u {
            Unroutable::Rank { .. } => ErrorCode::RankUnavailable,
            Unroutable::NoEngine { .. } | Unroutable::NoneAmong { .. } => ErrorCode::NoEngineAvailable,
            Unroutable::Saturated { .. } => ErrorCode::Saturated,
        };
        WireError::new(code, u.to_string())
    }
}

/// A query's `id`, echoed verbatim in its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Id<'a> {
    Str(&'a str),
    Int(i64),
    UInt(u64),
}

/// An [`Id`] kept past its query's buffer: a `reload` answered once the
/// file has been read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnedId {
    Str(String),
    Int(i64),
    UInt(u64),
}

impl Id<'_> {
    pub fn to_owned_id(self) -> OwnedId {
        match self {
            Id::Str(v) => OwnedId::Str(v.to_owned()),
            Id::Int(v) => OwnedId::Int(v),
            Id::UInt(v) => OwnedId::UInt(v),
        }
    }
}

impl OwnedId {
    pub fn as_id(&self) -> Id<'_> {
        match self {
            OwnedId::Str(v) => Id::Str(v),
            OwnedId::Int(v) => Id::Int(*v),
            OwnedId::UInt(v) => Id::UInt(*v),
        }
    }
}

impl Serialize for Id<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            Id::Str(v) => s.serialize_str(v),
            Id::Int(v) => s.serialize_i64(v),
            Id::UInt(v) => s.serialize_u64(v),
        }
    }
}
