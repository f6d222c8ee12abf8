//! vLLM's `/metrics` scraped through `--vllm-metrics-url`, against the real
//! binary and tiny HTTP servers in the test: bodies bring ranks up with
//! their gauges, endpoints that hang, fail or talk nonsense are counted by
//! result and never delay a route query, and an idle rank stays up because
//! the scrape itself is its heartbeat.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

/// Text rendered by vLLM's own PrometheusStatLogger: 7 waiting, 5 running.
const RANK3: &str = include_str!("../fixtures/vllm_metrics_rank3.prom");

/// What a test server answers to every request.
#[derive(Clone)]
enum Answer {
    /// 200 with this body (which the test may change).
    Metrics(Arc<Mutex<String>>),
    /// Reads the request and never answers.
    Hang,
    Status500,
    /// 200 with a body that is not vLLM's.
    Garbage,
}

/// A body with just the gauges dpcoord reads, at KV usage 0.5.
fn gauges(waiting: u64, running: u64) -> String {
    gauges_kv(waiting, running, "0.5")
}

fn gauges_kv(waiting: u64, running: u64, kv: &str) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv}\n"
    )
}

fn answer(mut stream: TcpStream, how: Answer) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let (status, body) = match how {
        Answer::Metrics(body) => ("200 OK", body.lock().unwrap().clone()),
        Answer::Garbage => ("200 OK", "<html><body>hello</body></html>\n".to_owned()),
        Answer::Status500 => ("500 Internal Server Error", String::new()),
        Answer::Hang => {
            // Held open, silent, until dpcoord gives up on it.
            let _ = stream.read(&mut buf);
            return;
        }
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(reply.as_bytes());
}

/// Serves `how` on a free loopback port; returns its `/metrics` URL.
fn serve(how: Answer) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let how = how.clone();
            std::thread::spawn(move || answer(stream, how));
        }
    });
    url
}

fn metrics_server(body: String) -> (String, Arc<Mutex<String>>) {
    let body = Arc::new(Mutex::new(body));
    (serve(Answer::Metrics(Arc::clone(&body))), body)
}

