//! An in-process dpcoord on private `ipc://` endpoints, for the simulator
//! and the demo. Its config is built as a TOML table and checked by
//! [`Config::from_table`], exactly as a user's file and flags would be.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dpcoord_daemon::config::{keys, Config, PolicyKind};
use dpcoord_daemon::io::daemon::Daemon;
use dpcoord_daemon::io::reload::ConfigSource;
use dpcoord_daemon::routing::Published;

use super::error::SimError;

/// A directory only this process uses, removed on drop.
pub struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    pub fn create(what: &str) -> std::io::Result<PrivateDir> {
        use std::os::unix::fs::DirBuilderExt;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir();
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = base.join(format!("dpcoord-{what}-{}-{n}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(PrivateDir { path }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The daemon's three ZeroMQ endpoints, and the SGLang load PUBs it
/// subscribes to (one per rank; none when engines send `StatsUpdate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    pub route: String,
    pub health: String,
    pub stats: String,
    pub load: Vec<String>,
    /// The KV-event PUBs each engine binds (one per rank; none when engines publish no events).
    pub kv: Vec<String>,
}

/// Daemon settings a run chooses; everything else keeps its default.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonSettings {
    pub ranks: u32,
    /// `engines.max_dp_size`: the most ranks a `resize` may set (0: `ranks`).
    pub max_ranks: u32,
    pub policy: String,
    pub stale_after_ms: u64,
    pub down_after_ms: u64,
    /// `engines.stall_after_ms`: work and no progress this long is `stalled` (0: never).
    pub stall_after_ms: u64,
    pub tick_ms: u64,
    pub pending_ttl_ms: u64,
    pub pending_transit_ms: u64,
    /// Engines publish SGLang load streams, one PUB per rank, which dpcoord
    /// subscribes to (`engines.sglang_load_connect`), instead of `StatsUpdate`.
    pub sglang_load: bool,
    /// `HOST:PORT` of the HTTP listener.
    pub metrics_bind: String,
    /// Engines publish KV-cache events, one PUB per rank, which dpcoord
    /// subscribes to (`kv_events.connect`).
    pub kv_events: bool,
    /// More `[routing]` keys, by name (`prefix_mode`, the `cache_*` weights).
    pub routing: Vec<(&'static str, toml::Value)>,
    /// `limits.max_message_bytes`: room for the longest prompt's `tokens` on a `route`.
    pub max_message_bytes: u64,
}

impl DaemonSettings {
    /// dpcoord's defaults (from the key specs) for `ranks` ranks and `policy`.
    pub fn defaults(ranks: u32, policy: &str) -> DaemonSettings {
        DaemonSettings {
            ranks,
            max_ranks: keys::MAX_DP_SIZE.default as u32,
            policy: policy.to_owned(),
            stale_after_ms: keys::STALE_AFTER_MS.default,
            down_after_ms: keys::DOWN_AFTER_MS.default,
            stall_after_ms: keys::STALL_AFTER_MS.default,
            tick_ms: keys::TICK_MS.default,
            pending_ttl_ms: keys::PENDING_TTL_MS.default,
            pending_transit_ms: keys::PENDING_TRANSIT_MS.default,
            sglang_load: false,
            metrics_bind: keys::METRICS_BIND.default.into(),
            kv_events: false,
            routing: Vec::new(),
            max_message_bytes: keys::MAX_MESSAGE_BYTES.default,
        }
    }

    /// The checked config for these settings on `eps`.
    pub fn config(&self, eps: &Endpoints) -> Result<Config, SimError> {
        let mut t = toml::Table::new();
        let s = |v: &str| toml::Value::String(v.to_owned());
        let i = |v: u64| toml::Value::Integer(v as i64);
        keys::ROUTE_BIND.key.set(&mut t, s(&eps.route));
        keys::HEALTH_BIND.key.set(&mut t, s(&eps.health));
        keys::STATS_BIND.key.set(&mut t, s(&eps.stats));
        keys::METRICS_BIND.key.set(&mut t, s(&self.metrics_bind));
        keys::DP_SIZE.key.set(&mut t, i(self.ranks.into()));
        keys::MAX_DP_SIZE.key.set(&mut t, i(self.max_ranks.into()));
        keys::STALE_AFTER_MS.key.set(&mut t, i(self.stale_after_ms));
        keys::DOWN_AFTER_MS.key.set(&mut t, i(self.down_after_ms));
        keys::STALL_AFTER_MS.key.set(&mut t, i(self.stall_after_ms));
        keys::POLICY.key.set(&mut t, s(&self.policy));
        keys::TICK_MS.key.set(&mut t, i(self.tick_ms));
        keys::PENDING_TTL_MS.key.set(&mut t, i(self.pending_ttl_ms));
        keys::PENDING_TRANSIT_MS.key.set(&mut t, i(self.pending_transit_ms));
        keys::MAX_MESSAGE_BYTES.key.set(&mut t, i(self.max_message_bytes));
        if !eps.load.is_empty() {
            let load = eps.load.iter().map(|ep| s(ep)).collect();
            keys::SGLANG_LOAD_CONNECT.key.set(&mut t, toml::Value::Array(load));
        }
        if !eps.kv.is_empty() {
            let kv = eps.kv.iter().map(|ep| s(ep)).collect();
            keys::KV_CONNECT.key.set(&mut t, toml::Value::Array(kv));
        }
        if !self.routing.is_empty() {
            let section = t.entry("routing").or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if let toml::Value::Table(routing) = section {
                for (name, value) in &self.routing {
                    routing.insert((*name).to_owned(), value.clone());
                }
            }
        }
        Ok(Config::from_table(t)?)
    }
}

/// A daemon running in this process, and where to reach it. Dropping it
/// stops the daemon too.
pub struct Local {
    daemon: Option<Daemon>,
    pub eps: Endpoints,
    /// The engine table as of the daemon's last tick.
    pub published: Arc<Published>,
    pub registry: prometheus::Registry,
    // Removed after the daemon has stopped (fields drop in order).
    _dir: PrivateDir,
}

impl Local {
    /// Starts a daemon; `what` names its private directory (`dpcoord-<what>-...`).
    pub fn start(settings: &DaemonSettings, what: &str) -> Result<Local, SimError> {
        let dir = PrivateDir::create(what)?;
        let ep = |name: &str| format!("ipc://{}/{name}", dir.path().display());
        let load = (0..settings.ranks).filter(|_| settings.sglang_load).map(|r| ep(&format!("load-{r}"))).collect();
        let kv = (0..settings.ranks).filter(|_| settings.kv_events).map(|r| ep(&format!("kv-{r}"))).collect();
        let eps = Endpoints { route: ep("route"), health: ep("health"), stats: ep("stats"), load, kv };
        let config = settings.config(&eps)?;
        // A reload re-reads the run's own configuration: nothing changes.
        let fixed = config.clone();
        let source = ConfigSource::new("the run's settings", move || Ok(fixed.clone()));
        let daemon = Daemon::start(&config, source, dpcoord_daemon::io::sockets::Local::default())?;
        let (published, registry) = (Arc::clone(&daemon.published), daemon.registry.clone());
        Ok(Local { daemon: Some(daemon), eps, published, registry, _dir: dir })
    }

    /// Stops the daemon (it answers what is queued first).
    pub fn stop(mut self) -> Result<(), SimError> {
        match self.daemon.take() {
            Some(d) => Ok(d.stop()?),
            None => Ok(()),
        }
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        if let Some(d) = self.daemon.take() {
            let _ = d.stop();
        }
    }
}

/// Every `routing.policy` value this build accepts, each checked by
/// parsing a config with it (so a policy added later appears by itself).
pub fn accepted_policies() -> Vec<String> {
    let accepted = |name: &str| {
        let mut t = toml::Table::new();
        keys::POLICY.key.set(&mut t, toml::Value::String(name.to_owned()));
        Config::from_table(t).is_ok()
    };
    PolicyKind::ALL.iter().map(|p| p.as_str()).filter(|n| accepted(n)).map(str::to_owned).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_kind_is_accepted() {
        let p = accepted_policies();
        assert_eq!(p.first().map(String::as_str), Some("round_robin"));
        assert_eq!(p.len(), PolicyKind::ALL.len());
    }

    #[test]
    fn settings_become_a_checked_config() {
        let (route, health, stats) = ("ipc:///x/r".into(), "ipc:///x/h".into(), "ipc:///x/s".into());
        let mut eps = Endpoints { route, health, stats, load: Vec::new(), kv: Vec::new() };
        let c = DaemonSettings::defaults(4, "round_robin").config(&eps).unwrap();
        assert_eq!((c.settings.engines.dp_size, c.server.stats_bind.as_deref()), (4, Some("ipc:///x/s")));
        assert_eq!(c.settings.routing.pending_transit, std::time::Duration::from_millis(100));
        eps.load = vec!["ipc:///x/l0".into()];
        let snapshots = DaemonSettings { pending_transit_ms: 0, ..DaemonSettings::defaults(4, "round_robin") };
        let c = snapshots.config(&eps).unwrap();
        assert_eq!(
            (c.server.sglang_load_connect, c.settings.routing.pending_transit),
            (eps.load.clone(), std::time::Duration::ZERO)
        );
        let bad = DaemonSettings { down_after_ms: 10, ..DaemonSettings::defaults(4, "round_robin") };
        assert!(matches!(bad.config(&eps), Err(SimError::Config(e)) if e.key == "engines.down_after_ms"));
        assert!(DaemonSettings::defaults(4, "nope").config(&eps).is_err());
    }
}
