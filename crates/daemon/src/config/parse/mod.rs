//! Reading one TOML section into typed values, each error naming `section.key`.

use std::time::Duration;

use super::keys::{self, FloatKey, IntKey, Key, ListKey, StrKey};
use super::Allowlist;
use super::{
    err, CacheAware, ConfigError, Engines, Gateway, HttpLimits, Limits, LoadWeights, LogFormat, PeerCaps, Penalty,
    PolicyKind, PrefixMode, ProxyLimits, Routing, Server, Sessions,
};

mod kv;
mod tls;
pub(super) use kv::parse_kv_events;
pub use tls::MAX_PEM_BYTES;

/// Reads one section's keys, remembering which were used.
pub(super) struct Section<'a> {
    name: &'static str,
    table: Option<&'a toml::Table>,
    seen: Vec<&'static str>,
}

impl<'a> Section<'a> {
    fn get(&mut self, k: &Key) -> Option<&'a toml::Value> {
        debug_assert_eq!(k.section, self.name, "{} read in the wrong section", k.path());
        self.seen.push(k.name);
        self.table.and_then(|t| t.get(k.name))
    }

    fn int(&mut self, k: &IntKey) -> Result<u64, ConfigError> {
        let Some(v) = self.get(&k.key) else { return Ok(k.default) };
        let i =
            v.as_integer().ok_or_else(|| err(k.key.path(), format!("expected an integer, got {}", v.type_str())))?;
        u64::try_from(i)
            .ok()
            .filter(|i| (k.min..=k.max).contains(i))
            .ok_or_else(|| err(k.key.path(), format!("must be between {} and {}, got {i}", k.min, k.max)))
    }

    /// A TCP listener's `HOST:PORT` (`:PORT`: every IPv4 interface, as
    /// Go's listeners and the Inference Extension's picker write it), or
    /// `None` for "" (off).
    fn listener(&mut self, k: &StrKey) -> Result<Option<std::net::SocketAddr>, ConfigError> {
        match self.string(k)? {
            b if b.is_empty() => Ok(None),
            b => {
                let every = b.strip_prefix(':').map(|port| format!("0.0.0.0:{port}"));
                every.as_deref().unwrap_or(&b).parse().map(Some).map_err(|_| {
                    let why = "an IP address and a port, or :PORT for every interface";
                    err(k.key.path(), format!("`{b}` is not HOST:PORT ({why}), or \"\" for off"))
                })
            }
        }
    }

    fn ms(&mut self, k: &IntKey) -> Result<Duration, ConfigError> {
        self.int(k).map(Duration::from_millis)
    }

    /// Whether the section (or a flag folded into it) sets `k`: an error
    /// about a value the user never wrote says it is the default.
    fn sets(&self, k: &Key) -> bool {
        self.table.is_some_and(|t| t.contains_key(k.name))
    }

    fn float(&mut self, k: &FloatKey) -> Result<f64, ConfigError> {
        let Some(v) = self.get(&k.key) else { return Ok(k.default) };
        let x = match v {
            toml::Value::Float(x) => *x,
            toml::Value::Integer(i) => *i as f64,
            other => return Err(err(k.key.path(), format!("expected a number, got {}", other.type_str()))),
        };
        if x.is_finite() && (k.min..=k.max).contains(&x) {
            Ok(x)
        } else {
            Err(err(k.key.path(), format!("must be between {} and {}, got {x}", k.min, k.max)))
        }
    }

    fn string(&mut self, k: &StrKey) -> Result<String, ConfigError> {
        match self.get(&k.key) {
            None => Ok(k.default.to_owned()),
            Some(toml::Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(err(k.key.path(), format!("expected a string, got {}", other.type_str()))),
        }
    }

    fn endpoint(&mut self, k: &StrKey) -> Result<String, ConfigError> {
        let s = self.string(k)?;
        check_endpoint(&s).map_err(|p| err(k.key.path(), p))?;
        Ok(s)
    }

    fn strings(&mut self, k: &ListKey) -> Result<Vec<String>, ConfigError> {
        let Some(v) = self.get(&k.key) else { return Ok(Vec::new()) };
        let arr = v
            .as_array()
            .ok_or_else(|| err(k.key.path(), format!("expected an array of strings, got {}", v.type_str())))?;
        arr.iter()
            .map(|e| {
                e.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| err(k.key.path(), format!("expected strings, got {}", e.type_str())))
            })
            .collect()
    }

    fn endpoints(&mut self, k: &ListKey) -> Result<Vec<String>, ConfigError> {
        let eps = self.strings(k)?;
        for e in &eps {
            check_endpoint(e).map_err(|p| err(k.key.path(), p))?;
        }
        Ok(eps)
    }

    /// An allowlist for the socket bound at `bind` (which must be TCP if the list is not empty).
    fn allowlist(&mut self, k: &ListKey, bind: Option<&str>) -> Result<Allowlist, ConfigError> {
        let list = Allowlist::parse(&self.strings(k)?).map_err(|p| err(k.key.path(), p))?;
        if !list.is_empty() && !bind.is_some_and(|b| b.starts_with("tcp://")) {
            return Err(err(k.key.path(), "needs a tcp:// bind; ipc:// access is controlled by file permissions"));
        }
        Ok(list)
    }

    /// Errors on any key of this section that no reader asked for.
    fn finish(self) -> Result<(), ConfigError> {
        let Some(t) = self.table else { return Ok(()) };
        match t.keys().find(|k| !self.seen.contains(&k.as_str())) {
            Some(k) => {
                let path = format!("{}.{k}", self.name);
                match keys::MOVED.iter().find(|(old, _)| *old == path) {
                    Some((_, why)) => Err(err(path, *why)),
                    None => Err(err(path, format!("unknown key; known keys: {}", self.seen.join(", ")))),
                }
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

pub(super) fn section<'a>(root: &'a toml::Table, name: &'static str) -> Result<Section<'a>, ConfigError> {
    let table = match root.get(name) {
        None => None,
        Some(toml::Value::Table(t)) => Some(t),
        Some(other) => return Err(err(name, format!("expected a [{name}] table, got {}", other.type_str()))),
    };
    Ok(Section { name, table, seen: Vec::new() })
}

pub(super) fn parse_server(mut s: Section<'_>) -> Result<Server, ConfigError> {
    let route_bind = s.endpoint(&keys::ROUTE_BIND)?;
    let health_bind = s.endpoint(&keys::HEALTH_BIND)?;
    let stats_bind = match s.string(&keys::STATS_BIND)? {
        b if b.is_empty() => None,
        b => {
            check_endpoint(&b).map_err(|p| err(keys::STATS_BIND.key.path(), p))?;
            Some(b)
        }
    };
    let stats_connect = s.endpoints(&keys::STATS_CONNECT)?;
    let metrics_bind = s.string(&keys::METRICS_BIND)?;
    let metrics_bind = metrics_bind.parse().map_err(|_| {
        err(keys::METRICS_BIND.key.path(), format!("`{metrics_bind}` is not HOST:PORT (an IP address and a port)"))
    })?;
    let log_format = match s.string(&keys::LOG_FORMAT)?.as_str() {
        "text" => LogFormat::Text,
        "json" => LogFormat::Json,
        other => {
            return Err(err(keys::LOG_FORMAT.key.path(), format!("must be \"text\" or \"json\", got \"{other}\"")))
        }
    };
    let route_allow = s.allowlist(&keys::ROUTE_ALLOW, Some(&route_bind))?;
    let health_allow = s.allowlist(&keys::HEALTH_ALLOW, Some(&health_bind))?;
    let stats_allow = s.allowlist(&keys::STATS_ALLOW, stats_bind.as_deref())?;
    let ipc_mode = parse_mode(&s.string(&keys::IPC_MODE)?).map_err(|p| err(keys::IPC_MODE.key.path(), p))?;
    let http = HttpLimits {
        max_connections: s.int(&keys::HTTP_MAX_CONNECTIONS)? as usize,
        header_timeout: s.ms(&keys::HTTP_HEADER_TIMEOUT_MS)?,
        idle_timeout: s.ms(&keys::HTTP_IDLE_TIMEOUT_MS)?,
    };
    let peers = PeerCaps {
        route: s.int(&keys::ROUTE_MAX_PEERS)? as u32,
        health: s.int(&keys::HEALTH_MAX_PEERS)? as u32,
        stats: s.int(&keys::STATS_MAX_PEERS)? as u32,
        per_address: s.int(&keys::MAX_PEERS_PER_ADDRESS)? as u32,
    };
    let epp_bind = s.listener(&keys::EPP_BIND)?;
    let epp_tls = tls::parse_epp_tls(&mut s)?;
    let proxy_bind = s.listener(&keys::PROXY_BIND)?;
    s.finish()?;
    Ok(Server {
        epp_bind,
        epp_tls,
        proxy_bind,
        // `[proxy]`, read after this section.
        proxy: ProxyLimits::default(),
        route_bind,
        health_bind,
        stats_bind,
        stats_connect,
        sglang_load_connect: Vec::new(),
        vllm_metrics_url: Vec::new(),
        vllm_metrics_interval: Duration::ZERO,
        metrics_bind,
        log_format,
        route_allow,
        health_allow,
        stats_allow,
        ipc_mode,
        http,
        peers,
        kv_events: Vec::new(),
        kv_topic: String::new(),
    })
}

/// A file mode as octal digits (`"0660"`, `"660"`), at most `0777`; `""` is none.
fn parse_mode(s: &str) -> Result<Option<u32>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    let bad = || format!("`{s}` is not a file mode; use 3 or 4 octal digits up to \"0777\", like \"0660\"");
    if !(3..=4).contains(&s.len()) || !s.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return Err(bad());
    }
    u32::from_str_radix(s, 8).ok().filter(|&m| m <= 0o777).map(Some).ok_or_else(bad)
}

/// What the engines section adds to the server's sockets (a restart changes them).
pub(super) struct EngineSources {
    pub sglang_load_connect: Vec<String>,
    pub vllm_metrics_url: Vec<String>,
    pub vllm_metrics_interval: Duration,
}

/// The engines section: the settings, and the engine sources to reach.
pub(super) fn parse_engines(mut s: Section<'_>) -> Result<(Engines, EngineSources), ConfigError> {
    let dp_size = s.int(&keys::DP_SIZE)? as u32;
    let max_dp_size = Some(s.int(&keys::MAX_DP_SIZE)? as u32).filter(|&m| m > 0);
    if let Some(max) = max_dp_size.filter(|&m| m < dp_size) {
        return Err(err(
            keys::MAX_DP_SIZE.key.path(),
            format!("must be 0 or at least {} ({dp_size}), got {max}", keys::DP_SIZE.key.path()),
        ));
    }
    let sglang_load_connect = s.endpoints(&keys::SGLANG_LOAD_CONNECT)?;
    let vllm_metrics_url = s.strings(&keys::VLLM_METRICS_URL)?;
    for url in &vllm_metrics_url {
        check_url(url).map_err(|p| err(keys::VLLM_METRICS_URL.key.path(), p))?;
    }
    let vllm_metrics_interval = s.ms(&keys::VLLM_METRICS_INTERVAL_MS)?;
    let stale_after = s.ms(&keys::STALE_AFTER_MS)?;
    let down_after = s.ms(&keys::DOWN_AFTER_MS)?;
    let readmit_updates = s.int(&keys::READMIT_UPDATES)? as u32;
    let stall_after = s.ms(&keys::STALL_AFTER_MS)?;
    let probe_failures = s.int(&keys::PROBE_FAILURES)? as u32;
    let stale_mark = if s.sets(&keys::STALE_AFTER_MS.key) { "" } else { ", default" };
    let down_mark = if s.sets(&keys::DOWN_AFTER_MS.key) { "" } else { " (default)" };
    s.finish()?;
    if down_after <= stale_after {
        return Err(err(
            keys::DOWN_AFTER_MS.key.path(),
            format!(
                "must be above {} ({} ms{stale_mark}), got {} ms{down_mark}",
                keys::STALE_AFTER_MS.key.path(),
                stale_after.as_millis(),
                down_after.as_millis()
            ),
        ));
    }
    let sources = EngineSources { sglang_load_connect, vllm_metrics_url, vllm_metrics_interval };
    Ok((
        Engines { dp_size, max_dp_size, stale_after, down_after, readmit_updates, stall_after, probe_failures },
        sources,
    ))
}

/// Checks a URL to scrape: `http://HOST:PORT/PATH` (plain HTTP, an explicit port, a path).
fn check_url(s: &str) -> Result<(), String> {
    let bad = || format!("`{s}` is not a URL to scrape; use http://HOST:PORT/PATH, like http://10.0.0.5:8000/metrics");
    let uri: ureq::http::Uri = s.parse().map_err(|_| bad())?;
    let host = uri.host().filter(|h| !h.is_empty());
    let path = uri.path_and_query().map(|p| p.as_str()).filter(|p| p.starts_with('/') && p.len() > 1);
    if uri.scheme_str() != Some("http") || host.is_none() || uri.port_u16().is_none() || path.is_none() {
        return Err(bad());
    }
    if s.contains('@') {
        return Err(format!("`{s}`: credentials in the URL are not supported"));
    }
    Ok(())
}

pub(super) fn parse_routing(mut s: Section<'_>) -> Result<Routing, ConfigError> {
    let name = s.string(&keys::POLICY)?;
    let policy = PolicyKind::parse(&name).ok_or_else(|| {
        let known: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.as_str()).collect();
        err(keys::POLICY.key.path(), format!("unknown policy \"{name}\"; available: {}", known.join(", ")))
    })?;
    let tick = s.ms(&keys::TICK_MS)?;
    let pending_ttl = s.ms(&keys::PENDING_TTL_MS)?;
    let pending_transit = s.ms(&keys::PENDING_TRANSIT_MS)?;
    let imbalance_window = s.ms(&keys::IMBALANCE_WINDOW_MS)?;
    let weights = LoadWeights {
        waiting: s.float(&keys::WEIGHT_WAITING)?,
        running: s.float(&keys::WEIGHT_RUNNING)?,
        pending: s.float(&keys::WEIGHT_PENDING)?,
    };
    let sessions = Sessions {
        capacity: s.int(&keys::SESSION_CAPACITY)? as usize,
        ttl: s.ms(&keys::SESSION_TTL_MS)?,
        max_load_ratio: s.float(&keys::SESSION_MAX_LOAD_RATIO)?,
    };
    let seed = s.int(&keys::SEED)?;
    let mode_name = s.string(&keys::PREFIX_MODE)?;
    let mode = PrefixMode::parse(&mode_name).ok_or_else(|| {
        let available = PrefixMode::ALL.map(PrefixMode::as_str).join(", ");
        err(keys::PREFIX_MODE.key.path(), format!("unknown mode \"{mode_name}\"; available: {available}"))
    })?;
    let cache = CacheAware {
        prefill_weight: s.float(&keys::CACHE_PREFILL_WEIGHT)?,
        balance_abs_tokens: s.int(&keys::CACHE_BALANCE_ABS_TOKENS)?,
        balance_rel: s.float(&keys::CACHE_BALANCE_REL)?,
        mode,
        ttl: s.ms(&keys::PREFIX_TTL_MS)?,
    };
    s.finish()?;
    Ok(Routing { policy, tick, pending_ttl, pending_transit, imbalance_window, weights, sessions, seed, cache })
}

