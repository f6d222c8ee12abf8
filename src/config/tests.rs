//! Unit tests of `config.rs`.

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

#[test]
fn the_shipped_example_is_the_defaults() {
    let text = include_str!("../../config/dpcoord.toml");
    assert_eq!(parse(text).unwrap(), Config::default());
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
    assert_eq!(key_of("[routing\n"), "config");
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
fn endpoints() {
    for ok in ["tcp://127.0.0.1:5570", "tcp://*:1", "tcp://[::1]:80", "ipc:///tmp/x", "inproc://a", "tcp://h:*"] {
        assert_eq!(check_endpoint(ok), Ok(()), "{ok}");
    }
    for bad in ["", "tcp://", "tcp://h", "tcp://:1", "tcp://h:99999", "ipc://", "udp://h:1", "127.0.0.1:5570"] {
        assert!(check_endpoint(bad).is_err(), "{bad}");
    }
}
