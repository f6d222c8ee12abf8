//! The HTTP server's connections: a cap, timeouts, and room for a new one.
//!
//! - At most [`Limits::max_connections`] connections are served at once.
//! - A request head must arrive within the header timeout of its first byte
//!   (a slowloris connection is closed); a connection with no byte either way
//!   for the idle timeout, and no request being answered, is closed.
//! - At the cap a new connection is not left in the accept queue: the
//!   connection silent the longest without a request being answered is
//!   closed to make room (`evicted`), and the new one waits for its slot at
//!   most the header timeout (`refused` past it). When every connection is
//!   answering a request, the new one is closed at once (`refused`). While
//!   [`MAX_WAITING`] new ones wait, no more are accepted (they queue in the
//!   kernel, holding no descriptor of dpcoord's). So `/healthz` is answered
//!   while idle or slowloris connections fill the cap.
//!
//! Each outcome is counted in `dpcoord_http_connections_closed_total{reason}`
//! (the proxy's connections, served the same way, in `dpcoord_proxy_*`).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use prometheus::{IntCounterVec, IntGauge, Opts, Registry};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::config::{HttpLimits, Server};
use crate::io::fds::Budget;
use crate::observability::metrics::{built, register};

/// New connections that may wait for an evicted one's slot at once.
pub const MAX_WAITING: usize = 16;

/// Why the server closed a connection it had accepted.
const REASONS: [&str; 4] = ["evicted", "refused", "header_timeout", "idle_timeout"];

/// The connection cap in force and the timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Limits {
    /// `server.http_*`, the cap lowered to the HTTP share of `fds`.
    pub fn new(http: &HttpLimits, fds: &Budget) -> Limits {
        Limits {
            max_connections: http.max_connections.min(fds.http_share()),
            header_timeout: http.header_timeout,
            idle_timeout: http.idle_timeout,
        }
    }
}

impl Default for Limits {
    /// The default keys within the limits in force (as the demo serves).
    fn default() -> Limits {
        let server: Server = crate::config::Config::default().server;
        Limits::new(&server.http, &Budget::current())
    }
}

/// Which server's connections: the names of its series.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    /// `dpcoord_{name}_connections...`
    pub name: &'static str,
    /// What they are, in the series' help.
    pub what: &'static str,
    /// Where the cap comes from, in the help of `..._connections_max`.
    pub cap: &'static str,
}

/// The HTTP server's (`/metrics`, `/healthz`...).
pub const HTTP: Family = Family {
    name: "http",
    what: "HTTP connections",
    cap: "server.http_max_connections within a quarter of the nofile limit",
};

/// The server's connection series.
#[derive(Clone)]
struct Counters {
    open: IntGauge,
    closed: IntCounterVec,
}

impl Counters {
    fn new(registry: &Registry, limits: &Limits, family: Family) -> Counters {
        let Family { name, what, cap } = family;
        let open = register(
            registry,
            built(IntGauge::new(format!("dpcoord_{name}_connections"), format!("{what} being served."))),
        );
        let max = register(
            registry,
            built(IntGauge::new(
                format!("dpcoord_{name}_connections_max"),
                format!("The cap of {what} in force: {cap}."),
            )),
        );
        let closed = register(
            registry,
            built(IntCounterVec::new(
                Opts::new(
                    format!("dpcoord_{name}_connections_closed_total"),
                    format!(
                        "{what} dpcoord closed: evicted (silent the longest, at the cap), refused (at the cap), \
                         header_timeout, idle_timeout."
                    ),
                ),
                &["reason"],
            )),
        );
        max.set(limits.max_connections as i64);
        for reason in REASONS {
            closed.with_label_values(&[reason]);
        }
        Counters { open, closed }
    }

    fn close(&self, reason: &str) {
        self.closed.with_label_values(&[reason]).inc();
    }
}

/// A time stamp on the server's clock: milliseconds rounded up (so a
/// deadline from it never ends early), 0 reserved for "none".
fn ms(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64 + 1
}

/// Whether the deadline `at` (from [`ms`] stamps) has passed.
fn passed(at: u64, epoch: Instant) -> bool {
    at <= epoch.elapsed().as_millis() as u64
}

