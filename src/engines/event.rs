//! Engine events: what a source says about one rank, once its wire format
//! is decoded.
//!
//! Every input format (dpcoord's own `StatsUpdate` today; the engines'
//! native load and KV streams next) decodes in its own `wire` module into
//! these types, and the coordinator applies them (`Coordinator::on_event`).
//! The engine table never sees a wire type, so a new source is a decoder
//! and a config entry, and nothing here changes unless it brings a new kind
//! of fact.

use serde::{Serialize, Serializer};

/// One engine's request counters within one boot:
/// `waiting` and `running` are gauges; `received`, `finished` and `failed`
/// only grow within a boot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub waiting: u64,
    pub running: u64,
    pub received: u64,
    pub finished: u64,
    pub failed: u64,
}

impl Counts {
    /// The counters that only grow within a boot, with their names.
    pub fn cumulative(&self) -> [(&'static str, u64); 3] {
        [("received", self.received), ("finished", self.finished), ("failed", self.failed)]
    }

    /// The wire order `[waiting, running, received, finished, failed]`.
    pub fn to_array(self) -> [u64; 5] {
        [self.waiting, self.running, self.received, self.finished, self.failed]
    }
}

impl From<[u64; 5]> for Counts {
    fn from([waiting, running, received, finished, failed]: [u64; 5]) -> Self {
        Counts { waiting, running, received, finished, failed }
    }
}

/// Serialized in the wire order, as the protocol's `counts` array.
impl Serialize for Counts {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_array().serialize(s)
    }
}

/// Tokens of the requests an engine holds, when it says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenLoad {
    pub waiting: u64,
    pub running: u64,
}

impl TokenLoad {
    pub fn total(self) -> u64 {
        self.waiting.saturating_add(self.running)
    }
}

/// One rank's load report. `rank` is as the source sent it (any integer a
/// MessagePack int can hold); the engine table checks it against the
/// current rank count.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    pub rank: i128,
    /// The engine incarnation; a higher one means it restarted.
    pub boot: u64,
    /// Rises strictly within a boot.
    pub seq: u64,
    pub counts: Counts,
    pub tokens: Option<TokenLoad>,
    pub kv_usage: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

impl LoadReport {
    /// A report with all counters at 0 and no optional field.
    pub fn new(rank: impl Into<i128>, boot: u64, seq: u64) -> Self {
        LoadReport {
            rank: rank.into(),
            boot,
            seq,
            counts: Counts::default(),
            tokens: None,
            kv_usage: None,
            ttft_ms: None,
            tpot_ms: None,
        }
    }

    /// With the counters in wire order `[waiting, running, received, finished, failed]`.
    pub fn counts(self, counts: [u64; 5]) -> Self {
        LoadReport { counts: counts.into(), ..self }
    }

    /// With `[waiting_tokens, running_tokens]`.
    pub fn tokens(self, [waiting, running]: [u64; 2]) -> Self {
        LoadReport { tokens: Some(TokenLoad { waiting, running }), ..self }
    }

    pub fn ttft_ms(self, ms: f64) -> Self {
        LoadReport { ttft_ms: Some(ms), ..self }
    }
}

/// What a source tells dpcoord about an engine.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// A load report: counters, token load, latencies.
    Load(LoadReport),
}
