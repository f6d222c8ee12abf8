//! The scenarios: each provokes one alert (or, normal life, none) and recovers.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use super::peers::{Engines, Frontend, Traffic, HEALTHY};
use super::{dashboard, sleep, wait_all, Ctx, BUSY_EMPTY, EXPLAIN_EMPTY, IDLE_EMPTY};
use crate::common::*;

/// An alert a scenario must fire: (alertname, severity, labels beyond the target's).
type Expected = (&'static str, &'static str, &'static [(&'static str, &'static str)]);

/// One dpcoord: its rank count, the ranks publishing before Prometheus
/// first scrapes it, what it does, and the alerts it must fire.
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    pub(crate) dp: u32,
    pub(crate) live: &'static [u32],
    /// dpcoord subscribes to the scenario's [`KvEvents`] (`--kv-events-connect`).
    pub(crate) kv: bool,
    /// Flags beyond `--dp-size` (and `--kv-events-connect`).
    pub(crate) args: &'static [&'static str],
    pub(crate) run: fn(&Ctx, &Scenario, &Daemon, &Engines),
    /// (alertname, severity, extra labels) of every alert it must fire.
    pub(crate) fires: &'static [Expected],
}

const ALL4: &[u32] = &[0, 1, 2, 3];
pub(crate) const MIN: Duration = Duration::from_secs(60);

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

/// Rank 2 keeps publishing but a prober fails it 3 times in a row
/// (`engines.probe_failures`): stalled until a probe succeeds.
fn stalled(ctx: &Ctx, sc: &Scenario, d: &Daemon, _: &Engines) {
    ctx.await_scraped(sc.name);
    let h = d.health_client();
    for _ in 0..3 {
        assert_eq!(h.call(json!({"v": 1, "op": "health_report", "rank": 2, "ok": false}))["ok"], json!(true));
    }
    d.wait_status(2, "stalled");
    ctx.await_firing(sc.name, &ctx.labels(sc.name, "DpcoordRankStalled", "critical", &[("dp_rank", "2")]), MIN);
    assert_eq!(h.call(json!({"v": 1, "op": "health_report", "rank": 2, "ok": true}))["ok"], json!(true));
    d.wait_status(2, "up");
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
    let fe = Frontend::start(d, Duration::from_millis(50), Traffic { route: true, pin: Some(0), ..Traffic::default() });
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

/// Normal life under `cache_aware`: a frontend asks for explained
/// placements of two prompts in turn and reports each delivered one block
/// short of its prediction. The prediction counters move and Prometheus
/// sees exactly what the frontend was told and reported; every dashboard
/// query answers, the delivered/predicted ratio and the error's quantiles
/// included. Nothing may fire.
fn explain(ctx: &Ctx, sc: &Scenario, d: &Daemon, _: &Engines) {
    ctx.await_scraped(sc.name);
    let fe = Frontend::start(d, Duration::from_millis(50), Traffic { explain: true, ..Traffic::default() });
    sleep(20.0);
    let sent = fe.explained();
    drop(fe);
    let scenario = format!("scenario=\"{}\"", sc.name);
    let total = |name: &str, labels: &str| ctx.value(&format!("sum({name}{{{scenario}{labels}}})"));
    let want = [sent.predicted, sent.best, sent.predicted, sent.delivered, sent.reports].map(|v| v as f64);
    ctx.until("the frontend's last reports scraped", MIN, || {
        let got = [
            total("dpcoord_prefix_predicted_tokens_total", ", of=\"chosen\""),
            total("dpcoord_prefix_predicted_tokens_total", ", of=\"best\""),
            total("dpcoord_prefix_reported_tokens_total", ", kind=\"predicted\""),
            total("dpcoord_prefix_reported_tokens_total", ", kind=\"delivered\""),
            total("dpcoord_prefix_prediction_error_tokens_count", ""),
        ];
        (got == want).then_some(())
    });
    ctx.log(sc.name, &format!("explained and reported: {sent:?}"));
    assert!(sent.reports >= 100 && sent.delivered > 0, "{sent:?}");
    let error = sent.predicted - sent.delivered;
    assert_eq!(total("dpcoord_prefix_prediction_error_tokens_sum", ""), error as f64);
    dashboard(ctx, sc.name, EXPLAIN_EMPTY);
    assert_eq!(ctx.firing(sc.name), BTreeSet::new());
}

pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "down",
        dp: 2,
        live: &[0, 1],
        kv: false,
        args: &[],
        run: down,
        fires: &[("DpcoordDown", "critical", &[])],
    },
    Scenario {
        name: "rank_down",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: rank_down,
        fires: &[("DpcoordRankDown", "critical", &[("dp_rank", "2")])],
    },
    Scenario {
        name: "never",
        dp: 4,
        live: &[0, 1, 2],
        kv: false,
        args: &[],
        run: never,
        fires: &[("DpcoordRankNeverReported", "warning", &[("dp_rank", "3")])],
    },
    Scenario {
        name: "stale",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: stale,
        fires: &[("DpcoordRankStatsStale", "warning", &[("dp_rank", "1")])],
    },
    Scenario {
        name: "flapping",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: flapping,
        fires: &[("DpcoordRankFlapping", "warning", &[("dp_rank", "1")])],
    },
    Scenario {
        name: "stalled",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: stalled,
        fires: &[("DpcoordRankStalled", "critical", &[("dp_rank", "2")])],
    },
    Scenario {
        name: "failing",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: failing,
        fires: &[("DpcoordRankFailing", "critical", &[("dp_rank", "2")])],
    },
    Scenario {
        name: "vanish",
        dp: 2,
        live: &[0, 1],
        kv: false,
        args: &[],
        run: vanish,
        fires: &[("DpcoordRankFailing", "critical", &[("dp_rank", "0")])],
    },
    Scenario {
        name: "skew",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: skew,
        fires: &[("DpcoordUserDispatchSkew", "warning", &[])],
    },
    Scenario {
        name: "refusals",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: refusals,
        fires: &[("DpcoordRouteErrors", "warning", &[])],
    },
    Scenario {
        name: "no_engine",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: no_engine,
        fires: &[("DpcoordNoEngineAvailable", "critical", &[])],
    },
    Scenario {
        name: "rejected",
        dp: 4,
        live: ALL4,
        kv: false,
        args: &[],
        run: rejected,
        fires: &[("DpcoordStatsRejected", "warning", &[("result", "unknown_rank")])],
    },
    Scenario {
        name: "kv_stopped",
        dp: 2,
        live: &[0, 1],
        kv: true,
        args: &[],
        run: kv_stopped,
        fires: &[("DpcoordRankKvEventsStopped", "warning", &[("dp_rank", "1")])],
    },
    Scenario { name: "kv_idle", dp: 2, live: &[0, 1], kv: true, args: &[], run: kv_idle, fires: &[] },
    Scenario { name: "start16", dp: 16, live: &[], kv: false, args: &[], run: start16, fires: &[] },
    Scenario {
        name: "explain",
        dp: 2,
        live: &[0, 1],
        kv: false,
        args: &["--policy", "cache_aware"],
        run: explain,
        fires: &[],
    },
    Scenario { name: "one_refusal", dp: 4, live: &[], kv: false, args: &[], run: one_refusal, fires: &[] },
];
