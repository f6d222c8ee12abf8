//! `dpcoord sim trace` end to end on the committed sample (a generated
//! agentic trace in Mooncake's format): the replay, the arms, the bound.
//! dpcoord runs stepped on the simulator's virtual time, so the rows
//! repeat exactly.

use crate::sim::{sim, Run};

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/agentic-sample.jsonl");

/// The cells of the row of `arm` at `fe` frontends in the table headed `table`.
fn row(text: &str, table: &str, arm: &str, fe: &str) -> String {
    let t = text.split("\n\n").find(|t| t.starts_with(table)).unwrap_or_else(|| panic!("{table} in {text}"));
    let rows: Vec<String> = t
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|c| c.len() > 2 && c[0] == arm && c[1] == fe)
        .map(|c| c.join(" "))
        .collect();
    assert_eq!(rows.len(), 1, "one row for {arm} at {fe} in:\n{t}");
    rows[0].clone()
}

#[test]
fn the_sample_replays_exactly_and_no_arm_passes_the_bound() {
    let out = tempfile::tempdir().unwrap();
    let args = ["trace", SAMPLE, "--requests", "60", "--ranks", "2", "--time-scale", "2", "--cache-blocks", "2048"];
    let policies = ["--policy", "round_robin", "--policy", "cache_aware/events", "--policy", "bound"];
    let Run { code, stdout, stderr } = sim(out.path(), &[&args[..], &policies[..]].concat());
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("mooncake trace, 60 of 300 requests over 10 s as recorded"), "{stdout}");
    assert!(stdout.contains("43.2 % of prompt tokens in blocks an earlier request had"), "{stdout}");
    // arm, fe, completed, lost, input tok/s, ttft p50/p90/p99 ms, hit %, std, placements per rank.
    let recorded = [
        "round_robin 1 60 0 8,861 15980.1 35189.3 42111.2 14.9 0.00 30 30",
        "cache_aware/events 1 60 0 8,671 15105.1 30725.3 40873.6 25.8 0.00 30 30",
        // The bound: every reused block a hit (43.2 %, the trace's own reuse), no wait.
        "bound 1 60 0 32,179 321.0 836.8 1087.0 43.2 0.00 0 0",
    ];
    for want in recorded {
        let cells: Vec<&str> = want.split(' ').collect();
        assert_eq!(row(&stdout, "as recorded", cells[0], cells[1]), want);
    }
    // 4 frontends place every request where 1 did.
    for arm in ["round_robin", "cache_aware/events"] {
        let (one, four) = (row(&stdout, "as recorded", arm, "1"), row(&stdout, "as recorded", arm, "4"));
        assert_eq!(one.replacen(" 1 ", " 4 ", 1), four);
    }
    // Nothing shared: no hits anywhere, the bound included.
    assert_eq!(row(&stdout, "no sharing", "bound", "1"), "bound 1 60 0 23,666 621.4 1034.2 1494.5 0.0 0.00 0 0");
    assert!(out.path().join("trace.svg").exists() && out.path().join("trace.txt").exists());
}

#[test]
fn generate_writes_the_sample_again_and_trace_needs_a_file() {
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("agentic.jsonl");
    let f = file.to_str().unwrap();
    let Run { code, stdout, stderr } = sim(out.path(), &["trace", "--generate", "agentic", f, "--requests", "300"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("300 requests over 52 s, mean input 8776 tokens, mean output 179"), "{stdout}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), std::fs::read_to_string(SAMPLE).unwrap());
    let Run { code, stderr, .. } = sim(out.path(), &["trace"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("trace needs FILE"), "{stderr}");
}
