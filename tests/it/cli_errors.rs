//! Command-line and configuration errors, as a user meets them: the real
//! binary, its exact stderr and exit status (2 for a usage or configuration
//! error), and nothing written, bound or started.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;

/// What a run of `dpcoord` left: its exit status, stdout and stderr.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `dpcoord ARGS` in `cwd` to its end (killed after 10 s).
fn run_in(cwd: &Path, args: &[&str]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpcoord"))
        .args(args)
        .current_dir(cwd)
        // Start-up's info lines are not what these tests are about.
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The outputs are a few lines: they fit the pipes until the exit.
    let status = wait_or_kill(&mut child, Duration::from_secs(10), "dpcoord");
    let read = |r: &mut dyn std::io::Read| {
        let mut s = String::new();
        r.read_to_string(&mut s).unwrap();
        s
    };
    let stdout = read(&mut child.stdout.take().unwrap());
    let stderr = read(&mut child.stderr.take().unwrap());
    Run { code: status.code(), stdout, stderr }
}

/// Asserts a usage or config error: exit 2, nothing on stdout, `stderr` exactly.
fn assert_refused(r: &Run, stderr: &str) {
    assert_eq!((r.code, r.stdout.as_str(), r.stderr.as_str()), (Some(2), "", stderr));
}

const MORE: &str = "For more information, try '--help'.\n";

#[cfg(feature = "sim")]
#[test]
fn sim_without_a_scenario_names_the_missing_argument_the_scenarios_and_the_usage() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["sim"]);
    let want = format!(
        "dpcoord: error: the following required arguments were not provided:\n  <SCENARIO>\n\n\
         \x20 tip: <SCENARIO> is one of: health-matrix, slow-rank, dead-rank, hetero-prompts, hung-rank, elastic, \
         pending, prefix, vllm-dp, trace, all\n\n\
         Usage: dpcoord sim <SCENARIO> [FILE]\n\n{MORE}"
    );
    assert_refused(&r, &want);
}

#[cfg(feature = "sim")]
#[test]
fn an_unknown_scenario_lists_the_valid_ones() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["sim", "nosuch"]);
    let want = format!(
        "dpcoord: error: invalid value 'nosuch' for '<SCENARIO>'\n  [possible values: health-matrix, slow-rank, \
         dead-rank, hetero-prompts, hung-rank, elastic, pending, prefix, vllm-dp, trace, all]\n\n{MORE}"
    );
    assert_refused(&r, &want);
    assert!(!dir.path().join("sim-out").exists(), "nothing written");
}

#[test]
fn an_unknown_flag_gets_the_usage_and_a_near_name_as_a_tip() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["--dp-size", "2", "--nosuch"]);
    let want =
        format!("dpcoord: error: unexpected argument '--nosuch' found\n\nUsage: dpcoord --dp-size <N>\n\n{MORE}");
    assert_refused(&r, &want);
    let r = run_in(dir.path(), &["--dp-sise", "2"]);
    let want = format!(
        "dpcoord: error: unexpected argument '--dp-sise' found\n\n  tip: a similar argument exists: '--dp-size'\n\n\
         Usage: dpcoord --dp-size <N>\n\n{MORE}"
    );
    assert_refused(&r, &want);
}

#[test]
fn daemon_flags_before_a_subcommand_are_refused_not_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ok.toml");
    std::fs::write(&file, "[engines]\ndp_size = 2\n").unwrap();
    let r = run_in(dir.path(), &["--dp-size", "3", "check-config", file.to_str().unwrap()]);
    let want = format!(
        "dpcoord: error: --dp-size is the daemon's; `dpcoord check-config` does not read it (see `dpcoord \
         check-config --help`)\n\nUsage: dpcoord [OPTIONS] [COMMAND]\n\n{MORE}"
    );
    assert_refused(&r, &want);
    let r = run_in(dir.path(), &["--config", file.to_str().unwrap(), "--policy", "least_load", "probe"]);
    let want = format!(
        "dpcoord: error: --config, --policy are the daemon's; `dpcoord probe` does not read them (see `dpcoord \
         probe --help`)\n\nUsage: dpcoord [OPTIONS] [COMMAND]\n\n{MORE}"
    );
    assert_refused(&r, &want);
}

