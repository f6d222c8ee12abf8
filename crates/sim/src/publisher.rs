//! An engine's side of its stats source: dpcoord's own `StatsUpdate` (with
//! the cumulative `received`), or SGLang's scheduler load stream (gauges
//! only, on the engine's own PUB, which dpcoord subscribes to).
//!
//! The SGLang publisher is called on a throttle (once per grid tick of the
//! run) and sends when the stat changed since its last send, or an
//! unchanged stat once a second: SGLang's on-change stream and heartbeat.

use super::error::NetError;
use super::model::{Micros, SimEngine};
use super::net::StatsPub;
use super::stepped::{SourcePeer, Wiring};
use dpcoord_daemon::wire::SourceKind;

/// SGLang re-sends an unchanged stat at most this often (virtual time).
const HEARTBEAT: Micros = 1_000_000;
/// `max_total_num_tokens` the simulated engines report.
const KV_MAX: u64 = 1 << 20;

/// SGLang's `LoadStat` fields the simulator fills in: `[running, waiting, kv_tokens, queued_tokens]`.
type Stat = [u64; 4];

fn stat(e: &SimEngine) -> Stat {
    let [waiting, running, ..] = e.counts();
    let [queued, kv] = e.tokens();
    [running, waiting, kv, queued]
}

/// One engine's SGLang-style load PUB (bound by the engine, as SGLang's is).
pub struct LoadPub {
    peer: SourcePeer,
    seq: i64,
    last: Option<(Stat, Micros)>,
}

impl LoadPub {
    /// The load PUB of rank `rank`, bound at `endpoint`.
    pub fn bind(wiring: &Wiring, endpoint: &str, rank: u32) -> Result<LoadPub, NetError> {
        let peer = wiring.publisher(endpoint, SourceKind::SglangLoad { rank }, true, 100_000)?;
        Ok(LoadPub { peer, seq: 0, last: None })
    }

    /// Sends rank `rank`'s stat: `[b"load", seq i64 BE, msgpack ["LoadStat", ...]]`.
    fn send(&mut self, rank: u32, s: Stat, now: Micros) -> Result<(), NetError> {
        let [running, waiting, kv, queued] = s;
        let load_stat = ("LoadStat", running, waiting, kv, KV_MAX, rank, queued, kv + queued, 256u64, 0u64, 0u64);
        self.peer.send(&[b"load", &self.seq.to_be_bytes(), &rmp_serde::to_vec(&load_stat)?])?;
        self.seq += 1;
        self.last = Some((s, now));
        Ok(())
    }

    /// One throttled call at virtual time `now`: sends on a change or a due
    /// heartbeat; whether it sent.
    fn call(&mut self, rank: u32, e: &SimEngine, now: Micros) -> Result<bool, NetError> {
        let s = stat(e);
        let due = match self.last {
            Some((last, at)) => last != s || now.saturating_sub(at) >= HEARTBEAT,
            None => true,
        };
        if due {
            self.send(rank, s, now)?;
        }
        Ok(due)
    }
}

/// One engine's publisher, and what its last message told dpcoord.
pub struct Publisher {
    kind: Kind,
    rank: u32,
    /// The engine's `received` when it last published: placements it held then.
    pub received: u64,
    /// Messages sent so far.
    pub sent: u64,
}

enum Kind {
    Stats(StatsPub),
    Load(LoadPub),
}

impl Publisher {
    pub fn stats(p: StatsPub, rank: u32) -> Publisher {
        Publisher { kind: Kind::Stats(p), rank, received: 0, sent: 0 }
    }

    pub fn load(p: LoadPub, rank: u32) -> Publisher {
        Publisher { kind: Kind::Load(p), rank, received: 0, sent: 0 }
    }

    /// Whether this is a gauge-only source (SGLang's), published on the throttle.
    pub fn is_load(&self) -> bool {
        matches!(self.kind, Kind::Load(_))
    }

    /// Sends the engine's stats now (at virtual time `now`).
    pub fn send(&mut self, e: &SimEngine, ttft_ms: Option<f64>, now: Micros) -> Result<(), NetError> {
        match &mut self.kind {
            Kind::Stats(p) => p.publish(e.counts(), e.tokens(), ttft_ms, Some(e.progress()))?,
            Kind::Load(p) => p.send(self.rank, stat(e), now)?,
        }
        self.sent += 1;
        self.received = e.counts()[2];
        Ok(())
    }

    /// The throttled call of a load publisher (a stats publisher sends on its own).
    pub fn call(&mut self, e: &SimEngine, now: Micros) -> Result<(), NetError> {
        if let Kind::Load(p) = &mut self.kind {
            if p.call(self.rank, e, now)? {
                self.sent += 1;
                self.received = e.counts()[2];
            }
        }
        Ok(())
    }

    /// The counts dpcoord's `state` shows once it has this publisher's last message.
    pub fn shown(&self) -> [u64; 5] {
        match &self.kind {
            Kind::Stats(p) => p.last,
            Kind::Load(p) => p.last.map_or([0; 5], |([running, waiting, ..], _)| [waiting, running, 0, 0, 0]),
        }
    }
}
