//! The gateway's fronts as the configuration turns them on: their
//! listeners, the picker's TLS and the model's tokenizer ready before the
//! daemon starts (a file that does not load stops the start), then started
//! on the daemon's in-process endpoints, and stopped before the daemon is.

use std::net::TcpListener;
use std::sync::Arc;

use dpcoord_daemon::config::{keys, Config, ConfigError};
use dpcoord_daemon::io::daemon::Daemon;
use dpcoord_daemon::io::http;
use dpcoord_daemon::io::sockets::{reply_queue, Local};
use dpcoord_daemon::wire::Channel;

use crate::endpoints::Endpoints;
use crate::metrics::{Front, GatewayMetrics};
use crate::prompts::Prompts;
use crate::reach::Reach;
use crate::tls::Tls;
use crate::{proxy, Bridge};

/// The fronts' listeners (bound, so a busy port was named before the
/// daemon started), the picker's TLS and the prompt encoder, not serving yet.
pub struct Ready {
    epp: Option<(TcpListener, Option<Tls>)>,
    proxy: Option<TcpListener>,
    prompts: Option<Arc<Prompts>>,
}

/// The fronts serving; [`Fronts::stop`] ends them.
pub struct Fronts {
    picker: Option<crate::Server>,
    proxy: Option<proxy::Server>,
    /// Tries the servers of ranks failing through the gateway.
    watch: Option<tokio::task::JoinHandle<()>>,
}

impl Ready {
    /// `epp` on `server.epp_bind` (its TLS made or read now), `proxy` on
    /// `server.proxy_bind`; with either, `gateway.tokenizer` (if any) is
    /// loaded now. An error names the key of what did not load.
    pub fn new(cfg: &Config, epp: Option<TcpListener>, proxy: Option<TcpListener>) -> Result<Ready, ConfigError> {
        let epp = match epp {
            Some(l) => {
                let addr = l.local_addr().map_err(|e| ConfigError {
                    key: keys::EPP_BIND.key.path(),
                    problem: format!("the listener has no address: {e}"),
                })?;
                let tls = Tls::load(&cfg.server.epp_tls, addr)?;
                Some((l, tls))
            }
            None => None,
        };
        let prompts = match epp.is_some() || proxy.is_some() {
            true => Some(Arc::new(
                Prompts::load(&cfg.settings.gateway)
                    .map_err(|e| ConfigError { key: keys::GATEWAY_TOKENIZER.key.path(), problem: e.to_string() })?,
            )),
            false => None,
        };
        Ok(Ready { epp, proxy, prompts })
    }

    /// The in-process endpoints the fronts ask through: the route socket,
    /// and the health socket for what they learn of the ranks' servers.
    pub fn local(&self) -> Local {
        let on = self.prompts.is_some();
        Local { route: on, health: on }
    }

    /// Registers both fronts' metrics on the daemon's registry (on or
    /// not, so the series are always there) and serves the fronts that are
    /// on, through a bridge to the daemon's [`Ready::local`] endpoints.
    pub fn start(self, rt: &tokio::runtime::Handle, cfg: &Config, daemon: &Daemon) -> std::io::Result<Fronts> {
        let dp = cfg.settings.engines.dp_size;
        let picker_metrics = GatewayMetrics::new(&daemon.registry, dp, Front::Picker);
        let proxy_metrics = GatewayMetrics::new(&daemon.registry, dp, Front::Proxy);
        let Some(prompts) = self.prompts else { return Ok(Fronts { picker: None, proxy: None, watch: None }) };
        // No more queries in flight than the route socket queues replies
        // for one peer: none is dropped.
        let in_flight = reply_queue(Channel::Route, cfg) as usize;
        let bridge = Bridge::start(&daemon.context, in_flight)?;
        let max_query = cfg.settings.limits.max_message_bytes;
        let endpoints = Arc::new(Endpoints::new(daemon.published.gateway()));
        let published = &daemon.published;
        let decider = |metrics| {
            let (bridge, endpoints, prompts) = (bridge.clone(), Arc::clone(&endpoints), Arc::clone(&prompts));
            crate::decider(bridge, Arc::clone(published), endpoints, metrics, prompts, max_query)
        };
        let (picker_decider, proxy_decider) =
            (self.epp.as_ref().map(|_| decider(picker_metrics)), self.proxy.as_ref().map(|_| decider(proxy_metrics)));
        // One watch over the ranks failing through either front.
        let reach = Arc::new(Reach::default());
        let timeout = cfg.server.proxy.connect_timeout;
        let watch = picker_decider
            .iter()
            .chain(&proxy_decider)
            .next()
            .map(|d| rt.spawn(Arc::clone(&reach).watch(Arc::clone(d), timeout)));
        let picker = self.epp.zip(picker_decider).map(|((l, tls), decider)| {
            tracing::info!(
                epp = %l.local_addr().map_or(String::new(), |a| a.to_string()),
                tls = cfg.server.epp_tls.mode().as_str(),
                "gateway endpoint picker serving"
            );
            // Handshakes in flight within the front's share of descriptors.
            let tls = tls.map(|t| t.within(daemon.fds.front_share()));
            crate::spawn(rt, l, tls, decider, Arc::clone(&reach))
        });
        let proxy = self.proxy.zip(proxy_decider).map(|(l, decider)| {
            let share = cfg.server.proxy.max_connections.min(daemon.fds.front_share());
            let conns = http::Limits { max_connections: share, ..daemon.http };
            tracing::info!(
                proxy = %l.local_addr().map_or(String::new(), |a| a.to_string()),
                max_connections = conns.max_connections,
                "proxy serving"
            );
            proxy::spawn(rt, l, decider, cfg.server.proxy, conns, &daemon.registry, Arc::clone(&reach))
        });
        Ok(Fronts { picker, proxy, watch })
    }
}

impl Fronts {
    /// Stops both at once: each stops accepting and gives its requests in
    /// flight at most [`crate::DRAIN`], while the coordinator still books
    /// their ends.
    pub async fn stop(self) {
        let picker = async {
            if let Some(p) = self.picker {
                p.stop().await;
            }
        };
        let proxy = async {
            if let Some(p) = self.proxy {
                p.stop().await;
            }
        };
        tokio::join!(picker, proxy);
        if let Some(w) = self.watch {
            w.abort();
        }
    }
}
