//! The bridge from the gateway's tasks (the picker's gRPC streams, the
//! proxy's requests) to the coordinator: one thread owns a DEALER
//! connected in-process to the route ROUTER, so every pick is a `route`
//! query (and every ended request a `finished` query) answered by the
//! routing thread like any frontend's: the same pending, sessions,
//! penalties, policy and health isolation. The thread also owns a DEALER
//! on the health ROUTER, for what the fronts learn of a rank's server
//! (`health_report`, `reach.rs`). Tasks hand a query over a channel and wake the thread
//! through a socket pair (only when it sleeps: a burst of queries costs one
//! wake-up); the reply comes back on a oneshot matched by the query's `id`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use dpcoord_daemon::io::sockets::{LOCAL_HEALTH, LOCAL_ROUTE};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Semaphore};

/// How long the thread waits before looking whether the picker is gone.
const POLL_MS: i64 = 200;

/// A query of the route socket (docs/PROTOCOL.md §4), as the picker sends it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Query {
    pub op: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The prompt's token ids (tokenizer mode), or its text keys.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_keys: Option<Vec<u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub among: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placed: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallbacks: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shed_waiting: Option<u64>,
    /// `health_report`'s outcome.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ok: Option<bool>,
    /// Asks for the prediction (`explain`) with the placement.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<bool>,
    /// `delivered`'s report: the prediction carried back, and what the
    /// engine served from its cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delivered: Option<u64>,
}

#[derive(Serialize)]
struct Wire<'a> {
    v: u8,
    id: u64,
    #[serde(flatten)]
    q: &'a Query,
}

/// A reply of the route socket, what the picker reads of it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Reply {
    #[serde(default)]
    pub id: Option<u64>,
    pub ok: bool,
    #[serde(default)]
    pub ranks: Vec<u32>,
    #[serde(default)]
    pub fallbacks: Vec<u32>,
    #[serde(default)]
    pub error: Option<ReplyError>,
    #[serde(default)]
    pub explain: Option<Explained>,
}

/// A reply's `explain`: what was predicted cached on each rank placed on.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Explained {
    #[serde(default)]
    pub chosen: Vec<Chosen>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Chosen {
    pub rank: u32,
    pub predicted: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ReplyError {
    pub code: String,
    pub message: String,
}

/// Which of the coordinator's sockets a query is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Socket {
    Route,
    Health,
}

type Ask = (Socket, Query, oneshot::Sender<Reply>);

/// How a task wakes the thread: a byte on a socket pair, written only by
/// the first hand-over after the thread went to sleep, not by every query
/// of a burst (each a syscall, and a wake-up the thread does not need).
struct Wake {
    byte: UnixStream,
    /// The thread sleeps, or is about to: the next hand-over writes the byte.
    asleep: AtomicBool,
}

/// The picker's handle on the bridge thread; cheap to clone.
#[derive(Clone)]
pub struct Bridge {
    tx: mpsc::Sender<Ask>,
    wake: Arc<Wake>,
    /// Queries in flight, at most the replies the route socket queues for
    /// the bridge's DEALER (libzmq drops a reply beyond them).
    in_flight: Arc<Semaphore>,
}

