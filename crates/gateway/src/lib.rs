//! The gateway: dpcoord in the HTTP path, with two fronts, each off by
//! default. The Kubernetes Gateway API Inference Extension's endpoint
//! picker, an Envoy `ext_proc` gRPC server (`server.epp_bind`), tells a
//! gateway which rank's endpoint takes each request (docs/operations.md,
//! "Behind a Kubernetes gateway"); the proxy (`server.proxy_bind`,
//! `dpcoord proxy`) is an OpenAI-compatible reverse proxy in front of one
//! server per rank (docs/operations.md, "One server per rank"). Every
//! decision is a `route` query to the coordinator through [`bridge`], so
//! both share the route socket's pending, sessions, penalties and policy;
//! the end of each response is booked with a `finished` query.
//!
//! - `body.rs`: the OpenAI request body (`model`, the prompt, `user`)
//! - `prompt/`: the prompt as token ids (the model's tokenizer) or text keys
//! - `prompts.rs`: the encoder in force, loaded again on a reload
//! - `bridge.rs`: the thread between the tasks and the coordinator's sockets
//! - `decide.rs`: one request's rank, or the refusal the client gets
//! - `endpoints.rs`: `gateway.endpoints` as addresses (names resolved)
//! - `service.rs`: one request's `ext_proc` stream (the picker)
//! - `reply.rs`: the `ext_proc` messages the picker answers with
//! - `proxy/`: the reverse proxy
//! - `subset.rs`: eligible ranks (endpoints, the gateway's subset hint)
//! - `reach.rs`: ranks failing through the gateway, reported and retried
//! - `metrics.rs`: `dpcoord_gateway_*`, `dpcoord_proxy_*`
//! - `resolve.rs`: endpoint names resolved to addresses, kept fresh
//! - `fronts.rs`: the fronts started with the daemon and stopped before it
//! - `tls.rs`: the picker's TLS (`server.epp_tls`), its handshakes and reloads
//!
//! The crate stands on the daemon's library (`dpcoord_daemon`): its
//! configuration, the published engine table, the HTTP connection serving,
//! the metrics registry and the in-process endpoints it opens on request.

pub mod body;
pub mod bridge;
pub mod decide;
mod endpoints;
mod fronts;
pub mod metrics;
pub mod prompt;
pub mod prompts;
pub mod proxy;
mod reach;
mod reply;
mod resolve;
pub mod service;
pub mod subset;
pub mod tls;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

pub use body::{ChatMessage, PromptText};
pub use bridge::Bridge;
pub use decide::Decider;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
pub use fronts::{Fronts, Ready};
use tokio::sync::watch;
use tonic_health::ServingStatus;

use dpcoord_daemon::routing::Published;

/// The gRPC health service names a gateway may probe, besides "" (the server).
pub const LIVENESS: &str = "liveness";
pub const READINESS: &str = "readiness";
pub const EXT_PROC: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// How often readiness looks at the ranks (the snapshot changes each tick).
const READY_EVERY: Duration = Duration::from_millis(100);

/// The running picker; [`Server::stop`] ends it.
pub struct Server {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Stops accepting, lets the open streams end for at most [`DRAIN`] (a
    /// stream lasts as long as its response), then closes the rest.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        drain(self.task, "picker streams").await;
    }
}

/// How long a front's requests in flight may take to end once it is told
/// to stop; the rest are closed, so the process still stops within its 2 s.
pub const DRAIN: Duration = Duration::from_millis(1000);

/// Waits at most [`DRAIN`] for a front's serving `task` (already told to
/// stop), then aborts it; `what` names its requests in the log.
async fn drain<T>(task: tokio::task::JoinHandle<T>, what: &str) {
    let abort = task.abort_handle();
    if tokio::time::timeout(DRAIN, task).await.is_err() {
        abort.abort();
        tracing::info!("{what} still open after the drain were closed");
    }
}

/// Whether a gateway should send requests: the process is not stopping
/// and some rank is up or stale.
fn ready(published: &Published) -> bool {
    !published.stopping() && published.state().ranks.iter().any(|r| routable(r.status))
}

