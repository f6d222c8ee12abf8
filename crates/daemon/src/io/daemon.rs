//! Runs the daemon: sockets, the coordinator thread, the scraper, and shutdown.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crate::config::Config;
use crate::io::fds::Budget;
use crate::io::http;
use crate::io::reload::ConfigSource;
use crate::io::scrape::Scraper;
use crate::io::sockets::{Local, Sockets, TransportError};
use crate::io::transport::{self, Control};
use crate::observability::metrics::Metrics;
use crate::routing::{Coordinator, Published};

/// A running daemon; [`Daemon::stop`] ends it.
pub struct Daemon {
    /// The metrics registry, for the HTTP server.
    pub registry: prometheus::Registry,
    /// Engine-table snapshots, replaced every tick.
    pub published: Arc<Published>,
    /// The HTTP server's connection cap (within the file descriptors' HTTP
    /// share) and timeouts.
    pub http: http::Limits,
    /// The `nofile` limits in force, for a frontend's share of them.
    pub fds: Budget,
    /// The sockets' context: a frontend in the process connects to the
    /// in-process endpoints it asked for ([`Local`]) in it.
    pub context: zmq::Context,
    control: Arc<Control>,
    thread: JoinHandle<Result<(), TransportError>>,
    scraper: Scraper,
}

impl Daemon {
    /// Binds every socket (errors come back here) and starts serving.
    /// `source` is where a reload (SIGHUP, the `reload` op) reads the
    /// configuration again.
    /// `local`: the in-process endpoints a frontend in the process asks
    /// through. First the soft `nofile` limit is raised to the hard one
    /// (logged).
    pub fn start(cfg: &Config, source: ConfigSource, local: Local) -> Result<Daemon, TransportError> {
        let fds = Budget::raise();
        fds.log_peer_caps(&cfg.server.peers);
        crate::io::trim::start();
        let http = http::Limits::new(&cfg.server.http, &fds);
        let sockets = Sockets::open(cfg, local)?;
        let metrics = Metrics::new(cfg.settings.engines.dp_size);
        let registry = metrics.registry.clone();
        let scraper = Scraper::start(&sockets.context(), &cfg.server, &metrics.scrapes)?;
        let context = sockets.context();
        let mut coord = Coordinator::new(&cfg.settings, metrics, Instant::now())
            .with_server(cfg.server.clone())
            .with_kv_endpoints(&cfg.server.kv_events);
        let published = coord.published();
        let control = Arc::new(Control::default());
        let shared = Arc::clone(&control);
        let thread = std::thread::Builder::new()
            .name("coordinator".into())
            .spawn(move || transport::serve(sockets, &mut coord, &shared, fds, source))
            .map_err(TransportError::Thread)?;
        tracing::info!(
            route = %cfg.server.route_bind,
            health = %cfg.server.health_bind,
            stats_bind = cfg.server.stats_bind.as_deref().unwrap_or(""),
            dp_size = cfg.settings.engines.dp_size,
            policy = cfg.settings.routing.policy.as_str(),
            http_max_connections = http.max_connections,
            "dpcoord serving"
        );
        Ok(Daemon { registry, published, http, fds, context, control, thread, scraper })
    }

    /// True once the coordinator thread has ended (on error or stop).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Asks the coordinator to re-read the configuration (SIGHUP); it does
    /// so between two queries, within one poll wait.
    pub fn request_reload(&self) {
        self.control.reload.store(true, Ordering::Relaxed);
    }

    /// Asks the coordinator to answer what is queued and stop, ends the
    /// scraper meanwhile (a request in flight may take its timeout), and
    /// waits for both (not for a configuration read in flight: its thread
    /// is left to end on its own).
    pub fn stop(self) -> Result<(), TransportError> {
        self.control.stop.store(true, Ordering::Relaxed);
        self.scraper.stop();
        match self.thread.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}
