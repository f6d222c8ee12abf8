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
//! recovers, and waits until it resolves. Three scenarios are normal life
//! that must fire nothing: 16 ranks joining 1.5 s apart after a start with
//! no engine, a single refused query, and ranks publishing KV events that
//! go idle (no placements, no events). Before any target exists,
//! `DpcoordAbsent` fires; a target removed from discovery takes its
//! range-window alerts with it at once. A monitor records every alert that
//! ever fires, and at the end the record must be exactly the expected set.
//! Every dashboard query then runs against the same server.
//!
//! The longest wait is `DpcoordRankFlapping` resolving, 3 minutes after the
//! last loss (its recency window): the file takes about 4 minutes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use rmpv::Value as M;
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

// -- Prometheus -----------------------------------------------------------------------

/// GET over HTTP/1.0 (so the body is never chunked); (status, body).
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let status = raw.split(' ').nth(1)?.parse().ok()?;
    Some((status, raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server on loopback with its config, rules, target list and
/// storage in a private directory; killed when dropped (its log is printed
/// if the test is failing).
struct Prometheus {
    addr: SocketAddr,
    dir: tempfile::TempDir,
    child: Option<Spawned>,
}

impl Prometheus {
    fn start(rules: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let p = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(p("dpcoord.rules.yml"), rules).unwrap();
        std::fs::write(p("targets.json"), "[]").unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files: [\"{}\"]\n\
             scrape_configs:\n  - job_name: dpcoord\n    file_sd_configs:\n      - files: [\"{}\"]\n        refresh_interval: 1s\n",
            p("dpcoord.rules.yml"),
            p("targets.json"),
        );
        std::fs::write(p("prometheus.yml"), config).unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = std::fs::File::create(p("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", p("prometheus.yml")))
            .arg(format!("--storage.tsdb.path={}", p("data")))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `prometheus` ({e}): this test needs the real server, from Debian's \
                     `prometheus` package (apt-get install prometheus; .ci/run installs it)"
                )
            });
        let prom = Prometheus { addr, dir, child: Some(Spawned::from(child)) };
        let start = Instant::now();
        while get(addr, "/-/ready").map(|(s, _)| s) != Some(200) {
            assert!(start.elapsed() < Duration::from_secs(30), "prometheus did not become ready in 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        prom
    }

    /// The `data` of a successful API answer.
    fn api(&self, path: &str) -> Value {
        let (status, body) = get(self.addr, path).unwrap_or_else(|| panic!("prometheus did not answer {path}"));
        assert_eq!(status, 200, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{path}: {body}");
        v["data"].clone()
    }

    /// An instant query's result vector.
    fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api(&format!("/api/v1/query?query={}", urlencode(expr)));
        assert_eq!(data["resultType"], "vector", "{expr}");
        data["result"].as_array().unwrap().clone()
    }

    /// Every pending or firing alert: (labels, state).
    fn alerts(&self) -> Vec<(Labels, String)> {
        let data = self.api("/api/v1/alerts");
        data["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| (serde_json::from_value(a["labels"].clone()).unwrap(), a["state"].as_str().unwrap().to_owned()))
            .collect()
    }

    /// Replaces the discovered targets (written whole, then renamed).
    fn set_targets(&self, targets: &BTreeMap<&str, SocketAddr>) {
        let list: Vec<Value> = targets
            .iter()
            .map(|(name, addr)| json!({"targets": [addr.to_string()], "labels": {"scenario": name}}))
            .collect();
        let tmp = self.dir.path().join("targets.json.tmp");
        std::fs::write(&tmp, serde_json::to_string(&list).unwrap()).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("targets.json")).unwrap();
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        drop(self.child.take());
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default();
            eprintln!("--- prometheus log ---\n{log}");
        }
    }
}

// -- simulated engines and frontends ----------------------------------------------------

/// What one simulated engine publishes: an update every `every` (none while
/// `None`), each finishing `finish` and failing `fail` more requests, plus
/// `burst` extra updates as fast as dpcoord takes them.
#[derive(Clone, Debug)]
struct Feed {
    rank: u32,
    every: Option<Duration>,
    finish: u64,
    fail: u64,
    burst: u64,
    seq: u64,
    finished: u64,
    failed: u64,
    last: Option<Instant>,
}

const HEALTHY: Option<Duration> = Some(Duration::from_millis(100));

