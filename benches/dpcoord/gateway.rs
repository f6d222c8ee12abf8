//! Gateway: the endpoint picker's decision against the `route` op, the same
//! daemon in the same run. A pick is timed from the request body's end of
//! stream (sent over an open `ext_proc` stream, as Envoy does) to the
//! picker's answer with the endpoint; a route is one REQ round trip on the
//! route socket. The picker's own cost is the difference: gRPC, the JSON
//! body, and the in-process hop to the same routing thread. Bodies: a
//! short prompt and one of about 8k tokens (32 KiB of text), keyed by its
//! text (no tokenizer configured); then, on a second daemon with Qwen3's
//! tokenizer configured, an 8.9k-token prompt whose pick includes
//! tokenizing it (`gateway_prompt` times the tokenizer alone).

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3 as ep;
use ep::external_processor_client::ExternalProcessorClient;
use ep::processing_request::Request as In;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::report::{num, ratio, Report, Table};
use crate::support::{call, req_socket, route_query, Daemon, Latencies};
use crate::Mode;

const DP: u32 = 8;
/// `BodySendMode::FULL_DUPLEX_STREAMED`.
const FULL_DUPLEX: i32 = 4;

fn body(prompt: &str) -> Vec<u8> {
    serde_json::json!({"model": "m", "prompt": prompt}).to_string().into_bytes()
}

/// A daemon of `DP` ranks, all up, with the picker on `port` and `gateway`
/// added to its `[gateway]`; its config lives in `dir`.
fn daemon(dir: &std::path::Path, port: u16, gateway: &str) -> Daemon {
    let cfg = dir.join("epp.toml");
    let endpoints: Vec<String> = (0..DP).map(|r| format!("\"10.0.0.{r}:8000\"")).collect();
    std::fs::write(
        &cfg,
        // The ranks report once (bring_up): they must stay up for the whole
        // run, which takes longer than the default stale and down times.
        // Plaintext: the client measured speaks plaintext ext_proc.
        format!(
            "[server]\nepp_bind = \"127.0.0.1:{port}\"\nepp_tls = \"off\"\n[engines]\nstale_after_ms = 3600000\ndown_after_ms = 3600000\n\
             [gateway]\nendpoints = [{}]\n{gateway}",
            endpoints.join(", ")
        ),
    )
    .expect("write the config");
    let d = Daemon::start(DP, &["--config", cfg.to_str().expect("utf-8 path"), "--policy", "least_load"]);
    d.bring_up(&[d.publisher(&d.ctx)], DP);
    d
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port()
}

/// `n` picks of `body`, each timed.
fn picks(rt: &tokio::runtime::Runtime, port: u16, body: &[u8], n: usize) -> Latencies {
    let mut client = rt
        .block_on(ExternalProcessorClient::connect(format!("http://127.0.0.1:{port}")))
        .expect("connect to the picker");
    let mut lat = Latencies::with_capacity(n);
    for _ in 0..n {
        lat.push(rt.block_on(pick(&mut client, body)));
    }
    lat
}

fn message(r: In) -> ep::ProcessingRequest {
    let config = ep::ProtocolConfiguration {
        request_body_mode: FULL_DUPLEX,
        response_body_mode: FULL_DUPLEX,
        ..Default::default()
    };
    ep::ProcessingRequest { request: Some(r), protocol_config: Some(config), ..Default::default() }
}

/// One request through the picker; the time from the body's end to the pick.
async fn pick(client: &mut ExternalProcessorClient<tonic::transport::Channel>, body: &[u8]) -> Duration {
    let (tx, rx) = mpsc::channel(8);
    tx.send(message(In::RequestHeaders(ep::HttpHeaders::default()))).await.expect("open stream");
    let mut replies = client.process(ReceiverStream::new(rx)).await.expect("ext_proc stream").into_inner();
    let start = Instant::now();
    let end = ep::HttpBody { body: body.to_vec(), end_of_stream: true, ..Default::default() };
    tx.send(message(In::RequestBody(end))).await.expect("send the body");
    let first = replies.message().await.expect("a reply").expect("the pick");
    let took = start.elapsed();
    assert!(matches!(first.response, Some(ep::processing_response::Response::RequestHeaders(_))), "{first:?}");
    replies.message().await.expect("the body back");
    // The response ends: the placement completes (pending back to zero).
    tx.send(message(In::ResponseHeaders(ep::HttpHeaders::default()))).await.expect("response headers");
    let done = ep::HttpBody { end_of_stream: true, ..Default::default() };
    tx.send(message(In::ResponseBody(done))).await.expect("response end");
    // Our side ends too, so the picker's stream closes at once.
    drop(tx);
    while let Ok(Some(_)) = replies.message().await {}
    took
}

pub fn run(mode: Mode, report: &mut Report) {
    let n = if mode == Mode::Full { 3000 } else { 20 };
    // Tokenizing takes milliseconds: fewer picks with the tokenizer.
    let tokenized_n = if mode == Mode::Full { 300 } else { 3 };
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let d = daemon(dir.path(), port, "");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let route = req_socket(&d.ctx, &d.route);
    let q = route_query();
    let mut t = Table::new(
        format!("gateway: picker decision vs the route op ({DP} ranks, least_load, {n} sequential each, same run)"),
        &["path", "p50 us", "p99 us", "p50 vs route"],
    );
    let mut routes = Latencies::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        call(&route, &q).expect("a route reply");
        routes.push(t0.elapsed());
    }
    let base = routes.quantile_us(0.5);
    t.row(vec!["route op (REQ)".into(), num(base, 1), num(routes.quantile_us(0.99), 1), "1.00x".into()]);
    let mut worst = 0.0f64;
    let mut row = |what: String, mut lat: Latencies| {
        let p50 = lat.quantile_us(0.5);
        t.row(vec![what, num(p50, 1), num(lat.quantile_us(0.99), 1), ratio(p50, base)]);
        p50 / base
    };
    for (what, bytes) in [("picker, short prompt", 64), ("picker, ~8k-token prompt (32 KiB), text keys", 32 << 10)] {
        let b = body(&"lorem ipsum ".repeat(bytes / 12 + 1));
        worst = worst.max(row(what.into(), picks(&rt, port, &b, n)));
    }
    drop(d);
    // The same decision with the prompt tokenized first, as vLLM would.
    let tokenizer = crate::gateway_prompt::unzip(dir.path());
    let config = crate::gateway_prompt::data().join("tokenizer_config.json");
    let with = format!("tokenizer = {:?}\ntokenizer_config = {:?}\n", tokenizer, config);
    let port = free_port();
    let d = daemon(dir.path(), port, &with);
    let prompt = crate::gateway_prompt::text(if mode == Mode::Full { 400 } else { 20 });
    let what = format!("picker + Qwen3 tokenizer, {} KiB prompt (~8.9k tokens)", prompt.len() >> 10);
    let tokenized = row(what, picks(&rt, port, &body(&prompt), tokenized_n));
    let by_tokenizer = d.metric("dpcoord_gateway_prompts_total{mode=\"tokenizer\"}");
    assert_eq!(by_tokenizer, Some(tokenized_n as f64), "every pick tokenized its prompt");
    drop(d);
    t.print();
    report.target(
        "gateway picker decision p50 vs the route op's round trip (same run)",
        "measured (no target yet)",
        format!("{worst:.2}x at worst without a tokenizer, {tokenized:.0}x with one"),
        true,
    );
}