impl Bridge {
    /// Connects a DEALER to [`LOCAL_ROUTE`] and one to [`LOCAL_HEALTH`]
    /// (bound by the daemon's sockets first), and starts the thread; at most `in_flight` queries wait for a reply at a time, the
    /// others wait their turn.
    pub fn start(ctx: &zmq::Context, in_flight: usize) -> std::io::Result<Bridge> {
        let dealer = |endpoint: &str| -> std::io::Result<zmq::Socket> {
            let d = ctx.socket(zmq::DEALER).map_err(std::io::Error::other)?;
            d.set_linger(0).map_err(std::io::Error::other)?;
            d.connect(endpoint).map_err(std::io::Error::other)?;
            Ok(d)
        };
        let route = dealer(LOCAL_ROUTE)?;
        let health = dealer(LOCAL_HEALTH)?;
        let fds = [&route, &health]
            .into_iter()
            .map(|d| d.get_fd().map_err(std::io::Error::other))
            .collect::<std::io::Result<Vec<RawFd>>>()?;
        let (wake_tx, wake_rx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        let (tx, rx) = mpsc::channel();
        let wake = Arc::new(Wake { byte: wake_tx, asleep: AtomicBool::new(false) });
        let woken = Arc::clone(&wake);
        std::thread::Builder::new()
            .name("gateway-bridge".into())
            .spawn(move || serve(&route, &health, &fds, &rx, &woken, wake_rx))?;
        let in_flight = Arc::new(Semaphore::new(in_flight.max(1)));
        Ok(Bridge { tx, wake, in_flight })
    }

    /// Asks the coordinator on the route socket; `None` when the bridge
    /// has stopped.
    pub async fn ask(&self, q: Query) -> Option<Reply> {
        self.ask_on(Socket::Route, q).await
    }

    /// Asks on `socket`.
    pub async fn ask_on(&self, socket: Socket, q: Query) -> Option<Reply> {
        // Held until the reply is in (or the bridge gave up on it).
        let _turn = self.in_flight.acquire().await.ok()?;
        let (tx, rx) = oneshot::channel();
        self.hand_over((socket, q, tx))?;
        rx.await.ok()
    }

    /// Tells the coordinator on the route socket without waiting for the
    /// reply (a `finished` from a response's end, which may come where
    /// nothing can await). Its reply is read and dropped; should the route
    /// socket's reply queue for the bridge be full, libzmq drops the reply,
    /// never the query.
    pub fn tell(&self, q: Query) {
        let (tx, _) = oneshot::channel();
        if self.hand_over((Socket::Route, q, tx)).is_none() {
            tracing::debug!("the gateway bridge has stopped: a report was not sent");
        }
    }

    fn hand_over(&self, ask: Ask) -> Option<()> {
        self.tx.send(ask).ok()?;
        // Pairs with the thread's fence between raising `asleep` and its
        // last look at the channel: it sees this query, or this sees the
        // flag up and wakes it.
        fence(Ordering::SeqCst);
        if self.wake.asleep.swap(false, Ordering::SeqCst) {
            // A full pipe already holds a wake-up: the byte is not needed.
            let _ = (&self.wake.byte).write(&[1]);
        }
        Some(())
    }
}

/// The thread: sends what tasks hand over, routes replies back by `id`
/// (one sequence for both sockets, so an `id` names one query). It sleeps
/// in a plain poll of the dealers' `ZMQ_FD`s (`fds`) and the wake-up
/// socket: `zmq::poll` on the sockets themselves asks each for its events
/// twice a call, a syscall each. A dealer is read until it has nothing
/// more whenever its descriptor stirred or a query was sent on it (a send
/// may take in the notice of a reply, which then never shows on the
/// descriptor), so no reply is left waiting.
fn serve(
    route: &zmq::Socket,
    health: &zmq::Socket,
    fds: &[RawFd],
    rx: &mpsc::Receiver<Ask>,
    wake: &Wake,
    mut bell: UnixStream,
) {
    let mut waiting: HashMap<u64, oneshot::Sender<Reply>> = HashMap::new();
    let mut next_id: u64 = 0;
    let mut scratch = [0u8; 256];
    let dealers = [route, health];
    let mut items: Vec<zmq::PollItem<'_>> =
        fds.iter().chain([&bell.as_raw_fd()]).map(|&fd| zmq::PollItem::from_fd(fd, zmq::POLLIN)).collect();
    // Which dealers to read: all at first.
    let mut stirred = vec![true; dealers.len()];
    let mut next: Option<Ask> = None;
    loop {
        loop {
            let (socket, q, reply) = match next.take().map_or_else(|| rx.try_recv(), Ok) {
                Ok(ask) => ask,
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            };
            let at = match socket {
                Socket::Route => 0,
                Socket::Health => 1,
            };
            next_id = next_id.wrapping_add(1);
            let bytes = rmp_serde::to_vec_named(&Wire { v: 1, id: next_id, q: &q });
            stirred[at] = true;
            match bytes.map(|b| dealers[at].send(b, zmq::DONTWAIT)) {
                Ok(Ok(())) => {
                    waiting.insert(next_id, reply);
                }
                _ => tracing::debug!("a gateway query was not sent"),
            }
        }
        for (dealer, stirred) in dealers.iter().zip(&mut stirred) {
            if !std::mem::take(stirred) {
                continue;
            }
            while let Ok(frame) = dealer.recv_bytes(zmq::DONTWAIT) {
                match rmp_serde::from_slice::<Reply>(&frame) {
                    Ok(r) => {
                        if let Some(tx) = r.id.and_then(|id| waiting.remove(&id)) {
                            let _ = tx.send(r);
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "a gateway reply was not read"),
                }
            }
        }
        // Tasks that gave up (their stream reset), and reports nobody
        // awaits, leave a closed sender.
        waiting.retain(|_, tx| !tx.is_closed());
        wake.asleep.store(true, Ordering::SeqCst);
        // Pairs with `hand_over`'s: a query handed over before the flag
        // was up came with no byte, so the channel is looked at once more;
        // with one there, the poll only looks which dealer stirred.
        fence(Ordering::SeqCst);
        let timeout = match rx.try_recv() {
            Ok(ask) => {
                next = Some(ask);
                0
            }
            Err(mpsc::TryRecvError::Empty) => POLL_MS,
            Err(mpsc::TryRecvError::Disconnected) => return,
        };
        let polled = zmq::poll(&mut items, timeout);
        wake.asleep.store(false, Ordering::SeqCst);
        if polled.is_err() {
            stirred.fill(true);
            continue;
        }
        for (stirred, item) in stirred.iter_mut().zip(&items) {
            *stirred = item.is_readable();
        }
        if items.last().is_some_and(zmq::PollItem::is_readable) {
            while bell.read(&mut scratch).is_ok_and(|n| n == scratch.len()) {}
        }
    }
}