#[cfg(feature = "sim")]
#[test]
fn sim_flags_get_the_tip_and_usage_too() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["sim", "--polcy", "least_load", "health-matrix"]);
    let want = format!(
        "dpcoord: error: unexpected argument '--polcy' found\n\n  tip: a similar argument exists: '--policy'\n\n\
         Usage: dpcoord sim --policy <NAME> <SCENARIO> [FILE]\n\n{MORE}"
    );
    assert_refused(&r, &want);
    let r = run_in(dir.path(), &["sim", "health-matrix", "--lockstep", "maybe"]);
    let want = format!(
        "dpcoord: error: invalid value 'maybe' for '--lockstep <BOOL>'\n  [possible values: true, false]\n\n{MORE}"
    );
    assert_refused(&r, &want);
    assert!(!dir.path().join("sim-out").exists(), "nothing written");
}

#[cfg(feature = "sim")]
#[test]
fn an_unknown_policy_is_refused_while_parsing_with_the_list() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["sim", "--policy", "fastest", "health-matrix"]);
    let want = format!(
        "dpcoord: error: invalid value 'fastest' for '--policy <NAME>'\n  [possible values: round_robin, least_load, \
         least_tokens, power_of_two, cache_aware, lmetric, lmetric/events, cache_aware/approx, cache_aware/events, \
         oracle, bound]\n\n{MORE}"
    );
    assert_refused(&r, &want);
    let r = run_in(dir.path(), &["demo", "--policy", "fastest"]);
    let want = format!(
        "dpcoord: error: invalid value 'fastest' for '--policy <NAME>'\n  [possible values: round_robin, least_load, \
         least_tokens, power_of_two, cache_aware, lmetric]\n\n{MORE}"
    );
    assert_refused(&r, &want);
    let r = run_in(dir.path(), &["sim", "--workload", "chatty", "prefix"]);
    let want = format!(
        "dpcoord: error: invalid value 'chatty' for '--workload <NAME>'\n  \
         [possible values: shared-prefix, multi-turn-chat, no-sharing]\n\n{MORE}"
    );
    assert_refused(&r, &want);
    assert!(!dir.path().join("sim-out").exists(), "nothing written");
}

#[cfg(feature = "sim")]
#[test]
fn a_policy_the_scenario_does_not_run_is_refused_before_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["sim", "--policy", "oracle", "health-matrix"]);
    assert_refused(
        &r,
        "dpcoord: error: --policy oracle: health-matrix runs a routing.policy: round_robin, least_load, \
         least_tokens, power_of_two, cache_aware, lmetric (`oracle` is an arm of the prefix scenario only)\n",
    );
    // prefix used to run zero arms and write an empty report.
    let r = run_in(dir.path(), &["sim", "--policy", "power_of_two", "prefix"]);
    assert_refused(
        &r,
        "dpcoord: error: --policy power_of_two: prefix runs the arms round_robin, least_load, \
         lmetric/events, cache_aware/approx, cache_aware/events, oracle\n",
    );
    let r = run_in(dir.path(), &["sim", "--policy", "oracle", "trace", "t.jsonl"]);
    assert_refused(
        &r,
        "dpcoord: error: --policy oracle: trace runs the arms round_robin, least_load, \
         lmetric/events, cache_aware/approx, cache_aware/events, bound\n",
    );
    assert!(!dir.path().join("sim-out").exists(), "nothing written");
}

#[cfg(feature = "sim")]
#[test]
fn an_out_path_that_cannot_be_a_directory_is_refused_before_any_run() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("taken");
    std::fs::write(&file, "").unwrap();
    let r = run_in(dir.path(), &["sim", "health-matrix", "--speed", "0", "--out", file.to_str().unwrap()]);
    let want =
        format!("dpcoord: error: --out {}: cannot create the directory: File exists (os error 17)\n", file.display());
    assert_refused(&r, &want);
}

#[test]
fn check_config_help_describes_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["check-config", "--help"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let line = r.stdout.lines().find(|l| l.trim_start().starts_with("<FILE>")).unwrap_or_default();
    assert_eq!(
        line.split_whitespace().collect::<Vec<_>>().join(" "),
        "<FILE> The TOML config file to check, as `--config FILE` would read it (no flags are folded in)"
    );
}

#[test]
fn a_liveness_error_says_which_value_is_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("slow.toml");
    std::fs::write(&file, "[engines]\nstale_after_ms = 5000\n").unwrap();
    let key = "dpcoord: error: engines.down_after_ms: must be above engines.stale_after_ms";
    assert_refused(
        &run_in(dir.path(), &["check-config", file.to_str().unwrap()]),
        &format!("{key} (5000 ms), got 3000 ms (default)\n"),
    );
    let metrics = free_addr().to_string();
    let run = |flags: &[&str]| run_in(dir.path(), &[flags, &["--metrics-bind", &metrics]].concat());
    assert_refused(&run(&["--down-after-ms", "500"]), &format!("{key} (1000 ms, default), got 500 ms\n"));
    let both = ["--stale-after-ms", "5000", "--down-after-ms", "4000"];
    assert_refused(&run(&both), &format!("{key} (5000 ms), got 4000 ms\n"));
}

