//! The KV-event streams: `seq` per publisher, gaps recovered through the
//! publisher's replay socket or answered by clearing the rank, and the
//! prefix index they feed (docs/PROTOCOL.md §11a).
//!
//! The coordinator owns this; it does no I/O either: a replay to ask for
//! is queued here and sent by the transport (`take_asks`).
//!
//! What changes the index (a batch to apply, a rank to clear) is queued in
//! the order it was decided and carried out a slice at a time
//! ([`KvStreams::work`]): the transport gives it a budget per poll round,
//! so a batch of any size delays a query by one slice. `seq`, gap and
//! replay decisions are taken when a message arrives, as before; only the
//! index lags, by the queue.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::config::{budget, KvEndpoint, KvSettings};
use crate::engines::kv::{KvBatch, KvBody, KvEvent, KvMessage, Medium};
use crate::engines::prefix::{PrefixIndex, Progress};
use crate::engines::{EngineTable, Status};
use crate::observability::kv_metrics::{BatchResult, KvMetrics, ReplayResult, ResetCause};
use crate::observability::ratelimit::LogLimiter;
use crate::wire::SourceRequest;

/// Live batches kept while a replay runs; past it the replay is given up.
const MAX_BUFFERED: usize = 1000;
/// The bytes of decoded live batches that every running replay together
/// may keep (`KvBatch::held_bytes`; a batch that does not decode counts its
/// reason's length). A replay whose next live batch would pass it is given
/// up like one past [`MAX_BUFFERED`]: the rank's index is cleared rather
/// than memory grown, however large and many the batches.
const MAX_BUFFERED_BYTES: usize = 32 << 20;

type Payload = Result<KvBatch, String>;

/// A change of the index waiting its turn, and how far it got.
enum Op {
    Apply { rank: u32, events: Vec<KvEvent>, at: Progress },
    Reset { rank: u32, cause: ResetCause, at: Progress },
}

/// A rank's reset is applied as this batch.
const CLEAR: &[KvEvent] = &[KvEvent::Cleared];

struct Replay {
    /// The `seq` the replay must deliver next.
    next: u64,
    /// The first replay of a publisher (from 0): it may start later.
    initial: bool,
    delivered: bool,
    /// A `seq` was missing from the replay.
    broken: bool,
    deadline: Instant,
    live: VecDeque<(u64, Payload)>,
    /// What `live` holds, by [`held_bytes`].
    bytes: usize,
}

/// What a buffered live batch holds, in bytes.
fn held_bytes(batch: &Payload) -> usize {
    match batch {
        Ok(b) => b.held_bytes(),
        Err(why) => why.len(),
    }
}

struct Stream {
    /// The rank its `+rank` endpoint was written for.
    hint: Option<u32>,
    can_replay: bool,
    /// The rank of the last batch applied.
    rank: Option<u32>,
    next: Option<u64>,
    replay: Option<Replay>,
}

pub(super) struct KvStreams {
    index: PrefixIndex,
    /// The index's share of the memory budget, split evenly by the ranks.
    index_bytes: u64,
    streams: Vec<Stream>,
    replay_timeout: Duration,
    asks: Vec<SourceRequest>,
    /// What every running replay's live batches hold together, in bytes.
    buffered_bytes: usize,
    /// What the streams know of each rank, one record per rank.
    ranks: Vec<KvRank>,
    /// Changes of the index not yet (wholly) applied, oldest first.
    ops: VecDeque<Op>,
    metrics: KvMetrics,
    log: LogLimiter<1>,
}

/// One rank as the KV streams know it.
#[derive(Debug, Clone, Copy, Default)]
struct KvRank {
    /// A publisher has sent a batch for the rank: its index is event-fed.
    events: bool,
    /// The rank's index may hold blocks the engine dropped: a replay or a
    /// reset of its is under way ([`KvStreams::degraded`]).
    degraded: bool,
}

impl KvStreams {
    /// `index_bytes` is the index's share of the memory budget, all ranks.
    pub fn new(kv: &KvSettings, index_bytes: u64, dp_size: u32, metrics: KvMetrics) -> Self {
        KvStreams {
            index: PrefixIndex::new(dp_size, budget::events_per_rank(index_bytes, dp_size)),
            index_bytes,
            streams: Vec::new(),
            replay_timeout: kv.replay_timeout,
            asks: Vec::new(),
            buffered_bytes: 0,
            ranks: vec![KvRank::default(); dp_size as usize],
            ops: VecDeque::new(),
            metrics,
            log: LogLimiter::default(),
        }
    }

