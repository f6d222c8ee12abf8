//! Unit tests of the config module: keys, parser and flags.

use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_table(Config::parse_toml(text)?)
}

fn key_of(text: &str) -> String {
    parse(text).unwrap_err().key
}

#[test]
fn defaults_match_the_contract() {
    let c = Config::default();
    assert_eq!(c.server.route_bind, "tcp://127.0.0.1:5570");
    assert_eq!(c.server.health_bind, "tcp://127.0.0.1:5571");
    assert_eq!(c.server.stats_bind.as_deref(), Some("tcp://127.0.0.1:5572"));
    assert_eq!(c.server.metrics_bind, "127.0.0.1:9570".parse().unwrap());
    assert_eq!(c.settings.engines.dp_size, 8);
    assert_eq!(c.settings.engines.stale_after, Duration::from_millis(1000));
    assert_eq!(c.settings.engines.down_after, Duration::from_millis(3000));
    assert_eq!(c.settings.engines.readmit_updates, 2);
    assert_eq!(c.settings.routing.policy, PolicyKind::RoundRobin);
    assert_eq!(c.settings.routing.weights, LoadWeights { waiting: 4.0, running: 1.0, pending: 4.0 });
    for p in PolicyKind::ALL {
        assert_eq!(parse(&format!("[routing]\npolicy = \"{}\"", p.as_str())).unwrap().settings.routing.policy, p);
    }
    assert_eq!(c.settings.routing.tick, Duration::from_millis(100));
    assert_eq!(c.settings.routing.pending_ttl, Duration::from_millis(2000));
    assert_eq!(c.settings.routing.imbalance_window, Duration::from_secs(60));
    assert_eq!((c.settings.limits.max_message_bytes, c.settings.limits.max_batch), (65536, 1024));
}

/// Every key at its default, from the key specs.
fn defaults_table() -> toml::Table {
    let mut t = toml::Table::new();
    for any in keys::ALL {
        let value = match any {
            keys::AnyKey::Int(k) => toml::Value::Integer(k.default as i64),
            keys::AnyKey::Float(k) => toml::Value::Float(k.default),
            keys::AnyKey::Str(k) => toml::Value::String(k.default.to_owned()),
            keys::AnyKey::List(_) => toml::Value::Array(Vec::new()),
        };
        any.key().set(&mut t, value);
    }
    t
}

#[test]
fn the_shipped_example_is_the_defaults() {
    let text = include_str!("../../../../config/dpcoord.toml");
    assert_eq!(parse(text).unwrap(), Config::default());
    // Every key of the specs is in the file, with its default, and no other.
    assert_eq!(Config::parse_toml(text).unwrap(), defaults_table());
    assert_eq!(Config::from_table(defaults_table()).unwrap(), Config::default());
}

#[test]
fn keys_are_unique_and_their_defaults_in_bounds() {
    let mut paths: Vec<String> = keys::ALL.iter().map(|k| k.key().path()).collect();
    paths.sort();
    paths.dedup();
    assert_eq!(paths.len(), keys::ALL.len());
    for any in keys::ALL {
        assert!(SECTIONS.contains(&any.key().section), "{}", any.key().path());
        match any {
            keys::AnyKey::Int(k) => assert!(k.min <= k.default && k.default <= k.max && k.max <= i64::MAX as u64),
            keys::AnyKey::Float(k) => assert!(k.min <= k.default && k.default <= k.max),
            keys::AnyKey::Str(_) | keys::AnyKey::List(_) => {}
        }
    }
}

fn command() -> clap::Command {
    clap::Command::new("dpcoord").args(flags())
}