fn start(urls: &[&str], extra: &[&str]) -> Daemon {
    let dp = urls.len().to_string();
    let mut args = vec!["--dp-size", dp.as_str()];
    for url in urls {
        args.extend_from_slice(&["--vllm-metrics-url", url]);
    }
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

#[test]
fn scraped_bodies_bring_two_ranks_up_with_their_counts() {
    let (url0, body0) = metrics_server(gauges(2, 3));
    let (url1, _) = metrics_server(RANK3.to_owned());
    let d = start(&[&url0, &url1], &FROZEN);
    let r0 = d.await_counts(0, [2, 3, 0, 0, 0]);
    let r1 = d.await_counts(1, [7, 5, 0, 0, 0]);
    assert_eq!((r0["status"].clone(), r1["status"].clone()), (json!("up"), json!("up")));
    *body0.lock().unwrap() = gauges(0, 9);
    d.await_counts(0, [0, 9, 0, 0, 0]);
    let ok = d.metric(r#"dpcoord_scrapes_total{result="ok"}"#).unwrap();
    assert!(ok >= 3.0, "{ok}");
    assert!(d.metric(r#"dpcoord_stats_messages_total{result="ok"}"#).unwrap() >= 3.0);
    assert_eq!(d.metric(r#"dpcoord_stats_messages_total{result="malformed"}"#), Some(0.0));
}

#[test]
fn the_kv_usage_is_shown_per_rank_and_one_out_of_range_fails_the_scrape() {
    let (url0, body0) = metrics_server(gauges_kv(2, 3, "0.75"));
    let (url1, _) = metrics_server(RANK3.to_owned());
    let d = start(&[&url0, &url1], &FROZEN);
    d.await_counts(0, [2, 3, 0, 0, 0]);
    d.await_counts(1, [7, 5, 0, 0, 0]);
    let usage = || d.ranks().iter().map(|r| r["kv_usage"].clone()).collect::<Vec<_>>();
    assert_eq!(usage(), [json!(0.75), json!(0.415)]);
    eventually("the gauges after a tick", || {
        let got = [0, 1].map(|r| d.metric(&format!("dpcoord_engine_kv_usage{{dp_rank=\"{r}\"}}")));
        (got == [Some(0.75), Some(0.415)]).then_some(())
    });
    // Usage 1.5, -0.25, NaN: each body is refused whole (its counts too).
    for kv in ["1.5", "-0.25", "NaN"] {
        let malformed = d.metric(r#"dpcoord_scrapes_total{result="malformed"}"#).unwrap();
        *body0.lock().unwrap() = gauges_kv(9, 9, kv);
        eventually(&format!("usage {kv} refused"), || {
            (d.metric(r#"dpcoord_scrapes_total{result="malformed"}"#).unwrap() > malformed).then_some(())
        });
        assert_eq!(d.ranks()[0]["counts"], json!([2, 3, 0, 0, 0]), "usage {kv}");
        assert_eq!(usage(), [json!(0.75), json!(0.415)], "usage {kv}");
    }
    *body0.lock().unwrap() = gauges_kv(1, 1, "1");
    d.await_counts(0, [1, 1, 0, 0, 0]);
    assert_eq!(usage(), [json!(1.0), json!(0.415)]);
}

#[test]
fn failing_endpoints_are_counted_and_never_delay_a_route_query() {
    let (good, _) = metrics_server(gauges(1, 1));
    let (hang, failing, garbage) = (serve(Answer::Hang), serve(Answer::Status500), serve(Answer::Garbage));
    let refused = format!("http://127.0.0.1:{}/metrics", free_port());
    let d = start(&[&good, &hang, &failing, &garbage, &refused], &FROZEN);
    let c = d.client();
    let mut slowest = Duration::ZERO;
    eventually("every failure counted", || {
        let asked = Instant::now();
        assert_eq!(c.route(json!({"v": 1, "op": "route"})), [0], "only rank 0 is up");
        slowest = slowest.max(asked.elapsed());
        std::thread::sleep(Duration::from_millis(20));
        let counted = |result: &str| d.metric(&format!("dpcoord_scrapes_total{{result=\"{result}\"}}")) >= Some(1.0);
        ["timeout", "http_error", "malformed", "connect_error", "ok"].iter().all(|r| counted(r)).then_some(())
    });
    // The hanging endpoint takes a second per scrape; a query takes none of it.
    assert!(slowest < Duration::from_millis(250), "a route query took {slowest:?}");
    let statuses: Vec<_> = d.ranks().iter().map(|r| r["status"].clone()).collect();
    assert_eq!(statuses, [json!("up"), json!("unknown"), json!("unknown"), json!("unknown"), json!("unknown")]);
    // A scrape in flight does not hold shutdown past its timeout.
    let stopping = Instant::now();
    assert!(d.stop().success());
    assert!(stopping.elapsed() < Duration::from_secs(3), "stop took {:?}", stopping.elapsed());
}

#[test]
fn an_idle_rank_stays_up_at_default_liveness_between_slow_scrapes() {
    let (url, _) = metrics_server(gauges(0, 0));
    // One scrape a second, as long as the default stale_after: the
    // heartbeat (2.5 intervals) keeps the rank from flapping.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dpcoord.toml");
    std::fs::write(&file, "[engines]\nvllm_metrics_interval_ms = 1000\n").unwrap();
    let d = start(&[&url], &["--config", file.to_str().unwrap()]);
    d.wait_status(0, "up");
    let until = Instant::now() + Duration::from_millis(3500);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(d.ranks()[0]["status"], "up");
    }
    assert_eq!(d.state()["epoch"], 1, "never left the routable set");
}