/// Engines publishing `StatsUpdate`s to one dpcoord from a thread.
struct Engines {
    feeds: Arc<Mutex<Vec<Feed>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Engines {
    /// Ranks `0..dp` (and any in `extra`), publishing every 100 ms if in `live`, else silent.
    fn start(d: &Daemon, dp: u32, live: &[u32]) -> Engines {
        let feeds: Vec<Feed> = (0..dp)
            .map(|rank| Feed {
                rank,
                every: if live.contains(&rank) { HEALTHY } else { None },
                finish: 1,
                fail: 0,
                burst: 0,
                seq: 0,
                finished: 0,
                failed: 0,
                last: None,
            })
            .collect();
        let feeds = Arc::new(Mutex::new(feeds));
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = d.publisher();
        let (f, s) = (feeds.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let send = |f: &mut Feed| {
                f.seq += 1;
                f.finished += f.finish;
                f.failed += f.fail;
                let counts = [0, 0, f.finished + f.failed, f.finished, f.failed];
                publisher.send(&update(f.rank, 1, f.seq, counts));
            };
            while !s.load(Ordering::Relaxed) {
                let now = Instant::now();
                for feed in f.lock().unwrap().iter_mut() {
                    if feed.every.is_some_and(|p| feed.last.map_or(true, |t| now - t >= p)) {
                        send(feed);
                        feed.last = Some(now);
                    }
                    while feed.burst > 0 {
                        send(feed);
                        feed.burst -= 1;
                        if feed.burst % 100 == 0 {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Engines { feeds, stop, thread: Some(thread) }
    }

    /// Changes the feed of `rank` (adding it if it is not there).
    fn set(&self, rank: u32, change: impl FnOnce(&mut Feed)) {
        let mut feeds = self.feeds.lock().unwrap();
        if !feeds.iter().any(|f| f.rank == rank) {
            let mut f = feeds[0].clone();
            (f.rank, f.every, f.seq, f.finished, f.failed, f.last, f.burst) = (rank, None, 0, 0, 0, None, 0);
            feeds.push(f);
        }
        change(feeds.iter_mut().find(|f| f.rank == rank).unwrap());
    }

    fn pace(&self, rank: u32, every: Option<Duration>) {
        self.set(rank, |f| f.every = every);
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.take().unwrap().join();
    }
}

/// What a frontend sends every tick.
#[derive(Clone, Copy, Debug, Default)]
struct Traffic {
    /// A route query placed by the policy.
    route: bool,
    /// A route query pinned to this rank.
    pin: Option<u64>,
    /// A query with an unknown op (refused as `unknown_op`).
    bad: bool,
}

/// A frontend asking one dpcoord from a thread; a refused route fails the test.
struct Frontend {
    traffic: Arc<Mutex<Traffic>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Frontend {
    fn start(d: &Daemon, every: Duration, traffic: Traffic) -> Frontend {
        let traffic = Arc::new(Mutex::new(traffic));
        let stop = Arc::new(AtomicBool::new(false));
        let c = d.client();
        let (t, s) = (traffic.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let now = *t.lock().unwrap();
                if now.route {
                    c.route(json!({"v": 1, "op": "route"}));
                }
                if let Some(rank) = now.pin {
                    assert_eq!(c.route(json!({"v": 1, "op": "route", "rank": rank})), [rank]);
                }
                if now.bad {
                    assert_eq!(c.error_code(json!({"v": 1, "op": "fly"})), "unknown_op");
                }
                std::thread::sleep(every);
            }
        });
        Frontend { traffic, stop, thread: Some(thread) }
    }

    fn set(&self, traffic: Traffic) {
        *self.traffic.lock().unwrap() = traffic;
    }
}

impl Drop for Frontend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let failed = self.thread.take().unwrap().join().is_err();
        if failed && !std::thread::panicking() {
            panic!("a frontend thread failed (see its panic above)");
        }
    }
}

/// An engine side's KV-cache events (docs/PROTOCOL.md §11a) in vLLM's
/// format, from a thread: one PUB the test binds for all ranks (each batch
/// names its `dp_rank`), sending every 100 ms, for each rank that is on, a
/// batch that stores one new block, as an engine serving requests does. An
/// idle engine stores nothing, so it publishes nothing.
struct KvEvents {
    on: Arc<Mutex<BTreeSet<u32>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl KvEvents {
    /// Binds the PUB on a free loopback port; returns it and its endpoint.
    fn bind(zmq: &zmq::Context) -> (KvEvents, String) {
        let publisher = zmq.socket(zmq::PUB).unwrap();
        publisher.set_linger(0).unwrap();
        let endpoint = loop {
            let e = format!("tcp://127.0.0.1:{}", free_port());
            if publisher.bind(&e).is_ok() {
                break e;
            }
        };
        let on = Arc::new(Mutex::new(BTreeSet::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (o, s) = (on.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let (mut seq, mut block) = (0u64, 0u64);
            while !s.load(Ordering::Relaxed) {
                let ranks: Vec<u32> = o.lock().unwrap().iter().copied().collect();
                for rank in ranks {
                    block += 1;
                    let stored = M::Map(vec![
                        ("type".into(), "BlockStored".into()),
                        ("block_hashes".into(), M::Array(vec![M::from(block)])),
                        ("parent_block_hash".into(), M::Nil),
                        ("token_ids".into(), M::Array(vec![M::from(block), M::from(rank)])),
                        ("block_size".into(), M::from(2)),
                        ("lora_id".into(), M::Nil),
                        ("medium".into(), "GPU".into()),
                    ]);
                    let ts = std::time::SystemTime::UNIX_EPOCH.elapsed().unwrap().as_secs_f64();
                    let batch = msgpack(&M::Array(vec![M::F64(ts), M::Array(vec![stored]), M::from(rank)]));
                    publisher.send_multipart([&b""[..], &seq.to_be_bytes(), &batch], 0).unwrap();
                    seq += 1;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        (KvEvents { on, stop, thread: Some(thread) }, endpoint)
    }

    fn publish(&self, rank: u32, on: bool) {
        let mut ranks = self.on.lock().unwrap();
        if on {
            ranks.insert(rank);
        } else {
            ranks.remove(&rank);
        }
    }
}

impl Drop for KvEvents {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.take().unwrap().join();
    }
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

// -- the scenarios ------------------------------------------------------------------------

/// An alert a scenario must fire: (alertname, severity, labels beyond the target's).
type Expected = (&'static str, &'static str, &'static [(&'static str, &'static str)]);

/// One dpcoord: its rank count, the ranks publishing before Prometheus
/// first scrapes it, what it does, and the alerts it must fire.
struct Scenario {
    name: &'static str,
    dp: u32,
    live: &'static [u32],
    /// dpcoord subscribes to the scenario's [`KvEvents`] (`--kv-events-connect`).
    kv: bool,
    run: fn(&Ctx, &Scenario, &Daemon, &Engines),
    /// (alertname, severity, extra labels) of every alert it must fire.
    fires: &'static [Expected],
}

const ALL4: &[u32] = &[0, 1, 2, 3];
const MIN: Duration = Duration::from_secs(60);

/// The dpcoord is killed, then started again on the same endpoints.
fn down(ctx: &Ctx, sc: &Scenario, d: &Daemon, _: &Engines) {
    ctx.await_scraped(sc.name);
    let status = Command::new("kill").args(["-KILL", &d.pid().to_string()]).status().unwrap();
    assert!(status.success());
    ctx.await_firing(sc.name, &ctx.labels(sc.name, "DpcoordDown", "critical", &[]), MIN);
    let again = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(["--route-bind", &d.route, "--health-bind", &d.health, "--stats-bind", &d.stats])
        .args(["--metrics-bind", &d.metrics.to_string(), "--dp-size", &sc.dp.to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    ctx.keep.lock().unwrap().push(Spawned::from(again));
    wait_all(d, 0..sc.dp, "up");
    ctx.await_resolved(sc.name, MIN);
}

/// Rank 2 goes silent until it is down, then publishes again.
fn rank_down(ctx: &Ctx, sc: &Scenario, d: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    e.pace(2, None);
    d.wait_status(2, "down");
    ctx.await_firing(sc.name, &ctx.labels(sc.name, "DpcoordRankDown", "critical", &[("dp_rank", "2")]), MIN);
    e.pace(2, HEALTHY);
    d.wait_status(2, "up");
    ctx.await_resolved(sc.name, MIN);
}

/// Rank 3 never publishes (15 minutes, here 45 s), then starts.
fn never(ctx: &Ctx, sc: &Scenario, d: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    let want = ctx.labels(sc.name, "DpcoordRankNeverReported", "warning", &[("dp_rank", "3")]);
    ctx.await_firing(sc.name, &want, 2 * MIN);
    e.pace(3, HEALTHY);
    d.wait_status(3, "up");
    ctx.await_resolved(sc.name, MIN);
}

/// Rank 1 publishes every 2.3 s (stale after 1 s, never down), then every 100 ms.
fn stale(ctx: &Ctx, sc: &Scenario, d: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    e.pace(1, Some(Duration::from_millis(2300)));
    d.wait_status(1, "stale");
    let want = ctx.labels(sc.name, "DpcoordRankStatsStale", "warning", &[("dp_rank", "1")]);
    ctx.await_firing(sc.name, &want, 2 * MIN);
    let age = ctx.value(&format!(
        "avg_over_time(dpcoord_engine_stats_age_seconds{{scenario=\"{}\", dp_rank=\"1\"}}[5m])",
        sc.name
    ));
    ctx.log(sc.name, &format!("rank 1's average age {age:.2} s"));
    assert_eq!(
        ctx.value(&format!(
            "dpcoord_engine_routable_changes_total{{scenario=\"{}\", dp_rank=\"1\", change=\"lost\"}}",
            sc.name
        )),
        0.0
    );
    e.pace(1, HEALTHY);
    ctx.await_resolved(sc.name, 2 * MIN);
}

/// Rank 1 goes down and comes back three times in about 15 s.
fn flapping(ctx: &Ctx, sc: &Scenario, d: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    // Healthy samples first, so the silences do not dominate the stale average.
    sleep(10.0);
    for _ in 0..3 {
        e.pace(1, None);
        d.wait_status(1, "down");
        e.pace(1, HEALTHY);
        d.wait_status(1, "up");
    }
    let want = ctx.labels(sc.name, "DpcoordRankFlapping", "warning", &[("dp_rank", "1")]);
    ctx.await_firing(sc.name, &want, MIN);
    let lost =
        format!("dpcoord_engine_routable_changes_total{{scenario=\"{}\", dp_rank=\"1\", change=\"lost\"}}", sc.name);
    let readmitted = lost.replace("lost", "readmitted");
    // The third readmission may land a scrape after the third loss.
    ctx.until("3 losses and 3 readmissions scraped", Duration::from_secs(10), || {
        ((ctx.value(&lost), ctx.value(&readmitted)) == (3.0, 3.0)).then_some(())
    });
    // No more losses: it resolves once the last one is 3 minutes old.
    let took = ctx.await_resolved(sc.name, 4 * MIN);
    assert!(took > 2 * MIN, "resolved after {took:?}, before its 3-minute recency window passed");
}

/// Rank 2 fails every request, then finishes them again.
fn failing(ctx: &Ctx, sc: &Scenario, _: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    e.set(2, |f| (f.finish, f.fail) = (0, 2));
    ctx.await_firing(sc.name, &ctx.labels(sc.name, "DpcoordRankFailing", "critical", &[("dp_rank", "2")]), MIN);
    // Recovered, it serves ten times its usual pace for a while: the
    // failures fall under half of the 5-minute window's completions.
    e.set(2, |f| (f.finish, f.fail) = (10, 0));
    ctx.await_resolved(sc.name, MIN);
}

/// Rank 0 fails every request; its target leaves discovery while the alert fires.
fn vanish(ctx: &Ctx, sc: &Scenario, _: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    e.set(0, |f| (f.finish, f.fail) = (0, 2));
    ctx.await_firing(sc.name, &ctx.labels(sc.name, "DpcoordRankFailing", "critical", &[("dp_rank", "0")]), MIN);
    ctx.remove_target(sc.name);
    // Without the `up` guard the 5-minute window would keep it firing for minutes.
    let took = ctx.await_resolved(sc.name, Duration::from_secs(20));
    assert!(took < Duration::from_secs(20));
    let q = format!("up{{scenario=\"{}\"}}", sc.name);
    ctx.until("the vanished target's up to go", Duration::from_secs(10), || {
        ctx.prom.query(&q).is_empty().then_some(())
    });
}

/// Frontends pin half their queries to rank 0, then stop pinning.
fn skew(ctx: &Ctx, sc: &Scenario, d: &Daemon, _: &Engines) {
    ctx.await_scraped(sc.name);
    let fe = Frontend::start(d, Duration::from_millis(50), Traffic { route: true, pin: Some(0), bad: false });
    ctx.await_firing(sc.name, &ctx.labels(sc.name, "DpcoordUserDispatchSkew", "warning", &[]), 2 * MIN);
    fe.set(Traffic { route: true, ..Traffic::default() });
    // The pinned placements leave dpcoord's 60 s window.
    ctx.await_resolved(sc.name, 2 * MIN);
}

/// A client sends one bad query per ten good ones (9 % refused), then stops;
/// the good traffic of the next 5 minutes, sent here in one burst of pings,
/// brings the 5-minute ratio under 1 %.
fn refusals(ctx: &Ctx, sc: &Scenario, d: &Daemon, _: &Engines) {
    ctx.await_scraped(sc.name);
    let good = Frontend::start(d, Duration::from_millis(50), Traffic { route: true, ..Traffic::default() });
    let bad = Frontend::start(d, Duration::from_millis(500), Traffic { bad: true, ..Traffic::default() });
    ctx.await_firing(sc.name, &ctx.labels(sc.name, "DpcoordRouteErrors", "warning", &[]), 2 * MIN);
    drop(bad);
    let refused = ctx.value(&format!("sum(dpcoord_route_errors_total{{scenario=\"{}\"}})", sc.name));
    let c = d.client();
    for _ in 0..(refused as usize * 120) {
        assert_eq!(c.call(json!({"v": 1, "op": "ping"}))["ok"], json!(true));
    }
    ctx.await_resolved(sc.name, MIN);
    drop(good);
}

/// Every engine stops; a few queries are refused (too few for DpcoordRouteErrors).
fn no_engine(ctx: &Ctx, sc: &Scenario, d: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    for r in 0..sc.dp {
        e.pace(r, None);
    }
    wait_all(d, 0..sc.dp, "down");
    let c = d.client();
    for _ in 0..3 {
        assert_eq!(c.error_code(json!({"v": 1, "op": "route"})), "no_engine_available");
    }
    ctx.await_firing(sc.name, &ctx.labels(sc.name, "DpcoordNoEngineAvailable", "critical", &[]), MIN);
    for r in 0..sc.dp {
        e.pace(r, HEALTHY);
    }
    wait_all(d, 0..sc.dp, "up");
    ctx.await_resolved(sc.name, MIN);
}

/// A stray engine publishes rank 9 (of 4) once a second, about 2.4 % of the
/// updates; then it stops and the others' next minutes of updates, sent here
/// in a burst, bring the ratio under 1 %.
fn rejected(ctx: &Ctx, sc: &Scenario, _: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    e.pace(9, Some(Duration::from_secs(1)));
    let want = ctx.labels(sc.name, "DpcoordStatsRejected", "warning", &[("result", "unknown_rank")]);
    ctx.await_firing(sc.name, &want, 2 * MIN);
    e.pace(9, None);
    let q = |result: &str| format!("dpcoord_stats_messages_total{{scenario=\"{}\", result=\"{result}\"}}", sc.name);
    let (bad, ok) = (ctx.value(&q("unknown_rank")), ctx.value(&q("ok")));
    let burst = ((bad * 150.0 - ok) / sc.dp as f64).max(0.0) as u64;
    for r in 0..sc.dp {
        e.set(r, |f| f.burst = burst);
    }
    ctx.await_resolved(sc.name, MIN);
}

/// Ranks 0 and 1 serve user traffic and publish KV events; rank 1's events
/// stop while its stats and placements go on (its publisher moved), then
/// come back.
fn kv_stopped(ctx: &Ctx, sc: &Scenario, d: &Daemon, _: &Engines) {
    ctx.await_scraped(sc.name);
    let kv = &ctx.kv[sc.name];
    let _fe = Frontend::start(d, Duration::from_millis(50), Traffic { route: true, ..Traffic::default() });
    kv.publish(0, true);
    kv.publish(1, true);
    ctx.await_kv_events(sc.name, &[0, 1]);
    kv.publish(1, false);
    let stopped = Instant::now();
    ctx.log(sc.name, "rank 1's KV events stopped; its stats and placements go on");
    let want = ctx.labels(sc.name, "DpcoordRankKvEventsStopped", "warning", &[("dp_rank", "1")]);
    ctx.await_firing(sc.name, &want, 3 * MIN);
    let took = stopped.elapsed();
    ctx.log(sc.name, &format!("firing {:.1} s after rank 1's events stopped", took.as_secs_f64()));
    assert!(took > 2 * MIN, "fired {took:?} after the events stopped, before its 2-minute window emptied");
    kv.publish(1, true);
    ctx.await_resolved(sc.name, Duration::from_secs(30));
}

/// Normal life with KV events: ranks 0 and 1 serve traffic and publish,
/// then the traffic ends and, as idle engines do, they publish nothing more
/// while their stats go on. Nothing may fire, also well after the rule's
/// 2-minute window has emptied of events. Meanwhile the dpcoords without
/// kv_events under traffic meet the rule's placement and no-event parts:
/// only "has had KV events" keeps them quiet.
fn kv_idle(ctx: &Ctx, sc: &Scenario, d: &Daemon, _: &Engines) {
    ctx.await_scraped(sc.name);
    let kv = &ctx.kv[sc.name];
    let fe = Frontend::start(d, Duration::from_millis(50), Traffic { route: true, ..Traffic::default() });
    kv.publish(0, true);
    kv.publish(1, true);
    ctx.await_kv_events(sc.name, &[0, 1]);
    sleep(5.0);
    let without_kv =
        "sum without (class) (increase(dpcoord_routed_total{class=\"user\", scenario!~\"kv_.*\"}[2m])) >= 10 \
         and sum without (result) (increase(dpcoord_kv_events_total[2m])) == 0 and dpcoord_engine_up == 1";
    let busy = ctx.until("a dpcoord without kv_events under traffic", MIN, || {
        let r = ctx.prom.query(without_kv);
        (!r.is_empty()).then_some(r)
    });
    let names: BTreeSet<&str> = busy.iter().map(|s| s["metric"]["scenario"].as_str().unwrap()).collect();
    ctx.log(
        sc.name,
        &format!("ranks with placements and no KV events, without kv_events: {} in {names:?}", busy.len()),
    );
    drop(fe);
    kv.publish(0, false);
    kv.publish(1, false);
    let idle = Instant::now();
    ctx.log(sc.name, "idle: no placements, no KV events, stats go on");
    // The window empties after 2 minutes, the scaled `for:` is 15 s.
    ctx.until("150 s of idleness", 3 * MIN, || (idle.elapsed() > Duration::from_secs(150)).then_some(()));
    let sel = format!("scenario=\"{}\"", sc.name);
    assert_eq!(ctx.value(&format!("sum(increase(dpcoord_kv_events_total{{{sel}}}[2m]))")), 0.0);
    assert!(ctx.value(&format!("min(sum without (result) (dpcoord_kv_events_total{{{sel}}}))")) > 0.0);
    assert_eq!(ctx.value(&format!("min(dpcoord_engine_up{{{sel}}})")), 1.0);
    assert_eq!(ctx.firing(sc.name), BTreeSet::new());
}

/// Normal life: a dpcoord that has heard from no engine for 5 s, then 16
/// ranks joining 1.5 s apart, then traffic. Nothing may fire. (Traffic
/// during the ramp would skew the first minute's placements towards the
/// early ranks; in production that lasts far less than the skew alert's 10
/// minutes, but not less than its 30 s here: docs/alerts.md.)
fn start16(ctx: &Ctx, sc: &Scenario, d: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    sleep(5.0);
    for r in 0..sc.dp {
        e.pace(r, HEALTHY);
        d.wait_status(r as usize, "up");
        sleep(1.5);
    }
    ctx.log(sc.name, "16 ranks up");
    let _fe = Frontend::start(d, Duration::from_millis(50), Traffic { route: true, ..Traffic::default() });
    // Longer than any scaled `for:` (45 s).
    sleep(50.0);
    let sel = format!("scenario=\"{}\"", sc.name);
    assert_eq!(ctx.value(&format!("sum(dpcoord_engine_routable_changes_total{{{sel}, change=\"joined\"}})")), 16.0);
    assert_eq!(ctx.value(&format!("sum(dpcoord_engine_routable_changes_total{{{sel}, change!=\"joined\"}})")), 0.0);
    assert_eq!(ctx.value(&format!("dpcoord_epoch{{{sel}}}")), 16.0);
    assert_eq!(ctx.firing(sc.name), BTreeSet::new());
}

/// Normal life: one query refused with no_engine_available before the
/// engines come up, then traffic. Nothing may fire. The dashboard's queries
/// run against this dpcoord while its traffic flows.
fn one_refusal(ctx: &Ctx, sc: &Scenario, d: &Daemon, e: &Engines) {
    ctx.await_scraped(sc.name);
    assert_eq!(d.client().error_code(json!({"v": 1, "op": "route"})), "no_engine_available");
    for r in 0..sc.dp {
        e.pace(r, HEALTHY);
    }
    wait_all(d, 0..sc.dp, "up");
    let _fe = Frontend::start(d, Duration::from_millis(100), Traffic { route: true, ..Traffic::default() });
    sleep(60.0);
    let sel = format!("scenario=\"{}\"", sc.name);
    assert_eq!(ctx.value(&format!("sum(dpcoord_route_errors_total{{{sel}}})")), 1.0);
    assert_eq!(ctx.firing(sc.name), BTreeSet::new());
    dashboard(ctx, sc.name, BUSY_EMPTY);
    dashboard(ctx, "rank_down", IDLE_EMPTY);
}

const SCENARIOS: &[Scenario] = &[
    Scenario { name: "down", dp: 2, live: &[0, 1], kv: false, run: down, fires: &[("DpcoordDown", "critical", &[])] },
    Scenario {
        name: "rank_down",
        dp: 4,
        live: ALL4,
        kv: false,
        run: rank_down,
        fires: &[("DpcoordRankDown", "critical", &[("dp_rank", "2")])],
    },
    Scenario {
        name: "never",
        dp: 4,
        live: &[0, 1, 2],
        kv: false,
        run: never,
        fires: &[("DpcoordRankNeverReported", "warning", &[("dp_rank", "3")])],
    },
    Scenario {
        name: "stale",
        dp: 4,
        live: ALL4,
        kv: false,
        run: stale,
        fires: &[("DpcoordRankStatsStale", "warning", &[("dp_rank", "1")])],
    },
    Scenario {
        name: "flapping",
        dp: 4,
        live: ALL4,
        kv: false,
        run: flapping,
        fires: &[("DpcoordRankFlapping", "warning", &[("dp_rank", "1")])],
    },
    Scenario {
        name: "failing",
        dp: 4,
        live: ALL4,
        kv: false,
        run: failing,
        fires: &[("DpcoordRankFailing", "critical", &[("dp_rank", "2")])],
    },
    Scenario {
        name: "vanish",
        dp: 2,
        live: &[0, 1],
        kv: false,
        run: vanish,
        fires: &[("DpcoordRankFailing", "critical", &[("dp_rank", "0")])],
    },
    Scenario {
        name: "skew",
        dp: 4,
        live: ALL4,
        kv: false,
        run: skew,
        fires: &[("DpcoordUserDispatchSkew", "warning", &[])],
    },
    Scenario {
        name: "refusals",
        dp: 4,
        live: ALL4,
        kv: false,
        run: refusals,
        fires: &[("DpcoordRouteErrors", "warning", &[])],
    },
    Scenario {
        name: "no_engine",
        dp: 4,
        live: ALL4,
        kv: false,
        run: no_engine,
        fires: &[("DpcoordNoEngineAvailable", "critical", &[])],
    },
    Scenario {
        name: "rejected",
        dp: 4,
        live: ALL4,
        kv: false,
        run: rejected,
        fires: &[("DpcoordStatsRejected", "warning", &[("result", "unknown_rank")])],
    },
    Scenario {
        name: "kv_stopped",
        dp: 2,
        live: &[0, 1],
        kv: true,
        run: kv_stopped,
        fires: &[("DpcoordRankKvEventsStopped", "warning", &[("dp_rank", "1")])],
    },
    Scenario { name: "kv_idle", dp: 2, live: &[0, 1], kv: true, run: kv_idle, fires: &[] },
    Scenario { name: "start16", dp: 16, live: &[], kv: false, run: start16, fires: &[] },
    Scenario { name: "one_refusal", dp: 4, live: &[], kv: false, run: one_refusal, fires: &[] },
];

// -- the dashboard ------------------------------------------------------------------------

/// Queries that may return nothing on the busy dpcoord, and why.
const BUSY_EMPTY: &[(&str, &str)] = &[];

/// Queries that may return nothing on a dpcoord without user traffic (only
/// the harness' `state` queries), and why.
const IDLE_EMPTY: &[(&str, &str)] = &[
    ("Refused queries by code / A", "nothing was refused: the panel lists only codes with refusals"),
    ("User dispatch skew (stddev / mean) / A", "no user placement in the last minute: no mean to divide by"),
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
