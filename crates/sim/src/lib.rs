//! The simulator: dpcoord routing simulated DP serving (`dpcoord sim`).
//!
//! Simulated engines publish `StatsUpdate` over ZeroMQ like real ranks;
//! simulated frontends ask dpcoord's route socket where each request goes and
//! hand it to that engine; a prober uses the health socket (or, to reproduce
//! the documented failure, the user route socket). dpcoord runs in-process,
//! unchanged, on private `ipc://` endpoints. Time is virtual and paced
//! against the wall clock (`--speed`), so a 100-second serving run takes a
//! couple of seconds.
//!
//! - `model`: one rank's scheduler and step-time model (pure)
//! - `cluster`: ranks stepping on their own or in lockstep
//! - `workload`: frontends (closed or open loop), seeded lengths
//! - `net`, `link`, `publisher`: the ZeroMQ peers (stats or SGLang load
//!   streams, routes, probes, `resize`)
//! - `spec`, `world`: what defines a run; the discrete-event loop
//! - `record`, `phase`, `summary`, `report`, `svg`, `svg_frame`, `svg_heat`:
//!   results, phases between resizes, each arm's numbers, text, chart
//! - `local`: an in-process daemon on private endpoints
//! - `stepped`: dpcoord's coordinator stepped on the run's virtual clock
//! - `scenario`: health-matrix, slow-rank, dead-rank, hetero-prompts
//! - `hung`: a rank that stops stepping and keeps publishing (hung-rank),
//!   with dpcoord's progress check on and off
//! - `elastic`: scale-up and scale-down under load (8 -> 12 -> 6 ranks)
//! - `pending`: dpcoord's pending placements against the truth, with
//!   `received` counters, reconciled by time, or overwritten by snapshots
//! - `prefix`, `prefix_cache`, `prompts`, `kv_pub`, `oracle`,
//!   `prefix_report`: prefix caches per rank (LRU, prefill of uncached
//!   tokens only), vLLM KV-event batches to dpcoord, shared-prefix / chat /
//!   no-sharing workloads with token ids, the oracle arm, the `cache_aware` sweep
//! - `trace`, `trace_file`, `trace_replay`, `trace_gen`, `trace_bound`:
//!   published request traces (Mooncake, Bailian) replayed on their
//!   timestamps over prefix caches, generated traces of their shape, and
//!   the bound no placement can beat
//! - `vllm_dp`: vLLM's own DP balancing (`stale`) against the same API
//!   servers asking dpcoord, on shared prefixes
//! - `stale`: frontends placing requests themselves (a stale snapshot, or
//!   vLLM 0.33's rule)
//! - `nodes`: API servers and ranks split over nodes (vLLM's hybrid load
//!   balancing), and the round-robin balancer in front of them
//! - `demo`, `demo_view`, `demo_summary`: `dpcoord demo`, its live view,
//!   and its closing comparison and verdict
//! - `args`, `arms`, `error`: `dpcoord sim`'s arguments, the arm names
//!   `--policy` accepts, the errors; below every module that uses them (this
//!   file only declares the modules and runs the scenario `main` is given)

pub mod args;
pub mod arms;
pub mod cluster;
pub mod demo;
pub mod demo_summary;
pub mod demo_view;
pub mod elastic;
pub mod error;
pub mod hung;
pub mod kv_pub;
pub mod link;
pub mod local;
pub mod model;
pub mod net;
pub mod nodes;
pub mod oracle;
pub mod pending;
pub mod phase;
pub mod prefix;
pub mod prefix_cache;
pub mod prefix_report;
pub mod prompts;
pub mod publisher;
pub mod record;
pub mod report;
pub mod scenario;
pub mod spec;
pub mod stale;
pub mod stepped;
pub mod summary;
pub mod svg;
pub mod svg_frame;
pub mod svg_heat;
pub mod trace;
pub mod trace_bound;
pub mod trace_file;
pub mod trace_gen;
pub mod trace_replay;
pub mod vllm_dp;
pub mod workload;
pub mod world;

use std::path::Path;
use std::process::ExitCode;

pub use args::{DaemonMode, Scenario, SimArgs};
pub use error::SimError;

use scenario::Outcome;

/// Makes `--out` before any run, so a path that cannot be a directory is
/// refused at once (exit 2), not after the simulation.
fn make_out(out: &Path) -> Result<(), SimError> {
    std::fs::create_dir_all(out)
        .map_err(|e| SimError::Usage(format!("--out {}: cannot create the directory: {e}", out.display())))
}

fn write_outcome(out: &Path, o: &Outcome) -> Result<(), SimError> {
    let (txt, svg) = (out.join(format!("{}.txt", o.name)), out.join(format!("{}.svg", o.name)));
    for (path, body) in [(&txt, &o.text), (&svg, &o.svg)] {
        std::fs::write(path, body)
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display())))?;
    }
    println!("{}\nwrote {} and {}\n", o.text, txt.display(), svg.display());
    Ok(())
}

/// Runs scenario `s` (`all` runs each in turn), handing each outcome to
/// `emit`; fails after emitting an outcome that broke its promise.
fn run(s: Scenario, a: &SimArgs, emit: &mut dyn FnMut(Outcome) -> Result<(), SimError>) -> Result<(), SimError> {
    let outcome = match s {
        Scenario::All => {
            let each = [Scenario::HealthMatrix, Scenario::SlowRank, Scenario::DeadRank, Scenario::HeteroPrompts];
            for one in each.into_iter().chain([Scenario::HungRank, Scenario::Elastic, Scenario::Pending]) {
                run(one, a, emit)?;
            }
            return Ok(());
        }
        Scenario::HealthMatrix => scenario::health_matrix(a)?,
        Scenario::SlowRank => scenario::slow_rank(a)?,
        Scenario::DeadRank => scenario::dead_rank(a)?,
        Scenario::HeteroPrompts => scenario::hetero_prompts(a)?,
        Scenario::HungRank => hung::hung_rank(a)?,
        Scenario::Elastic => elastic::elastic(a)?,
        Scenario::Pending => pending::pending(a)?,
        Scenario::Prefix => prefix::prefix(a)?,
        Scenario::VllmDp => vllm_dp::vllm_dp(a)?,
        Scenario::Trace => trace::trace(a)?,
    };
    let broken = outcome.broken.clone().map(|b| SimError::Broken { scenario: outcome.name, what: b });
    emit(outcome)?;
    broken.map_or(Ok(()), Err)
}

/// `dpcoord sim`: runs the scenario, prints and writes the reports (or,
/// with `--generate`, writes the trace).
pub fn main(args: &SimArgs) -> ExitCode {
    let result = args.check().and_then(|()| match (args.generate, &args.file) {
        (Some(shape), Some(file)) => trace::write_generated(shape, file, args),
        _ => make_out(&args.out).and_then(|()| run(args.scenario, args, &mut |o| write_outcome(&args.out, &o))),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ SimError::Usage(_)) => {
            eprintln!("dpcoord: error: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("dpcoord sim: error: {e}");
            ExitCode::FAILURE
        }
    }
}