/// Whether a rank of this status takes requests (up or stale).
fn routable(status: &str) -> bool {
    status == "up" || status == "stale"
}

/// A front's decider: `metrics` are the front's, the rest shared (one
/// resolver of the endpoints for both fronts).
fn decider(
    bridge: Bridge,
    published: Arc<Published>,
    endpoints: Arc<endpoints::Endpoints>,
    metrics: metrics::GatewayMetrics,
    prompts: Arc<prompts::Prompts>,
    max_query_bytes: usize,
) -> Arc<Decider> {
    Arc::new(Decider { bridge, published, endpoints, prompts, max_query_bytes, metrics, bodyless: Default::default() })
}

/// Serves the picker and the gRPC health service on `listener` (already
/// bound, so a bind error was reported before the daemon started), over
/// `tls` (`None`: plaintext); `reach` is where the ranks' 5xx answers go.
pub fn spawn(
    rt: &tokio::runtime::Handle,
    listener: TcpListener,
    tls: Option<tls::Tls>,
    decider: Arc<Decider>,
    reach: Arc<reach::Reach>,
) -> Server {
    let published = Arc::clone(&decider.published);
    let picker = service::Picker { decider, reach };
    let (stop, stopped) = watch::channel(false);
    let task = rt.spawn(async move {
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter.set_service_status("", ServingStatus::Serving).await;
        reporter.set_service_status(LIVENESS, ServingStatus::Serving).await;
        // Readiness follows the ranks, and is withdrawn the moment the
        // picker is told to stop (before the listener closes).
        let mut stopping = stopped.clone();
        let _watcher = Aborted(tokio::spawn(async move {
            let mut was = None;
            loop {
                let now = ready(&published) && !*stopping.borrow();
                if was != Some(now) {
                    let status = if now { ServingStatus::Serving } else { ServingStatus::NotServing };
                    reporter.set_service_status(READINESS, status).await;
                    reporter.set_service_status(EXT_PROC, status).await;
                    was = Some(now);
                }
                tokio::select! {
                    () = tokio::time::sleep(READY_EVERY) => {}
                    // With the picker's handle gone, look again on the tick.
                    changed = stopping.changed() => if changed.is_err() {
                        tokio::time::sleep(READY_EVERY).await;
                    }
                }
            }
        }));
        let listener = match listener.set_nonblocking(true).and_then(|()| tokio::net::TcpListener::from_std(listener)) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "the gateway picker's listener cannot be served");
                return;
            }
        };
        let router =
            tonic::transport::Server::builder().add_service(health).add_service(ExternalProcessorServer::new(picker));
        let shutdown = {
            let mut stopped = stopped.clone();
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            }
        };
        let served = match tls {
            None => {
                // Each connection without Nagle's delay: a pick is a few
                // small HTTP/2 frames, which would otherwise wait for the
                // peer's delayed ACK (40 ms on Linux) one round trip in two.
                let incoming =
                    tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(listener), |conn| {
                        conn.and_then(|c| c.set_nodelay(true).map(|()| c))
                    });
                router.serve_with_incoming_shutdown(incoming, shutdown).await
            }
            Some(tls) => {
                // Handshakes in tasks of their own (tls::accept), each
                // finished connection handed to tonic through a channel.
                let tls = Arc::new(tls);
                let (conns, incoming) = tokio::sync::mpsc::channel(64);
                let _accept = Aborted(tokio::spawn(tls::accept(listener, Arc::clone(&tls), conns, stopped.clone())));
                let _reload = Aborted(tokio::spawn(async move { tls.watch().await }));
                let incoming = tokio_stream::wrappers::ReceiverStream::new(incoming);
                router.serve_with_incoming_shutdown(incoming, shutdown).await
            }
        };
        if let Err(e) = served {
            tracing::error!(error = %e, "the gateway picker stopped");
        }
    });
    Server { stop, task }
}

/// A task aborted when this is dropped: with the picker's task, whether it
/// ends or is aborted after the drain.
struct Aborted<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for Aborted<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
