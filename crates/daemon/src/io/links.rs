//! The links of the sources dpcoord connects to (`server.stats_connect`,
//! `server.sglang_load_connect`, `kv_events`), kept up by dpcoord itself.
//!
//! Each connecting source socket has one endpoint and a size limit per
//! frame (`ZMQ_MAXMSGSIZE`, set in `io::sockets`). A frame above it is a
//! protocol error, and libzmq 4.3 ends a connecting session for good on a
//! protocol error: it never reconnects that endpoint, so one oversized frame
//! would silence an engine until a restart. libzmq's socket monitor tells
//! the two endings apart: a link that ends by a connection error (the peer
//! went away) is followed by `CONNECT_RETRIED` as libzmq starts over; one
//! that ends by a protocol error is `DISCONNECTED` and nothing after it.
//! So a link `DISCONNECTED` and not retried (nor connected again) within
//! [`GRACE`] is connected again here: `zmq_disconnect` of its endpoint ends
//! what is left of the old session, `zmq_connect` starts a new one (never
//! two). Should libzmq's retry event come later than [`GRACE`], the same
//! replacement still leaves exactly one session; only the count is one more.
//! `tests/it/source_bounds.rs::libzmq_retries_a_lost_link_but_never_one_closed_over_an_oversized_frame`
//! checks this against the vendored libzmq.

use std::time::{Duration, Instant};

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use super::error::{endpoint_err, TransportError};
use super::monitor::monitor;
use super::peers::event_of;
use super::source::Source;
use crate::config::keys::Key;
use crate::observability::metrics::{built, register};
use crate::observability::ratelimit::LogLimiter;
use crate::wire::SourceKind;

/// How long a closed link waits for libzmq's own retry before dpcoord
/// connects it again; also the least time between two reconnects of one
/// link, so a peer that sends oversized frames costs a connection (and a
/// frame header read) every 200 ms at most.
pub const GRACE: Duration = Duration::from_millis(200);
/// Monitor events queued for dpcoord to read, in messages (two per event):
/// a link makes a few per reconnect, and the loop reads every monitor whenever it signals.
const EVENT_HWM: i32 = 1000;
/// Events read per poll round, so no socket starves another.
const BATCH: usize = 256;
const DISCONNECTED: u16 = zmq::SocketEvent::DISCONNECTED as u16;
const CONNECTED: u16 = zmq::SocketEvent::CONNECTED as u16;
/// libzmq is at work on the link: connecting, waiting to retry, or connected.
const AT_WORK: [u16; 3] = [
    zmq::SocketEvent::CONNECTED as u16,
    zmq::SocketEvent::CONNECT_DELAYED as u16,
    zmq::SocketEvent::CONNECT_RETRIED as u16,
];

/// A connecting source socket's one endpoint and the PAIR socket that
/// receives its connection events.
pub struct Link {
    /// Its place in `Sockets::sources`.
    pub source: usize,
    /// The kind of source behind it.
    pub kind: SourceKind,
    pub endpoint: String,
    pub monitor: zmq::Socket,
}

/// Asks libzmq to report `s`'s link events and connects the socket that
/// reads them, then connects `s` to `endpoint` (so no event goes unseen),
/// the endpoint configuration key `key` names.
pub fn connect(
    ctx: &zmq::Context,
    s: &zmq::Socket,
    source: usize,
    kind: SourceKind,
    key: &'static Key,
    endpoint: &str,
) -> Result<Link, TransportError> {
    let name = kind.as_str();
    let inproc = format!("inproc://dpcoord.links.{source}");
    let events = AT_WORK.iter().fold(DISCONNECTED as i32, |all, &e| all | e as i32);
    let monitor = monitor(ctx, s, &inproc, events, EVENT_HWM, name)?;
    s.connect(endpoint).map_err(endpoint_err("connect", name, Some(key), endpoint))?;
    Ok(Link { source, kind, endpoint: endpoint.to_owned(), monitor })
}

/// One link's state: since when it has been closed and not retried, and
/// whether it connected again since its first connection.
struct State {
    closed: Option<Instant>,
    connected_once: bool,
    renewed: bool,
    reconnects: IntCounter,
}

/// The links of every connecting source, and their reconnects.
pub struct Relinks {
    states: Vec<State>,
    log: LogLimiter<2>,
}

/// The causes of [`Relinks`]'s rate-limited warnings.
const RECONNECTED: usize = 0;
const CONNECT_FAILED: usize = 1;

