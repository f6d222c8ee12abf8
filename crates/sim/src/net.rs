//! The simulator's peers, speaking the wire contract like real ones:
//! frontend and prober REQ sockets, and one stats PUB socket per engine
//! (over ZeroMQ, or straight into a stepped coordinator: `stepped`).

use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::error::NetError;
use super::stepped::{QueryPeer, SourcePeer, Wiring};
use dpcoord_daemon::wire::{Channel, SourceKind};

#[derive(Serialize)]
struct Query<'a> {
    v: u8,
    op: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens: Option<&'a [u32]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rank: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ok: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dp_size: Option<u32>,
    /// The ranks a placement may take (docs/PROTOCOL.md §4).
    #[serde(skip_serializing_if = "Option::is_none")]
    among: Option<&'a [u32]>,
}

impl Query<'_> {
    fn op(op: &'static str) -> Query<'static> {
        Query { v: 1, op, tokens: None, prompt_tokens: None, rank: None, ok: None, dp_size: None, among: None }
    }
}

#[derive(Deserialize)]
struct ErrorBody {
    code: String,
    message: String,
}

#[derive(Deserialize)]
struct Reply {
    ok: bool,
    #[serde(default)]
    ranks: Vec<u32>,
    rank: Option<u32>,
    dp_size: Option<u32>,
    epoch: Option<u64>,
    error: Option<ErrorBody>,
}

/// One rank in a `state` reply.
#[derive(Debug, Clone, Deserialize)]
pub struct RankState {
    pub status: String,
    pub counts: [u64; 5],
    /// dpcoord's own placements it counts as not yet in the rank's reports.
    #[serde(default)]
    pub pending: u64,
}

#[derive(Deserialize)]
struct PrefixReply {
    #[serde(default)]
    matched: Vec<u64>,
}

#[derive(Deserialize)]
struct StateReply {
    epoch: u64,
    ranks: Vec<RankState>,
}

/// dpcoord's answer to a placement: a rank, or a refusal code (try again later).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Rank(u32),
    Refused(String),
}

/// A `route` query.
fn route_query<'a>(
    prompt_tokens: u64,
    tokens: Option<&'a [u32]>,
    pin: Option<u32>,
    among: Option<&'a [u32]>,
) -> Query<'a> {
    Query { prompt_tokens: Some(prompt_tokens), tokens, rank: pin, among, ..Query::op("route") }
}

/// A REQ socket: one query, one reply.
pub struct Rpc {
    peer: QueryPeer,
}

impl Rpc {
    /// A REQ socket to `endpoint`, dpcoord's `ch` socket.
    pub fn connect(wiring: &Wiring, endpoint: &str, ch: Channel) -> Result<Rpc, NetError> {
        Ok(Rpc { peer: wiring.query(endpoint, ch)? })
    }

    fn call<R: DeserializeOwned>(&self, q: &Query) -> Result<R, NetError> {
        let reply = self.peer.call(&rmp_serde::to_vec_named(q)?)?;
        Ok(rmp_serde::from_slice(&reply)?)
    }

    fn placement(&self, q: &Query, health: bool) -> Result<Answer, NetError> {
        let r: Reply = self.call(q)?;
        let rank = if health { r.rank } else { r.ranks.first().copied() };
        match (r.ok, rank, r.error) {
            (true, Some(rank), _) => Ok(Answer::Rank(rank)),
            (_, _, Some(e)) => Ok(Answer::Refused(e.code)),
            _ => Err(NetError::Refused { op: q.op, code: "?".into(), message: "reply without a rank".into() }),
        }
    }

    /// A user placement for one request (`op: route`).
    pub fn route(&self, prompt_tokens: u64) -> Result<Answer, NetError> {
        self.route_prompt(prompt_tokens, None, None, None)
    }

    /// A user placement with the prompt's token ids (for `cache_aware`), an
    /// optional pin (`rank`) and the ranks it may take (`among`; all if none).
    pub fn route_prompt(
        &self,
        prompt_tokens: u64,
        tokens: Option<&[u32]>,
        pin: Option<u32>,
        among: Option<&[u32]>,
    ) -> Result<Answer, NetError> {
        self.placement(&route_query(prompt_tokens, tokens, pin, among), false)
    }

    /// How many whole blocks of `tokens`, from the first, each rank holds in
    /// dpcoord's prefix index (`op: prefix`, health socket only).
    pub fn prefix(&self, tokens: &[u32]) -> Result<Vec<u64>, NetError> {
        Ok(self.call::<PrefixReply>(&Query { tokens: Some(tokens), ..Query::op("prefix") })?.matched)
    }

    /// A health placement (`op: health_route`).
    pub fn health_route(&self) -> Result<Answer, NetError> {
        self.placement(&Query::op("health_route"), true)
    }