/// What one connection has done, shared by its I/O, its service and the table.
struct Watch {
    /// The last byte read or written.
    last_io: AtomicU64,
    /// The first byte of a request head not yet answered; 0 when none.
    head_since: AtomicU64,
    /// Requests being answered.
    answering: AtomicUsize,
    evicted: AtomicBool,
    evict: Notify,
    /// The deadline moved earlier or came back (a head began, an answer ended).
    rearm: Notify,
}

impl Watch {
    fn new(now: u64) -> Watch {
        Watch {
            last_io: AtomicU64::new(now),
            head_since: AtomicU64::new(0),
            answering: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            evict: Notify::new(),
            rearm: Notify::new(),
        }
    }

    /// The reason and the time (server ms) the connection's current timeout ends.
    fn deadline(&self, limits: &Limits) -> Option<(&'static str, u64)> {
        if self.answering.load(Ordering::Relaxed) > 0 {
            return None;
        }
        match self.head_since.load(Ordering::Relaxed) {
            0 => Some(("idle_timeout", self.last_io.load(Ordering::Relaxed) + limits.idle_timeout.as_millis() as u64)),
            t => Some(("header_timeout", t + limits.header_timeout.as_millis() as u64)),
        }
    }
}

/// The connections being served, for eviction.
#[derive(Default)]
struct Table {
    next: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<Watch>>>,
}