/// What an event means for its link: closed (`Some(true)`), in libzmq's
/// hands (`Some(false)`), or nothing (`None`).
fn closes(event: &[u8]) -> Option<bool> {
    let (id, _) = event_of(event)?;
    match id {
        DISCONNECTED => Some(true),
        _ if AT_WORK.contains(&id) => Some(false),
        _ => None,
    }
}

impl Relinks {
    /// States for `links`, with `dpcoord_source_reconnects_total{source,endpoint}` in `registry`.
    pub fn new(links: &[Link], sources: &[Source], registry: &Registry) -> Relinks {
        let counter = register(
            registry,
            built(IntCounterVec::new(
                Opts::new(
                    "dpcoord_source_reconnects_total",
                    "Links to a source that libzmq closed and would not retry (a frame above the \
                     source's size limit, or another protocol error), connected again by dpcoord.",
                ),
                &["source", "endpoint"],
            )),
        );
        let states = links
            .iter()
            .map(|l| State {
                closed: None,
                connected_once: false,
                renewed: false,
                reconnects: counter.with_label_values(&[sources[l.source].kind.as_str(), &l.endpoint]),
            })
            .collect();
        Relinks { states, log: LogLimiter::default() }
    }

    /// Reads link `i`'s events until EAGAIN; `true` when the batch limit stopped it first.
    pub fn drain(&mut self, i: usize, monitor: &zmq::Socket, now: Instant) -> Result<bool, zmq::Error> {
        let state = &mut self.states[i];
        for _ in 0..BATCH {
            let event = match monitor.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => return Ok(false),
                Err(e) => return Err(e),
            };
            match closes(&event[0]) {
                Some(true) => state.closed = state.closed.or(Some(now)),
                Some(false) => state.closed = None,
                None => {}
            }
            if event_of(&event[0]).is_some_and(|(id, _)| id == CONNECTED) {
                state.renewed |= state.connected_once;
                state.connected_once = true;
            }
        }
        Ok(true)
    }

    /// Whether link `i` was connected again (a new session: its peer may
    /// be a new process) since the last call.
    pub fn take_renewed(&mut self, i: usize) -> bool {
        std::mem::take(&mut self.states[i].renewed)
    }

    /// When the next closed link is due to be connected again.
    pub fn next_due(&self) -> Option<Instant> {
        self.states.iter().filter_map(|s| s.closed).min().map(|t| t + GRACE)
    }

    /// Connects again every link closed at least [`GRACE`] ago that libzmq did not retry.
    pub fn reconnect_due(&mut self, links: &[Link], sources: &[Source], now: Instant) {
        for (state, link) in self.states.iter_mut().zip(links) {
            if state.closed.is_none_or(|t| now.saturating_duration_since(t) < GRACE) {
                continue;
            }
            state.closed = None;
            let src = &sources[link.source];
            let name = src.kind.as_str();
            // A closed session leaves its endpoint registered; should it be
            // gone (ENOENT), there is nothing left to end and connect starts anew.
            let _ = src.socket.disconnect(&link.endpoint);
            if let Err(e) = src.socket.connect(&link.endpoint) {
                // Tried again after another GRACE (descriptors may come free).
                state.closed = Some(now);
                if let Some(suppressed) = self.log.allow(CONNECT_FAILED, now) {
                    tracing::warn!(source = name, endpoint = %link.endpoint, error = %e, suppressed, "cannot connect a source again");
                }
                continue;
            }
            state.reconnects.inc();
            if let Some(suppressed) = self.log.allow(RECONNECTED, now) {
                tracing::warn!(
                    source = name,
                    endpoint = %link.endpoint,
                    suppressed,
                    "a source link closed over a protocol error (a frame above its size limit?) that libzmq \
                     would not retry: connected again"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: zmq::SocketEvent) -> Vec<u8> {
        let mut e = (id as u16).to_ne_bytes().to_vec();
        e.extend_from_slice(&7u32.to_ne_bytes());
        e
    }

    #[test]
    fn disconnected_closes_libzmqs_own_connect_events_reopen_others_say_nothing() {
        assert_eq!(closes(&event(zmq::SocketEvent::DISCONNECTED)), Some(true));
        for e in [zmq::SocketEvent::CONNECTED, zmq::SocketEvent::CONNECT_DELAYED, zmq::SocketEvent::CONNECT_RETRIED] {
            assert_eq!(closes(&event(e)), Some(false));
        }
        assert_eq!(closes(&event(zmq::SocketEvent::CLOSED)), None);
        assert_eq!(closes(&[1]), None);
    }
}