    /// A probe's outcome (`op: health_report`).
    pub fn health_report(&self, rank: u32, ok: bool) -> Result<(), NetError> {
        let r: Reply = self.call(&Query { rank: Some(rank), ok: Some(ok), ..Query::op("health_report") })?;
        match r.error {
            Some(e) if !r.ok => Err(NetError::Refused { op: "health_report", code: e.code, message: e.message }),
            _ => Ok(()),
        }
    }

    /// The engine table as dpcoord sees it (`op: state`).
    pub fn state(&self) -> Result<Vec<RankState>, NetError> {
        Ok(self.call::<StateReply>(&Query::op("state"))?.ranks)
    }

    /// The table's epoch (`op: state`).
    pub fn epoch(&self) -> Result<u64, NetError> {
        Ok(self.call::<StateReply>(&Query::op("state"))?.epoch)
    }

    /// Resizes dpcoord's table (`op: resize`, health socket only); its
    /// reply's `(dp_size, epoch)`.
    pub fn resize(&self, dp_size: u32) -> Result<(u32, u64), NetError> {
        let r: Reply = self.call(&Query { dp_size: Some(dp_size), ..Query::op("resize") })?;
        match (r.ok, r.dp_size, r.epoch, r.error) {
            (true, Some(n), Some(epoch), _) => Ok((n, epoch)),
            (_, _, _, Some(e)) => Err(NetError::Refused { op: "resize", code: e.code, message: e.message }),
            _ => Err(NetError::Refused { op: "resize", code: "?".into(), message: "reply without dp_size".into() }),
        }
    }

    /// Polls `state` until every rank is `up`.
    pub fn wait_all_up(
        &self,
        deadline: Duration,
        mut beat: impl FnMut() -> Result<(), NetError>,
    ) -> Result<(), NetError> {
        let start = Instant::now();
        loop {
            beat()?;
            if self.state()?.iter().all(|r| r.status == "up") {
                return Ok(());
            }
            if start.elapsed() > deadline {
                return Err(NetError::NotUp(deadline));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[derive(Serialize)]
struct Update {
    v: u8,
    rank: u32,
    boot: u64,
    seq: u64,
    counts: [u64; 5],
    tokens: [u64; 2],
    #[serde(skip_serializing_if = "Option::is_none")]
    ttft_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    progress: Option<u64>,
}

/// One engine's stats PUB socket (it connects to dpcoord's stats bind).
pub struct StatsPub {
    peer: SourcePeer,
    rank: u32,
    boot: u64,
    seq: u64,
    /// The counts of the last update sent.
    pub last: [u64; 5],
}

impl StatsPub {
    pub fn connect(wiring: &Wiring, endpoint: &str, rank: u32, boot: u64) -> Result<StatsPub, NetError> {
        let peer = wiring.publisher(endpoint, SourceKind::Stats, false, 100_000)?;
        Ok(StatsPub { peer, rank, boot, seq: 0, last: [0; 5] })
    }

    /// Sends one `StatsUpdate` with the next `seq` (and the engine's
    /// `progress`, its steps, when given).
    pub fn publish(
        &mut self,
        counts: [u64; 5],
        tokens: [u64; 2],
        ttft_ms: Option<f64>,
        progress: Option<u64>,
    ) -> Result<(), NetError> {
        self.seq += 1;
        let u = Update { v: 1, rank: self.rank, boot: self.boot, seq: self.seq, counts, tokens, ttft_ms, progress };
        self.peer.send(&[&rmp_serde::to_vec_named(&u)?])?;
        self.last = counts;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(q: &Query) -> Vec<(String, rmpv::Value)> {
        let bytes = rmp_serde::to_vec_named(q).unwrap();
        let rmpv::Value::Map(m) = rmpv::decode::read_value(&mut &bytes[..]).unwrap() else { panic!("not a map") };
        m.into_iter().map(|(k, v)| (k.as_str().unwrap().to_owned(), v)).collect()
    }

    #[test]
    fn a_route_query_carries_among_only_when_given() {
        let node: Vec<u32> = (4..8).collect();
        let with = decoded(&route_query(3712, None, None, Some(&node)));
        let among = with.iter().find(|(k, _)| k == "among").map(|(_, v)| v.clone());
        assert_eq!(among, Some(rmpv::Value::Array((4..8).map(rmpv::Value::from).collect())));
        assert_eq!(
            with.iter().find(|(k, _)| k == "op").map(|(_, v)| v.as_str().unwrap().to_owned()).as_deref(),
            Some("route")
        );
        let keys: Vec<String> = decoded(&route_query(3712, None, Some(5), None)).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["v", "op", "prompt_tokens", "rank"], "no among: every rank, as before");
    }
}