#[test]
fn the_flags_are_the_documented_ones() {
    let cmd = command();
    let shown: Vec<(String, String, String)> = cmd
        .get_arguments()
        .map(|a| {
            let long = a.get_long().unwrap_or_default().to_owned();
            let value = a.get_value_names().map(|v| v.join(" ")).unwrap_or_default();
            (long, value, a.get_help().map(ToString::to_string).unwrap_or_default())
        })
        .collect();
    let expected = [
        ("dp-size", "N", "Number of DP ranks (engines.dp_size)"),
        ("max-dp-size", "N", "Most ranks a resize may set without a restart (0: --dp-size) (engines.max_dp_size)"),
        ("policy", "NAME", "User routing policy (routing.policy)"),
        ("route-bind", "EP", "ROUTER endpoint for routing queries (server.route_bind)"),
        ("health-bind", "EP", "ROUTER endpoint for health queries (server.health_bind)"),
        ("stats-bind", "EP", "SUB bind endpoint for engine stats, \"\" to disable (server.stats_bind)"),
        ("stats-connect", "EP", "Engine PUB endpoint to connect to; repeatable (server.stats_connect)"),
        (
            "sglang-load-connect",
            "EP",
            "SGLang scheduler load PUB (--load-publish-endpoint) to subscribe to (the i-th is rank i); repeatable (engines.sglang_load_connect)",
        ),
        (
            "vllm-metrics-url",
            "URL",
            "vLLM API server /metrics to scrape (external LB: the i-th is rank i); repeatable (engines.vllm_metrics_url)",
        ),
        (
            "kv-events-connect",
            "EP",
            "Engine KV-event PUB to subscribe to; tcp://HOST:PORT+rank is one per rank; repeatable (kv_events.connect)",
        ),
        ("kv-events-replay", "EP", "Their replay ROUTER endpoints, same forms; repeatable (kv_events.replay)"),
        ("metrics-bind", "HOST:PORT", "HTTP listener for metrics and probes (server.metrics_bind)"),
        ("tick-ms", "MS", "Tick period in ms (routing.tick_ms)"),
        ("stale-after-ms", "MS", "engines.stale_after_ms"),
        ("down-after-ms", "MS", "engines.down_after_ms"),
        ("pending-ttl-ms", "MS", "routing.pending_ttl_ms"),
        ("log-format", "FORMAT", "text or json (server.log_format)"),
    ];
    let expected: Vec<(String, String, String)> =
        expected.iter().map(|(l, v, h)| (l.to_string(), v.to_string(), h.to_string())).collect();
    assert_eq!(shown, expected);
}

#[test]
fn every_flag_lands_at_its_key() {
    for any in keys::ALL {
        let key = any.key();
        if key.flag.is_none() {
            continue;
        }
        let flag = format!("--{}", key.flag_long().unwrap());
        let (args, expected) = match any {
            keys::AnyKey::Int(_) => (vec![flag.as_str(), "-7"], toml::Value::Integer(-7)),
            keys::AnyKey::Float(_) => (vec![flag.as_str(), "0.25"], toml::Value::Float(0.25)),
            keys::AnyKey::Str(_) => (vec![flag.as_str(), "x"], toml::Value::String("x".into())),
            keys::AnyKey::List(_) => (
                vec![flag.as_str(), "a", flag.as_str(), "b"],
                toml::Value::Array(vec![toml::Value::String("a".into()), toml::Value::String("b".into())]),
            ),
        };
        let matches = command().allow_negative_numbers(true).try_get_matches_from(["dpcoord"].into_iter().chain(args));
        let mut t = Config::parse_toml(&format!("[{}]\n{} = 1", key.section, key.name)).unwrap();
        fold_flags(&matches.unwrap(), &mut t);
        assert_eq!(t[key.section][key.name], expected, "{flag}");
        assert_eq!(t.len(), 1, "{flag}");
    }
}

#[test]
fn no_flag_leaves_the_file_alone() {
    let mut t = Config::parse_toml("[engines]\ndp_size = 4").unwrap();
    fold_flags(&command().get_matches_from(["dpcoord"]), &mut t);
    assert_eq!(t, Config::parse_toml("[engines]\ndp_size = 4").unwrap());
}

#[test]
fn errors_name_the_key() {
    assert_eq!(key_of("[routing]\npolicy = \"fastest\""), "routing.policy");
    assert_eq!(key_of("[engines]\ndp_size = 0"), "engines.dp_size");
    assert_eq!(key_of("[engines]\ndp_size = \"8\""), "engines.dp_size");
    assert_eq!(key_of("[engines]\nstale_after_ms = 5000"), "engines.down_after_ms");
    assert_eq!(key_of("[server]\nroute_bind = \"localhost:1\""), "server.route_bind");
    assert_eq!(key_of("[server]\nstats_connect = [\"tcp://x\"]"), "server.stats_connect");
    assert_eq!(key_of("[server]\nmetrics_bind = \"nowhere\""), "server.metrics_bind");
    assert_eq!(key_of("[server]\nlog_format = \"xml\""), "server.log_format");
    assert_eq!(key_of("[server]\nroute_allow = [\"10.0.0.0/40\"]"), "server.route_allow");
    assert_eq!(key_of("[server]\nhealth_bind = \"ipc:///x\"\nhealth_allow = [\"10.0.0.1\"]"), "server.health_allow");
    assert_eq!(key_of("[server]\nstats_bind = \"\"\nstats_allow = [\"10.0.0.1\"]"), "server.stats_allow");
    assert_eq!(key_of("[limits]\nmax_batch = -1"), "limits.max_batch");
    assert_eq!(key_of("[penalty]\nstale = -1.0"), "penalty.stale");
    assert_eq!(key_of("[penalty]\nfailure_smoothing = 0"), "penalty.failure_smoothing");
    assert_eq!(key_of("[routing]\nsession_max_load_ratio = 0.5"), "routing.session_max_load_ratio");
    assert_eq!(key_of("[routing]\nweight_pending = \"x\""), "routing.weight_pending");
    assert_eq!(key_of("[routing]\ntickms = 5"), "routing.tickms");
    assert_eq!(key_of("[router]\npolicy = \"round_robin\""), "router");
    assert_eq!(key_of("routing = 3"), "routing");
    assert_eq!(key_of("[routing\n"), "config:1:9");
}