    /// The publishers, in `kv_events.connect` order (a message's `stream`).
    pub fn set_endpoints(&mut self, endpoints: &[KvEndpoint]) {
        self.finish();
        self.streams = endpoints
            .iter()
            .map(|e| Stream { hint: e.rank, can_replay: e.replay.is_some(), rank: None, next: None, replay: None })
            .collect();
        self.buffered_bytes = 0;
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// New limits; a smaller share is enforced on each rank as it is next
    /// written.
    pub fn reload(&mut self, kv: &KvSettings, index_bytes: u64) {
        self.index_bytes = index_bytes;
        self.index.set_cap(budget::events_per_rank(index_bytes, self.index.dp_size()));
        self.replay_timeout = kv.replay_timeout;
    }

    /// Whether `rank`'s index is degraded: a gap is being replayed, or a
    /// reset (a gap that could not be replayed, a restart, a new session)
    /// is queued, so it may hold blocks its engine no longer has. It is
    /// exact again only once the replay recovered or the reset is applied,
    /// never on a guess; exact means every block it holds was stored by
    /// the engine and not removed since, as an unbroken run of events says.
    pub fn degraded(&self, rank: u32) -> bool {
        self.ranks.get(rank as usize).is_some_and(|r| r.degraded)
    }

    fn refresh_trust(&mut self) {
        self.ranks.iter_mut().for_each(|r| r.degraded = false);
        let replaying = self.streams.iter().filter(|st| st.replay.is_some()).filter_map(|st| st.hint.or(st.rank));
        let resetting = self.ops.iter().filter_map(|op| match op {
            Op::Reset { rank, .. } => Some(*rank),
            Op::Apply { .. } => None,
        });
        for rank in replaying.chain(resetting) {
            if let Some(r) = self.ranks.get_mut(rank as usize) {
                r.degraded = true;
            }
        }
    }

    /// Publisher `stream`'s link was connected again. Its engine may have
    /// restarted with a `seq` that passed the old one before the link came
    /// back, so the `seq` cannot tell: the rank's index is cleared, and the
    /// next batch starts over as a first one (with a replay from 0 where
    /// the publisher has a replay socket). A link never heard from, or
    /// connected for the first time, changes nothing.
    pub fn new_session(&mut self, stream: u16) {
        let Some(st) = self.streams.get_mut(usize::from(stream)) else { return };
        if st.next.is_none() && st.replay.is_none() {
            return;
        }
        if let Some(r) = st.replay.take() {
            self.buffered_bytes -= r.bytes;
        }
        st.next = None;
        let rank = st.hint.or(st.rank);
        self.reset(rank, ResetCause::Reconnect);
    }

    /// Whether a publisher has sent a batch for `rank`.
    pub fn has_events(&self, rank: u32) -> bool {
        self.ranks.get(rank as usize).is_some_and(|r| r.events)
    }

    /// The ranks of each per-rank part: the records, the index, the series.
    #[cfg(test)]
    pub fn ranks(&self) -> [usize; 3] {
        [self.ranks.len(), self.index.dp_size() as usize, self.metrics.ranks()]
    }

    /// Grows or shrinks to `dp_size` ranks; what is queued is applied
    /// first (a resize is an operator's rare act).
    pub fn resize(&mut self, dp_size: u32) {
        self.finish();
        self.ranks.resize(dp_size as usize, KvRank::default());
        self.index.resize(dp_size);
        self.index.set_cap(budget::events_per_rank(self.index_bytes, dp_size));
        self.metrics.resize(dp_size);
    }

    /// Replays to ask for: `(stream, start_seq)`, moved into `out`.
    pub fn take_asks(&mut self, out: &mut Vec<SourceRequest>) {
        out.append(&mut self.asks);
    }

    /// Takes one message and applies what it changes, whole.
    #[cfg(test)]
    pub fn on_message(&mut self, msg: KvMessage, now: Instant) {
        self.accept(msg, now);
        self.finish();
    }

    /// Takes one message: `seq`, gaps and replays are decided now, what it
    /// changes in the index is queued for [`KvStreams::work`].
    pub fn accept(&mut self, msg: KvMessage, now: Instant) {
        let s = usize::from(msg.stream);
        if s >= self.streams.len() {
            return;
        }
        match (msg.from_replay, msg.body) {
            (false, KvBody::Batch { seq, batch }) => self.live(s, seq, batch, now),
            (true, KvBody::Batch { seq, batch }) => self.replayed(s, seq, batch, now),
            (true, KvBody::ReplayEnd) => self.finish_replay(s, None, now),
            (false, KvBody::ReplayEnd) => {}
        }
        self.refresh_trust();
    }

    fn live(&mut self, s: usize, seq: u64, batch: Payload, now: Instant) {
        if let Some(r) = &mut self.streams[s].replay {
            let bytes = held_bytes(&batch);
            if r.live.len() < MAX_BUFFERED && self.buffered_bytes + bytes <= MAX_BUFFERED_BYTES {
                r.live.push_back((seq, batch));
                r.bytes += bytes;
                self.buffered_bytes += bytes;
                return;
            }
            self.finish_replay(s, Some(ReplayResult::Incomplete), now);
        }
        // One SUB connection delivers a publisher's batches in order, once:
        // a seq below the next expected one means the publisher restarted
        // (its seq 0 may have been lost), and what it held before is gone.
        if self.streams[s].next.is_some_and(|next| seq < next) {
            self.reset(self.rank_of(s, &batch), ResetCause::Restart);
            self.streams[s].next = None;
        }
        // A replay keeps this batch until it ends: only when there is room.
        let room = self.buffered_bytes + held_bytes(&batch) <= MAX_BUFFERED_BYTES;
        let st = &mut self.streams[s];
        match st.next {
            None if st.can_replay && seq > 0 && room => self.start_replay(s, 0, true, (seq, batch), now),
            Some(next) if seq > next && st.can_replay && room => {
                self.metrics.gap();
                self.start_replay(s, next, false, (seq, batch), now);
            }
            next => {
                if next.is_some_and(|n| seq > n) {
                    self.metrics.gap();
                    let why = if st.can_replay { ReplayResult::Incomplete } else { ReplayResult::Unavailable };
                    self.metrics.replay(why);
                    self.reset(self.rank_of(s, &batch), ResetCause::Gap);
                }
                self.streams[s].next = Some(seq + 1);
                self.apply(s, batch, now);
            }
        }
    }

    fn start_replay(&mut self, s: usize, from: u64, initial: bool, first: (u64, Payload), now: Instant) {
        self.asks.push(SourceRequest::kv_replay(s as u16, from));
        let bytes = held_bytes(&first.1);
        self.buffered_bytes += bytes;
        self.streams[s].replay = Some(Replay {
            next: from,
            initial,
            delivered: false,
            broken: false,
            deadline: now + self.replay_timeout,
            live: VecDeque::from([first]),
            bytes,
        });
    }

    fn replayed(&mut self, s: usize, seq: u64, batch: Payload, now: Instant) {
        let Some(r) = &mut self.streams[s].replay else {
            self.metrics.batch(BatchResult::Stale);
            return;
        };
        if r.initial && !r.delivered && seq > r.next {
            // The publisher's buffer starts later: history before it is unknown, not a gap.
            r.next = seq;
        }
        if r.broken || seq < r.next {
            self.metrics.batch(BatchResult::Stale);
            return;
        }
        if seq > r.next {
            r.broken = true;
            return;
        }
        r.next += 1;
        r.delivered = true;
        self.apply(s, batch, now);
    }

    /// Ends stream `s`'s replay: `forced` when it timed out or overflowed.
    fn finish_replay(&mut self, s: usize, forced: Option<ReplayResult>, now: Instant) {
        let Some(r) = self.streams[s].replay.take() else { return };
        self.buffered_bytes -= r.bytes;
        let hole = forced.is_some() || r.broken || r.live.front().is_some_and(|(first, _)| *first > r.next);
        if hole && (r.delivered || !r.initial) {
            let rank = self.streams[s].hint.or(self.streams[s].rank);
            self.reset(rank, ResetCause::Gap);
        }
        if !r.initial {
            self.metrics.replay(forced.unwrap_or(if hole {
                ReplayResult::Incomplete
            } else {
                ReplayResult::Recovered
            }));
        }
        let mut next = r.next;
        for (seq, batch) in r.live {
            if seq < next {
                self.metrics.batch(BatchResult::Stale);
                continue;
            }
            next = seq + 1;
            self.apply(s, batch, now);
        }
        self.streams[s].next = Some(next);
    }

    /// The rank a batch is about: its endpoint's (a `+rank` endpoint
    /// resets no other rank, whatever its batches name), else its own, else
    /// the stream's last.
    fn rank_of(&self, s: usize, batch: &Payload) -> Option<u32> {
        let st = &self.streams[s];
        st.hint.or(batch.as_ref().ok().and_then(|b| b.rank)).or(st.rank)
    }

    fn apply(&mut self, s: usize, batch: Payload, now: Instant) {
        let batch = match batch {
            Ok(b) => b,
            Err(why) => return self.drop_batch(BatchResult::Malformed, &why, now),
        };
        // A `+rank` endpoint (and its replay socket) writes its own rank
        // only: a batch naming another takes its `seq`, as a malformed one
        // does, and changes nothing else.
        let hint = self.streams[s].hint;
        if let Some((own, named)) = hint.zip(batch.rank).filter(|(own, named)| own != named) {
            let why = format!("KV events: a batch naming dp_rank {named} from the endpoint of rank {own}");
            return self.drop_batch(BatchResult::WrongRank, &why, now);
        }
        let Some(rank) = hint.or(batch.rank) else {
            let why = "KV events: the batch names no dp_rank and its endpoint is not a +rank form";
            return self.drop_batch(BatchResult::Malformed, why, now);
        };
        if rank >= self.index.dp_size() {
            let why = format!("KV events: dp_rank {rank} is outside 0..{}", self.index.dp_size());
            return self.drop_batch(BatchResult::UnknownRank, &why, now);
        }
        self.streams[s].rank = Some(rank);
        self.ranks[rank as usize].events = true;
        self.ops.push_back(Op::Apply { rank, events: batch.events, at: Progress::default() });
    }

    /// Whether a change of the index is waiting.
    pub fn pending(&self) -> bool {
        !self.ops.is_empty()
    }

    /// Applies what is queued, in order, touching at most `budget` blocks
    /// (at least one step); returns the blocks touched. A batch's outcome
    /// is counted once it is whole.
    pub fn work(&mut self, budget: usize) -> usize {
        let mut used = 0;
        while used < budget {
            let Some(op) = self.ops.front_mut() else { break };
            let (rank, events, at) = match op {
                Op::Apply { rank, events, at } => (*rank, &events[..], at),
                Op::Reset { rank, at, .. } => (*rank, CLEAR, at),
            };
            if rank >= self.index.dp_size() {
                self.ops.pop_front();
                continue;
            }
            let (n, done) = self.index.apply_some(rank, events, at, budget - used);
            used += n;
            if !done {
                break;
            }
            match self.ops.pop_front() {
                Some(Op::Apply { rank, at, .. }) => {
                    self.metrics.applied(rank, &at.applied);
                    for _ in 0..at.applied.cleared {
                        self.metrics.reset(rank, ResetCause::Cleared);
                    }
                    self.metrics.batch(BatchResult::Ok);
                }
                Some(Op::Reset { rank, cause, .. }) => {
                    if matches!(cause, ResetCause::Restart | ResetCause::Down) {
                        self.index.forget_block_size(rank);
                    }
                    self.metrics.reset(rank, cause);
                }
                None => {}
            }
        }
        self.refresh_trust();
        used
    }

    /// Applies everything queued.
    pub fn finish(&mut self) {
        while self.pending() {
            self.work(usize::MAX);
        }
    }

    pub fn drop_batch(&mut self, result: BatchResult, why: &str, now: Instant) {
        self.metrics.batch(result);
        if let Some(suppressed) = self.log.allow(0, now) {
            tracing::warn!(result = result.as_str(), reason = why, suppressed, "dropped a KV event batch");
        }
    }

    /// Empties `rank`'s index (if known and in range) after what is
    /// queued, and counts why once done. A restart or a rank gone `down`
    /// also forgets the rank's block size (the next engine may use
    /// another); a gap keeps it.
    pub fn reset(&mut self, rank: Option<u32>, cause: ResetCause) {
        let Some(rank) = rank.filter(|&r| r < self.index.dp_size()) else { return };
        self.ops.push_back(Op::Reset { rank, cause, at: Progress::default() });
        self.ranks[rank as usize].degraded = true;
    }

    /// Whether a reset of `rank` is queued.
    fn resetting(&self, rank: u32) -> bool {
        self.ops.iter().any(|op| matches!(op, Op::Reset { rank: r, .. } if *r == rank))
    }

    /// Whether `rank` holds a block or has a batch queued.
    pub fn holds_or_queued(&self, rank: u32) -> bool {
        self.index.holds_any(rank) || self.ops.iter().any(|op| matches!(op, Op::Apply { rank: r, .. } if *r == rank))
    }

    /// Replays past their deadline end as incomplete; ranks that went
    /// `down` lose their index; the block gauges are refreshed.
    pub fn tick(&mut self, now: Instant, engines: &EngineTable) {
        for s in 0..self.streams.len() {
            if self.streams[s].replay.as_ref().is_some_and(|r| now >= r.deadline) {
                self.finish_replay(s, Some(ReplayResult::Timeout), now);
            }
        }
        self.refresh_trust();
        for rank in 0..self.index.dp_size() {
            if engines.get(rank).status == Status::Down && self.index.holds_any(rank) && !self.resetting(rank) {
                self.reset(Some(rank), ResetCause::Down);
            }
            self.metrics.blocks(rank, Medium::ALL.map(|m| self.index.blocks(rank, m)), self.degraded(rank));
        }
    }
}

#[cfg(test)]
mod tests;
