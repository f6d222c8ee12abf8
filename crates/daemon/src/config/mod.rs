//! Configuration: TOML file + command-line flags -> checked [`Config`].
//!
//! Each key is defined once, in [`keys`]; the parser and the flags are built
//! from those specs. Flags are folded into the same TOML table as the file (a
//! flag wins), and one pass turns that table into typed values. Every error
//! names the key as `section.key`, so a bad flag and a bad file line read the
//! same way.

use std::net::SocketAddr;
use std::time::Duration;

pub use allowlist::Allowlist;
pub use policy::PolicyKind;

mod allowlist;
mod binds;
pub mod budget;
mod flags;
pub mod keys;
mod parse;
mod policy;
mod proxy_args;
pub use budget::Budget;
pub use flags::{flags, fold_flags};
use keys::SECTIONS;
pub use parse::{check_endpoint, MAX_PEM_BYTES};
use parse::{
    parse_engines, parse_gateway, parse_kv_events, parse_limits, parse_penalty, parse_proxy, parse_routing,
    parse_server, section,
};
pub use proxy_args::fold_proxy_args;

/// A config problem, rendered as one line naming the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct ConfigError {
    pub key: String,
    pub problem: String,
}

pub(crate) fn err(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError { key: key.into(), problem: problem.into() }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Weights of the request load estimate `waiting*w + running*w + pending*w`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadWeights {
    pub waiting: f64,
    pub running: f64,
    pub pending: f64,
}

/// Session affinity: bounded memory and when a session moves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sessions {
    pub capacity: usize,
    pub ttl: Duration,
    /// A session stays on its rank while that rank's cost is at most this
    /// many times the cheapest routable rank's cost.
    pub max_load_ratio: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Server {
    pub route_bind: String,
    pub health_bind: String,
    /// `None` when the bind is disabled (`""`).
    pub stats_bind: Option<String>,
    pub stats_connect: Vec<String>,
    /// SGLang scheduler load publishers to subscribe to, in rank order (`engines.sglang_load_connect`).
    pub sglang_load_connect: Vec<String>,
    /// vLLM API servers' `/metrics`, in rank order (`engines.vllm_metrics_url`).
    pub vllm_metrics_url: Vec<String>,
    /// How often each is scraped (`engines.vllm_metrics_interval_ms`).
    pub vllm_metrics_interval: Duration,
    pub metrics_bind: SocketAddr,
    pub log_format: LogFormat,
    /// Peer allowlists of the bound sockets (TCP only; empty = no check).
    pub route_allow: Allowlist,
    pub health_allow: Allowlist,
    pub stats_allow: Allowlist,
    /// File mode set on each bound ipc:// socket; `None` keeps the umask's.
    pub ipc_mode: Option<u32>,
    /// The HTTP server's connection cap and timeouts (`server.http_*`).
    pub http: HttpLimits,
    /// How many peers each bound socket holds at once (`server.*_max_peers`).
    pub peers: PeerCaps,
    /// The engines' KV-event publishers (`kv_events.connect`, expanded).
    pub kv_events: Vec<KvEndpoint>,
    /// Their subscription prefix (`kv_events.topic`).
    pub kv_topic: String,
    /// The gateway endpoint picker's gRPC listener (`server.epp_bind`); `None`: off.
    pub epp_bind: Option<SocketAddr>,
    /// How the picker serves on it (`server.epp_tls`, `epp_cert`, `epp_key`).
    pub epp_tls: EppTls,
    /// The proxy's HTTP listener (`server.proxy_bind`); `None`: off.
    pub proxy_bind: Option<SocketAddr>,
    /// The proxy's bounds (`[proxy]`).
    pub proxy: ProxyLimits,
}

impl Server {
    /// The key of the gateway front that is on (which needs
    /// `gateway.endpoints`), the picker's first; `None` when neither is.
    pub fn front(&self) -> Option<String> {
        let on = [(self.epp_bind, &keys::EPP_BIND), (self.proxy_bind, &keys::PROXY_BIND)];
        on.into_iter().find(|(bind, _)| bind.is_some()).map(|(_, k)| k.key.path())
    }
}

crate::names! {
    #[names(parse)]
    /// How the gateway endpoint picker serves its gRPC (`server.epp_tls`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum EppTlsMode {
        /// TLS with a certificate made at start, as the Inference
        /// Extension's own picker serves by default.
        SelfSigned => "self_signed",
        /// TLS with `server.epp_cert` and `server.epp_key`, read again when
        /// either file changes.
        Files => "files",
        /// Plaintext gRPC.
        Off => "off",
    }
}