impl Table {
    fn insert(&self, w: Arc<Watch>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).insert(id, w);
        id
    }

    fn remove(&self, id: u64) {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// Asks the connection silent the longest, of those answering no
    /// request, to close; false when there is none.
    fn evict_one(&self) -> bool {
        let conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        let victim = conns
            .values()
            .filter(|w| w.answering.load(Ordering::Relaxed) == 0 && !w.evicted.load(Ordering::Relaxed))
            .min_by_key(|w| w.last_io.load(Ordering::Relaxed));
        match victim {
            Some(w) => {
                w.evicted.store(true, Ordering::Relaxed);
                w.evict.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Everything the accept loop hands each connection.
struct Shared {
    limits: Limits,
    epoch: Instant,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    /// A waiting connection got its slot or gave up.
    waited: Notify,
    table: Table,
    counters: Counters,
    router: Router,
    stop: watch::Receiver<bool>,
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes,
/// then lets the requests in flight finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    registry: &Registry,
    limits: Limits,
    family: Family,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let (stop_tx, stop) = watch::channel(false);
    let shared = Arc::new(Shared {
        limits,
        epoch: Instant::now(),
        slots: Arc::new(Semaphore::new(limits.max_connections)),
        waiting: AtomicUsize::new(0),
        waited: Notify::new(),
        table: Table::default(),
        counters: Counters::new(registry, &limits, family),
        router,
        stop,
    });
    let mut last_warned: Option<Instant> = None;
    tokio::pin!(shutdown);
    'serving: loop {
        while shared.waiting.load(Ordering::Relaxed) >= MAX_WAITING {
            tokio::select! {
                () = shared.waited.notified() => {}
                () = &mut shutdown => break 'serving,
            }
        }
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut shutdown => break 'serving,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors (EMFILE, ENFILE) or a connection reset
                // before it was accepted: wait a little rather than spin.
                if last_warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    tracing::warn!(error = %e, "cannot accept an HTTP connection");
                    last_warned = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        admit(&shared, stream);
    }
    let _ = stop_tx.send(true);
    // Every connection has ended once all its slots are back.
    let _ = shared.slots.acquire_many(limits.max_connections as u32).await;
    Ok(())
}

/// Serves `stream` now, after an eviction, or not at all.
fn admit(shared: &Arc<Shared>, stream: TcpStream) {
    // Answers are small writes (a streamed response's chunks): none waits
    // for the peer's delayed ACK.
    let _ = stream.set_nodelay(true);
    if let Ok(slot) = Arc::clone(&shared.slots).try_acquire_owned() {
        // In the table at once: the next accept may need to evict it.
        let watch = Arc::new(Watch::new(ms(shared.epoch)));
        let id = shared.table.insert(Arc::clone(&watch));
        tokio::spawn(connection(Arc::clone(shared), stream, slot, watch, id));
        return;
    }
    if !shared.table.evict_one() {
        shared.counters.close("refused");
        return;
    }
    shared.waiting.fetch_add(1, Ordering::Relaxed);
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        let slot = tokio::time::timeout(shared.limits.header_timeout, Arc::clone(&shared.slots).acquire_owned()).await;
        shared.waiting.fetch_sub(1, Ordering::Relaxed);
        shared.waited.notify_one();
        match slot {
            Ok(Ok(slot)) => {
                let watch = Arc::new(Watch::new(ms(shared.epoch)));
                let id = shared.table.insert(Arc::clone(&watch));
                connection(shared, stream, slot, watch, id).await;
            }
            _ => shared.counters.close("refused"),
        }
    });
}

/// Serves one connection until it ends, times out or is evicted.
/// `watch` is its entry `id` in the table, removed at the end.
async fn connection(shared: Arc<Shared>, stream: TcpStream, slot: OwnedSemaphorePermit, watch: Arc<Watch>, id: u64) {
    shared.counters.open.inc();
    let io = TokioIo::new(Watched { inner: stream, watch: Arc::clone(&watch), epoch: shared.epoch });
    let service = Answering { inner: TowerToHyperService::new(shared.router.clone()), watch: Arc::clone(&watch) };
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The timeouts are this module's; 16 KiB bounds what a head may buffer.
    builder.header_read_timeout(None).max_buf_size(16 * 1024);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stop = shared.stop.clone();
    let closed = loop {
        let (reason, at) = watch.deadline(&shared.limits).unwrap_or(("", u64::MAX));
        let sleep = tokio::time::sleep_until(shared.epoch + Duration::from_millis(at.min(1 << 40)));
        tokio::select! {
            _ = conn.as_mut() => break None,
            () = watch.evict.notified() => break Some("evicted"),
            () = watch.rearm.notified() => {}
            () = sleep, if !reason.is_empty() => {
                if watch.deadline(&shared.limits).is_some_and(|(_, t)| passed(t, shared.epoch)) {
                    break Some(reason);
                }
            }
            _ = stop.changed() => {
                conn.as_mut().graceful_shutdown();
                let _ = conn.as_mut().await;
                break None;
            }
        }
    };
    if let Some(reason) = closed {
        shared.counters.close(reason);
    }
    shared.table.remove(id);
    shared.counters.open.dec();
    drop(slot);
}

/// The router, counting the requests being answered.
#[derive(Clone)]
struct Answering {
    inner: TowerToHyperService<Router>,
    watch: Arc<Watch>,
}

/// Marks a request answered when dropped (its future ended or was dropped).
struct Answered(Arc<Watch>);

impl Drop for Answered {
    fn drop(&mut self) {
        self.0.answering.fetch_sub(1, Ordering::Relaxed);
        self.0.rearm.notify_one();
    }
}

impl hyper::service::Service<hyper::Request<Incoming>> for Answering {
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        // The head is complete: the header timeout ends here.
        self.watch.answering.fetch_add(1, Ordering::Relaxed);
        self.watch.head_since.store(0, Ordering::Relaxed);
        let answered = Answered(Arc::clone(&self.watch));
        let fut = self.inner.call(req);
        Box::pin(async move {
            let response = fut.await;
            drop(answered);
            response
        })
    }
}

/// A stream that records when bytes move, and when a new head begins.
struct Watched {
    inner: TcpStream,
    watch: Arc<Watch>,
    epoch: Instant,
}

impl Watched {
    fn moved(&self, read: bool) {
        let now = ms(self.epoch);
        self.watch.last_io.store(now, Ordering::Relaxed);
        let w = &self.watch;
        if read && w.answering.load(Ordering::Relaxed) == 0 && w.head_since.load(Ordering::Relaxed) == 0 {
            w.head_since.store(now, Ordering::Relaxed);
            w.rearm.notify_one();
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.moved(true);
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.moved(false);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
