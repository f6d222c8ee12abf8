//! `dpcoord sim` end to end: the real binary runs dpcoord in-process with
//! simulated engines, frontends and a prober. dpcoord's coordinator is
//! stepped on the run's virtual clock (one event loop), so every run is
//! exactly reproducible and reports are checked to the last digit.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::wait_or_kill;
use dpcoord_daemon::config::PolicyKind;

/// Longest any one run may take (`sim all` with its defaults takes about 16 s unoptimized).
const DEADLINE: Duration = Duration::from_secs(90);

pub(crate) struct Run {
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// Runs `dpcoord sim ARGS --speed 0 --out OUT`, killing it after [`DEADLINE`].
pub(crate) fn sim(out: &Path, args: &[&str]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .arg("sim")
        .args(args)
        .args(["--speed", "0", "--out"])
        .arg(out)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dpcoord sim");
    let reader = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            pipe.read_to_string(&mut s).unwrap();
            s
        })
    };
    let stdout = reader(Box::new(child.stdout.take().unwrap()));
    let stderr = reader(Box::new(child.stderr.take().unwrap()));
    let status = wait_or_kill(&mut child, DEADLINE, &format!("dpcoord sim {args:?}"));
    Run { code: status.code(), stdout: stdout.join().unwrap(), stderr: stderr.join().unwrap() }
}

/// The whitespace-separated cells of the table row starting with `arm` (and `policy`).
fn row<'a>(text: &'a str, arm: &str, policy: &str) -> Vec<&'a str> {
    let cells = |l: &'a str| l.split_whitespace().collect::<Vec<_>>();
    let rows: Vec<Vec<&str>> =
        text.lines().map(cells).filter(|c| c.len() > 2 && c[0] == arm && c[1] == policy).collect();
    assert_eq!(rows.len(), 1, "one row for {arm} {policy} in:\n{text}");
    rows[0].clone()
}

fn cells(s: &str) -> Vec<&str> {
    s.split_whitespace().collect()
}

