//! The read-only HTTP side: `/metrics`, `/healthz`, `/readyz` and `/state`.
//!
//! It reads only what the coordinator shares on purpose: the metrics
//! registry (atomics) and the engine-table snapshot replaced on every tick.
//! It never reaches routing state. `main` and the demo both start it with
//! [`bind`] then [`serve`] (or [`spawn`], which hands back a stop handle).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus::{Encoder, Registry, TextEncoder};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub mod conns;
pub use conns::Limits;

use crate::config::keys;
use crate::engines::Status;
use crate::routing::Published;
use crate::wire::StateView;

/// The listener could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot listen on {addr}: {source}", keys::METRICS_BIND.key.path())]
pub struct BindError {
    pub addr: SocketAddr,
    #[source]
    pub source: std::io::Error,
}

/// Opens the listener (before serving, so a busy port is reported at start).
/// It needs no runtime; [`serve`] takes it over.
pub fn bind(addr: SocketAddr) -> Result<std::net::TcpListener, BindError> {
    let listener = std::net::TcpListener::bind(addr).map_err(|source| BindError { addr, source })?;
    listener.set_nonblocking(true).map_err(|source| BindError { addr, source })?;
    Ok(listener)
}

/// What the handlers read.
#[derive(Clone)]
struct Sources {
    registry: Registry,
    published: Arc<Published>,
}

/// The routes, with axum's 404 for unknown paths and 405 for other methods.
fn router(registry: Registry, published: Arc<Published>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/state", get(state))
        .fallback(not_found)
        .with_state(Sources { registry, published })
}

/// Serves HTTP/1.1 on `listener` within `limits` (the connection cap and
/// timeouts, see `conns.rs`) until `shutdown` completes, then finishes
/// the requests in flight. Must run inside a tokio runtime with I/O enabled.
pub async fn serve(
    listener: std::net::TcpListener,
    registry: Registry,
    published: Arc<Published>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let app = router(registry.clone(), published);
    conns::serve(listener, app, &registry, limits, conns::HTTP, shutdown).await
}

/// How long [`Running::stop`] waits for requests in flight.
const DRAIN: Duration = Duration::from_millis(500);

/// A server started by [`spawn`].
pub struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

/// Starts [`serve`] as a task on `rt`.
pub fn spawn(
    rt: &tokio::runtime::Handle,
    listener: std::net::TcpListener,
    registry: Registry,
    published: Arc<Published>,
    limits: Limits,
) -> Running {
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async {
        // A dropped sender also means stop.
        let _ = stopped.await;
    };
    Running { stop, task: rt.spawn(serve(listener, registry, published, limits, shutdown)) }
}

impl Running {
    /// Stops accepting, waits up to `DRAIN` (500 ms) for requests in flight, and
    /// reports how the server ended.
    pub async fn stop(self) -> std::io::Result<()> {
        let _ = self.stop.send(());
        let abort = self.task.abort_handle();
        match tokio::time::timeout(DRAIN, self.task).await {
            Ok(Ok(served)) => served,
            Ok(Err(join)) => Err(std::io::Error::other(format!("the HTTP task failed: {join}"))),
            Err(_) => {
                abort.abort();
                Err(std::io::Error::other("requests were still open after 500 ms; closed them"))
            }
        }
    }
}

async fn metrics(State(s): State<Sources>) -> Response {
    let encoder = TextEncoder::new();
    let mut body = Vec::with_capacity(8192);
    match encoder.encode(&s.registry.gather(), &mut body) {
        Ok(()) => ([(header::CONTENT_TYPE, encoder.format_type().to_owned())], body).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cannot encode metrics");
            (StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode metrics: {e}\n")).into_response()
        }
    }
}

async fn not_found(uri: Uri) -> (StatusCode, String) {
    let why = format!("not found: {}; dpcoord serves /metrics, /healthz, /readyz and /state\n", uri.path());
    (StatusCode::NOT_FOUND, why)
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 when at least one rank is routable; 503 with a one-line reason otherwise.
fn readiness(view: &StateView) -> (StatusCode, String) {
    let total = view.ranks.len();
    let is_routable = |s: &str| s == Status::Up.as_str() || s == Status::Stale.as_str();
    let routable = view.ranks.iter().filter(|r| is_routable(r.status)).count();
    if routable > 0 {
        (StatusCode::OK, format!("ready: {routable} of {total} ranks routable (epoch {})\n", view.epoch))
    } else {
        let count = |s: &str| view.ranks.iter().filter(|r| r.status == s).count();
        let why = format!(
            "not ready: no routable rank ({} unknown, {} down, of {total}; epoch {})\n",
            count(Status::Unknown.as_str()),
            count(Status::Down.as_str()),
            view.epoch
        );
        (StatusCode::SERVICE_UNAVAILABLE, why)
    }
}

async fn readyz(State(s): State<Sources>) -> (StatusCode, String) {
    if s.published.stopping() {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: stopping\n".into());
    }
    readiness(&s.published.state())
}

async fn state(State(s): State<Sources>) -> Json<StateView> {
    Json(StateView::clone(&s.published.state()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::RankView;

    fn rank(rank: u32, status: &'static str) -> RankView {
        RankView {
            rank,
            status,
            stall: None,
            counts: Default::default(),
            pending: 0,
            routed: 0,
            penalty: 0.0,
            age_ms: None,
            boot: None,
            load: 0.0,
            kv_blocks: Default::default(),
            kv_block_size: None,
            kv_index: None,
            kv_usage: None,
        }
    }

    #[test]
    fn ready_once_any_rank_is_up_or_stale() {
        let mut v = StateView {
            epoch: 0,
            policy: "round_robin",
            ranks: vec![rank(0, "unknown"), rank(1, "down")],
            kv_block_size: None,
            ..StateView::default()
        };
        assert_eq!(
            readiness(&v),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: no routable rank (1 unknown, 1 down, of 2; epoch 0)\n".into()
            )
        );
        v.ranks[1].status = "stale";
        v.epoch = 3;
        assert_eq!(readiness(&v), (StatusCode::OK, "ready: 1 of 2 ranks routable (epoch 3)\n".into()));
    }

    #[test]
    fn bind_failure_names_the_key() {
        let taken = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = taken.local_addr().unwrap();
        let e = bind(addr).unwrap_err();
        assert!(e.to_string().starts_with(&format!("server.metrics_bind: cannot listen on {addr}: ")), "{e}");
    }
}
