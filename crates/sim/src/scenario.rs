//! The scenarios: which arms run, with what, and what the report says.
//!
//! Every arm gets a fresh in-process dpcoord and a fresh simulated cluster;
//! arms of one scenario differ only in what the scenario compares (health
//! traffic, or the routing policy). The later scenarios (`hung`, `elastic`,
//! `pending`, `prefix`, `vllm_dp`, `trace`) have modules of their own,
//! standing on this one's arm helpers; `lib.rs` runs the one asked for.

use std::fmt::Write;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use super::args::{DaemonMode, SimArgs};
use super::cluster::EngineSpec;
use super::error::SimError;
use super::link::{Link, ProbeVia};
use super::local::{accepted_policies, DaemonSettings, Local};
use super::model::{Micros, SimEngine, DEFAULT_COST};
use super::stepped::{Core, Wiring};
use super::summary::ArmResult;
use super::workload::{Lengths, Load};
use super::world::{self, ArmSpec, Handoff, Probe, Prompts};
use super::{report, svg};
use dpcoord_daemon::config::keys;

/// One scenario's report and chart.
pub struct Outcome {
    pub name: &'static str,
    pub text: String,
    pub svg: String,
    /// What the scenario promises and this run broke (the run then fails).
    pub broken: Option<String>,
}

/// Virtual time the workload needs at full prefill budget on every rank.
pub(super) fn nominal_us(a: &SimArgs) -> Micros {
    let tokens = a.prompts * u64::from(a.input_tokens + a.output_tokens);
    let per_step = u64::from(a.ranks) * u64::from(a.chunk);
    let step = SimEngine::new(a.chunk, 1, DEFAULT_COST, 100).step_us(a.chunk);
    let compute = tokens.div_ceil(per_step) * step;
    let arrivals = a.rate.map_or(0, |r| (a.prompts as f64 / r * 1e6) as Micros);
    compute.max(arrivals)
}

/// The arm every scenario starts from; `lockstep` is the scenario's default.
pub(super) fn base(a: &SimArgs, name: &str, lockstep: bool) -> ArmSpec {
    let nominal = nominal_us(a);
    ArmSpec {
        name: name.to_owned(),
        ranks: a.ranks,
        engine: EngineSpec { chunk: a.chunk, max_running: 256, cost: DEFAULT_COST, cache: None },
        lockstep: a.lockstep.unwrap_or(lockstep),
        slow: None,
        kill: None,
        hang: None,
        resizes: Vec::new(),
        frontends: a.frontends,
        nodes: 1,
        load: a.rate.map_or(Load::Closed { concurrency: a.concurrency }, |rate| Load::Open { rate }),
        prompts: Some(a.prompts),
        lengths: Lengths { input: (a.input_tokens, a.input_tokens), output: (a.output_tokens, a.output_tokens) },
        probe: None,
        timeout: None,
        seed: a.seed,
        speed: a.speed,
        sync: a.sync,
        sample_every: (nominal / 200).max(10_000),
        handoff: Handoff::default(),
        horizon: nominal.saturating_mul(20).saturating_add(60_000_000),
        prompts_of: Prompts::default(),
        replay: None,
    }
}

pub(super) fn describe(a: &SimArgs, spec: &ArmSpec) -> String {
    let load = match a.rate {
        Some(r) => format!("open loop at {r} requests/s"),
        None => format!("closed loop at concurrency {}", a.concurrency),
    };
    format!(
        "{} ranks{}, chunk {} tokens/step/rank, {} frontend(s), {load}, {} prompts of {} in / {} out tokens, \
         prober every {} ms, speed {}x, seed {}",
        a.ranks,
        if spec.lockstep { " in lockstep" } else { " stepping on their own" },
        a.chunk,
        a.frontends,
        a.prompts,
        a.input_tokens,
        a.output_tokens,
        a.probe_every_ms,
        a.speed,
        a.seed
    )
}

