//! Operations without restarts: the admin ops of the health socket
//! (`resize`, `reload`), `SIGHUP`, and the allowlists the ZAP handler asks
//! about. The coordinator does no I/O: a `reload` op is answered
//! [`Answered::AfterReload`], the transport reads the configuration off the
//! routing thread (`io::reload`) and hands what it read to
//! [`Coordinator::reloaded`], which applies what routing reads; what binds
//! a socket, or sets a size limit libzmq enforces on one, cannot change
//! without a restart, and a reload that would change it is refused naming
//! the key.
//!
//! A `resize` holds across reloads until the configuration's own
//! `engines.dp_size` changes; then that value wins. Either way the reply
//! says which (`dp_size_from`), and the log warns when the two differ.

use std::time::Instant;

use super::Coordinator;
use crate::config::{keys, Allowlist, Config, ConfigError, Server, Settings};
use crate::observability::metrics::ReloadResult;
use crate::wire::{self, Admin, DpSizeFrom, ErrorCode, Id, OwnedId, SourceLimits, WireError};

/// What became of a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered {
    /// The reply is in `out`.
    Now,
    /// A `reload` (with the query's `id`): nothing was written; the reply is
    /// [`Coordinator::reload_reply`] once the configuration has been read
    /// and handed to [`Coordinator::reloaded`].
    AfterReload(Option<OwnedId>),
}

/// The socket settings in force (a reload may change the allowlists and
/// the peer caps; the rest needs a restart).
pub(super) struct Reloadable {
    server: Server,
    /// The `limits.max_batch` the reply queues were sized for at start.
    sized_batch: u32,
}

/// The key of a reload that would make replies larger than the route and
/// health sockets' queues were sized for at start (`ceiling` ranks,
/// `sized_batch` placements), with why; `None` if it fits.
fn reply_size_key(settings: &Settings, ceiling: u32, sized_batch: u32) -> Option<String> {
    let (dp_size, max_dp_size) = (settings.engines.dp_size, settings.engines.max_dp_size);
    if max_dp_size.is_some_and(|m| m != ceiling) {
        Some(format!("{}: the reply queues are sized for {ceiling} ranks at start", keys::MAX_DP_SIZE.key.path()))
    } else if dp_size > ceiling {
        Some(format!(
            "{} {dp_size} is above {} = {ceiling}, which the reply queues are sized for at start",
            keys::DP_SIZE.key.path(),
            keys::MAX_DP_SIZE.key.path()
        ))
    } else if settings.limits.max_batch > sized_batch {
        Some(format!(
            "{} {} is above {sized_batch}, which the reply queues are sized for at start",
            keys::MAX_BATCH.key.path(),
            settings.limits.max_batch
        ))
    } else {
        None
    }
}

/// Where the rank count in force came from, and the configuration's
/// `engines.dp_size` as last applied (at start or by a reload).
pub(super) struct DpOrigin {
    configured: u32,
    from: DpSizeFrom,
}

impl DpOrigin {
    pub(super) fn new(configured: u32) -> Self {
        DpOrigin { configured, from: DpSizeFrom::File }
    }
}

