//! The memory budget: `limits.memory_budget_bytes` split over everything a
//! peer can make dpcoord hold. What the socket caps and tables can reach is
//! reserved first, at its worst; the rest is the prefix indexes', three
//! quarters for the KV-event index and one for the approximate one, each
//! shared evenly by the ranks and kept there by evicting the oldest entries
//! (counted). A configuration whose reservations leave the indexes less
//! than [`MIN_INDEX_BYTES`] is refused.
//!
//! The per-entry costs are the worst a hash map entry reaches (a table just
//! grown is 7/16 full), measured by `cargo bench --bench dpcoord -- prefix`
//! and held by `tests/it/memory_ceiling.rs`.

use super::{Server, Settings};

/// A connected ZeroMQ peer: libzmq's stream buffers and pipes (38 KB measured).
pub const PEER_BYTES: u64 = 40 << 10;
/// A session-table entry (its hashed key, rank and time, the LRU's links).
pub const SESSION_BYTES: u64 = 128;
/// An HTTP connection at its header limit, with its buffers.
pub const HTTP_CONNECTION_BYTES: u64 = 64 << 10;
/// A request through the proxy: the client's connection and the one to the
/// rank's server, each at its buffer limit (`gateway/proxy/`).
pub const PROXY_STREAM_BYTES: u64 = 2 * HTTP_CONNECTION_BYTES;
/// What a connection to a stats or SGLang load source may queue.
pub const SOURCE_LINK_BYTES: u64 = 2 << 20;
/// What a KV publisher's SUB, and its replay DEALER, may queue: at the
/// default `kv_events.max_batch_bytes`, one batch queued and one in
/// libzmq's decoder.
pub const KV_LINK_BYTES: u64 = 8 << 20;
/// The decoded live batches that running KV replays keep together.
pub const REPLAY_BUFFER_BYTES: u64 = 32 << 20;
/// One block of the KV-event index: its entry in the rank's hash -> key
/// map and its share of the key -> ranks bitset map.
pub const EVENT_BLOCK_BYTES: u64 = 100;
/// One key of the approximate index: its time in the rank's map, up to two
/// entries in the placement-order queue (at its capacity's worst), and its
/// share of the key -> ranks bitset map.
pub const APPROX_KEY_BYTES: u64 = 192;
/// The least the prefix indexes must be left.
pub const MIN_INDEX_BYTES: u64 = 4 << 20;

/// The budget, part by part, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Budget {
    pub total: u64,
    /// Connected peers of the three bound sockets, at their caps.
    pub peers: u64,
    /// HTTP connections, at `server.http_max_connections`.
    pub http: u64,
    /// The proxy's connections at `proxy.max_connections`, and its request
    /// bodies at `proxy.max_buffered_bytes` (0 with the proxy off).
    pub proxy: u64,
    /// The session table, full.
    pub sessions: u64,
    /// The queues of the sources dpcoord connects to, the KV decoder's
    /// queue (two batches) and the replay buffers.
    pub sources: u64,
    /// The KV-event index, all ranks.
    pub events_index: u64,
    /// The approximate index, all ranks.
    pub approx_index: u64,
}