/// Runs one arm on a fresh dpcoord (`--daemon` says which kind).
pub(super) fn run_arm(spec: &ArmSpec, settings: &DaemonSettings, a: &SimArgs) -> Result<ArmResult, SimError> {
    let started = Instant::now();
    let via = spec.probe.map_or(ProbeVia::Health, |p| p.via);
    let result = match a.daemon {
        DaemonMode::Stepped => {
            let (core, eps) = Core::start(settings)?;
            let mut link = Link::wire(Wiring::Stepped(core), &eps, spec.frontends, via, spec.engines(), spec.sync)?
                .with_ttft(a.ttft);
            let rec = world::run(spec, &mut link, &AtomicBool::new(false), None)?;
            rec.summarize(&spec.name, &settings.policy, link.sync_timeouts)
        }
        DaemonMode::Threaded => {
            let local = Local::start(settings, "sim")?;
            let mut link = Link::open(&local.eps, spec.frontends, via, spec.engines(), spec.sync)?
                .with_ttft(a.ttft)
                .with_registry(local.registry.clone());
            let rec = world::run(spec, &mut link, &AtomicBool::new(false), None)?;
            let result = rec.summarize(&spec.name, &settings.policy, link.sync_timeouts);
            drop(link);
            local.stop()?;
            result
        }
    };
    eprintln!("  ran {} ({}) in {:.1} s", spec.name, settings.policy, started.elapsed().as_secs_f32());
    Ok(result)
}

pub(super) fn probe(a: &SimArgs, via: ProbeVia) -> Option<Probe> {
    Some(Probe { every: a.probe_every_ms.max(1) * 1000, via })
}

pub(super) fn health_matrix(a: &SimArgs) -> Result<Outcome, SimError> {
    let policy = a.policies.first().cloned().unwrap_or_else(|| "round_robin".into());
    let settings = DaemonSettings::defaults(a.ranks, &policy);
    let arms = [
        ("health-off", None),
        ("health-channel", probe(a, ProbeVia::Health)),
        ("mixed-route", probe(a, ProbeVia::Route)),
    ];
    let mut results = Vec::new();
    for (name, probe) in arms {
        results.push(run_arm(&ArmSpec { probe, ..base(a, name, true) }, &settings, a)?);
    }
    let title = "health-matrix: health probes off / on the health channel / mixed into the user route socket";
    let setup = describe(a, &base(a, "", true));
    let mut text = format!("{title}\n{setup}\n\n{}\n{}", report::table(&results), report::probes(&results));
    text.push_str(&report::versus(&results[1], &results[0]));
    text.push_str(&report::versus(&results[2], &results[0]));
    text.push_str(&report::caveats(&results));
    Ok(Outcome { name: "health-matrix", svg: svg::chart(title, &results), text, broken: None })
}

/// The policies to compare: `--policy`, or every one this build accepts.
pub(super) fn policies(a: &SimArgs) -> Vec<String> {
    if a.policies.is_empty() {
        accepted_policies()
    } else {
        a.policies.clone()
    }
}

/// Runs `spec` under every policy and compares them.
fn compare(a: &SimArgs, name: &'static str, title: &str, spec: ArmSpec) -> Result<Outcome, SimError> {
    let mut results = Vec::new();
    for policy in &policies(a) {
        results.push(run_arm(&spec, &DaemonSettings::defaults(a.ranks, policy), a)?);
    }
    let setup = describe(a, &spec);
    let mut text = format!("{name}: {title}\n{setup}\n\n{}\n{}", report::table(&results), report::probes(&results));
    let lost: u64 = results.iter().map(|r| r.lost).sum();
    if lost == 0 {
        text.push_str("zero requests lost in every arm\n");
    } else {
        let _ = writeln!(text, "LOST {lost} requests over all arms");
    }
    let _ = writeln!(
        text,
        "highest input tokens/s: {}; lowest ttft p99: {}",
        report::best(&results, |r| r.input_tps().round()),
        report::best(&results, |r| -(r.ttft_p99 as f64))
    );
    let broken = deaths(a, &results, &mut text);
    text.push_str(&report::caveats(&results));
    Ok(Outcome { name, svg: svg::chart(&format!("{name}: {title}"), &results), text, broken })
}

