//! The user documents against the code: every configuration key has its
//! row in docs/configuration.md (and no row names a key that is gone),
//! every metric family the real binary exports has its row in
//! docs/PROTOCOL.md's table and in docs/operations.md's (or, for the KV
//! index's, docs/prefix-cache.md's), every alert in the Prometheus rules
//! has its row and its section in docs/alerts.md, and PROTOCOL.md's table
//! of defaults and bounds says what the key specs say.

use std::collections::BTreeSet;

use crate::common::*;
use dpcoord_daemon::config::keys;

fn doc(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// The keys a configuration.md row names in its first cell:
/// `` `section.key` `` or `` `section.a` / `b` / `c` `` (same section).
fn documented_keys(text: &str) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for line in text.lines().filter(|l| l.starts_with("| `")) {
        let cell = line.split('|').nth(1).unwrap_or("");
        let names: Vec<&str> = cell.split('/').map(|n| n.trim().trim_matches('`')).collect();
        let Some((section, _)) = names[0].split_once('.') else { continue };
        for n in names {
            keys.insert(if n.contains('.') { n.to_owned() } else { format!("{section}.{n}") });
        }
    }
    keys
}

#[test]
fn every_configuration_key_has_its_row_and_no_row_is_stale() {
    let code: BTreeSet<String> = keys::ALL.iter().map(|k| k.key().path()).collect();
    let documented = documented_keys(&doc("docs/configuration.md"));
    let missing: Vec<_> = code.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&code).collect();
    assert!(missing.is_empty() && stale.is_empty(), "undocumented keys {missing:?}; rows for no key {stale:?}");
}

/// The metric names the first cell of a document's table rows names
/// (`` | `name` `` or `` | `a{labels}`, `b` ``).
fn table_metrics(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| l.starts_with("| `dpcoord_"))
        .flat_map(|l| l.split('|').nth(1).unwrap_or("").split('`').skip(1).step_by(2).collect::<Vec<_>>())
        .filter(|name| name.starts_with("dpcoord_"))
        .map(|name| name.split('{').next().unwrap_or("").to_owned())
        .collect()
}

#[test]
fn every_metric_family_has_its_rows_and_no_row_is_stale() {
    // Every source kind configured and the proxy on, so every family is registered.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("proxy.toml");
    let proxy = format!("[server]\nproxy_bind = \"{}\"\n[gateway]\nendpoints = [\"a:1\", \"a:2\"]\n", free_addr());
    std::fs::write(&config, proxy).unwrap();
    let d = Daemon::frozen(
        "2",
        &[
            "--vllm-metrics-url",
            "http://127.0.0.1:1/metrics",
            "--kv-events-connect",
            "tcp://127.0.0.1:1",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    let (code, body) = d.http_get("/metrics");
    assert_eq!(code, 200);
    let exported: BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    assert!(exported.contains("dpcoord_kv_blocks") && exported.contains("dpcoord_scrapes_total"), "{exported:?}");
    let protocol = table_metrics(&doc("docs/PROTOCOL.md"));
    let mut operations = table_metrics(&doc("docs/operations.md"));
    operations.extend(table_metrics(&doc("docs/prefix-cache.md")));
    for (name, rows) in [("PROTOCOL.md", &protocol), ("operations.md or prefix-cache.md", &operations)] {
        let missing: Vec<_> = exported.difference(rows).collect();
        let stale: Vec<_> = rows.difference(&exported).collect();
        assert!(missing.is_empty() && stale.is_empty(), "{name}: no row for {missing:?}; rows for nothing {stale:?}");
    }
}

#[test]
fn every_alert_has_its_row_and_its_section() {
    let rules = doc("deploy/prometheus/dpcoord.rules.yml");
    let alerts: BTreeSet<&str> = rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert!(alerts.len() >= 13, "{alerts:?}");
    let text = doc("docs/alerts.md");
    let rows: BTreeSet<&str> =
        text.lines().filter_map(|l| l.strip_prefix("| [")).filter_map(|l| l.split(']').next()).collect();
    let sections: BTreeSet<&str> = text.lines().filter_map(|l| l.strip_prefix("## ")).collect();
    assert_eq!(rows, alerts, "the table of docs/alerts.md");
    let without: Vec<_> = alerts.difference(&sections).collect();
    assert!(without.is_empty(), "alerts without a section in docs/alerts.md: {without:?}");
}

/// A number as the documents write it: `65,536`, `2^40`, `2^63−1`, `1e6`, `2.0`.
fn doc_number(s: &str) -> Option<f64> {
    let s = s.trim().replace(',', "");
    if let Some((base, exp)) = s.split_once('^') {
        let (exp, minus_one) = match exp.split_once('−') {
            Some((e, "1")) => (e, true),
            Some(_) => return None,
            None => (exp, false),
        };
        let v = base.parse::<f64>().ok()?.powi(exp.parse().ok()?);
        return Some(if minus_one { v - 1.0 } else { v });
    }
    s.parse().ok()
}

/// The default and the bounds of `path` in the code, as numbers (bounds
/// `None` for a string key).
fn code_bounds(path: &str) -> Option<(String, Option<(f64, f64)>)> {
    keys::ALL.iter().find(|k| k.key().path() == path).map(|k| match k {
        keys::AnyKey::Int(k) => (k.default.to_string(), Some((k.min as f64, k.max as f64))),
        keys::AnyKey::Float(k) => (k.default.to_string(), Some((k.min, k.max))),
        keys::AnyKey::Str(k) => (k.default.to_owned(), None),
        keys::AnyKey::List(_) => (String::new(), None),
    })
}

/// PROTOCOL.md §13 states defaults and bounds; each row says what the key
/// specs say (`a / _b` rows name keys of one prefix, with `x / y` values).
#[test]
fn protocol_defaults_and_bounds_are_the_codes() {
    let text = doc("docs/PROTOCOL.md");
    let section = text.split("## 13.").nth(1).expect("PROTOCOL.md has §13");
    let mut checked = 0;
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (names, defaults, allowed) = (cells[1], cells[2], cells[3]);
        let names: Vec<&str> = names.split('/').map(|n| n.trim().trim_matches('`')).collect();
        let first = names[0].to_owned();
        let stem = first.rsplit_once('_').map_or(first.as_str(), |(s, _)| s).to_owned();
        let paths: Vec<String> =
            names.iter().map(|n| if n.starts_with('_') { format!("{stem}{n}") } else { (*n).to_owned() }).collect();
        let defaults: Vec<&str> = defaults.split('/').map(|d| d.trim().trim_matches('`')).collect();
        assert_eq!(paths.len(), defaults.len(), "{line}");
        for (path, default) in paths.iter().zip(&defaults) {
            let (code_default, bounds) = code_bounds(path).unwrap_or_else(|| panic!("§13 names no key: {path}"));
            match (doc_number(default), code_default.parse::<f64>()) {
                (Some(d), Ok(c)) => assert_eq!(d, c, "§13 default of {path}"),
                _ => assert_eq!(*default, code_default, "§13 default of {path}"),
            }
            if let Some((min, max)) = bounds {
                let range = allowed.split_whitespace().next().unwrap_or("").trim_end_matches(',');
                let (lo, hi) = range.split_once("..=").unwrap_or_else(|| panic!("§13 bounds of {path}: {allowed}"));
                assert_eq!((doc_number(lo), doc_number(hi)), (Some(min), Some(max)), "§13 bounds of {path}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 25, "only {checked} keys read from §13");
}