impl Budget {
    /// The parts as `(name, bytes)`, as metrics and `check-config` show them.
    pub fn parts(&self) -> [(&'static str, u64); 7] {
        [
            ("peers", self.peers),
            ("http", self.http),
            ("proxy", self.proxy),
            ("sessions", self.sessions),
            ("sources", self.sources),
            ("events_index", self.events_index),
            ("approx_index", self.approx_index),
        ]
    }

    /// Splits `total` for this server and these settings; `Err` says what
    /// the reservations need when they leave the indexes too little.
    pub fn of(total: u64, server: &Server, settings: &Settings) -> Result<Budget, String> {
        let caps = &server.peers;
        let peers = (u64::from(caps.route) + u64::from(caps.health) + u64::from(caps.stats)) * PEER_BYTES;
        let http = server.http.max_connections as u64 * HTTP_CONNECTION_BYTES;
        let proxy = match server.proxy_bind {
            Some(_) => {
                server.proxy.max_connections as u64 * PROXY_STREAM_BYTES + server.proxy.max_buffered_bytes as u64
            }
            None => 0,
        };
        let sessions = settings.routing.sessions.capacity as u64 * SESSION_BYTES;
        let links = (server.stats_connect.len() + server.sglang_load_connect.len()) as u64;
        let links = links * link_bytes(SOURCE_LINK_BYTES, 5, settings.limits.max_message_bytes);
        let kv_links = server.kv_events.iter().map(|e| 1 + u64::from(e.replay.is_some())).sum::<u64>();
        let batch = settings.kv.max_batch_bytes as u64;
        let kv = match kv_links {
            0 => 0,
            n => n * link_bytes(KV_LINK_BYTES, 2, settings.kv.max_batch_bytes) + 2 * batch + REPLAY_BUFFER_BYTES,
        };
        let sources = links + kv;
        let reserved = peers + http + proxy + sessions + sources;
        let left = total.saturating_sub(reserved);
        if left < MIN_INDEX_BYTES {
            return Err(format!(
                "{total} bytes leave the prefix indexes {left}, under {MIN_INDEX_BYTES}: peers at their caps \
                 reserve {peers}, HTTP connections {http}, the proxy {proxy}, the session table {sessions}, \
                 the sources {sources}; \
                 raise it to at least {} or lower those caps",
                reserved + MIN_INDEX_BYTES
            ));
        }
        let approx_index = left / 4;
        Ok(Budget { total, peers, http, proxy, sessions, sources, events_index: left - approx_index, approx_index })
    }
}

/// What one link's queue holds at most: `bytes`, or `least` of its
/// largest frames (the message limit and libzmq's 64 KiB of slack) when
/// that is more (`io/sockets.rs` sets its high-water mark so).
fn link_bytes(bytes: u64, least: u64, max_message: usize) -> u64 {
    bytes.max(least * (max_message as u64 + (64 << 10)))
}

/// The budget's split as `check-config` prints it: one line, in MiB, with
/// what the indexes' shares hold per rank at `dp_size`.
pub fn describe(b: &Budget, dp_size: u32) -> String {
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    let approx = b.approx_index - b.approx_index / 4;
    format!(
        "memory budget {:.1} MiB: peers {:.1}, http {:.1}, sessions {:.1}, sources {:.1}; \
         KV-event index {:.1} ({} blocks a rank at dp_size {dp_size}), approximate index {:.1} ({} keys a rank)",
        mib(b.total),
        mib(b.peers),
        mib(b.http),
        mib(b.sessions),
        mib(b.sources),
        mib(b.events_index),
        events_per_rank(b.events_index, dp_size),
        mib(b.approx_index),
        approx_per_rank(approx, dp_size),
    )
}

/// Blocks each of `dp_size` ranks may keep in the KV-event index.
pub fn events_per_rank(events_index: u64, dp_size: u32) -> usize {
    per_rank(events_index, dp_size, EVENT_BLOCK_BYTES)
}

/// Keys each of `dp_size` ranks may keep in the approximate index.
pub fn approx_per_rank(approx_index: u64, dp_size: u32) -> usize {
    per_rank(approx_index, dp_size, APPROX_KEY_BYTES)
}

fn per_rank(bytes: u64, dp_size: u32, each: u64) -> usize {
    usize::try_from(bytes / u64::from(dp_size.max(1)) / each).unwrap_or(usize::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_default_budget_is_split_as_the_docs_say() {
        let cfg = Config::default();
        let b = cfg.settings.memory;
        assert_eq!(b.total, 480 << 20);
        assert_eq!(b.peers, 2304 * (40 << 10), "1024 route + 256 health + 1024 stats peers");
        assert_eq!(b.http, 256 * (64 << 10));
        assert_eq!(b.sessions, 100_000 * 128);
        assert_eq!(b.sources, 0, "no source is connected by default");
        let left = b.total - b.peers - b.http - b.sessions;
        assert_eq!((b.approx_index, b.events_index), (left / 4, left - left / 4));
        assert_eq!(events_per_rank(b.events_index, 8), (b.events_index / 8 / 100) as usize);
    }

    #[test]
    fn kv_publishers_reserve_their_queues_and_too_small_a_budget_is_refused() {
        let text = "[engines]\ndp_size = 8\n[kv_events]\nconnect = [\"tcp://127.0.0.1:5557+rank\"]\n\
                    replay = [\"tcp://127.0.0.1:5657+rank\"]\n";
        let cfg = Config::from_table(text.parse().unwrap()).unwrap();
        let per_link = 2 * ((4 << 20) + (64 << 10));
        assert_eq!(cfg.settings.memory.sources, 16 * per_link + 2 * (4 << 20) + (32 << 20));
        let small = format!("{text}[limits]\nmemory_budget_bytes = {}\n", 256 << 20);
        let e = Config::from_table(small.parse().unwrap()).unwrap_err();
        assert_eq!(e.key, "limits.memory_budget_bytes");
        assert!(e.problem.contains("the sources 178257920; raise it to at least"), "{}", e.problem);
    }

    #[test]
    fn check_config_describes_the_split_at_the_defaults() {
        let cfg = Config::default();
        assert_eq!(
            describe(&cfg.settings.memory, 8),
            "memory budget 480.0 MiB: peers 90.0, http 16.0, sessions 12.2, sources 0.0; KV-event index 271.3 \
             (355656 blocks a rank at dp_size 8), approximate index 90.4 (46309 keys a rank)"
        );
    }

    #[test]
    fn every_rank_keeps_at_least_one_entry() {
        assert_eq!((events_per_rank(0, 8), approx_per_rank(1000, 0)), (1, 5));
    }
}