#[test]
fn a_toml_syntax_error_is_one_line_naming_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "[server]\nroute_bind = \"tcp://127.0.0.1:5570\"\nhealth_bind = tcp://127.0.0.1:5571\n")
        .unwrap();
    let want = format!("dpcoord: error: {}:3:15: invalid string; expected `\"`, `'`\n", file.display());
    let path = file.to_str().unwrap();
    assert_refused(&run_in(dir.path(), &["check-config", path]), &want);
    // The daemon refuses it the same way, before binding anything.
    let metrics = free_addr().to_string();
    assert_refused(&run_in(dir.path(), &["--config", path, "--metrics-bind", &metrics]), &want);
    assert!(std::net::TcpListener::bind(&metrics).is_ok(), "the metrics port was never bound");
    // A relative path reads as given.
    let want = "dpcoord: error: bad.toml:3:15: invalid string; expected `\"`, `'`\n";
    assert_refused(&run_in(dir.path(), &["check-config", "bad.toml"]), want);
}

#[test]
fn a_bind_in_a_missing_directory_names_its_key_and_says_to_create_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no/such/dir");
    for key in ["route", "health", "stats"] {
        let ep = |name: &str| if name == key { format!("ipc://{}/{name}", missing.display()) } else { ipc(&dir, name) };
        let metrics = free_addr().to_string();
        let (route, health, stats) = (ep("route"), ep("health"), ep("stats"));
        let args =
            ["--route-bind", &route, "--health-bind", &health, "--stats-bind", &stats, "--metrics-bind", &metrics];
        let want = format!(
            "dpcoord: error: server.{key}_bind: cannot bind {}: No such file or directory; the directory {} does not \
             exist: create it first (mkdir -p)\n",
            ep(key),
            missing.display()
        );
        assert_refused(&run_in(dir.path(), &args), &want);
        assert!(!missing.exists(), "{key}: nothing created");
    }
}

#[test]
fn clashing_binds_are_refused_naming_both_keys() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let file = dir.path().join("clash.toml");
    let route = format!("tcp://127.0.0.1:{port}");
    std::fs::write(&file, format!("[server]\nroute_bind = \"{route}\"\nhealth_bind = \"{route}\"\n")).unwrap();
    let want = format!(
        "dpcoord: error: server.health_bind: `{route}` clashes with server.route_bind; each bind needs an endpoint \
         of its own\n"
    );
    let path = file.to_str().unwrap();
    assert_refused(&run_in(dir.path(), &["check-config", path]), &want);
    let metrics = free_addr().to_string();
    assert_refused(&run_in(dir.path(), &["--config", path, "--metrics-bind", &metrics]), &want);
    assert!(std::net::TcpListener::bind(&metrics).is_ok(), "the metrics port was never bound");

    // One socket file spelled two ways; the daemon refuses it before creating either.
    let (sock, same) = (ipc(&dir, "q.sock"), format!("ipc://{}/./q.sock", dir.path().display()));
    let args = ["--route-bind", &sock, "--health-bind", &ipc(&dir, "h"), "--stats-bind", &same];
    let r = run_in(dir.path(), &[&args[..], &["--metrics-bind", &metrics]].concat());
    let want = format!(
        "dpcoord: error: server.stats_bind: `{same}` clashes with server.route_bind (`{sock}`); each bind needs an \
         endpoint of its own\n"
    );
    assert_refused(&r, &want);
    assert!(!dir.path().join("q.sock").exists() && !dir.path().join("h").exists(), "nothing bound");

    // The HTTP listener and a ZeroMQ bind on every address of its port.
    let r = run_in(
        dir.path(),
        &["--stats-bind", &format!("tcp://*:{port}"), "--metrics-bind", &format!("127.0.0.1:{port}")],
    );
    let want = format!(
        "dpcoord: error: server.metrics_bind: `127.0.0.1:{port}` clashes with server.stats_bind (`tcp://*:{port}`); \
         each bind needs an endpoint of its own\n"
    );
    assert_refused(&r, &want);
}
