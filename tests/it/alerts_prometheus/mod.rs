//! The alert rules and the Grafana dashboard, run by a real Prometheus
//! (Debian's `prometheus` package; the test fails if it is missing) that
//! scrapes real `dpcoord` processes every second.
//!
//! Prometheus loads `deploy/prometheus/dpcoord.rules.yml` with every `for:`
//! divided by [`FOR_DIVISOR`] and nothing else changed (range windows and
//! thresholds stay as in production). One dpcoord per scenario, all scraped
//! at once through a file_sd target list (the target's `scenario` label names
//! it); each scenario provokes one alert with simulated engines and
//! frontends, waits until exactly that alert fires with the expected labels,
//! recovers, and waits until it resolves. Four scenarios are normal life
//! that must fire nothing: 16 ranks joining 1.5 s apart after a start with
//! no engine, a single refused query, ranks publishing KV events that go
//! idle (no placements, no events), and `cache_aware` placements explained
//! and reported delivered (the prediction counters must move, exactly). Before any target exists,
//! `DpcoordAbsent` fires; a target removed from discovery takes its
//! range-window alerts with it at once. A monitor records every alert that
//! ever fires, and at the end the record must be exactly the expected set.
//! Every dashboard query then runs against the same server.
//!
//! The longest wait is `DpcoordRankFlapping` resolving, 3 minutes after the
//! last loss (its recency window): the test takes about 4 minutes.
//!
//! This file holds the rules' scaling, the state the scenarios share, the
//! dashboard check and the test; `prometheus.rs` runs the server,
//! `peers.rs` the simulated engines, frontends and KV-event publishers, and
//! `scenarios.rs` what each scenario does and must fire.

mod peers;
mod prometheus;
mod scenarios;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::*;
use peers::{Engines, KvEvents};
use prometheus::{urlencode, Prometheus};
use scenarios::{MIN, SCENARIOS};
use serde_json::{json, Value};

/// Every `for:` of the rules is divided by this in the test: 1m -> 3s,
/// 5m -> 15s, 10m -> 30s, 15m -> 45s.
const FOR_DIVISOR: u64 = 20;

const RULES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/dpcoord.rules.yml");
const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/dpcoord.json");

type Labels = BTreeMap<String, String>;

// -- the rules, scaled ----------------------------------------------------------------

/// Seconds in a Prometheus duration such as `90s`, `5m` or `1h`.
fn seconds(d: &str) -> u64 {
    let (n, unit) = d.split_at(d.len() - 1);
    let n: u64 = n.parse().unwrap_or_else(|_| panic!("not a simple duration: {d}"));
    n * match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => panic!("not a simple duration: {d}"),
    }
}

