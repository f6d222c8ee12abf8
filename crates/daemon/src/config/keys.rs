//! Every config key, defined once: its section, name, kind, default, bounds
//! and, for some, a command-line flag. The parser (`parse/`) reads keys
//! through these specs, the flags (`flags.rs`) are built from them, and the
//! simulator takes its defaults from them.

/// Where a key lives, and its command-line flag if it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub section: &'static str,
    pub name: &'static str,
    pub flag: Option<Flag>,
}

/// A command-line flag `--name-with-dashes VALUE` that sets its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag {
    pub value_name: &'static str,
    /// Whether the flag carries its section's name (`--kv-events-connect`
    /// for `kv_events.connect`), for sections whose key names are generic.
    pub in_section: bool,
    /// What the flag sets; `--help` appends the key's `section.name`
    /// (and shows only that when this is empty).
    pub help: &'static str,
}

impl Key {
    const fn new(section: &'static str, name: &'static str) -> Key {
        Key { section, name, flag: None }
    }

    const fn flagged(section: &'static str, name: &'static str, value_name: &'static str, help: &'static str) -> Key {
        Key { section, name, flag: Some(Flag { value_name, in_section: false, help }) }
    }

    /// A key whose flag is `--section-name`.
    const fn flagged_in_section(
        section: &'static str,
        name: &'static str,
        value_name: &'static str,
        help: &'static str,
    ) -> Key {
        Key { section, name, flag: Some(Flag { value_name, in_section: true, help }) }
    }

    /// The flag's name without `--`, if the key has a flag.
    pub fn flag_long(&self) -> Option<String> {
        let flag = self.flag?;
        let name = if flag.in_section { format!("{}_{}", self.section, self.name) } else { self.name.to_owned() };
        Some(name.replace('_', "-"))
    }

    /// `section.name`, as errors name the key.
    pub fn path(&self) -> String {
        format!("{}.{}", self.section, self.name)
    }

    /// Sets this key in a table, overriding the file's value or the default.
    pub fn set(&self, root: &mut toml::Table, value: toml::Value) {
        super::set(root, self.section, self.name, value);
    }
}

/// An integer in `min..=max` (keys ending in `_ms` are milliseconds).
/// Every bound is at most `i64::MAX`, the largest TOML integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntKey {
    pub key: Key,
    pub default: u64,
    pub min: u64,
    pub max: u64,
}

/// A finite number in `min..=max` (a TOML integer is taken as well).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FloatKey {
    pub key: Key,
    pub default: f64,
    pub min: f64,
    pub max: f64,
}

/// A string; what it must look like is checked where it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StrKey {
    pub key: Key,
    pub default: &'static str,
}

/// An array of strings, empty by default. Its flag is repeatable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListKey {
    pub key: Key,
}