pub(super) fn parse_penalty(mut s: Section<'_>) -> Result<Penalty, ConfigError> {
    let max_penalty = s.float(&keys::MAX_PENALTY)?;
    let stale = s.float(&keys::STALE)?;
    let health_failure = s.float(&keys::HEALTH_FAILURE)?;
    let health_half_life = s.ms(&keys::HEALTH_HALF_LIFE_MS)?;
    let failure = s.float(&keys::FAILURE)?;
    let failure_smoothing = s.float(&keys::FAILURE_SMOOTHING)?;
    let ttft = s.float(&keys::TTFT)?;
    s.finish()?;
    Ok(Penalty { max_penalty, stale, health_failure, health_half_life, failure, failure_smoothing, ttft })
}

/// `[proxy]`: the proxy's bounds.
pub(super) fn parse_proxy(mut s: Section<'_>) -> Result<ProxyLimits, ConfigError> {
    let p = ProxyLimits {
        max_connections: s.int(&keys::PROXY_MAX_CONNECTIONS)? as usize,
        max_buffered_bytes: s.int(&keys::PROXY_MAX_BUFFERED_BYTES)? as usize,
        body_timeout: s.ms(&keys::PROXY_BODY_TIMEOUT_MS)?,
        connect_timeout: s.ms(&keys::PROXY_CONNECT_TIMEOUT_MS)?,
    };
    s.finish()?;
    Ok(p)
}