#[test]
fn flags_override_the_file_and_empty_stats_bind_disables_it() {
    let mut t = Config::parse_toml("[engines]\ndp_size = 4\n[server]\nstats_bind = \"\"").unwrap();
    set(&mut t, "engines", "dp_size", toml::Value::Integer(16));
    let c = Config::from_table(t).unwrap();
    assert_eq!(c.settings.engines.dp_size, 16);
    assert_eq!(c.server.stats_bind, None);
}

#[test]
fn ipc_mode_is_octal_digits_or_empty() {
    assert_eq!(Config::default().server.ipc_mode, None);
    for (text, mode) in [("0660", 0o660), ("660", 0o660), ("0777", 0o777), ("0600", 0o600)] {
        assert_eq!(parse(&format!("[server]\nipc_mode = \"{text}\"")).unwrap().server.ipc_mode, Some(mode), "{text}");
    }
    for bad in ["\"rw-rw----\"", "\"0668\"", "\"1777\"", "\"66\"", "\"00660\"", "\" 660\"", "\"+660\"", "660"] {
        let e = parse(&format!("[server]\nipc_mode = {bad}")).unwrap_err();
        assert_eq!(e.key, "server.ipc_mode", "{bad}");
    }
    let e = parse("[server]\nipc_mode = \"0668\"").unwrap_err().to_string();
    assert!(e.starts_with("server.ipc_mode: `0668` is not a file mode"), "{e}");
}

#[test]
fn endpoints() {
    for ok in ["tcp://127.0.0.1:5570", "tcp://*:1", "tcp://[::1]:80", "ipc:///tmp/x", "inproc://a", "tcp://h:*"] {
        assert_eq!(check_endpoint(ok), Ok(()), "{ok}");
    }
    for bad in ["", "tcp://", "tcp://h", "tcp://:1", "tcp://h:99999", "ipc://", "udp://h:1", "127.0.0.1:5570"] {
        assert!(check_endpoint(bad).is_err(), "{bad}");
    }
}

#[test]
fn vllm_metrics_urls_are_plain_http_with_a_port_and_a_path() {
    let c = Config::default();
    assert_eq!((c.server.vllm_metrics_url.len(), c.server.vllm_metrics_interval), (0, Duration::from_millis(250)));
    let ok = ["http://10.0.0.5:8000/metrics", "http://[::1]:8000/metrics", "http://vllm-0.svc:8000/metrics?x=1"];
    let text = format!("[engines]\nvllm_metrics_url = {ok:?}\nvllm_metrics_interval_ms = 1000");
    let c = parse(&text).unwrap();
    assert_eq!(
        (c.server.vllm_metrics_url, c.server.vllm_metrics_interval),
        (ok.map(String::from).to_vec(), Duration::from_secs(1))
    );
    let bad = [
        "https://h:8000/metrics",
        "http://h/metrics",
        "http://h:8000",
        "http://h:8000/",
        "http://:8000/metrics",
        "h:8000/metrics",
        "http://u:p@h:8000/metrics",
        "http://h:99999/metrics",
        "",
    ];
    for url in bad {
        let e = parse(&format!("[engines]\nvllm_metrics_url = [{url:?}]")).unwrap_err();
        assert_eq!(e.key, "engines.vllm_metrics_url", "{url}");
    }
    assert_eq!(key_of("[engines]\nvllm_metrics_interval_ms = 10"), "engines.vllm_metrics_interval_ms");
}

/// A FIFO nobody writes is refused at once: the open does not wait for a
/// writer and the opened descriptor is what is checked. Run on a thread so
/// that a regression fails the test instead of hanging it.
#[test]
fn a_fifo_nobody_writes_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("dpcoord.toml");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let (tx, rx) = std::sync::mpsc::channel();
    let path = fifo.clone();
    std::thread::spawn(move || tx.send(read_file(&path)));
    let read = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("read_file blocked on a FIFO");
    assert_eq!(read, Err(err("config", format!("{} is not a regular file", fifo.display()))));
    // A directory is refused the same way; a missing file names the OS error.
    assert_eq!(read_file(dir.path()), Err(err("config", format!("{} is not a regular file", dir.path().display()))));
    let missing = dir.path().join("missing.toml");
    assert_eq!(
        read_file(&missing),
        Err(err("config", format!("cannot read {}: No such file or directory (os error 2)", missing.display())))
    );
}
