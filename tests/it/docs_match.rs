//! The user documents against the code: every configuration key has its
//! row in docs/configuration.md (and no row names a key that is gone),
//! every series the real binary exports has its row, with its type and
//! labels, in the one metrics table, docs/operations.md's (and every row
//! is exported), every alert in the Prometheus rules
//! has its row and its section in docs/alerts.md, and PROTOCOL.md's table
//! of defaults and bounds says what the key specs say.

use std::collections::{BTreeMap, BTreeSet};

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

/// A series as the metrics table describes it, or as `/metrics` exports it:
/// its type and its labels, each with its values (`None` where the table
/// does not list them).
#[derive(Debug)]
struct Series {
    kind: String,
    labels: BTreeMap<String, Option<BTreeSet<String>>>,
}

/// The text between the heading `heading` and the next heading.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let start = text.find(&format!("\n{heading}\n")).unwrap_or_else(|| panic!("no heading {heading:?}"));
    let body = &text[start + heading.len() + 2..];
    body.find("\n#").map_or(body, |end| &body[..end])
}

/// The labels cell of a row: `none`, or `` `a`, `b` (`x`/`y`) ``, where a
/// label's values follow it in parentheses; they are read only when the
/// parentheses hold nothing but `` `value` ``s and slashes.
fn row_labels(cell: &str) -> Option<BTreeMap<String, Option<BTreeSet<String>>>> {
    let mut labels = BTreeMap::new();
    if cell == "none" {
        return Some(labels);
    }
    let (mut rest, mut last) = (cell, None::<String>);
    while let Some(c) = rest.chars().next() {
        match c {
            '`' => {
                let end = rest[1..].find('`')? + 1;
                let name = rest[1..end].to_owned();
                labels.insert(name.clone(), None);
                last = Some(name);
                rest = &rest[end + 1..];
            }
            '(' => {
                let (mut depth, mut end) = (0, None);
                for (i, c) in rest.char_indices() {
                    depth += match c {
                        '(' => 1,
                        ')' => -1,
                        _ => 0,
                    };
                    if depth == 0 {
                        end = Some(i);
                        break;
                    }
                }
                let inner = &rest[1..end?];
                let values: Option<BTreeSet<String>> = inner
                    .split('/')
                    .map(|v| {
                        v.strip_prefix('`')?.strip_suffix('`').filter(|v| !v.contains(['`', ' '])).map(str::to_owned)
                    })
                    .collect();
                labels.insert(last.take()?, values);
                rest = &rest[end? + 1..];
            }
            ',' | ' ' => rest = &rest[1..],
            _ => return None,
        }
    }
    Some(labels)
}

/// The metrics table of docs/operations.md, "### Metrics": the reference for
/// every series; a row it cannot read, or a name twice, fails the test.
fn metrics_table() -> BTreeMap<String, Series> {
    let text = doc("docs/operations.md");
    let mut rows = BTreeMap::new();
    // Every line of the table after its header and the line under it.
    for line in section(&text, "### Metrics").lines().filter(|l| l.starts_with('|')).skip(2) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let read = || {
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            Some((name, Series { kind: (*cells.get(2)?).to_owned(), labels: row_labels(cells.get(3)?)? }))
        };
        let (name, row) =
            read().unwrap_or_else(|| panic!("docs/operations.md, metrics table: cannot read the row {line}"));
        assert!(
            rows.insert(name.to_owned(), row).is_none(),
            "docs/operations.md, metrics table: two rows for `{name}`"
        );
    }
    assert!(rows.len() >= 50, "only {} rows read from docs/operations.md's metrics table", rows.len());
    rows
}