/// `[gateway]`: one `host:port` per rank, or one for all with
/// `rank_header`; `front` names the key of a front that is on (the picker,
/// the proxy), which then needs endpoints.
pub(super) fn parse_gateway(mut s: Section<'_>, dp_size: u32, front: Option<String>) -> Result<Gateway, ConfigError> {
    let path = keys::GATEWAY_ENDPOINTS.key.path();
    let endpoints = s.strings(&keys::GATEWAY_ENDPOINTS)?;
    for e in &endpoints {
        check_host_port(e).map_err(|p| err(&path, p))?;
    }
    let rank_header = Some(s.string(&keys::GATEWAY_RANK_HEADER)?).filter(|h| !h.is_empty());
    if let Some(h) = &rank_header {
        if !h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(err(keys::GATEWAY_RANK_HEADER.key.path(), format!("`{h}` is not a header name")));
        }
    }
    let max_body_bytes = s.int(&keys::GATEWAY_MAX_BODY_BYTES)? as usize;
    let fallbacks = s.int(&keys::GATEWAY_FALLBACKS)? as u8;
    if fallbacks > 0 && rank_header.is_some() {
        let why = "with gateway.rank_header one endpoint serves every rank: there is no other endpoint to fall \
                   back to (the engine's server balances its own ranks); set 0";
        return Err(err(keys::GATEWAY_FALLBACKS.key.path(), why));
    }
    let shed_waiting = s.int(&keys::GATEWAY_SHED_WAITING)?;
    let file = |s: &mut Section<'_>, k: &StrKey| -> Result<Option<std::path::PathBuf>, ConfigError> {
        let v = s.string(k)?;
        if v.is_empty() {
            return Ok(None);
        }
        match std::fs::metadata(&v) {
            Ok(m) if m.is_file() => Ok(Some(v.into())),
            Ok(_) => Err(err(k.key.path(), format!("`{v}` is not a file"))),
            Err(e) => Err(err(k.key.path(), format!("cannot read `{v}`: {e}"))),
        }
    };
    let tokenizer = file(&mut s, &keys::GATEWAY_TOKENIZER)?;
    let tokenizer_config = file(&mut s, &keys::GATEWAY_TOKENIZER_CONFIG)?;
    if tokenizer_config.is_some() && tokenizer.is_none() {
        return Err(err(
            keys::GATEWAY_TOKENIZER_CONFIG.key.path(),
            "needs gateway.tokenizer (the tokenizer.json it goes with)",
        ));
    }
    s.finish()?;
    match (rank_header.is_some(), endpoints.len()) {
        (_, 0) if front.is_some() => {
            let on = front.unwrap_or_default();
            return Err(err(&path, format!("{on} is set: name each rank's host:port here")));
        }
        (true, n) if n > 1 => {
            return Err(err(&path, format!("{n} endpoints with gateway.rank_header: one endpoint serves every rank")))
        }
        (false, n) if n > 0 && n != dp_size as usize => {
            return Err(err(
                &path,
                format!("{n} endpoints for engines.dp_size = {dp_size}: one per rank, in rank order"),
            ))
        }
        _ => {}
    }
    let shed_waiting = (shed_waiting > 0).then_some(shed_waiting);
    Ok(Gateway { endpoints, rank_header, max_body_bytes, fallbacks, shed_waiting, tokenizer, tokenizer_config })
}