/// The picker's TLS: the mode, with `files` the two PEM files (checked
/// readable and holding a PEM block of their kind; the gateway parses them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EppTls {
    SelfSigned,
    Files { cert: std::path::PathBuf, key: std::path::PathBuf },
    Off,
}

impl EppTls {
    pub fn mode(&self) -> EppTlsMode {
        match self {
            EppTls::SelfSigned => EppTlsMode::SelfSigned,
            EppTls::Files { .. } => EppTlsMode::Files,
            EppTls::Off => EppTlsMode::Off,
        }
    }
}

/// What the proxy holds at most and waits for (`[proxy]`, fixed for the
/// process's life).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyLimits {
    pub max_connections: usize,
    pub max_buffered_bytes: usize,
    pub body_timeout: Duration,
    pub connect_timeout: Duration,
}

/// How the gateway endpoint picker names ranks to the gateway (`[gateway]`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Gateway {
    /// `host:port` of each rank (the i-th is rank i), or the one endpoint
    /// of every rank when `rank_header` is set.
    pub endpoints: Vec<String>,
    /// The header that carries the rank number; `None`: one endpoint per rank.
    pub rank_header: Option<String>,
    pub max_body_bytes: usize,
    /// Next-best endpoints after the pick (`gateway.fallbacks`), with one
    /// endpoint per rank.
    pub fallbacks: u8,
    /// `gateway.shed_waiting`: a 429 when every eligible rank has at least
    /// this many requests queued; `None`: never.
    pub shed_waiting: Option<u64>,
    /// The model's tokenizer.json (`gateway.tokenizer`); `None`: prompts are
    /// keyed by their text.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Its tokenizer_config.json (`gateway.tokenizer_config`), for chats.
    pub tokenizer_config: Option<std::path::PathBuf>,
}

impl Gateway {
    /// The endpoint the gateway sends `rank`'s requests to; `None` for a
    /// rank without one (not eligible through the gateway). An empty entry
    /// is none: the picker's resolved copy has one for a name that does not
    /// resolve now (a configured one is never empty).
    pub fn endpoint(&self, rank: u32) -> Option<&str> {
        let e = match self.rank_header {
            Some(_) => self.endpoints.first(),
            None => self.endpoints.get(rank as usize),
        };
        e.map(String::as_str).filter(|e| !e.is_empty())
    }

    /// The ranks of `dp_size` that an endpoint serves.
    pub fn ranks_of<'a>(&'a self, endpoint: &'a str, dp_size: u32) -> impl Iterator<Item = u32> + 'a {
        (0..dp_size).filter(move |&r| self.endpoint(r) == Some(endpoint))
    }
}

/// The HTTP server's connections: how many at once (before the file
/// descriptor share is applied) and how long a head or a silence may last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

/// The most connected peers of each bound socket, and of one source address
/// on each; the ZAP handler refuses a new one beyond either (`io::peers`).
/// Changed by a reload, like the allowlists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCaps {
    pub route: u32,
    pub health: u32,
    pub stats: u32,
    pub per_address: u32,
}

impl PeerCaps {
    /// The cap of a ZAP domain (`route`, `health`, `stats`).
    pub fn of(&self, domain: &str) -> Option<u32> {
        match domain {
            "route" => Some(self.route),
            "health" => Some(self.health),
            "stats" => Some(self.stats),
            _ => None,
        }
    }
}

/// One KV-event publisher: its PUB, its replay ROUTER if any, and the rank
/// a `+rank` form wrote it for (used when a batch names none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEndpoint {
    pub connect: String,
    pub replay: Option<String>,
    pub rank: Option<u32>,
}

