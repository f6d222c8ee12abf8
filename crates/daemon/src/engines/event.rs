//! Engine events: what a source says about one rank, once its wire format
//! is decoded.
//!
//! Every input format (dpcoord's own `StatsUpdate` today; the engines'
//! native load and KV streams next) decodes in its own `wire` module into
//! these types, and the coordinator applies them (`Coordinator::on_event`).
//! The engine table never sees a wire type, so a new source is a decoder
//! and a config entry, and nothing here changes unless it brings a new kind
//! of fact.

use std::time::Duration;

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

/// How a source numbers its reports, which is how a restart shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sequence {
    /// dpcoord's `StatsUpdate`: `boot` names the engine incarnation (a
    /// higher one means it restarted) and `seq` rises strictly within it.
    Boot { boot: u64, seq: u64 },
    /// A stream each publisher process numbers from 0 (SGLang's load PUB):
    /// on one connection reports arrive in order, so a `seq` not above the
    /// last one means the publisher restarted.
    Restarting { seq: u64 },
}

/// One rank's load report. `rank` is as the source sent it (any integer a
/// MessagePack int can hold); the engine table checks it against the
/// current rank count.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    pub rank: i128,
    pub sequence: Sequence,
    /// With `cumulative`, all five counters; without, `waiting` and
    /// `running` only (the others are 0).
    pub counts: Counts,
    /// Whether `received`, `finished` and `failed` are the engine's own
    /// cumulative counters. A source of gauges only (`false`) leaves
    /// pending placements to be reconciled by time (`routing.pending_transit_ms`).
    pub cumulative: bool,
    /// The longest the source goes without re-sending an unchanged report
    /// (liveness allows for it); zero when it says nothing.
    pub heartbeat: Duration,
    pub tokens: Option<TokenLoad>,
    pub kv_usage: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    /// A counter that moves whenever the engine works (steps, tokens), or
    /// `None` when the source gives none: what tells a busy engine from a
    /// wedged one.
    pub progress: Option<u64>,
}

impl LoadReport {
    /// A `StatsUpdate`-style report with all counters at 0 and no optional field.
    pub fn new(rank: impl Into<i128>, boot: u64, seq: u64) -> Self {
        LoadReport {
            rank: rank.into(),
            sequence: Sequence::Boot { boot, seq },
            counts: Counts::default(),
            cumulative: true,
            heartbeat: Duration::ZERO,
            tokens: None,
            kv_usage: None,
            ttft_ms: None,
            tpot_ms: None,
            progress: None,
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

    pub fn progress(self, progress: u64) -> Self {
        LoadReport { progress: Some(progress), ..self }
    }
}

/// What a source tells dpcoord about an engine.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// A load report: counters, token load, latencies.
    Load(LoadReport),
    /// A batch of KV-cache events (or a replay's end) from one publisher.
    Kv(super::kv::KvMessage),
}