/// `host:port` as a gateway names an endpoint: a port, and a host that is
/// an IP address (IPv6 in brackets) or a DNS name; anything else (an
/// unrendered placeholder such as `@POD_IP@`) is refused, naming the host.
fn check_host_port(e: &str) -> Result<(), String> {
    let Some((host, _)) = e.rsplit_once(':').filter(|(_, p)| p.parse::<u16>().is_ok_and(|p| p > 0)) else {
        return Err(format!("`{e}` is not HOST:PORT"));
    };
    let ip = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let name = |h: &str| {
        !h.is_empty()
            && h.len() <= 253
            && h.split('.').all(|l| {
                !l.is_empty()
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            })
    };
    if ip.parse::<std::net::IpAddr>().is_ok() || name(host) {
        return Ok(());
    }
    let hint = if host.contains('@') { " (a placeholder left unrendered?)" } else { "" };
    Err(format!("`{e}`: the host `{host}` is neither an IP address nor a DNS name{hint}"))
}

pub(super) fn parse_limits(mut s: Section<'_>) -> Result<Limits, ConfigError> {
    let max_message_bytes = s.int(&keys::MAX_MESSAGE_BYTES)? as usize;
    let max_batch = s.int(&keys::MAX_BATCH)? as u32;
    let max_prompt_tokens = s.int(&keys::MAX_PROMPT_TOKENS)? as u32;
    let memory_budget = s.int(&keys::MEMORY_BUDGET_BYTES)?;
    s.finish()?;
    Ok(Limits { max_message_bytes, max_batch, max_prompt_tokens, memory_budget })
}