/// The prefix index's limits (`[kv_events]`).
#[derive(Debug, Clone, PartialEq)]
pub struct KvSettings {
    pub max_batch_bytes: usize,
    pub replay_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Engines {
    pub dp_size: u32,
    /// `engines.max_dp_size`; `None`: the `dp_size` of the start.
    pub max_dp_size: Option<u32>,
    pub stale_after: Duration,
    pub down_after: Duration,
    pub readmit_updates: u32,
    /// `engines.stall_after_ms`; zero: never.
    pub stall_after: Duration,
    /// `engines.probe_failures`; zero: never.
    pub probe_failures: u32,
}

impl Engines {
    /// The largest `dp_size` this configuration lets a running dpcoord
    /// reach: what the sockets' reply queues are sized for at start.
    pub fn dp_ceiling(&self) -> u32 {
        self.max_dp_size.unwrap_or(self.dp_size)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub policy: PolicyKind,
    pub tick: Duration,
    pub pending_ttl: Duration,
    /// From a source of gauges only (no `received`), a placement is taken
    /// as included in the engine's snapshot once the snapshot arrives this
    /// long after the placement; younger ones stay pending on top of it.
    pub pending_transit: Duration,
    pub imbalance_window: Duration,
    pub weights: LoadWeights,
    pub sessions: Sessions,
    /// Seed of power_of_two's random choices.
    pub seed: u64,
    pub cache: CacheAware,
}

crate::names! {
    #[names(parse)]
    /// Where `cache_aware` learns which rank holds a prefix (`routing.prefix_mode`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum PrefixMode {
        /// KV events where a rank publishes them, dpcoord's placements elsewhere.
        Auto => "auto",
        /// KV events only.
        Events => "events",
        /// dpcoord's own placements only.
        Approximate => "approximate",
    }
}

/// The `cache_aware` policy's weights and its prefix sources.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAware {
    /// Weight of the uncached prefill tokens against the token load.
    pub prefill_weight: f64,
    /// The guard: the prefix term is dropped when the token loads spread
    /// by more than this many tokens ...
    pub balance_abs_tokens: u64,
    /// ... and the largest is more than this many times the smallest.
    pub balance_rel: f64,
    pub mode: PrefixMode,
    /// How long an approximate entry lives without a new placement.
    pub ttl: Duration,
}

/// Weights and caps of the result-metric penalty (see `penalty.rs`).
#[derive(Debug, Clone, PartialEq)]
pub struct Penalty {
    pub max_penalty: f64,
    pub stale: f64,
    pub health_failure: f64,
    pub health_half_life: Duration,
    /// Weight of the smoothed failure ratio (0..1).
    pub failure: f64,
    /// Smoothing factor of the failure ratio per tick with completions.
    pub failure_smoothing: f64,
    /// Weight of `max(0, ttft / median ttft - 1)`.
    pub ttft: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub max_message_bytes: usize,
    pub max_batch: u32,
    pub max_prompt_tokens: u32,
    /// `limits.memory_budget_bytes`, split in [`Settings::memory`].
    pub memory_budget: u64,
}

/// Everything routing reads: what a running daemon can take at a tick
/// (`Coordinator::reload`) without rebinding a socket.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub engines: Engines,
    pub routing: Routing,
    pub penalty: Penalty,
    pub limits: Limits,
    pub kv: KvSettings,
    /// The memory budget's parts (`budget.rs`).
    pub memory: Budget,
    /// The gateway endpoint picker's ranks and endpoints.
    pub gateway: Gateway,
}

/// The whole configuration: what binds sockets (`server`, fixed for the
/// process's life) and what routing reads (`settings`).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub server: Server,
    pub settings: Settings,
}

impl Default for Settings {
    fn default() -> Self {
        Config::default().settings
    }
}

impl Default for Config {
    fn default() -> Self {
        match Config::from_table(toml::Table::new()) {
            Ok(c) => c,
            Err(e) => unreachable!("the defaults are valid: {e}"),
        }
    }
}

impl Config {
    /// Parses TOML text (the file's contents); a syntax error reads
    /// `config:LINE:COL: what`.
    pub fn parse_toml(text: &str) -> Result<toml::Table, ConfigError> {
        parse_named(text, "config")
    }

