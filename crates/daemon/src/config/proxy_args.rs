//! `dpcoord proxy LISTEN SERVER...` as keys: the proxy's listener, one rank
//! per server in the order given (`engines.dp_size`, `gateway.endpoints`),
//! and, when no other load source is configured, each server's `/metrics`
//! scraped as vLLM's (`engines.vllm_metrics_url`). Folded into the table
//! after the file and the flags, so they win over both.

use super::keys::{self, Key, ListKey};
use super::{err, ConfigError};

/// The keys any of which names each rank's load source: when one is set,
/// the servers' `/metrics` are not scraped. (The stats bind, on by default,
/// names none: publishers come to it.)
const SOURCES: [&ListKey; 3] = [&keys::VLLM_METRICS_URL, &keys::SGLANG_LOAD_CONNECT, &keys::STATS_CONNECT];

/// Folds the proxy's `listen` address and `servers` into `t`.
pub fn fold_proxy_args(t: &mut toml::Table, listen: &str, servers: &[String]) -> Result<(), ConfigError> {
    keys::PROXY_BIND.key.set(t, listen.into());
    if servers.is_empty() {
        return Ok(());
    }
    let endpoints = servers.iter().map(|s| endpoint(s)).collect::<Result<Vec<String>, ConfigError>>()?;
    let list = |items: Vec<String>| toml::Value::Array(items.into_iter().map(toml::Value::String).collect());
    keys::DP_SIZE.key.set(t, toml::Value::Integer(endpoints.len() as i64));
    let sourced = SOURCES.iter().any(|k| is_set(t, &k.key));
    if !sourced {
        keys::VLLM_METRICS_URL.key.set(t, list(endpoints.iter().map(|e| format!("http://{e}/metrics")).collect()));
    }
    keys::GATEWAY_ENDPOINTS.key.set(t, list(endpoints));
    Ok(())
}

/// A server as `host:port`: `http://host:port` (a trailing `/` allowed) or
/// `host:port` as given.
fn endpoint(server: &str) -> Result<String, ConfigError> {
    let bare = server.strip_prefix("http://").unwrap_or(server).trim_end_matches('/');
    let why = if server.starts_with("https://") {
        "https is not supported: the proxy reaches the ranks' servers over plain HTTP"
    } else if bare.contains('/') {
        "a server is HOST:PORT or http://HOST:PORT, without a path"
    } else {
        match bare.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
                return Ok(bare.to_owned())
            }
            _ => "a server is HOST:PORT or http://HOST:PORT",
        }
    };
    Err(err("proxy SERVER", format!("`{server}`: {why}")))
}

/// Whether the file or a flag gave `key` a value other than empty.
fn is_set(t: &toml::Table, key: &Key) -> bool {
    match t.get(key.section).and_then(|s| s.get(key.name)) {
        Some(toml::Value::Array(a)) => !a.is_empty(),
        Some(toml::Value::String(s)) => !s.is_empty(),
        Some(_) => true,
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn folded(file: &str, servers: &[&str]) -> Result<Config, ConfigError> {
        let mut t = Config::parse_toml(file).unwrap();
        let servers: Vec<String> = servers.iter().map(|s| (*s).to_owned()).collect();
        fold_proxy_args(&mut t, "127.0.0.1:8000", &servers)?;
        Config::from_table(t)
    }

    #[test]
    fn each_server_is_a_rank_scraped_as_vllm_unless_a_source_is_set() {
        let c = folded("", &["http://10.0.0.1:8000/", "10.0.0.2:8001"]).unwrap();
        assert_eq!(c.server.proxy_bind, Some("127.0.0.1:8000".parse().unwrap()));
        assert_eq!(c.settings.engines.dp_size, 2);
        assert_eq!(c.settings.gateway.endpoints, ["10.0.0.1:8000", "10.0.0.2:8001"]);
        assert_eq!(c.server.vllm_metrics_url, ["http://10.0.0.1:8000/metrics", "http://10.0.0.2:8001/metrics"]);
        let sglang = "[engines]\nsglang_load_connect = [\"tcp://10.0.0.1:5600\", \"tcp://10.0.0.2:5600\"]\n";
        let c = folded(sglang, &["10.0.0.1:30000", "10.0.0.2:30000"]).unwrap();
        assert!(c.server.vllm_metrics_url.is_empty());
        assert_eq!(c.server.sglang_load_connect.len(), 2);
    }

    #[test]
    fn a_server_that_is_not_host_port_is_refused_saying_why() {
        let e = folded("", &["https://a:1"]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "proxy SERVER: `https://a:1`: https is not supported: the proxy reaches the ranks' servers over plain HTTP"
        );
        let e = folded("", &["http://a:1/v1"]).unwrap_err();
        assert!(e.to_string().ends_with("without a path"), "{e}");
        assert!(folded("", &["a"]).is_err() && folded("", &["a:0"]).is_err() && folded("", &[":80"]).is_err());
    }

    #[test]
    fn without_servers_the_file_names_the_endpoints() {
        let e = folded("", &[]).unwrap_err();
        assert_eq!(e.key, "gateway.endpoints");
        assert!(e.problem.contains("server.proxy_bind is set"), "{e}");
    }
}