/// When dpcoord showed the rank that died `down`, and the user placements
/// it gave that rank after its death and after showing it down; a
/// placement on a rank shown down breaks the run, as does a stepped run
/// in which dpcoord never showed it down.
fn deaths(a: &SimArgs, results: &[ArmResult], text: &mut String) -> Option<String> {
    let died: Vec<_> = results.iter().filter_map(|r| r.death.map(|d| (r, d))).collect();
    let (_, first) = died.first()?;
    let _ = writeln!(
        text,
        "\nrank {} died at {:.2} s; a rank silent for engines.down_after_ms ({} ms) is down at the next tick \
         (routing.tick_ms {} ms)\n{:<14}  {:>13}  {:>11}  {:>23}  {:>22}",
        first.rank,
        first.at as f64 / 1e6,
        keys::DOWN_AFTER_MS.default,
        keys::TICK_MS.default,
        "policy",
        "shown down at",
        "after death",
        "placements after death",
        "after it showed down"
    );
    let mut broken = Vec::new();
    for (r, d) in &died {
        let (at, after) = match d.down_at {
            Some(t) => (format!("{:.2} s", t as f64 / 1e6), format!("{:.2} s", (t - d.at) as f64 / 1e6)),
            None => ("never".to_owned(), "-".to_owned()),
        };
        let _ = writeln!(text, "{:<14}  {at:>13}  {after:>11}  {:>23}  {:>22}", r.policy, d.after_death, d.after_down);
        if d.after_down > 0 {
            broken.push(format!(
                "{}: {} placements on rank {} after dpcoord showed it down",
                r.policy, d.after_down, d.rank
            ));
        }
        // Its last stats came at most one heartbeat before it died.
        let due = d.at + (keys::DOWN_AFTER_MS.default + keys::TICK_MS.default) * 1000 + world::BEAT;
        let stop = Stop { label: &r.policy, rank: d.rank, at: d.at, ended: d.ended, event: "died", shown: "down" };
        broken.extend(stop.judge(d.down_at, due, a.daemon == DaemonMode::Threaded, text));
    }
    for b in &broken {
        let _ = writeln!(text, "{b}");
    }
    (!broken.is_empty()).then(|| broken.join("; "))
}

/// A rank that stopped (`event`, at `at` µs into the run, which ended at
/// `ended`) and what dpcoord had to show of it (`shown`: down, stalled).
pub(super) struct Stop<'a> {
    pub label: &'a str,
    pub rank: u32,
    pub at: Micros,
    pub ended: Micros,
    pub event: &'a str,
    pub shown: &'a str,
}

impl Stop<'_> {
    /// The breach, if dpcoord showed the stop (`shown_at`) after `due` or
    /// never; a run that ended before `due` says so in `text` instead. A
    /// threaded daemon is not timed (its clock is the wall's).
    pub fn judge(&self, shown_at: Option<Micros>, due: Micros, threaded: bool, text: &mut String) -> Option<String> {
        let Stop { label, rank, at, ended, event, shown } = *self;
        match shown_at {
            None if threaded => None,
            None if ended < due => {
                let _ = writeln!(text, "(the run ended {:.2} s after rank {rank} {event})", (ended - at) as f64 / 1e6);
                None
            }
            None => Some(format!("{label}: dpcoord never showed rank {rank} {shown}")),
            Some(t) if t > due => Some(format!(
                "{label}: dpcoord showed rank {rank} {shown} only {:.2} s after it {event}",
                (t - at) as f64 / 1e6
            )),
            Some(_) => None,
        }
    }
}

pub(super) fn slow_rank(a: &SimArgs) -> Result<Outcome, SimError> {
    let spec = ArmSpec { slow: Some((0, 50)), probe: probe(a, ProbeVia::Health), ..base(a, "slow-rank", false) };
    compare(a, "slow-rank", "rank 0 runs at half speed", spec)
}

pub(super) fn dead_rank(a: &SimArgs) -> Result<Outcome, SimError> {
    let rank = 3 % a.ranks;
    let at = nominal_us(a) * 3 / 10;
    let spec = ArmSpec { kill: Some((rank, at)), probe: probe(a, ProbeVia::Health), ..base(a, "dead-rank", true) };
    let down = keys::DOWN_AFTER_MS.default;
    let seen = match (a.daemon, a.speed) {
        (DaemonMode::Stepped, _) => format!("{down} ms of virtual time"),
        (DaemonMode::Threaded, x) if x > 0.0 => {
            format!("{down} ms of wall time, {:.1} s of virtual time", down as f64 / 1000.0 * x)
        }
        (DaemonMode::Threaded, _) => format!("{down} ms of wall time, maybe never in an unpaced run"),
    };
    let title = format!(
        "rank {rank} dies at {:.1} s and its requests are retried; dpcoord sees it down after {seen}",
        at as f64 / 1e6
    );
    compare(a, "dead-rank", &title, spec)
}

pub(super) fn hetero_prompts(a: &SimArgs) -> Result<Outcome, SimError> {
    let lo = (a.input_tokens / 16).max(1);
    let hi = a.input_tokens.saturating_mul(2).saturating_sub(lo).max(lo);
    let mut spec = ArmSpec { probe: probe(a, ProbeVia::Health), ..base(a, "hetero-prompts", true) };
    spec.lengths.input = (lo, hi);
    compare(a, "hetero-prompts", &format!("prompt lengths uniform in {lo}..={hi} tokens"), spec)
}