/// The first key of `server` that differs in a way only a restart can apply
/// (anything but the allowlists and the peer caps, which only ZAP reads).
fn restart_key(old: &Server, new: &Server) -> Option<String> {
    let same_binds = Server {
        route_allow: old.route_allow.clone(),
        health_allow: old.health_allow.clone(),
        stats_allow: old.stats_allow.clone(),
        peers: old.peers,
        ..new.clone()
    };
    if same_binds == *old {
        return None;
    }
    let named = [
        (&keys::ROUTE_BIND.key, old.route_bind != new.route_bind),
        (&keys::HEALTH_BIND.key, old.health_bind != new.health_bind),
        (&keys::STATS_BIND.key, old.stats_bind != new.stats_bind),
        (&keys::STATS_CONNECT.key, old.stats_connect != new.stats_connect),
        (&keys::SGLANG_LOAD_CONNECT.key, old.sglang_load_connect != new.sglang_load_connect),
        (&keys::VLLM_METRICS_URL.key, old.vllm_metrics_url != new.vllm_metrics_url),
        (&keys::VLLM_METRICS_INTERVAL_MS.key, old.vllm_metrics_interval != new.vllm_metrics_interval),
        (&keys::METRICS_BIND.key, old.metrics_bind != new.metrics_bind),
        (&keys::LOG_FORMAT.key, old.log_format != new.log_format),
        (&keys::IPC_MODE.key, old.ipc_mode != new.ipc_mode),
        (&keys::HTTP_MAX_CONNECTIONS.key, old.http.max_connections != new.http.max_connections),
        (&keys::HTTP_HEADER_TIMEOUT_MS.key, old.http.header_timeout != new.http.header_timeout),
        (&keys::HTTP_IDLE_TIMEOUT_MS.key, old.http.idle_timeout != new.http.idle_timeout),
        // With the `+rank` form, a new dp_size changes the expansion too.
        (&keys::KV_CONNECT.key, old.kv_events != new.kv_events),
        (&keys::KV_TOPIC.key, old.kv_topic != new.kv_topic),
        (&keys::EPP_TLS.key, old.epp_tls != new.epp_tls),
    ];
    Some(named.into_iter().find(|(_, changed)| *changed).map_or("server".into(), |(key, _)| key.path()))
}

/// The first size limit that libzmq enforces on dpcoord's sockets (each
/// frame's `ZMQ_MAXMSGSIZE`, the high-water marks derived from it, set when
/// a socket opens) that differs: a new value would hold for dpcoord's own
/// checks but not for its sockets, so it waits for a restart.
fn socket_limit_key(old: &SourceLimits, new: &SourceLimits) -> Option<String> {
    if old.message != new.message {
        Some(keys::MAX_MESSAGE_BYTES.key.path())
    } else if old.kv_batch != new.kv_batch {
        Some(keys::KV_MAX_BATCH_BYTES.key.path())
    } else {
        None
    }
}

impl Coordinator {
    /// Lets `reload` (the op and `SIGHUP`) apply a configuration read
    /// again; `server` is what the sockets were opened with. Without it a
    /// `reload` is refused at once.
    pub fn with_server(mut self, server: Server) -> Self {
        self.config = Some(Reloadable { server, sized_batch: self.limits.max_batch });
        self
    }

    /// Whether a `reload` op is answered after a read ([`Answered::AfterReload`]).
    pub(super) fn reloads(&self) -> bool {
        self.config.is_some()
    }

    /// The peer allowlist of a ZAP domain (`route`, `health`, `stats`) in
    /// force; `None` admits every peer.
    pub fn allowlist(&self, domain: &str) -> Option<&Allowlist> {
        let server = &self.config.as_ref()?.server;
        match domain {
            "route" => Some(&server.route_allow),
            "health" => Some(&server.health_allow),
            "stats" => Some(&server.stats_allow),
            _ => None,
        }
    }

    /// The most connected peers of a ZAP domain's socket in force, and of
    /// one source address on it; `None` without a configuration (no cap).
    pub fn peer_cap(&self, domain: &str) -> Option<(u32, u32)> {
        let peers = &self.config.as_ref()?.server.peers;
        Some((peers.of(domain)?, peers.per_address))
    }

    pub(super) fn admin(&mut self, op: Admin, now: Instant) -> Result<(), WireError> {
        match op {
            Admin::Resize(dp_size) => {
                self.resize(dp_size);
                self.dp.from = DpSizeFrom::Resize;
                Ok(())
            }
            // Reached only without a server (see `answer_health`).
            Admin::Reload => {
                self.reloaded(Err(crate::config::err("config", "this dpcoord has no configuration to re-read")), now)
            }
        }
    }

    /// The `resize` and `reload` reply: the rank count in force, whence, and the epoch.
    pub(super) fn admin_reply(&self, id: Option<Id<'_>>, out: &mut Vec<u8>) {
        wire::encode_admin(out, id, self.engines.dp_size(), self.dp.from, self.engines.epoch());
    }