    /// Checks a whole table (file plus flags) and builds the config.
    pub fn from_table(root: toml::Table) -> Result<Config, ConfigError> {
        if let Some(k) = root.keys().find(|k| !SECTIONS.contains(&k.as_str())) {
            return Err(err(k.as_str(), format!("unknown section; known sections: {}", SECTIONS.join(", "))));
        }
        let mut server = parse_server(section(&root, "server")?)?;
        let (engines, sources) = parse_engines(section(&root, "engines")?)?;
        server.sglang_load_connect = sources.sglang_load_connect;
        server.vllm_metrics_url = sources.vllm_metrics_url;
        server.vllm_metrics_interval = sources.vllm_metrics_interval;
        let (kv_events, kv_topic, kv) = parse_kv_events(section(&root, "kv_events")?, engines.dp_size)?;
        server.kv_events = kv_events;
        server.kv_topic = kv_topic;
        binds::check_distinct(&server)?;
        if server.stats_bind.is_some() && server.peers.stats < engines.dp_size {
            return Err(err(
                keys::STATS_MAX_PEERS.key.path(),
                format!(
                    "{} is below engines.dp_size = {}: every rank's publisher connects to the stats bind",
                    server.peers.stats, engines.dp_size
                ),
            ));
        }
        server.proxy = parse_proxy(section(&root, "proxy")?)?;
        let limits = parse_limits(section(&root, "limits")?)?;
        keys::check_query_work(engines.dp_size, limits.max_batch).map_err(|p| err(keys::MAX_BATCH.key.path(), p))?;
        let engines_dp = engines.dp_size;
        let mut settings = Settings {
            engines,
            routing: parse_routing(section(&root, "routing")?)?,
            penalty: parse_penalty(section(&root, "penalty")?)?,
            limits,
            kv,
            memory: Budget::default(),
            gateway: parse_gateway(section(&root, "gateway")?, engines_dp, server.front())?,
        };
        if server.proxy_bind.is_some() && server.proxy.max_buffered_bytes < settings.gateway.max_body_bytes {
            return Err(err(
                keys::PROXY_MAX_BUFFERED_BYTES.key.path(),
                format!(
                    "{} is below gateway.max_body_bytes = {}: the largest body could never be held",
                    server.proxy.max_buffered_bytes, settings.gateway.max_body_bytes
                ),
            ));
        }
        settings.memory = Budget::of(settings.limits.memory_budget, &server, &settings)
            .map_err(|p| err(keys::MEMORY_BUDGET_BYTES.key.path(), p))?;
        Ok(Config { server, settings })
    }
}

/// The largest configuration file read (the shipped example is under 8 KiB).
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Reads and parses a configuration file: a regular file (a FIFO or a device
/// would block or never end) of at most [`MAX_FILE_BYTES`].
///
/// The path is opened without blocking (`O_NONBLOCK`: opening a FIFO to
/// read returns at once instead of waiting for a writer) and the opened
/// descriptor is checked, not the path: a check of the path and then an
/// `open` would let the path be swapped for a FIFO in between.
pub fn read_file(path: &std::path::Path) -> Result<toml::Table, ConfigError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let cannot = |e: std::io::Error| err("config", format!("cannot read {}: {e}", path.display()));
    // std opens with O_CLOEXEC already.
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(cannot)?;
    if !file.metadata().map_err(cannot)?.is_file() {
        return Err(err("config", format!("{} is not a regular file", path.display())));
    }
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1).read_to_string(&mut text).map_err(cannot)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(err("config", format!("{} is larger than {MAX_FILE_BYTES} bytes", path.display())));
    }
    parse_named(&text, &path.display().to_string())
}

/// Parses TOML text read from `name`; a syntax error is one line,
/// `NAME:LINE:COL: what` (as compilers write it), its key the position.
fn parse_named(text: &str, name: &str) -> Result<toml::Table, ConfigError> {
    text.parse::<toml::Table>().map_err(|e| {
        // toml's message is a few lines ("invalid string", "expected ..."): one clause each.
        let what: Vec<&str> = e.message().lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        let what = what.join("; ");
        match e.span() {
            Some(span) => {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                err(format!("{name}:{line}:{col}"), what)
            }
            None => err(name, what),
        }
    })
}

/// Sets `section.key = value` in a table, creating the section as needed
/// (how a flag overrides the file).
pub fn set(root: &mut toml::Table, section: &str, key: &str, value: toml::Value) {
    let entry = root.entry(section.to_owned()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if !entry.is_table() {
        *entry = toml::Value::Table(toml::Table::new());
    }
    if let toml::Value::Table(t) = entry {
        t.insert(key.to_owned(), value);
    }
}

#[cfg(test)]
mod tests;
