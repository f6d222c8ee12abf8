//! `dpcoord proxy`: an OpenAI-compatible HTTP reverse proxy in front of one
//! server per rank (vLLM or vLLM Ascend with external data parallelism,
//! SGLang, any OpenAI-compatible engine), on `server.proxy_bind`. Each
//! request's rank is decided in process by the coordinator, as the picker's
//! (`decide.rs`), its response streamed back unbuffered, and its end booked.
//!
//! - `forward.rs`: one request, from its body to its response
//! - `booked.rs`: the response body that books `finished` at its end, and
//!   reports what the engine served from its cache (`delivered`)
//!
//! Its client connections are served as the HTTP server's are
//! (`io/http/conns.rs`: a cap, header and idle timeouts, eviction), with
//! their own series (`dpcoord_proxy_connections*`).

mod booked;
mod forward;

use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{oneshot, Semaphore};
use tokio::task::JoinHandle;

use crate::reach::Reach;
use crate::Decider;
use dpcoord_daemon::config::ProxyLimits;
use dpcoord_daemon::io::http::conns::{self, Family, Limits};
use dpcoord_daemon::observability::metrics::{built, register};

/// The most bytes hyper buffers on a connection to a rank's server, each way.
const UPSTREAM_BUF: usize = 16 << 10;
/// How long an idle connection to a rank's server is kept for reuse.
const UPSTREAM_IDLE: Duration = Duration::from_secs(30);

/// The proxy's client connections' series.
pub const CONNECTIONS: Family = Family {
    name: "proxy",
    what: "Proxy client connections",
    cap: "proxy.max_connections within a sixteenth of the nofile limit",
};

/// What every request reads.
pub struct Proxy {
    decider: Arc<Decider>,
    client: Client<HttpConnector, http_body_util::Full<hyper::body::Bytes>>,
    limits: ProxyLimits,
    /// `proxy.max_buffered_bytes`, a permit a byte.
    buffered: Arc<Semaphore>,
    /// `dpcoord_proxy_buffered_bytes`: what the bodies hold now.
    buffered_bytes: prometheus::IntGauge,
    reach: Arc<Reach>,
}

/// The running proxy; [`Server::stop`] ends it.
pub struct Server {
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Stops accepting, lets the requests in flight end for at most
    /// [`super::DRAIN`], then closes what is left.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        crate::drain(self.task, "proxy requests").await;
    }
}

/// Serves the proxy on `listener` (already bound, so a bind error was
/// reported before the daemon started) within `conns` (the client
/// connection cap in force, the HTTP timeouts).
pub fn spawn(
    rt: &tokio::runtime::Handle,
    listener: std::net::TcpListener,
    decider: Arc<Decider>,
    limits: ProxyLimits,
    conns: Limits,
    registry: &prometheus::Registry,
    reach: Arc<Reach>,
) -> Server {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(limits.connect_timeout));
    connector.set_nodelay(true);
    // Idle connections kept per rank: the cap spread over the ranks.
    let ranks = decider.published.dp_size().max(1) as usize;
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(UPSTREAM_IDLE)
        .pool_max_idle_per_host(conns.max_connections.div_ceil(ranks))
        .http1_max_buf_size(UPSTREAM_BUF)
        .build(connector);
    let buffered_bytes = register(
        registry,
        built(prometheus::IntGauge::new(
            "dpcoord_proxy_buffered_bytes",
            "Bytes of request bodies the proxy holds now (at most proxy.max_buffered_bytes).",
        )),
    );
    let proxy = Arc::new(Proxy {
        decider: Arc::clone(&decider),
        client,
        limits,
        buffered: Arc::new(Semaphore::new(limits.max_buffered_bytes)),
        buffered_bytes,
        reach,
    });
    let router = axum::Router::new().fallback(forward::handle).with_state(proxy);
    let (stop, stopped) = oneshot::channel::<()>();
    let registry = registry.clone();
    let task = rt.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let shutdown = async {
            let _ = stopped.await;
        };
        conns::serve(listener, router, &registry, conns, CONNECTIONS, shutdown).await
    });
    Server { stop, task }
}