/// The series of a Prometheus text body: each `# TYPE` family with the
/// label names and values of its samples (`le` of a histogram's buckets
/// aside).
fn exported_series(body: &str) -> BTreeMap<String, Series> {
    let mut families: BTreeMap<String, Series> = BTreeMap::new();
    for line in body.lines() {
        if let Some(family) = line.strip_prefix("# TYPE ") {
            let (name, kind) = family.split_once(' ').unwrap_or_else(|| panic!("/metrics: {line}"));
            families.insert(name.to_owned(), Series { kind: kind.to_owned(), labels: BTreeMap::new() });
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let sample = line.rsplit_once(' ').map_or(line, |(s, _)| s);
        let (name, mut labels) = sample.split_once('{').unwrap_or((sample, ""));
        let family = ["_bucket", "_sum", "_count", ""]
            .iter()
            .filter_map(|suffix| name.strip_suffix(suffix))
            .find(|f| families.contains_key(*f))
            .unwrap_or_else(|| panic!("/metrics: a sample of no `# TYPE` family: {line}"));
        let series = families.get_mut(family).unwrap();
        while let Some((label, rest)) = labels.split_once("=\"") {
            let end = rest.find('"').unwrap_or_else(|| panic!("/metrics: {line}"));
            let label = label.trim_start_matches(',');
            if label != "le" {
                let values = series.labels.entry(label.to_owned()).or_insert_with(|| Some(BTreeSet::new()));
                values.as_mut().unwrap().insert(rest[..end].to_owned());
            }
            labels = &rest[end + 1..];
        }
    }
    families
}

/// What differs between the table's rows and the exported series, one line
/// per difference, each naming its series.
fn table_differences(table: &BTreeMap<String, Series>, exported: &BTreeMap<String, Series>) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, series) in exported {
        let Some(row) = table.get(name) else {
            problems.push(format!("`{name}` ({}) is exported but has no row in the table", series.kind));
            continue;
        };
        if row.kind != series.kind {
            problems.push(format!("`{name}`: the row says type {}, /metrics says {}", row.kind, series.kind));
        }
        let (documented, found): (Vec<_>, Vec<_>) = (row.labels.keys().collect(), series.labels.keys().collect());
        if documented != found {
            problems.push(format!("`{name}`: the row says labels {documented:?}, /metrics has {found:?}"));
        }
        for (label, values) in &row.labels {
            if let (Some(documented), Some(Some(found))) = (values, series.labels.get(label)) {
                if documented != found {
                    problems.push(format!(
                        "`{name}`, label `{label}`: the row lists {documented:?}, /metrics has {found:?}"
                    ));
                }
            }
        }
    }
    for name in table.keys().filter(|name| !exported.contains_key(*name)) {
        problems.push(format!("`{name}` has a row in the table but is not exported"));
    }
    problems
}

#[test]
fn every_exported_series_has_its_row_and_every_row_is_exported() {
    // Every source kind configured (each with its reconnect series) and the
    // proxy on, so every family and every listed label value is exported.
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
            "--kv-events-replay",
            "tcp://127.0.0.1:2",
            "--stats-connect",
            "tcp://127.0.0.1:3",
            "--sglang-load-connect",
            "tcp://127.0.0.1:4",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    let (code, body) = d.http_get("/metrics");
    assert_eq!(code, 200);
    let exported = exported_series(&body);
    for family in
        ["dpcoord_kv_blocks", "dpcoord_scrapes_total", "dpcoord_proxy_connections", "dpcoord_gateway_requests_total"]
    {
        assert!(exported.contains_key(family), "{family} not exported: {:?}", exported.keys());
    }
    let problems = table_differences(&metrics_table(), &exported);
    assert!(
        problems.is_empty(),
        "docs/operations.md's metrics table (### Metrics) against the binary's /metrics:\n{}",
        problems.join("\n")
    );
    // prefix-cache.md's table of what to watch names no series that is gone.
    let gone: Vec<_> =
        table_metrics(&doc("docs/prefix-cache.md")).into_iter().filter(|m| !exported.contains_key(m)).collect();
    assert!(gone.is_empty(), "docs/prefix-cache.md names series the binary does not export: {gone:?}");
}

/// The metrics are described in one table: PROTOCOL.md §12 links to it and
/// keeps no rows of its own, and every series it names has a row there.
#[test]
fn the_metrics_table_is_the_only_one() {
    let table = metrics_table();
    let text = doc("docs/PROTOCOL.md");
    let rows: Vec<_> = text.lines().filter(|l| l.starts_with("| `dpcoord_")).collect();
    assert!(rows.is_empty(), "docs/PROTOCOL.md has metric rows again; they belong in docs/operations.md: {rows:?}");
    let metrics = text.split("## 12. Metrics").nth(1).expect("PROTOCOL.md has §12").split("\n## ").next().unwrap();
    assert!(metrics.contains("(operations.md#metrics)"), "PROTOCOL.md §12 does not link to operations.md#metrics");
    let named: BTreeSet<&str> =
        metrics.split('`').skip(1).step_by(2).filter(|n| n.starts_with("dpcoord_") && !n.ends_with('_')).collect();
    let unknown: Vec<_> = named.iter().filter(|n| !table.contains_key(**n)).collect();
    assert!(unknown.is_empty(), "PROTOCOL.md §12 names series without a row in docs/operations.md: {unknown:?}");
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