#[test]
fn health_matrix_health_channel_matches_health_off_and_mixed_traffic_skews() {
    let out = tempfile::tempdir().unwrap();
    let args = ["health-matrix", "--input-tokens", "16384", "--probe-every-ms", "1000"];
    let r = sim(out.path(), &args);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    // arm, policy, completed, lost, retries, input tok/s, ttft p50, ttft p99, std, placements x 8.
    let even = "160 0 0 94,672 2701.4 3376.8 0.00 20 20 20 20 20 20 20 20";
    assert_eq!(row(&r.stdout, "health-off", "round_robin"), cells(&format!("health-off round_robin {even}")));
    assert_eq!(row(&r.stdout, "health-channel", "round_robin"), cells(&format!("health-channel round_robin {even}")));
    // The mixed arm's 30 probes took user placements: [21 22 20 18 21 17 21 20]
    // has squared deviations summing to 20, so std = sqrt(20 / 8) = 1.58.
    let skewed = "mixed-route round_robin 160 0 0 86,257 2701.4 5402.9 1.58 21 22 20 18 21 17 21 20";
    assert_eq!(row(&r.stdout, "mixed-route", "round_robin"), cells(skewed));
    for line in [
        "probes in health-channel (round_robin): 27 (0 failed), per rank 4 4 4 3 3 3 3 3",
        // The mixed arm ran longer, so its prober sent more probes.
        "probes in mixed-route (round_robin): 30 (0 failed), per rank 3 2 4 6 3 7 2 3",
        "health-channel vs health-off: identical placements (std 0.00 vs 0.00), input tokens/s +0.00 %, \
         ttft p99 3376.8 vs 3376.8 ms",
        "mixed-route vs health-off: different placements (std 1.58 vs 0.00), input tokens/s -8.89 %, \
         ttft p99 5402.9 vs 3376.8 ms",
    ] {
        assert!(r.stdout.lines().any(|l| l == line), "missing {line:?} in:\n{}", r.stdout);
    }
    let text = std::fs::read_to_string(out.path().join("health-matrix.txt")).unwrap();
    assert!(r.stdout.starts_with(&text), "the written report is what was printed");
    let svg = std::fs::read_to_string(out.path().join("health-matrix.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
    assert_eq!(svg.matches(">user placements per rank, so far<").count(), 3, "a placements panel per arm");
    assert_eq!(svg.matches(">work held per rank (tokens").count(), 3, "a heat strip per arm");
    // Probes off and on the health channel give even placements, so their
    // 8 lines are drawn as one band; mixed into the route socket they are not.
    assert_eq!(svg.matches(">8 ranks within 1 (0-7)<").count(), 2, "health-off and health-channel only");
}

#[test]
fn open_loop_replicas_still_see_health_isolation() {
    let out = tempfile::tempdir().unwrap();
    let args = ["health-matrix", "--rate", "1.5", "--frontends", "3", "--input-tokens", "16384"];
    let r = sim(out.path(), &args);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    assert!(r.stdout.contains("3 frontend(s), open loop at 1.5 requests/s"), "{}", r.stdout);
    let off = row(&r.stdout, "health-off", "round_robin");
    let on = row(&r.stdout, "health-channel", "round_robin");
    assert_eq!(off[1..], on[1..], "health on its own channel changes nothing");
    assert_eq!(off[2..4], ["160", "0"]);
    assert_eq!(off[8..], ["0.00", "20", "20", "20", "20", "20", "20", "20", "20"]);
}

#[test]
fn every_scenario_runs_every_policy_and_loses_nothing() {
    let out = tempfile::tempdir().unwrap();
    let args = ["all", "--prompts", "24", "--concurrency", "8", "--input-tokens", "4096", "--probe-every-ms", "300"];
    let r = sim(out.path(), &args);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    for name in ["slow-rank", "dead-rank", "hetero-prompts"] {
        let text = std::fs::read_to_string(out.path().join(format!("{name}.txt"))).unwrap();
        for p in PolicyKind::ALL {
            let cells = row(&text, name, p.as_str());
            assert_eq!(cells[2..4], ["24", "0"], "{name} {}: 24 completed, 0 lost", p.as_str());
        }
        assert!(text.contains("zero requests lost in every arm\n"), "{text}");
        assert!(out.path().join(format!("{name}.svg")).is_file());
    }
    let matrix = std::fs::read_to_string(out.path().join("health-matrix.txt")).unwrap();
    assert_eq!(row(&matrix, "health-off", "round_robin")[2..4], ["24", "0"]);
    let elastic = std::fs::read_to_string(out.path().join("elastic.txt")).unwrap();
    assert!(elastic.contains("zero requests lost in every arm\n"), "{elastic}");
    assert!(out.path().join("elastic.svg").is_file());
    let pending = std::fs::read_to_string(out.path().join("pending.txt")).unwrap();
    assert!(pending.contains("zero requests lost in every arm\n"), "{pending}");
    assert!(out.path().join("pending.svg").is_file());
}

#[test]
fn pending_exact_counters_match_the_truth_reconciling_never_misses_and_overwriting_never_double_counts() {
    let out = tempfile::tempdir().unwrap();
    let r = sim(out.path(), &["pending", "--prompts", "40"]);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    // frontends, arm, completed, lost, std, double, missed, max 2x, max 0x, input tok/s,
    // ttft p50, ttft p99, placements x 8.
    for frontends in ["1", "4", "16"] {
        for arm in ["exact", "reconcile", "overwrite"] {
            let cells = row(&r.stdout, frontends, arm);
            assert_eq!(cells[2..4], ["160", "0"], "{frontends} {arm}: 160 completed, 0 lost");
            assert_eq!(cells.len(), 12 + 8, "{frontends} {arm}: one placement count per rank");
            let placed: u64 = cells[12..].iter().map(|c| c.parse::<u64>().unwrap()).sum();
            assert_eq!(placed, 160, "{frontends} {arm}: one placement per request");
            // By construction: with `received` pending is exact; a placement is
            // acknowledged by time only after its hop (20-50 ms < 100 ms), so
            // reconciling never counts one nowhere; overwriting acknowledges at
            // the next snapshot, so it never counts one twice.
            let (double, missed) = ((cells[5], cells[7]), (cells[6], cells[8]));
            match arm {
                "exact" => assert_eq!((double, missed), (("0.000", "0"), ("0.000", "0")), "{frontends} exact"),
                "reconcile" => assert_eq!(missed, ("0.000", "0"), "{frontends} reconcile"),
                _ => assert_eq!(double, ("0.000", "0"), "{frontends} overwrite"),
            }
        }
    }
    for line in [
        "exact: pending equals the truth at every check: holds",
        "reconcile: no placement counted nowhere (missed 0): holds",
        "overwrite: no placement counted twice (double 0): holds",
        "zero requests lost in every arm",
    ] {
        assert!(r.stdout.lines().any(|l| l == line), "missing {line:?} in:\n{}", r.stdout);
    }
    let text = std::fs::read_to_string(out.path().join("pending.txt")).unwrap();
    assert!(r.stdout.starts_with(&text), "the written report is what was printed");
    let svg = std::fs::read_to_string(out.path().join("pending.svg")).unwrap();
    assert_eq!(svg.matches(">user placements per rank, so far<").count(), 9, "3 frontend counts x 3 arms");
    assert_eq!(svg.matches(">work held per rank (tokens").count(), 9, "a heat strip per arm");
}

#[test]
fn elastic_grows_and_shrinks_the_table_without_losing_a_request_or_placing_on_removed_ranks() {
    let out = tempfile::tempdir().unwrap();
    let r = sim(out.path(), &["elastic"]);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    for heading in [
        "phase 1: 8 ranks (0-7) from the start",
        "phase 2: 12 ranks (0-11); at 33.1 s ranks 8-11 start and the operator sends resize 12: \
         they take placements once they publish",
        "phase 3: 6 ranks (0-5); at 54.6 s the operator sends resize 6: ranks 6-11 take no placement \
         from its reply on, finish what they hold and stop",
        "zero requests lost in every arm",
        "no placement on a removed rank after its resize reply, in any arm",
    ] {
        assert!(r.stdout.lines().any(|l| l == heading), "missing {heading:?} in:\n{}", r.stdout);
    }
    // phase, policy, epoch, from s, to s, completed, input tok/s, ttft p50, ttft p99, std, removed,
    // drained s, placements per rank. Epochs: 8 ranks came up (8); the resize to 12 moved it once
    // (9); ranks 8-11 came up (13); the resize to 6 moved it once (14).
    for p in PolicyKind::ALL {
        let mut completed = 0;
        let phases = [("8-ranks", "8", 8, "-"), ("12-ranks", "9", 12, "-"), ("6-ranks", "14", 6, "0")];
        for (phase, epoch, ranks, removed) in phases {
            let cells = row(&r.stdout, phase, p.as_str());
            assert_eq!((cells[2], cells[10]), (epoch, removed), "{phase} {}: epoch, removed", p.as_str());
            assert_eq!(cells.len() - 12, ranks, "{phase} {}: one placement count per rank", p.as_str());
            completed += cells[5].parse::<u64>().unwrap();
        }
        assert_eq!(completed, 160, "{}: every prompt completed in some phase", p.as_str());
    }
    let svg = std::fs::read_to_string(out.path().join("elastic.svg")).unwrap();
    let arms = PolicyKind::ALL.len();
    assert_eq!(svg.matches(">user placements per rank, so far<").count(), arms, "a placements panel per arm");
    assert_eq!(svg.matches(">rank 11<").count(), arms, "every arm's heat strip has a row for rank 11");
    assert_eq!(svg.matches("stroke-dasharray").count(), arms * 2 * 2, "both resizes marked in every panel");
}

/// More of these, with clap's whole messages, in `cli_errors.rs`.
#[test]
fn bad_arguments_exit_2_saying_why() {
    let out = tempfile::tempdir().unwrap();
    let r = sim(out.path(), &["health-matrix", "--rate", "0"]);
    assert_eq!(r.code, Some(2));
    assert_eq!(r.stderr, "dpcoord: error: --rate must be a number > 0, got 0\n");
    let r = sim(out.path(), &["no-such-scenario"]);
    assert_eq!(r.code, Some(2));
    assert!(
        r.stderr.starts_with("dpcoord: error: invalid value 'no-such-scenario' for '<SCENARIO>'\n"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("[possible values: health-matrix, slow-rank, "), "{}", r.stderr);
    assert!(!out.path().join("health-matrix.txt").exists());
    let r = sim(out.path(), &["vllm-dp", "--policy", "least_load"]);
    assert_eq!(r.code, Some(2));
    assert_eq!(
        r.stderr,
        "dpcoord: error: --policy least_load: vllm-dp runs its arms vllm-rule, least_load, cache_aware/events, \
         and takes no --policy\n"
    );
    let r = sim(out.path(), &["slow-rank", "--nodes", "2"]);
    assert_eq!((r.code, r.stderr.as_str()), (Some(2), "dpcoord: error: --nodes 2: only vllm-dp runs over nodes\n"));
}

/// Every scenario, with its defaults, twice: the same bytes on stdout and
/// in every file written.
#[test]
fn sim_all_repeats_byte_for_byte() {
    let out = tempfile::tempdir().unwrap();
    let files = |dir: &Path| {
        let mut names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        names.sort();
        names.into_iter().map(|p| (p.clone(), std::fs::read(p).unwrap())).collect::<Vec<_>>()
    };
    let first = sim(out.path(), &["all"]);
    assert_eq!(first.code, Some(0), "stderr: {}", first.stderr);
    let written = files(out.path());
    assert_eq!(written.len(), 7 * 2, "a report and a chart per scenario: {written:?}");
    let second = sim(out.path(), &["all"]);
    assert_eq!(second.code, Some(0), "stderr: {}", second.stderr);
    assert!(first.stdout == second.stdout, "stdout differs:\n{}\n---\n{}", first.stdout, second.stdout);
    for ((path, a), (_, b)) in written.iter().zip(files(out.path())) {
        assert!(*a == b, "{} differs between the runs", path.display());
    }
}

/// vLLM 0.33's own balancing (vllm-rule) against the same API servers asking
/// dpcoord, at 2 and 4 API servers, twice: exact rows, and the same bytes.
#[test]
fn vllm_dp_compares_vllms_rule_with_dpcoord_and_repeats_byte_for_byte() {
    let out = tempfile::tempdir().unwrap();
    let args = ["vllm-dp", "--requests", "480"];
    let first = sim(out.path(), &args);
    assert_eq!(first.code, Some(0), "stderr: {}", first.stderr);
    let text = std::fs::read_to_string(out.path().join("vllm-dp.txt")).unwrap();
    let svg = std::fs::read_to_string(out.path().join("vllm-dp.svg")).unwrap();
    assert!(first.stdout.starts_with(&text), "the written report is what was printed");
    // arm, API servers, completed, lost, input tok/s, ttft p50/p90/p99 ms, hit %, std, placements per rank.
    for want in [
        "vllm-rule 2 480 0 92,762 687.8 1608.7 2477.0 25.5 1.50 60 62 62 60 59 61 58 58",
        "least_load 2 480 0 95,683 317.5 992.3 2343.0 26.0 1.58 58 60 62 60 59 63 59 59",
        "cache_aware/events 2 480 0 167,517 123.1 992.3 1998.3 72.4 6.32 57 51 68 67 68 59 54 56",
    ] {
        let c = cells(want);
        assert_eq!(row(&text, c[0], c[1]), c, "{want}");
    }
    for arm in ["vllm-rule", "least_load", "cache_aware/events"] {
        let c = row(&text, arm, "4");
        assert_eq!(c[2..4], ["480", "0"], "{arm} at 4 API servers: 480 completed, 0 lost");
        assert_eq!(c[10..].iter().map(|n| n.parse::<u64>().unwrap()).sum::<u64>(), 480, "{arm}: placed once");
    }
    for line in [
        "2 API servers, cache_aware/events vs vllm-rule: input tok/s 167,517 vs 92,762 (x1.81), ttft p50 123.1 vs \
         687.8 ms, p99 1998.3 vs 2477.0 ms (x0.81), hit 72.4 vs 25.5 %",
        "zero requests lost in every arm",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
    }
    assert!(svg.contains(">vllm-dp: throughput and TTFT p90 per arm (solid: 2 API servers, pale: 4)<"), "{svg}");
    assert_eq!(svg.matches(">a bar per arm: 2 frontends solid, 4 frontends pale; 0 at the bottom<").count(), 2);
    let second = sim(out.path(), &args);
    assert_eq!(second.code, Some(0), "stderr: {}", second.stderr);
    assert!(first.stdout == second.stdout, "stdout differs:\n{}\n---\n{}", first.stdout, second.stdout);
    assert!(std::fs::read_to_string(out.path().join("vllm-dp.txt")).unwrap() == text, "vllm-dp.txt differs");
    assert!(std::fs::read_to_string(out.path().join("vllm-dp.svg")).unwrap() == svg, "vllm-dp.svg differs");
}

/// `vllm-dp --nodes 2`: the one-node table as without it, then every arm over
/// 2 nodes of 4 ranks, each placement on its API server's node.
#[test]
fn vllm_dp_over_two_nodes_adds_a_table_and_keeps_each_request_on_its_node() {
    let out = tempfile::tempdir().unwrap();
    let r = sim(out.path(), &["vllm-dp", "--requests", "480", "--nodes", "2"]);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    let text = std::fs::read_to_string(out.path().join("vllm-dp.txt")).unwrap();
    let svg = std::fs::read_to_string(out.path().join("vllm-dp.svg")).unwrap();
    let (one, two) = text.split_once("\nshared-prefix on 2 nodes of 4 ranks").expect("a two-node table");
    let want = "vllm-rule 2 480 0 92,762 687.8 1608.7 2477.0 25.5 1.50 60 62 62 60 59 61 58 58";
    assert_eq!(row(one, "vllm-rule", "2"), cells(want), "the one-node rows are those without --nodes");
    // arm, API servers, completed, lost, input tok/s, ttft p50/p90/p99 ms, hit %, std, placements per rank.
    for want in [
        "vllm-rule 2 480 0 91,903 652.7 1571.4 2477.0 23.4 2.45 62 59 61 58 63 56 58 63",
        "least_load 2 480 0 95,834 319.0 992.3 2477.0 26.8 3.81 57 63 66 54 60 56 63 61",
        "cache_aware/events 4 480 0 147,820 127.3 992.3 2343.0 64.2 4.30 54 63 67 56 65 57 60 58",
    ] {
        let c = cells(want);
        assert_eq!(row(two, c[0], c[1]), c, "{want}");
    }
    for arm in ["vllm-rule", "least_load", "cache_aware/events"] {
        for k in ["2", "4"] {
            let per_rank: Vec<u64> = row(two, arm, k)[10..].iter().map(|n| n.parse().unwrap()).collect();
            let nodes = [per_rank[..4].iter().sum::<u64>(), per_rank[4..].iter().sum::<u64>()];
            assert_eq!(nodes, [240, 240], "{arm} at {k}: the balancer alternates the nodes");
        }
    }
    for line in [
        "2 API servers, cache_aware/events on 2 nodes vs 1: input tok/s 146,055 vs 167,517 (x0.87), ttft p50 125.5 \
         vs 123.1 ms, p99 2210.7 vs 1998.3 ms (x1.11), hit 63.8 vs 72.4 %",
        "2 nodes, 2 API servers, cache_aware/events vs vllm-rule: input tok/s 146,055 vs 91,903 (x1.59), ttft p50 \
         125.5 vs 652.7 ms, p99 2210.7 vs 2477.0 ms (x0.89), hit 63.8 vs 23.4 %",
        "every placement on its API server's node",
        "zero requests lost in every arm",
    ] {
        assert!(two.lines().any(|l| l == line), "missing {line:?} in:\n{two}");
    }
    assert!(svg.contains(">shared-prefix, 2 nodes: input tokens/s<"), "{svg}");
}

/// Rank 3 dies at 29.78 s; its last stats went out less than 100 ms before
/// (a step's end or the heartbeat), so dpcoord's first 100 ms tick after
/// 3000 ms of silence, at 32.8 s, shows it down, and no policy places a
/// request on it from then on.
#[test]
fn dead_rank_is_seen_down_after_down_after_ms_and_takes_no_placement_after() {
    let out = tempfile::tempdir().unwrap();
    let r = sim(out.path(), &["dead-rank"]);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    let heading = "rank 3 died at 29.78 s; a rank silent for engines.down_after_ms (3000 ms) is down at the next \
                   tick (routing.tick_ms 100 ms)";
    assert!(r.stdout.lines().any(|l| l == heading), "missing {heading:?} in:\n{}", r.stdout);
    // policy, shown down at, after death, placements after death, after it showed down.
    let placed_after_death = [
        ("round_robin", "1"),
        ("least_load", "0"),
        ("least_tokens", "1"),
        ("power_of_two", "0"),
        ("cache_aware", "1"),
        ("lmetric", "0"),
    ];
    assert_eq!(placed_after_death.len(), PolicyKind::ALL.len());
    for (policy, after_death) in placed_after_death {
        let line: Vec<&str> = r.stdout.lines().map(cells).find(|c| c.first() == Some(&policy)).unwrap();
        assert_eq!(line[1..], ["32.80", "s", "3.02", "s", after_death, "0"], "{policy}");
    }
    for p in PolicyKind::ALL {
        let cells = row(&r.stdout, "dead-rank", p.as_str());
        assert_eq!(cells[2..4], ["160", "0"], "{}: 160 completed, 0 lost", p.as_str());
    }
}

/// Rank 3 hangs in its step at 7.50 s (30 % of a 40-prompt run) and keeps
/// publishing the same counts; its progress last moved at its last step end
/// before that, so with detection on dpcoord's first 100 ms tick 10000 ms
/// after it, at 17.50 s, shows it stalled, and no policy places a request on it from then on. With it off
/// round_robin keeps sending it requests, each placed again after the
/// frontends' 30 s timeout. Nothing is lost, and a second run writes the
/// same bytes.
#[test]
fn hung_rank_is_seen_stalled_after_stall_after_ms_and_takes_no_placement_after() {
    let out = tempfile::tempdir().unwrap();
    let args = ["hung-rank", "--prompts", "40"];
    let r = sim(out.path(), &args);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    let text = std::fs::read_to_string(out.path().join("hung-rank.txt")).unwrap();
    assert!(r.stdout.starts_with(&text), "the written report is what was printed");
    for line in [
        "rank 3 hangs in its first step from 7.50 s on; a rank with work whose progress stands still for \
         engines.stall_after_ms (10000 ms) is stalled at the next tick (routing.tick_ms 100 ms); a frontend \
         places a request again after 30 s without a token from it",
        "zero requests lost in every arm",
        "round_robin: detect vs off: input tok/s 48,175 vs 30,068 (+60.2 %), ttft p99 34960.0 vs 64960.0 ms, \
         timeouts 4 vs 5",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
    }
    // policy, arm, hung at, shown stalled at, after hang, placements hang->stalled, after it stalled, timeouts.
    assert_eq!(row(&text, "round_robin", "detect")[2..], cells("7.50 s 17.50 s 10.00 s 2 0 4"));
    assert_eq!(row(&text, "round_robin", "off")[2..], cells("7.50 s never - 3 0 5"));
    for p in PolicyKind::ALL {
        let detect = row(&text, p.as_str(), "detect");
        assert_eq!(detect[4..6], ["17.50", "s"], "{}: shown stalled at", p.as_str());
        assert_eq!(detect[9], "0", "{}: no placement after it showed stalled", p.as_str());
        assert_eq!(row(&text, p.as_str(), "off")[4], "never", "{}: never stalled with detection off", p.as_str());
        for arm in ["detect", "off"] {
            assert_eq!(row(&text, arm, p.as_str())[2..4], ["40", "0"], "{arm} {}: 40 completed, 0 lost", p.as_str());
        }
    }
    let svg = std::fs::read_to_string(out.path().join("hung-rank.svg")).unwrap();
    assert_eq!(svg.matches(">user placements per rank, so far<").count(), 2 * PolicyKind::ALL.len(), "a panel per arm");
    let again = sim(out.path(), &args);
    assert_eq!(again.code, Some(0), "stderr: {}", again.stderr);
    assert!(r.stdout == again.stdout, "stdout differs:\n{}\n---\n{}", r.stdout, again.stdout);
    assert!(std::fs::read_to_string(out.path().join("hung-rank.txt")).unwrap() == text, "hung-rank.txt differs");
    assert!(std::fs::read_to_string(out.path().join("hung-rank.svg")).unwrap() == svg, "hung-rank.svg differs");
}

/// Short prompts and long answers: rank 3 hangs at 0.20 s while its
/// requests decode, so their first tokens came; the frontends give up on
/// them once 30 s pass with no token (their rank's progress still), and
/// nothing is lost even with detection off, where round_robin places some
/// on the hung rank again and again.
#[test]
fn hung_rank_places_decoding_requests_again_and_loses_none() {
    let out = tempfile::tempdir().unwrap();
    let args = ["hung-rank", "--prompts", "40", "--input-tokens", "1000", "--output-tokens", "500"];
    let r = sim(out.path(), &[&args[..], &["--policy", "round_robin"]].concat());
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    assert_eq!(row(&r.stdout, "detect", "round_robin")[2..5], ["40", "0", "3"], "completed, lost, retries");
    assert_eq!(row(&r.stdout, "off", "round_robin")[2..5], ["40", "0", "6"], "completed, lost, retries");
    assert_eq!(row(&r.stdout, "round_robin", "detect")[2..], cells("0.20 s 10.30 s 10.10 s 1 0 3"));
    assert_eq!(row(&r.stdout, "round_robin", "off")[2..], cells("0.20 s never - 4 0 6"));
    assert!(r.stdout.lines().any(|l| l == "zero requests lost in every arm"), "{}", r.stdout);
}
