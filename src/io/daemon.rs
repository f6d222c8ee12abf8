//! Runs the daemon: sockets, the coordinator thread, and shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crate::config::Config;
use crate::io::sockets::{Sockets, TransportError};
use crate::io::transport;
use crate::observability::metrics::Metrics;
use crate::routing::{Coordinator, Published};

/// A running daemon; [`Daemon::stop`] ends it.
pub struct Daemon {
    /// The metrics registry, for the HTTP server.
    pub registry: prometheus::Registry,
    /// Engine-table snapshots, replaced every tick.
    pub published: Arc<Published>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<(), TransportError>>,
}

impl Daemon {
    /// Binds every socket (errors come back here) and starts serving.
    pub fn start(cfg: &Config) -> Result<Daemon, TransportError> {
        let sockets = Sockets::open(cfg)?;
        let metrics = Metrics::new(cfg.settings.engines.dp_size);
        let registry = metrics.registry.clone();
        let mut coord = Coordinator::new(&cfg.settings, metrics, Instant::now());
        let published = coord.published();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("coordinator".into())
            .spawn(move || transport::serve(sockets, &mut coord, &flag))
            .map_err(TransportError::Thread)?;
        tracing::info!(
            route = %cfg.server.route_bind,
            health = %cfg.server.health_bind,
            stats_bind = cfg.server.stats_bind.as_deref().unwrap_or(""),
            dp_size = cfg.settings.engines.dp_size,
            policy = cfg.settings.routing.policy.as_str(),
            "dpcoord serving"
        );
        Ok(Daemon { registry, published, stop, thread })
    }

    /// True once the coordinator thread has ended (on error or stop).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Asks the coordinator to answer what is queued and stop; waits for it.
    pub fn stop(self) -> Result<(), TransportError> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}
