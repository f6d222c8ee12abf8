//! Connected peers per bound socket (route, health, stats bind), counted
//! from libzmq's socket monitors, and the caps on them.
//!
//! Every peer costs libzmq about 38 KB (its stream buffers and the
//! connection's pipes), and nothing else bounds how many connect, so each
//! bound socket holds at most its `server.*_max_peers`, and one source
//! address at most `server.max_peers_per_address` of them (counted per
//! socket by `peer_sources`). A TCP connection beyond either is shut down
//! here as soon as its `ACCEPTED` is read, before any handshake; an ipc
//! connection has no address and no ends to check, and the ZAP handler
//! refuses it during its handshake when its socket is full (`io::zap`).
//!
//! The count is libzmq's own: `ACCEPTED` adds one, `DISCONNECTED` takes one
//! away. In libzmq 4.3 every accepted connection ends with exactly one
//! `DISCONNECTED` (`stream_engine_base_t::error` emits it on every way out,
//! whether the handshake succeeded, was refused by ZAP, or never began; the
//! only other way out, `terminate`, is taken when the socket itself closes),
//! so the count is every connection the socket holds, handshaking ones
//! included. `HANDSHAKE_SUCCEEDED` would count only admitted peers, but it
//! carries no file descriptor, so its `DISCONNECTED` could not be told from
//! a refused one's; a refused connection is closed within milliseconds, so
//! the two counts differ only that long.
//! `tests/it/peer_cap.rs::libzmq_ends_every_accepted_connection_with_one_disconnect`
//! checks this against the vendored libzmq.

use std::os::fd::RawFd;
use std::time::Instant;

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::error::TransportError;
use super::monitor::monitor;
use super::peer_sources::{BySource, Source};
use crate::observability::metrics::{built, register};
use crate::observability::ratelimit::LogLimiter;

/// Events queued for dpcoord to read, in messages (two per event). libzmq
/// blocks its I/O thread rather than drop a monitor event, so this is far
/// above what one poll round can leave behind (the loop reads every monitor
/// whenever it signals): 50,000 events, about 6 MB at most.
const EVENT_HWM: i32 = 100_000;
/// Events read per poll round, so no socket starves another.
const BATCH: usize = 256;
const ACCEPTED: u16 = zmq::SocketEvent::ACCEPTED as u16;
const DISCONNECTED: u16 = zmq::SocketEvent::DISCONNECTED as u16;

/// The PAIR socket that receives a bound socket's connection events.
pub struct Monitor {
    /// The bound socket's name, which is also its ZAP domain.
    pub name: &'static str,
    pub socket: zmq::Socket,
}

/// Asks libzmq to report `s`'s connections and disconnections, and
/// connects the socket that reads them. Called before `s` binds, so no
/// connection goes uncounted.
pub fn watch(ctx: &zmq::Context, s: &zmq::Socket, name: &'static str) -> Result<Monitor, TransportError> {
    let endpoint = format!("inproc://dpcoord.peers.{name}");
    let events = (zmq::SocketEvent::ACCEPTED as i32) | (zmq::SocketEvent::DISCONNECTED as i32);
    let socket = monitor(ctx, s, &endpoint, events, EVENT_HWM, name)?;
    Ok(Monitor { name, socket })
}

/// One watched socket's count and metric series.
struct Count {
    name: &'static str,
    connected: u32,
    sources: BySource,
    gauge: IntGauge,
    /// Refusals by [`Refusal`], in its order.
    refused: [IntCounter; 2],
}

/// The connected peers of every bound socket.
pub struct Peers {
    counts: Vec<Count>,
    /// Refusals logged, per socket.
    log: LogLimiter<3>,
}

/// A connection event: its kind and file descriptor (libzmq's event frame
/// is the event id, u16, then its value, u32, native byte order).
pub(super) fn event_of(frame: &[u8]) -> Option<(u16, RawFd)> {
    let id = u16::from_ne_bytes(frame.get(..2)?.try_into().ok()?);
    let value = u32::from_ne_bytes(frame.get(2..6)?.try_into().ok()?);
    Some((id, value as RawFd))
}

/// Why a new peer is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its socket holds its `*_max_peers`.
    SocketFull,
    /// Its source address holds `max_peers_per_address` on that socket.
    AddressFull,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::SocketFull => "socket_full",
            Refusal::AddressFull => "address_full",
        }
    }
}