/// The rules with every `for:` value divided by [`FOR_DIVISOR`]; every other
/// line as it is. Also returns how many lines changed.
fn scaled_rules(rules: &str) -> (String, usize) {
    let mut changed = 0;
    let mut out = String::new();
    for line in rules.lines() {
        match line.split_once("for: ") {
            Some((indent, value)) if indent.trim().is_empty() => {
                let s = seconds(value.trim());
                assert_eq!(s % FOR_DIVISOR, 0, "`for: {value}` is not a multiple of {FOR_DIVISOR} s");
                out.push_str(&format!("{indent}for: {}s\n", s / FOR_DIVISOR));
                changed += 1;
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    (out, changed)
}

#[test]
fn rules_are_scaled_only_in_their_for_lines() {
    let text = std::fs::read_to_string(RULES).unwrap();
    let (scaled, changed) = scaled_rules(&text);
    let (a, b): (Vec<&str>, Vec<&str>) = (text.lines().collect(), scaled.lines().collect());
    assert_eq!(a.len(), b.len());
    let differ: Vec<(&str, &str)> = a.iter().zip(&b).filter(|(x, y)| x != y).map(|(x, y)| (*x, *y)).collect();
    assert_eq!(differ.len(), changed);
    assert!(changed >= 8, "the rules have {changed} `for:` lines");
    assert!(differ.iter().all(|(x, y)| x.trim_start().starts_with("for: ") && y.trim_start().starts_with("for: ")));
    assert!(differ.contains(&("        for: 15m", "        for: 45s")), "{differ:?}");
}

// -- the test's shared state --------------------------------------------------------------

struct Ctx {
    prom: Prometheus,
    t0: Instant,
    /// Every scenario's dpcoord metrics address (its `instance` label).
    instances: BTreeMap<&'static str, SocketAddr>,
    /// The targets Prometheus is given.
    targets: Mutex<BTreeMap<&'static str, SocketAddr>>,
    /// Processes to keep until the end (a restarted dpcoord).
    keep: Mutex<Vec<Spawned>>,
    /// The KV-event publishers of the scenarios with `kv`.
    kv: BTreeMap<&'static str, KvEvents>,
    /// Set when any scenario fails, so the others stop waiting.
    failed: AtomicBool,
}

/// Sets [`Ctx::failed`] if its scenario thread unwinds.
struct FailFlag<'a>(&'a AtomicBool);

impl Drop for FailFlag<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

impl Ctx {
    fn log(&self, scenario: &str, what: &str) {
        println!("[{:6.1} s] {scenario}: {what}", self.t0.elapsed().as_secs_f64());
    }

    /// Polls `f` every 250 ms until it returns `Some`; fails after `within`.
    fn until<T>(&self, what: &str, within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
        let start = Instant::now();
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(!self.failed.load(Ordering::Relaxed), "stopped waiting for {what}: another scenario failed");
            assert!(start.elapsed() < within, "timed out after {within:?} waiting for {what}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The labels an alert of `scenario` must carry.
    fn labels(&self, scenario: &str, alert: &str, severity: &str, extra: &[(&str, &str)]) -> Labels {
        let instance = self.instances[scenario].to_string();
        let mut l: Labels = [
            ("alertname", alert),
            ("severity", severity),
            ("job", "dpcoord"),
            ("instance", &instance),
            ("scenario", scenario),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        l.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        l
    }

    /// The labels of the alerts of `scenario` that are firing.
    fn firing(&self, scenario: &str) -> BTreeSet<Labels> {
        let alerts = self.prom.alerts();
        alerts
            .into_iter()
            .filter(|(l, state)| state == "firing" && l.get("scenario").map(String::as_str) == Some(scenario))
            .map(|(l, _)| l)
            .collect()
    }

    /// Waits until `want` fires, failing if any other alert of the scenario fires first.
    fn await_firing(&self, scenario: &str, want: &Labels, within: Duration) {
        let start = Instant::now();
        self.until(&format!("{} to fire", want["alertname"]), within, || {
            let firing = self.firing(scenario);
            let others: Vec<&Labels> = firing.iter().filter(|l| *l != want).collect();
            assert!(others.is_empty(), "{scenario}: unexpected alerts firing: {others:?}");
            firing.contains(want).then_some(())
        });
        self.log(scenario, &format!("{} firing after {:.1} s", want["alertname"], start.elapsed().as_secs_f64()));
    }

    /// Waits until no alert of `scenario` is firing.
    fn await_resolved(&self, scenario: &str, within: Duration) -> Duration {
        let start = Instant::now();
        self.until(&format!("the alerts of {scenario} to resolve"), within, || {
            self.firing(scenario).is_empty().then_some(())
        });
        let took = start.elapsed();
        self.log(scenario, &format!("resolved after {:.1} s", took.as_secs_f64()));
        took
    }

    /// Waits until Prometheus has scraped the scenario's dpcoord.
    fn await_scraped(&self, scenario: &str) {
        let q = format!("up{{job=\"dpcoord\", scenario=\"{scenario}\"}} == 1");
        self.until(&format!("{scenario} to be scraped"), Duration::from_secs(30), || {
            (!self.prom.query(&q).is_empty()).then_some(())
        });
    }

    /// The one value of an instant query that must return one sample.
    fn value(&self, expr: &str) -> f64 {
        let r = self.prom.query(expr);
        assert_eq!(r.len(), 1, "{expr}: {r:?}");
        r[0]["value"][1].as_str().unwrap().parse().unwrap()
    }

    /// Waits until Prometheus has scraped KV events of each of `ranks`.
    fn await_kv_events(&self, scenario: &str, ranks: &[u32]) {
        for r in ranks {
            let q = format!("sum(dpcoord_kv_events_total{{scenario=\"{scenario}\", dp_rank=\"{r}\"}}) > 0");
            self.until(&format!("KV events of rank {r} scraped"), Duration::from_secs(30), || {
                (!self.prom.query(&q).is_empty()).then_some(())
            });
        }
    }

    fn remove_target(&self, scenario: &str) {
        let mut targets = self.targets.lock().unwrap();
        targets.remove(scenario);
        self.prom.set_targets(&targets);
    }
}

fn sleep(secs: f64) {
    std::thread::sleep(Duration::from_secs_f64(secs));
}

fn wait_all(d: &Daemon, ranks: impl IntoIterator<Item = u32>, status: &str) {
    for r in ranks {
        d.wait_status(r as usize, status);
    }
}

// -- the dashboard ------------------------------------------------------------------------

/// The dashboard's queries of `delivered` reports: empty where no frontend
/// reports what the engines delivered.
const NO_REPORTS: [(&str, &str); 4] = [
    ("Delivered / predicted cached tokens, per rank / A", "no delivered report: nothing to divide"),
    ("Prediction error (predicted - delivered) / A", "no delivered report: no quantile"),
    ("Prediction error (predicted - delivered) / B", "no delivered report: no quantile"),
    ("Prediction error (predicted - delivered) / C", "no delivered report: no quantile"),
];

/// Queries that may return nothing on the busy dpcoord, and why.
const BUSY_EMPTY: &[(&str, &str)] = &NO_REPORTS;

/// Queries that may return nothing on the dpcoord whose frontend explains
/// and reports, and why.
const EXPLAIN_EMPTY: &[(&str, &str)] =
    &[("Refused queries by code / A", "nothing was refused: the panel lists only codes with refusals")];

/// Queries that may return nothing on a dpcoord without user traffic (only
/// the harness' `state` queries), and why.
const IDLE_EMPTY: &[(&str, &str)] = &[
    ("Refused queries by code / A", "nothing was refused: the panel lists only codes with refusals"),
    ("User dispatch skew (stddev / mean) / A", "no user placement in the last minute: no mean to divide by"),
    NO_REPORTS[0],
    NO_REPORTS[1],
    NO_REPORTS[2],
    NO_REPORTS[3],
];

/// Every query of the dashboard: (panel title / refId, expr).
fn dashboard_queries() -> Vec<(String, String)> {
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let mut out = Vec::new();
    let mut panels: Vec<&Value> = dash["panels"].as_array().unwrap().iter().collect();
    while let Some(p) = panels.pop() {
        panels.extend(p["panels"].as_array().into_iter().flatten());
        for t in p["targets"].as_array().into_iter().flatten() {
            let key = format!("{} / {}", p["title"].as_str().unwrap(), t["refId"].as_str().unwrap());
            out.push((key, t["expr"].as_str().unwrap().to_owned()));
        }
    }
    out.sort();
    out
}

/// Runs every dashboard query for the dpcoord of `scenario`: each returns
/// data without NaN, or is listed in `may_be_empty` (and is empty).
fn dashboard(ctx: &Ctx, scenario: &str, may_be_empty: &[(&str, &str)]) {
    let instance = ctx.instances[scenario].to_string();
    let values =
        ctx.prom.api(&format!("/api/v1/label/instance/values?match[]={}", urlencode("dpcoord_epoch{job=\"dpcoord\"}")));
    assert!(values.as_array().unwrap().contains(&json!(instance)), "$instance cannot offer {instance}: {values}");
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    let mut problems = Vec::new();
    for (key, expr) in &queries {
        let e = expr.replace("$__rate_interval", "5m").replace("$instance", &instance);
        let result = ctx.prom.query(&e);
        let nan: Vec<&Value> = result.iter().filter(|s| s["value"][1] == "NaN").collect();
        let explained = may_be_empty.iter().any(|(k, _)| k == key);
        if !nan.is_empty() {
            problems.push(format!("{key}: NaN in {nan:?}"));
        }
        if result.is_empty() != explained {
            problems.push(format!("{key}: {} series (listed as may be empty: {explained}): {e}", result.len()));
        }
    }
    assert!(problems.is_empty(), "dashboard on {scenario}:\n{}", problems.join("\n"));
    ctx.log(scenario, &format!("all {} dashboard queries answered", queries.len()));
}

// -- the test -------------------------------------------------------------------------------

#[test]
fn each_alert_fires_and_resolves_in_a_real_prometheus_and_normal_life_fires_nothing() {
    let (rules, changed) = scaled_rules(&std::fs::read_to_string(RULES).unwrap());
    assert!(changed > 0);
    let prom = Prometheus::start(&rules);
    let t0 = Instant::now();
    let zmq = zmq::Context::new();
    let mut kv = BTreeMap::new();
    let coords: Vec<(Daemon, Engines)> = SCENARIOS
        .iter()
        .map(|sc| {
            let mut args = vec!["--dp-size".to_owned(), sc.dp.to_string()];
            args.extend(sc.args.iter().map(|a| (*a).to_owned()));
            if sc.kv {
                let (events, endpoint) = KvEvents::bind(&zmq);
                args.extend(["--kv-events-connect".to_owned(), endpoint]);
                kv.insert(sc.name, events);
            }
            let d = Daemon::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
            let e = Engines::start(&d, sc.dp, sc.live);
            wait_all(&d, sc.live.iter().copied(), "up");
            (d, e)
        })
        .collect();
    let ctx = Ctx {
        prom,
        t0,
        instances: SCENARIOS.iter().zip(&coords).map(|(sc, (d, _))| (sc.name, d.metrics)).collect(),
        targets: Mutex::new(BTreeMap::new()),
        keep: Mutex::new(Vec::new()),
        kv,
        failed: AtomicBool::new(false),
    };
    let stop = AtomicBool::new(false);
    let (failure, seen) = std::thread::scope(|s| {
        let monitor = s.spawn(|| {
            let mut seen: BTreeSet<Labels> = BTreeSet::new();
            while !stop.load(Ordering::Relaxed) {
                seen.extend(ctx.prom.alerts().into_iter().filter(|(_, st)| st == "firing").map(|(l, _)| l));
                sleep(0.25);
            }
            seen
        });
        let _stop = SetOnDrop(&stop);
        // No target yet: nothing to watch, which is an alert of its own.
        let absent: Labels = [("alertname", "DpcoordAbsent"), ("job", "dpcoord"), ("severity", "critical")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let is_firing = |l: &Labels| ctx.prom.alerts().iter().any(|(a, st)| a == l && st == "firing");
        ctx.until("DpcoordAbsent to fire", MIN, || is_firing(&absent).then_some(()));
        ctx.log("-", "DpcoordAbsent firing with no target");
        {
            let mut targets = ctx.targets.lock().unwrap();
            targets.extend(ctx.instances.iter().map(|(k, v)| (*k, *v)));
            ctx.prom.set_targets(&targets);
        }
        ctx.until("DpcoordAbsent to resolve", MIN, || (!is_firing(&absent)).then_some(()));
        ctx.log("-", "DpcoordAbsent resolved: the targets are discovered");
        let runs: Vec<_> = SCENARIOS
            .iter()
            .zip(&coords)
            .map(|(sc, (d, e))| {
                let ctx = &ctx;
                s.spawn(move || {
                    let _flag = FailFlag(&ctx.failed);
                    (sc.run)(ctx, sc, d, e);
                    ctx.log(sc.name, "done");
                })
            })
            .collect();
        let results: Vec<_> = runs.into_iter().map(|h| h.join()).collect();
        let failure = results.into_iter().filter_map(Result::err).next();
        stop.store(true, Ordering::Relaxed);
        (failure, monitor.join().unwrap())
    });
    if let Some(panic) = failure {
        std::panic::resume_unwind(panic);
    }
    let mut want: BTreeSet<Labels> = SCENARIOS
        .iter()
        .flat_map(|sc| sc.fires.iter().map(|(name, sev, extra)| ctx.labels(sc.name, name, sev, extra)))
        .collect();
    want.insert(
        [("alertname", "DpcoordAbsent"), ("job", "dpcoord"), ("severity", "critical")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    );
    assert_eq!(seen, want, "the alerts that ever fired");
    ctx.log("-", "every alert fired exactly where expected");
}
