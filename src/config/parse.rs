//! Reading one TOML section into typed values, each error naming `section.key`.

use std::time::Duration;

use super::{
    err, ConfigError, Engines, Limits, LoadWeights, LogFormat, Penalty, PolicyKind, Routing, Server, Sessions,
};
use crate::io::access::Allowlist;

/// Reads one section's keys, remembering which were used.
pub(super) struct Section<'a> {
    name: &'static str,
    table: Option<&'a toml::Table>,
    seen: Vec<&'static str>,
}

impl<'a> Section<'a> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.name)
    }

    fn get(&mut self, k: &'static str) -> Option<&'a toml::Value> {
        self.seen.push(k);
        self.table.and_then(|t| t.get(k))
    }

    fn int(&mut self, k: &'static str, default: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
        let Some(v) = self.get(k) else { return Ok(default) };
        let i = v.as_integer().ok_or_else(|| err(self.key(k), format!("expected an integer, got {}", v.type_str())))?;
        u64::try_from(i)
            .ok()
            .filter(|i| (min..=max).contains(i))
            .ok_or_else(|| err(self.key(k), format!("must be between {min} and {max}, got {i}")))
    }

    fn ms(&mut self, k: &'static str, default: u64, min: u64, max: u64) -> Result<Duration, ConfigError> {
        self.int(k, default, min, max).map(Duration::from_millis)
    }

    fn float(&mut self, k: &'static str, default: f64, min: f64, max: f64) -> Result<f64, ConfigError> {
        let Some(v) = self.get(k) else { return Ok(default) };
        let x = match v {
            toml::Value::Float(x) => *x,
            toml::Value::Integer(i) => *i as f64,
            other => return Err(err(self.key(k), format!("expected a number, got {}", other.type_str()))),
        };
        if x.is_finite() && (min..=max).contains(&x) {
            Ok(x)
        } else {
            Err(err(self.key(k), format!("must be between {min} and {max}, got {x}")))
        }
    }

    fn string(&mut self, k: &'static str, default: &str) -> Result<String, ConfigError> {
        match self.get(k) {
            None => Ok(default.to_owned()),
            Some(toml::Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(err(self.key(k), format!("expected a string, got {}", other.type_str()))),
        }
    }

    fn endpoint(&mut self, k: &'static str, default: &str) -> Result<String, ConfigError> {
        let s = self.string(k, default)?;
        check_endpoint(&s).map_err(|p| err(self.key(k), p))?;
        Ok(s)
    }

    fn strings(&mut self, k: &'static str) -> Result<Vec<String>, ConfigError> {
        let Some(v) = self.get(k) else { return Ok(Vec::new()) };
        let arr = v
            .as_array()
            .ok_or_else(|| err(self.key(k), format!("expected an array of strings, got {}", v.type_str())))?;
        arr.iter()
            .map(|e| {
                e.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| err(self.key(k), format!("expected strings, got {}", e.type_str())))
            })
            .collect()
    }

    fn endpoints(&mut self, k: &'static str) -> Result<Vec<String>, ConfigError> {
        let eps = self.strings(k)?;
        for e in &eps {
            check_endpoint(e).map_err(|p| err(self.key(k), p))?;
        }
        Ok(eps)
    }

    /// An allowlist for the socket bound at `bind` (which must be TCP if the list is not empty).
    fn allowlist(&mut self, k: &'static str, bind: Option<&str>) -> Result<Allowlist, ConfigError> {
        let list = Allowlist::parse(&self.strings(k)?).map_err(|p| err(self.key(k), p))?;
        if !list.is_empty() && !bind.is_some_and(|b| b.starts_with("tcp://")) {
            return Err(err(self.key(k), "needs a tcp:// bind; ipc:// access is controlled by file permissions"));
        }
        Ok(list)
    }

    /// Errors on any key of this section that no reader asked for.
    fn finish(self) -> Result<(), ConfigError> {
        let Some(t) = self.table else { return Ok(()) };
        match t.keys().find(|k| !self.seen.contains(&k.as_str())) {
            Some(k) => {
                Err(err(format!("{}.{k}", self.name), format!("unknown key; known keys: {}", self.seen.join(", "))))
            }
            None => Ok(()),
        }
    }
}

/// Checks a ZeroMQ endpoint: `tcp://host:port`, `ipc://path` or `inproc://name`.
pub fn check_endpoint(s: &str) -> Result<(), String> {
    let bad = || format!("`{s}` is not an endpoint; use tcp://HOST:PORT, ipc://PATH or inproc://NAME");
    if let Some(rest) = s.strip_prefix("tcp://") {
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        if host.is_empty() || !(port == "*" || port.parse::<u16>().is_ok()) {
            return Err(bad());
        }
        return Ok(());
    }
    match s.strip_prefix("ipc://").or_else(|| s.strip_prefix("inproc://")) {
        Some(rest) if !rest.is_empty() => Ok(()),
        _ => Err(bad()),
    }
}

pub(super) const SECTIONS: [&str; 5] = ["server", "engines", "routing", "penalty", "limits"];

pub(super) fn section<'a>(root: &'a toml::Table, name: &'static str) -> Result<Section<'a>, ConfigError> {
    let table = match root.get(name) {
        None => None,
        Some(toml::Value::Table(t)) => Some(t),
        Some(other) => return Err(err(name, format!("expected a [{name}] table, got {}", other.type_str()))),
    };
    Ok(Section { name, table, seen: Vec::new() })
}