impl Peers {
    /// Counts for the sockets of `monitors`, with their series in `registry`:
    /// `dpcoord_peers_connected{socket}` and `dpcoord_peers_refused_total{socket,reason}`.
    pub fn new(monitors: &[Monitor], registry: &Registry) -> Peers {
        let gauge = register(
            registry,
            built(IntGaugeVec::new(
                Opts::new(
                    "dpcoord_peers_connected",
                    "ZeroMQ connections a bound socket holds (handshaking ones included).",
                ),
                &["socket"],
            )),
        );
        let refused = register(
            registry,
            built(IntCounterVec::new(
                Opts::new(
                    "dpcoord_peers_refused_total",
                    "New peers refused: their socket held its *_max_peers (socket_full), or their \
                     address held max_peers_per_address on it (address_full).",
                ),
                &["socket", "reason"],
            )),
        );
        let counts = monitors
            .iter()
            .map(|m| Count {
                name: m.name,
                connected: 0,
                sources: BySource::default(),
                gauge: gauge.with_label_values(&[m.name]),
                refused: [Refusal::SocketFull, Refusal::AddressFull]
                    .map(|r| refused.with_label_values(&[m.name, r.label()])),
            })
            .collect();
        Peers { counts, log: LogLimiter::default() }
    }

    /// Reads the events of monitor `i` (its place in the list `new` was
    /// given) until EAGAIN; `true` when the batch limit stopped it first.
    /// A TCP connection accepted beyond `caps` (the socket's cap, and its
    /// source's) is closed at once: it never reaches its handshake.
    pub fn drain(&mut self, i: usize, monitor: &zmq::Socket, caps: Option<(u32, u32)>) -> Result<bool, zmq::Error> {
        for _ in 0..BATCH {
            let event = match monitor.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => return Ok(false),
                Err(e) => return Err(e),
            };
            let count = &mut self.counts[i];
            match event_of(&event[0]) {
                Some((ACCEPTED, fd)) => {
                    count.connected = count.connected.saturating_add(1);
                    let source = count.sources.accepted(fd);
                    let refusal = caps.zip(source).and_then(|((cap, per), s)| self.over(i, Some(s), cap, per));
                    if let Some(refusal) = refusal.filter(|_| self.counts[i].sources.close(fd)) {
                        self.refused(i, refusal, source);
                    }
                }
                Some((DISCONNECTED, fd)) => {
                    count.connected = count.connected.saturating_sub(1);
                    count.sources.disconnected(fd);
                }
                _ => {}
            }
            let count = &self.counts[i];
            count.gauge.set(i64::from(count.connected));
        }
        Ok(true)
    }

    /// Whether socket `i`, with a new peer from `source` already counted,
    /// holds more than `cap`, or that source more than `per_source`.
    fn over(&self, i: usize, source: Option<Source>, cap: u32, per_source: u32) -> Option<Refusal> {
        let count = &self.counts[i];
        if count.connected > cap {
            Some(Refusal::SocketFull)
        } else if source.is_some_and(|s| count.sources.count(s) > per_source) {
            Some(Refusal::AddressFull)
        } else {
            None
        }
    }

    /// Counts a refusal on socket `i` and logs it (once a second at most
    /// per socket).
    fn refused(&mut self, i: usize, refusal: Refusal, source: Option<Source>) {
        let count = &self.counts[i];
        count.refused[refusal as usize].inc();
        if let Some(suppressed) = self.log.allow(i, Instant::now()) {
            let from_address = source.map_or(0, |s| count.sources.count(s));
            let why = match refusal {
                Refusal::SocketFull => "connection refused: the socket holds its *_max_peers",
                Refusal::AddressFull => {
                    "connection refused: the peer's address holds server.max_peers_per_address on this socket"
                }
            };
            let peer = source.map(|s| s.to_string()).unwrap_or_default();
            tracing::warn!(socket = count.name, peer, connected = count.connected, from_address, suppressed, "{why}");
        }
    }

    /// Whether a new ipc peer of socket `i` (its place, from `index`),
    /// already counted, makes it hold more than `cap`; if so the refusal is
    /// counted and logged. (A TCP peer beyond its caps was closed when it
    /// was accepted.)
    pub fn refuse_ipc(&mut self, i: usize, cap: u32) -> bool {
        let over = self.over(i, None, cap, u32::MAX).is_some();
        if over {
            self.refused(i, Refusal::SocketFull, None);
        }
        over
    }

    /// The place of `domain`'s monitor, to read it before a decision.
    pub fn index(&self, domain: &str) -> Option<usize> {
        self.counts.iter().position(|c| c.name == domain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: u16) -> Vec<u8> {
        let mut e = id.to_ne_bytes().to_vec();
        e.extend_from_slice(&7u32.to_ne_bytes());
        e
    }

    #[test]
    fn events_carry_their_kind_and_descriptor() {
        assert_eq!(event_of(&event(ACCEPTED)), Some((ACCEPTED, 7)));
        assert_eq!(event_of(&event(DISCONNECTED)), Some((DISCONNECTED, 7)));
        assert_eq!(event_of(&[1, 0, 7]), None);
    }
}