    /// Applies a configuration read again for a reload, or changes nothing
    /// and says why (counted in `dpcoord_config_reloads_total{result}`).
    pub fn reloaded(&mut self, read: Result<Config, ConfigError>, now: Instant) -> Result<(), WireError> {
        let outcome = self.try_reload(read, now);
        let result = match &outcome {
            Ok(()) => ReloadResult::Ok,
            Err((result, _)) => *result,
        };
        self.metrics.reload(result);
        match outcome {
            Ok(()) => {
                let (dp_size, from) = (self.engines.dp_size(), self.dp.from.as_str());
                tracing::info!(dp_size, dp_size_from = from, policy = self.user.policy().as_str(), "reloaded");
                Ok(())
            }
            Err((_, why)) => {
                tracing::warn!(reason = %why, "reload refused; nothing changed");
                Err(WireError::new(ErrorCode::InvalidConfig, format!("{why}; nothing changed")))
            }
        }
    }

    /// The reply to a `reload` op once its outcome is known: as `resize`
    /// answers, or the refusal (counted like any error reply).
    pub fn reload_reply(&self, id: Option<Id<'_>>, outcome: &Result<(), WireError>, out: &mut Vec<u8>) {
        match outcome {
            Ok(()) => self.admin_reply(id, out),
            Err(e) => self.refuse(id, e, out),
        }
    }

    fn try_reload(&mut self, read: Result<Config, ConfigError>, now: Instant) -> Result<(), (ReloadResult, String)> {
        let mut cfg = read.map_err(|e| (ReloadResult::Invalid, e.to_string()))?;
        let Some(reloadable) = self.config.as_ref() else {
            return Err((ReloadResult::Invalid, "this dpcoord has no configuration to re-read".into()));
        };
        if let Some(key) = restart_key(&reloadable.server, &cfg.server)
            .or_else(|| socket_limit_key(&self.sources, &super::source_limits(&cfg.settings)))
        {
            return Err((ReloadResult::RestartRequired, format!("{key}: cannot change without a restart")));
        }
        if let Some(why) = reply_size_key(&cfg.settings, self.limits.max_dp_size, reloadable.sized_batch) {
            return Err((ReloadResult::RestartRequired, format!("{why}: cannot change without a restart")));
        }
        let configured = cfg.settings.engines.dp_size;
        let kept = self.kept_dp_size(&cfg.settings).map_err(|why| (ReloadResult::Invalid, why))?;
        if let Some(reloadable) = self.config.as_mut() {
            reloadable.server = cfg.server;
        }
        cfg.settings.engines.dp_size = kept.unwrap_or(configured);
        self.dp = DpOrigin { configured, from: kept.map_or(DpSizeFrom::File, |_| DpSizeFrom::Resize) };
        self.reload(cfg.settings, now);
        Ok(())
    }

    /// The resized rank count a reload keeps (the configuration's
    /// `engines.dp_size` is the one last applied), or `None` when the
    /// configuration's value is in force from this reload on; a warning
    /// when the two differ. A kept count must still fit the new
    /// `limits.max_batch`, or the reload is refused.
    fn kept_dp_size(&self, new: &Settings) -> Result<Option<u32>, String> {
        let (in_force, configured) = (self.engines.dp_size(), new.engines.dp_size);
        if self.dp.from == DpSizeFrom::File {
            return Ok(None);
        }
        if configured != self.dp.configured {
            if configured != in_force {
                tracing::warn!(
                    "reload: engines.dp_size changed in the configuration from {} to {configured}; \
                     it replaces dp_size {in_force} set by a resize",
                    self.dp.configured
                );
            }
            return Ok(None);
        }
        keys::check_query_work(in_force, new.limits.max_batch).map_err(|why| {
            format!("{}: {why} (dp_size {in_force} is in force from a resize)", keys::MAX_BATCH.key.path())
        })?;
        if configured != in_force {
            tracing::warn!(
                "reload: dp_size {in_force} set by a resize stays; engines.dp_size in the configuration is still \
                 {configured} (change it there to apply it)"
            );
        }
        Ok(Some(in_force))
    }
}