pub(super) fn parse_server(mut s: Section<'_>) -> Result<Server, ConfigError> {
    let route_bind = s.endpoint("route_bind", "tcp://127.0.0.1:5570")?;
    let health_bind = s.endpoint("health_bind", "tcp://127.0.0.1:5571")?;
    let stats_bind = match s.string("stats_bind", "tcp://127.0.0.1:5572")? {
        b if b.is_empty() => None,
        b => {
            check_endpoint(&b).map_err(|p| err("server.stats_bind", p))?;
            Some(b)
        }
    };
    let stats_connect = s.endpoints("stats_connect")?;
    let metrics_bind = s.string("metrics_bind", "127.0.0.1:9570")?;
    let metrics_bind = metrics_bind.parse().map_err(|_| {
        err("server.metrics_bind", format!("`{metrics_bind}` is not HOST:PORT (an IP address and a port)"))
    })?;
    let log_format = match s.string("log_format", "text")?.as_str() {
        "text" => LogFormat::Text,
        "json" => LogFormat::Json,
        other => return Err(err("server.log_format", format!("must be \"text\" or \"json\", got \"{other}\""))),
    };
    let route_allow = s.allowlist("route_allow", Some(&route_bind))?;
    let health_allow = s.allowlist("health_allow", Some(&health_bind))?;
    let stats_allow = s.allowlist("stats_allow", stats_bind.as_deref())?;
    s.finish()?;
    Ok(Server {
        route_bind,
        health_bind,
        stats_bind,
        stats_connect,
        metrics_bind,
        log_format,
        route_allow,
        health_allow,
        stats_allow,
    })
}

pub(super) fn parse_engines(mut s: Section<'_>) -> Result<Engines, ConfigError> {
    let dp_size = s.int("dp_size", 8, 1, 65536)? as u32;
    let stale_after = s.ms("stale_after_ms", 1000, 1, 3_600_000)?;
    let down_after = s.ms("down_after_ms", 3000, 1, 3_600_000)?;
    let readmit_updates = s.int("readmit_updates", 2, 1, 1000)? as u32;
    s.finish()?;
    if down_after <= stale_after {
        return Err(err(
            "engines.down_after_ms",
            format!(
                "must be above engines.stale_after_ms ({} ms), got {} ms",
                stale_after.as_millis(),
                down_after.as_millis()
            ),
        ));
    }
    Ok(Engines { dp_size, stale_after, down_after, readmit_updates })
}

pub(super) fn parse_routing(mut s: Section<'_>) -> Result<Routing, ConfigError> {
    let name = s.string("policy", "round_robin")?;
    let policy = PolicyKind::parse(&name).ok_or_else(|| {
        let known: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.as_str()).collect();
        err("routing.policy", format!("unknown policy \"{name}\"; available: {}", known.join(", ")))
    })?;
    let tick = s.ms("tick_ms", 100, 1, 10_000)?;
    let pending_ttl = s.ms("pending_ttl_ms", 2000, 1, 3_600_000)?;
    let imbalance_window = s.ms("imbalance_window_ms", 60_000, 1000, 86_400_000)?;
    let weights = LoadWeights {
        waiting: s.float("weight_waiting", 4.0, 0.0, 1e6)?,
        running: s.float("weight_running", 1.0, 0.0, 1e6)?,
        pending: s.float("weight_pending", 4.0, 0.0, 1e6)?,
    };
    let sessions = Sessions {
        capacity: s.int("session_capacity", 100_000, 1, 100_000_000)? as usize,
        ttl: s.ms("session_ttl_ms", 600_000, 1, 86_400_000)?,
        max_load_ratio: s.float("session_max_load_ratio", 2.0, 1.0, 1e6)?,
    };
    let seed = s.int("seed", 0, 0, i64::MAX as u64)?;
    s.finish()?;
    Ok(Routing { policy, tick, pending_ttl, imbalance_window, weights, sessions, seed })
}

pub(super) fn parse_penalty(mut s: Section<'_>) -> Result<Penalty, ConfigError> {
    let max_penalty = s.float("max_penalty", 10.0, 0.0, 1e6)?;
    let stale = s.float("stale", 1.0, 0.0, 1e6)?;
    let health_failure = s.float("health_failure", 1.0, 0.0, 1e6)?;
    let health_half_life = s.ms("health_half_life_ms", 5000, 1, 3_600_000)?;
    let failure = s.float("failure", 5.0, 0.0, 1e6)?;
    let failure_smoothing = s.float("failure_smoothing", 0.5, 0.01, 1.0)?;
    let ttft = s.float("ttft", 1.0, 0.0, 1e6)?;
    s.finish()?;
    Ok(Penalty { max_penalty, stale, health_failure, health_half_life, failure, failure_smoothing, ttft })
}

pub(super) fn parse_limits(mut s: Section<'_>) -> Result<Limits, ConfigError> {
    let max_message_bytes = s.int("max_message_bytes", 65536, 256, 16 << 20)? as usize;
    let max_batch = s.int("max_batch", 1024, 1, 65536)? as u32;
    s.finish()?;
    Ok(Limits { max_message_bytes, max_batch })
}
