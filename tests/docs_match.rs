//! The user documents against the code: every configuration key has its
//! row in docs/configuration.md (and no row names a key that is gone),
//! every metric family the real binary exports has its row in
//! docs/PROTOCOL.md's table and in docs/operations.md's (or, for the KV
//! index's, docs/prefix-cache.md's), and every alert in the Prometheus
//! rules has its row and its section in docs/alerts.md.
mod common;

use std::collections::BTreeSet;

use common::*;
use dpcoord::config::keys;

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
    // Every source kind configured, so every family is registered.
    let d = Daemon::frozen(
        "2",
        &["--vllm-metrics-url", "http://127.0.0.1:1/metrics", "--kv-events-connect", "tcp://127.0.0.1:1"],
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