/// Any key, with its kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AnyKey {
    Int(&'static IntKey),
    Float(&'static FloatKey),
    Str(&'static StrKey),
    List(&'static ListKey),
}

impl AnyKey {
    pub fn key(self) -> &'static Key {
        match self {
            AnyKey::Int(k) => &k.key,
            AnyKey::Float(k) => &k.key,
            AnyKey::Str(k) => &k.key,
            AnyKey::List(k) => &k.key,
        }
    }
}

const SERVER: &str = "server";
const ENGINES: &str = "engines";
const ROUTING: &str = "routing";
const PENALTY: &str = "penalty";
const LIMITS: &str = "limits";
const KV_EVENTS: &str = "kv_events";
const GATEWAY: &str = "gateway";
const PROXY: &str = "proxy";

/// The sections of a config file, in file order.
pub const SECTIONS: [&str; 8] = [SERVER, ENGINES, ROUTING, PENALTY, LIMITS, KV_EVENTS, GATEWAY, PROXY];

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 86_400_000;
/// Upper bound of weights and ratios.
const BIG: f64 = 1e6;

pub const ROUTE_BIND: StrKey = StrKey {
    key: Key::flagged(SERVER, "route_bind", "EP", "ROUTER endpoint for routing queries"),
    default: "tcp://127.0.0.1:5570",
};
pub const HEALTH_BIND: StrKey = StrKey {
    key: Key::flagged(SERVER, "health_bind", "EP", "ROUTER endpoint for health queries"),
    default: "tcp://127.0.0.1:5571",
};
pub const STATS_BIND: StrKey = StrKey {
    key: Key::flagged(SERVER, "stats_bind", "EP", "SUB bind endpoint for engine stats, \"\" to disable"),
    default: "tcp://127.0.0.1:5572",
};
pub const STATS_CONNECT: ListKey =
    ListKey { key: Key::flagged(SERVER, "stats_connect", "EP", "Engine PUB endpoint to connect to; repeatable") };
pub const SGLANG_LOAD_CONNECT: ListKey = ListKey {
    key: Key::flagged(
        ENGINES,
        "sglang_load_connect",
        "EP",
        "SGLang scheduler load PUB (--load-publish-endpoint) to subscribe to (the i-th is rank i); repeatable",
    ),
};
pub const VLLM_METRICS_URL: ListKey = ListKey {
    key: Key::flagged(
        ENGINES,
        "vllm_metrics_url",
        "URL",
        "vLLM API server /metrics to scrape (external LB: the i-th is rank i); repeatable",
    ),
};
pub const VLLM_METRICS_INTERVAL_MS: IntKey =
    IntKey { key: Key::new(ENGINES, "vllm_metrics_interval_ms"), default: 250, min: 50, max: 10_000 };
pub const METRICS_BIND: StrKey = StrKey {
    key: Key::flagged(SERVER, "metrics_bind", "HOST:PORT", "HTTP listener for metrics and probes"),
    default: "127.0.0.1:9570",
};
pub const LOG_FORMAT: StrKey =
    StrKey { key: Key::flagged(SERVER, "log_format", "FORMAT", "text or json"), default: "text" };
pub const ROUTE_ALLOW: ListKey = ListKey { key: Key::new(SERVER, "route_allow") };
pub const HEALTH_ALLOW: ListKey = ListKey { key: Key::new(SERVER, "health_allow") };
pub const STATS_ALLOW: ListKey = ListKey { key: Key::new(SERVER, "stats_allow") };
/// The gateway endpoint picker's gRPC listener (Envoy ext_proc); "" = off.
pub const EPP_BIND: StrKey = StrKey { key: Key::new(SERVER, "epp_bind"), default: "" };
/// How the picker serves gRPC: `self_signed` (TLS with a certificate made at
/// start, as the Inference Extension's own picker), `files` (TLS with
/// `epp_cert` and `epp_key`, read again when they change) or `off` (plaintext).
pub const EPP_TLS: StrKey = StrKey { key: Key::new(SERVER, "epp_tls"), default: "self_signed" };
/// The picker's certificate chain, PEM (with `epp_tls = "files"` only).
pub const EPP_CERT: StrKey = StrKey { key: Key::new(SERVER, "epp_cert"), default: "" };
/// Its private key, PEM (with `epp_tls = "files"` only).
pub const EPP_KEY: StrKey = StrKey { key: Key::new(SERVER, "epp_key"), default: "" };
/// The proxy's HTTP listener (OpenAI-compatible, one server per rank); "" = off.
pub const PROXY_BIND: StrKey = StrKey { key: Key::new(SERVER, "proxy_bind"), default: "" };
/// Octal file mode of the ipc:// sockets dpcoord binds; "" keeps the umask's.
pub const IPC_MODE: StrKey = StrKey { key: Key::new(SERVER, "ipc_mode"), default: "" };
/// Concurrent HTTP connections; at most a quarter of the file descriptors
/// (the soft `nofile` limit) is taken whatever this says.
pub const HTTP_MAX_CONNECTIONS: IntKey =
    IntKey { key: Key::new(SERVER, "http_max_connections"), default: 256, min: 1, max: 1 << 20 };
/// How long an HTTP request's head may take from its first byte.
pub const HTTP_HEADER_TIMEOUT_MS: IntKey =
    IntKey { key: Key::new(SERVER, "http_header_timeout_ms"), default: 5000, min: 10, max: 600_000 };
/// How long an HTTP connection may go without a byte either way between requests.
pub const HTTP_IDLE_TIMEOUT_MS: IntKey =
    IntKey { key: Key::new(SERVER, "http_idle_timeout_ms"), default: 30_000, min: 10, max: HOUR_MS };

/// Connected peers each bound socket holds at once (ZAP refuses the rest at
/// their handshake). At about 38 KB a peer (40 KiB in the memory budget),
/// the defaults together are 2,304 peers, 90 MiB of the budget
/// (docs/failure-behaviour.md, "Memory budget").
pub const ROUTE_MAX_PEERS: IntKey =
    IntKey { key: Key::new(SERVER, "route_max_peers"), default: 1024, min: 1, max: 1 << 20 };
pub const HEALTH_MAX_PEERS: IntKey =
    IntKey { key: Key::new(SERVER, "health_max_peers"), default: 256, min: 1, max: 1 << 20 };
/// At least `engines.dp_size` when the stats bind is on: one publisher per rank.
pub const STATS_MAX_PEERS: IntKey =
    IntKey { key: Key::new(SERVER, "stats_max_peers"), default: 1024, min: 1, max: 1 << 20 };
/// Connected TCP peers one source address (an IPv4 address, an IPv6 /64)
/// holds on each bound socket: one hostile host fills at most this much of
/// a socket, so the others can still connect (ipc peers are not counted).
pub const MAX_PEERS_PER_ADDRESS: IntKey =
    IntKey { key: Key::new(SERVER, "max_peers_per_address"), default: 128, min: 1, max: 1 << 20 };

/// At most 1,024 ranks: memory, `/metrics` and each query's work grow with
/// the rank count (at 4,096 ranks RSS passed 128 MiB once `/metrics` was
/// scraped; docs/failure-behaviour.md, "Configuration bounds").
pub const DP_SIZE: IntKey =
    IntKey { key: Key::flagged(ENGINES, "dp_size", "N", "Number of DP ranks"), default: 8, min: 1, max: 1024 };
/// The largest `dp_size` a `resize` or a reload may set (0: the `dp_size`
/// of the start). The route and health sockets' reply queues are sized at
/// start for a `state` reply of this many ranks (libzmq's marks cannot be
/// lowered on live connections safely), so a larger size needs a restart.
pub const MAX_DP_SIZE: IntKey = IntKey {
    key: Key::flagged(ENGINES, "max_dp_size", "N", "Most ranks a resize may set without a restart (0: --dp-size)"),
    default: 0,
    min: 0,
    max: DP_SIZE.max,
};
pub const STALE_AFTER_MS: IntKey =
    IntKey { key: Key::flagged(ENGINES, "stale_after_ms", "MS", ""), default: 1000, min: 1, max: HOUR_MS };
pub const DOWN_AFTER_MS: IntKey =
    IntKey { key: Key::flagged(ENGINES, "down_after_ms", "MS", ""), default: 3000, min: 1, max: HOUR_MS };
pub const READMIT_UPDATES: IntKey = IntKey { key: Key::new(ENGINES, "readmit_updates"), default: 2, min: 1, max: 1000 };
/// A rank with work whose `progress` has not moved for this long is
/// `stalled` (0: never); only sources that report progress can tell.
pub const STALL_AFTER_MS: IntKey =
    IntKey { key: Key::new(ENGINES, "stall_after_ms"), default: 10_000, min: 0, max: HOUR_MS };
/// Failed `health_report`s in a row that make a rank `stalled` (0: never).
pub const PROBE_FAILURES: IntKey = IntKey { key: Key::new(ENGINES, "probe_failures"), default: 3, min: 0, max: 1000 };

pub const POLICY: StrKey =
    StrKey { key: Key::flagged(ROUTING, "policy", "NAME", "User routing policy"), default: "round_robin" };
pub const TICK_MS: IntKey =
    IntKey { key: Key::flagged(ROUTING, "tick_ms", "MS", "Tick period in ms"), default: 100, min: 1, max: 10_000 };
pub const PENDING_TTL_MS: IntKey =
    IntKey { key: Key::flagged(ROUTING, "pending_ttl_ms", "MS", ""), default: 2000, min: 1, max: HOUR_MS };
pub const PENDING_TRANSIT_MS: IntKey =
    IntKey { key: Key::new(ROUTING, "pending_transit_ms"), default: 100, min: 0, max: 60_000 };
pub const IMBALANCE_WINDOW_MS: IntKey =
    IntKey { key: Key::new(ROUTING, "imbalance_window_ms"), default: 60_000, min: 1000, max: DAY_MS };
pub const WEIGHT_WAITING: FloatKey =
    FloatKey { key: Key::new(ROUTING, "weight_waiting"), default: 4.0, min: 0.0, max: BIG };
pub const WEIGHT_RUNNING: FloatKey =
    FloatKey { key: Key::new(ROUTING, "weight_running"), default: 1.0, min: 0.0, max: BIG };
pub const WEIGHT_PENDING: FloatKey =
    FloatKey { key: Key::new(ROUTING, "weight_pending"), default: 4.0, min: 0.0, max: BIG };
pub const SESSION_CAPACITY: IntKey =
    IntKey { key: Key::new(ROUTING, "session_capacity"), default: 100_000, min: 1, max: 100_000_000 };
pub const SESSION_TTL_MS: IntKey =
    IntKey { key: Key::new(ROUTING, "session_ttl_ms"), default: 600_000, min: 1, max: DAY_MS };
pub const SESSION_MAX_LOAD_RATIO: FloatKey =
    FloatKey { key: Key::new(ROUTING, "session_max_load_ratio"), default: 2.0, min: 1.0, max: BIG };
pub const SEED: IntKey = IntKey { key: Key::new(ROUTING, "seed"), default: 0, min: 0, max: i64::MAX as u64 };
pub const CACHE_PREFILL_WEIGHT: FloatKey =
    FloatKey { key: Key::new(ROUTING, "cache_prefill_weight"), default: 4.0, min: 0.0, max: BIG };
pub const CACHE_BALANCE_ABS_TOKENS: IntKey =
    IntKey { key: Key::new(ROUTING, "cache_balance_abs_tokens"), default: 32_768, min: 0, max: 1 << 32 };
pub const CACHE_BALANCE_REL: FloatKey =
    FloatKey { key: Key::new(ROUTING, "cache_balance_rel"), default: 2.0, min: 1.0, max: BIG };
/// `auto`, `events` or `approximate` (docs/PROTOCOL.md §7).
pub const PREFIX_MODE: StrKey = StrKey { key: Key::new(ROUTING, "prefix_mode"), default: "auto" };
pub const PREFIX_TTL_MS: IntKey =
    IntKey { key: Key::new(ROUTING, "prefix_ttl_ms"), default: 120_000, min: 1, max: DAY_MS };

pub const MAX_PENALTY: FloatKey = FloatKey { key: Key::new(PENALTY, "max_penalty"), default: 10.0, min: 0.0, max: BIG };
pub const STALE: FloatKey = FloatKey { key: Key::new(PENALTY, "stale"), default: 1.0, min: 0.0, max: BIG };
pub const HEALTH_FAILURE: FloatKey =
    FloatKey { key: Key::new(PENALTY, "health_failure"), default: 1.0, min: 0.0, max: BIG };
pub const HEALTH_HALF_LIFE_MS: IntKey =
    IntKey { key: Key::new(PENALTY, "health_half_life_ms"), default: 5000, min: 1, max: HOUR_MS };
pub const FAILURE: FloatKey = FloatKey { key: Key::new(PENALTY, "failure"), default: 5.0, min: 0.0, max: BIG };
pub const FAILURE_SMOOTHING: FloatKey =
    FloatKey { key: Key::new(PENALTY, "failure_smoothing"), default: 0.5, min: 0.01, max: 1.0 };
pub const TTFT: FloatKey = FloatKey { key: Key::new(PENALTY, "ttft"), default: 1.0, min: 0.0, max: BIG };

pub const MAX_MESSAGE_BYTES: IntKey =
    IntKey { key: Key::new(LIMITS, "max_message_bytes"), default: 65_536, min: 256, max: 16 << 20 };
pub const MAX_BATCH: IntKey = IntKey { key: Key::new(LIMITS, "max_batch"), default: 1024, min: 1, max: 65_536 };
/// The most work one route query may ask for: `engines.dp_size` times
/// `limits.max_batch`. A scoring policy weighs every rank for each placement,
/// so a query with `n = max_batch` costs about this many rank weighings
/// (1.0-1.6 ms at the bound; docs/failure-behaviour.md, "Configuration bounds"),
/// while every other client waits.
pub const MAX_QUERY_WORK: u64 = 1 << 18;

/// Checks `dp_size x max_batch` against [`MAX_QUERY_WORK`]; the error names
/// both keys and the largest `max_batch` this `dp_size` allows.
pub fn check_query_work(dp_size: u32, max_batch: u32) -> Result<(), String> {
    let work = u64::from(dp_size) * u64::from(max_batch);
    if work <= MAX_QUERY_WORK {
        return Ok(());
    }
    Err(format!(
        "{} = {dp_size} with {} = {max_batch} is {work} rank weighings per query, above {MAX_QUERY_WORK}; \
         with this dp_size, max_batch may be at most {}",
        DP_SIZE.key.path(),
        MAX_BATCH.key.path(),
        MAX_QUERY_WORK / u64::from(dp_size.max(1)),
    ))
}

pub const MAX_PROMPT_TOKENS: IntKey =
    IntKey { key: Key::new(LIMITS, "max_prompt_tokens"), default: 262_144, min: 1, max: 16 << 20 };
/// What dpcoord may hold for its peers, tables and indexes (`budget.rs`):
/// 480 MiB, which with 32 MiB for the binary, its threads and the
/// allocator's slack is the deployment's 512 MiB limit.
pub const MEMORY_BUDGET_BYTES: IntKey =
    IntKey { key: Key::new(LIMITS, "memory_budget_bytes"), default: 480 << 20, min: 16 << 20, max: 1 << 40 };
/// Keys that are gone, and what took their place.
pub const MOVED: [(&str, &str); 1] = [(
    "kv_events.max_blocks_per_rank",
    "replaced by limits.memory_budget_bytes: the index is bounded in bytes across ranks",
)];

pub const KV_CONNECT: ListKey = ListKey {
    key: Key::flagged_in_section(
        KV_EVENTS,
        "connect",
        "EP",
        "Engine KV-event PUB to subscribe to; tcp://HOST:PORT+rank is one per rank; repeatable",
    ),
};
pub const KV_REPLAY: ListKey = ListKey {
    key: Key::flagged_in_section(KV_EVENTS, "replay", "EP", "Their replay ROUTER endpoints, same forms; repeatable"),
};
pub const KV_TOPIC: StrKey = StrKey { key: Key::new(KV_EVENTS, "topic"), default: "" };
pub const KV_MAX_BATCH_BYTES: IntKey =
    IntKey { key: Key::new(KV_EVENTS, "max_batch_bytes"), default: 4 << 20, min: 1024, max: 1 << 28 };
pub const KV_REPLAY_TIMEOUT_MS: IntKey =
    IntKey { key: Key::new(KV_EVENTS, "replay_timeout_ms"), default: 2000, min: 1, max: 600_000 };

/// Each rank's `host:port` as the gateway reaches it (the i-th is rank i),
/// or one endpoint for every rank with `rank_header`.
pub const GATEWAY_ENDPOINTS: ListKey = ListKey { key: Key::new(GATEWAY, "endpoints") };
/// The header that carries the rank to an engine balancing its own ranks
/// behind one endpoint; "" = none (one endpoint per rank).
pub const GATEWAY_RANK_HEADER: StrKey = StrKey { key: Key::new(GATEWAY, "rank_header"), default: "" };
/// The largest request body the picker reads.
pub const GATEWAY_MAX_BODY_BYTES: IntKey =
    IntKey { key: Key::new(GATEWAY, "max_body_bytes"), default: 4 << 20, min: 1024, max: 64 << 20 };

/// How many next-best endpoints follow the picked one (Envoy tries them
/// in order when its retry policy retries); 0 = the pick alone.
pub const GATEWAY_FALLBACKS: IntKey = IntKey { key: Key::new(GATEWAY, "fallbacks"), default: 0, min: 0, max: 16 };
/// Requests answered 429 when every eligible rank has at least this many
/// queued (waiting plus pending); 0 = never shed.
pub const GATEWAY_SHED_WAITING: IntKey =
    IntKey { key: Key::new(GATEWAY, "shed_waiting"), default: 0, min: 0, max: 1_000_000 };

/// The model's tokenizer.json, for prompts tokenized as the engine does;
/// "" = none (an approximate prefix over the prompt's text).
pub const GATEWAY_TOKENIZER: StrKey = StrKey { key: Key::new(GATEWAY, "tokenizer"), default: "" };
/// Its tokenizer_config.json, for the chat template; "" = none.
pub const GATEWAY_TOKENIZER_CONFIG: StrKey = StrKey { key: Key::new(GATEWAY, "tokenizer_config"), default: "" };

/// Client connections the proxy serves at once; at most a sixteenth of the
/// file descriptors is taken whatever this says (as many again go to the
/// ranks' servers).
pub const PROXY_MAX_CONNECTIONS: IntKey =
    IntKey { key: Key::new(PROXY, "max_connections"), default: 1024, min: 1, max: 1 << 20 };
/// Request bodies the proxy holds at once, all requests together.
pub const PROXY_MAX_BUFFERED_BYTES: IntKey =
    IntKey { key: Key::new(PROXY, "max_buffered_bytes"), default: 64 << 20, min: 1 << 20, max: 1 << 36 };
/// How long a request body may take to arrive, from its head.
pub const PROXY_BODY_TIMEOUT_MS: IntKey =
    IntKey { key: Key::new(PROXY, "body_timeout_ms"), default: 30_000, min: 10, max: HOUR_MS };
/// How long a connection to a rank's server may take before the next-best
/// rank is tried.
pub const PROXY_CONNECT_TIMEOUT_MS: IntKey =
    IntKey { key: Key::new(PROXY, "connect_timeout_ms"), default: 1000, min: 10, max: 60_000 };

/// Every key: first those with a flag, in `--help` order, then the rest.
pub const ALL: [AnyKey; 76] = [
    AnyKey::Int(&DP_SIZE),
    AnyKey::Int(&MAX_DP_SIZE),
    AnyKey::Str(&POLICY),
    AnyKey::Str(&ROUTE_BIND),
    AnyKey::Str(&HEALTH_BIND),
    AnyKey::Str(&STATS_BIND),
    AnyKey::List(&STATS_CONNECT),
    AnyKey::List(&SGLANG_LOAD_CONNECT),
    AnyKey::List(&VLLM_METRICS_URL),
    AnyKey::List(&KV_CONNECT),
    AnyKey::List(&KV_REPLAY),
    AnyKey::Str(&METRICS_BIND),
    AnyKey::Int(&TICK_MS),
    AnyKey::Int(&STALE_AFTER_MS),
    AnyKey::Int(&DOWN_AFTER_MS),
    AnyKey::Int(&PENDING_TTL_MS),
    AnyKey::Int(&PENDING_TRANSIT_MS),
    AnyKey::Str(&LOG_FORMAT),
    AnyKey::List(&ROUTE_ALLOW),
    AnyKey::List(&HEALTH_ALLOW),
    AnyKey::List(&STATS_ALLOW),
    AnyKey::Str(&IPC_MODE),
    AnyKey::Int(&HTTP_MAX_CONNECTIONS),
    AnyKey::Int(&HTTP_HEADER_TIMEOUT_MS),
    AnyKey::Int(&HTTP_IDLE_TIMEOUT_MS),
    AnyKey::Int(&ROUTE_MAX_PEERS),
    AnyKey::Int(&HEALTH_MAX_PEERS),
    AnyKey::Int(&STATS_MAX_PEERS),
    AnyKey::Int(&MAX_PEERS_PER_ADDRESS),
    AnyKey::Int(&READMIT_UPDATES),
    AnyKey::Int(&STALL_AFTER_MS),
    AnyKey::Int(&PROBE_FAILURES),
    AnyKey::Int(&VLLM_METRICS_INTERVAL_MS),
    AnyKey::Int(&IMBALANCE_WINDOW_MS),
    AnyKey::Float(&WEIGHT_WAITING),
    AnyKey::Float(&WEIGHT_RUNNING),
    AnyKey::Float(&WEIGHT_PENDING),
    AnyKey::Int(&SESSION_CAPACITY),
    AnyKey::Int(&SESSION_TTL_MS),
    AnyKey::Float(&SESSION_MAX_LOAD_RATIO),
    AnyKey::Int(&SEED),
    AnyKey::Float(&CACHE_PREFILL_WEIGHT),
    AnyKey::Int(&CACHE_BALANCE_ABS_TOKENS),
    AnyKey::Float(&CACHE_BALANCE_REL),
    AnyKey::Str(&PREFIX_MODE),
    AnyKey::Int(&PREFIX_TTL_MS),
    AnyKey::Float(&MAX_PENALTY),
    AnyKey::Float(&STALE),
    AnyKey::Float(&HEALTH_FAILURE),
    AnyKey::Int(&HEALTH_HALF_LIFE_MS),
    AnyKey::Float(&FAILURE),
    AnyKey::Float(&FAILURE_SMOOTHING),
    AnyKey::Float(&TTFT),
    AnyKey::Int(&MAX_MESSAGE_BYTES),
    AnyKey::Int(&MAX_BATCH),
    AnyKey::Int(&MAX_PROMPT_TOKENS),
    AnyKey::Int(&MEMORY_BUDGET_BYTES),
    AnyKey::Str(&KV_TOPIC),
    AnyKey::Int(&KV_MAX_BATCH_BYTES),
    AnyKey::Int(&KV_REPLAY_TIMEOUT_MS),
    AnyKey::Str(&EPP_BIND),
    AnyKey::Str(&EPP_TLS),
    AnyKey::Str(&EPP_CERT),
    AnyKey::Str(&EPP_KEY),
    AnyKey::List(&GATEWAY_ENDPOINTS),
    AnyKey::Str(&GATEWAY_RANK_HEADER),
    AnyKey::Int(&GATEWAY_MAX_BODY_BYTES),
    AnyKey::Int(&GATEWAY_FALLBACKS),
    AnyKey::Int(&GATEWAY_SHED_WAITING),
    AnyKey::Str(&GATEWAY_TOKENIZER),
    AnyKey::Str(&GATEWAY_TOKENIZER_CONFIG),
    AnyKey::Str(&PROXY_BIND),
    AnyKey::Int(&PROXY_MAX_CONNECTIONS),
    AnyKey::Int(&PROXY_MAX_BUFFERED_BYTES),
    AnyKey::Int(&PROXY_BODY_TIMEOUT_MS),
    AnyKey::Int(&PROXY_CONNECT_TIMEOUT_MS),
];
