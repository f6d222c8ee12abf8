//! The gateway endpoint picker's configuration errors (the real binary,
//! exit 2, the key named) and the route socket's additions it rests on:
//! `among` and `finished` (docs/PROTOCOL.md §4, §6). The picker's gRPC
//! stream itself is driven from Envoy's protos in
//! clients/python/tests/test_gateway_epp.py.

use serde_json::json;

use crate::common::*;

/// `check-config FILE` and the daemon on it: both exit 2 saying `why`.
fn refused(toml: &str, why: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, toml).unwrap();
    let path = path.to_str().unwrap();
    let (code, err) = run_to_end(&["check-config", path]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(why), "{err}");
    let (code, err) = run_to_end(&["--config", path, "--metrics-bind", &free_addr().to_string()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(why), "{err}");
}

#[test]
fn a_bad_picker_configuration_is_refused_naming_the_key() {
    let eps = r#"[gateway]
endpoints = ["10.0.0.1:8000", "10.0.0.2:8000"]
"#;
    refused(
        &format!("[server]\nepp_bind = \"nope\"\n[engines]\ndp_size = 2\n{eps}"),
        "server.epp_bind: `nope` is not HOST:PORT",
    );
    refused(
        "[server]\nepp_bind = \"127.0.0.1:9002\"\n",
        "gateway.endpoints: server.epp_bind is set: name each rank's host:port here",
    );
    refused(
        &format!("[engines]\ndp_size = 3\n{eps}"),
        "gateway.endpoints: 2 endpoints for engines.dp_size = 3: one per rank, in rank order",
    );
    refused(
        &format!("[engines]\ndp_size = 2\n{eps}rank_header = \"x-data-parallel-rank\"\n"),
        "gateway.endpoints: 2 endpoints with gateway.rank_header: one endpoint serves every rank",
    );
    refused("[gateway]\nendpoints = [\"no-port\"]\n", "gateway.endpoints: `no-port` is not HOST:PORT");
    refused("[gateway]\nrank_header = \"a b\"\n", "gateway.rank_header: `a b` is not a header name");
    // The shipped gateway overlay's ConfigMap, before its init container ran.
    refused(
        "[engines]\ndp_size = 1\n[gateway]\nendpoints = [\"@POD_IP@:8000\"]\n",
        "gateway.endpoints: `@POD_IP@:8000`: the host `@POD_IP@` is neither an IP address nor a DNS name \
         (a placeholder left unrendered?)",
    );
    refused(
        "[engines]\ndp_size = 1\n[gateway]\nendpoints = [\"10.0.0.1:8000\"]\nrank_header = \"x-data-parallel-rank\"\n\
         fallbacks = 2\n",
        "gateway.fallbacks: with gateway.rank_header one endpoint serves every rank",
    );
}

/// The picker's TLS keys (`server.epp_tls`, `epp_cert`, `epp_key`): the
/// files only with `files`, both then, each readable and holding its PEM
/// block; a pair that does not go together is refused by `check-config`
/// and the start alike (the gateway parses it: crates/gateway/src/tls.rs).
#[test]
fn a_bad_picker_tls_configuration_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let picker = |tls: &str| {
        format!(
            "[server]\nepp_bind = \"127.0.0.1:{}\"\n{tls}[engines]\ndp_size = 1\n\
             [gateway]\nendpoints = [\"10.0.0.1:8000\"]\n",
            free_addr().port()
        )
    };
    refused(&picker("epp_tls = \"on\"\n"), "server.epp_tls: unknown mode \"on\"; available: self_signed, files, off");
    refused(
        &picker("epp_tls = \"files\"\n"),
        "server.epp_cert: server.epp_tls = \"files\" needs the certificate chain's PEM file (leaf first) here",
    );
    // A PEM block of the right shape; what it holds is the gateway's to parse.
    let cert = file("cert.pem", "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n");
    refused(
        &picker(&format!("epp_tls = \"files\"\nepp_cert = \"{cert}\"\n")),
        "server.epp_key: server.epp_tls = \"files\" needs the certificate's private key, a PEM file here",
    );
    refused(
        &picker(&format!("epp_cert = \"{cert}\"\n")),
        "server.epp_cert: is read only with server.epp_tls = \"files\" (it is \"self_signed\")",
    );
    refused(
        &picker("epp_tls = \"off\"\nepp_key = \"/k.pem\"\n"),
        "server.epp_key: is read only with server.epp_tls = \"files\" (it is \"off\")",
    );
    let missing = dir.path().join("missing.pem");
    let missing = missing.to_str().unwrap();
    refused(
        &picker(&format!("epp_tls = \"files\"\nepp_cert = \"{missing}\"\nepp_key = \"{cert}\"\n")),
        &format!("server.epp_cert: cannot read `{missing}`: No such file or directory"),
    );
    refused(
        &picker(&format!("epp_tls = \"files\"\nepp_cert = \"{cert}\"\nepp_key = \"{cert}\"\n")),
        &format!("server.epp_key: `{cert}` holds no PEM private key (-----BEGIN PRIVATE KEY-----): only `CERTIFICATE`"),
    );
    let key = file("key.pem", "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n");
    refused(
        &picker(&format!("epp_tls = \"files\"\nepp_cert = \"{key}\"\nepp_key = \"{key}\"\n")),
        &format!("server.epp_cert: `{key}` holds no PEM certificate (-----BEGIN CERTIFICATE-----): only `PRIVATE KEY`"),
    );
    // Blocks of the right shape whose contents are no certificate or key:
    // the gateway's parse refuses them, naming the key.
    refused(
        &picker(&format!("epp_tls = \"files\"\nepp_cert = \"{cert}\"\nepp_key = \"{key}\"\n")),
        &format!("server.epp_key: `{key}` is not a key rustls can sign with"),
    );
}

/// `:PORT`, as the Inference Extension writes its picker's port, is every
/// interface; names and IPv6 addresses are endpoints too (checked only:
/// nothing binds here).
#[test]
fn a_picker_on_every_interface_and_named_endpoints_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let toml = "[server]\nepp_bind = \":9002\"\nproxy_bind = \":8000\"\n[engines]\ndp_size = 3\n\
                [gateway]\nendpoints = [\"vllm-0.vllm.svc:8000\", \"[fd00::1]:8000\", \"10.0.0.3:8000\"]\n";
    std::fs::write(&path, toml).unwrap();
    let (code, err) = run_to_end(&["check-config", path.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn a_busy_picker_port_stops_start_up_naming_the_key() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let addr = busy.local_addr().unwrap();
    std::fs::write(
        &path,
        format!("[server]\nepp_bind = \"{addr}\"\n[engines]\ndp_size = 1\n[gateway]\nendpoints = [\"a:1\"]\n"),
    )
    .unwrap();
    let (code, err) = run_to_end(&["--config", path.to_str().unwrap(), "--metrics-bind", &free_addr().to_string()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("cannot listen on {addr} (server.epp_bind)")), "{err}");
}

#[test]
fn among_restricts_the_pick_and_finished_completes_it() {
    let d = Daemon::frozen_up("3", &[0, 1, 2]);
    let c = d.client();
    let route = |among: &[u64]| c.route(json!({"v": 1, "op": "route", "among": among}));
    for _ in 0..3 {
        assert_eq!(route(&[2]), vec![2]);
    }
    assert_eq!(route(&[0, 1]), vec![0]);
    assert_eq!(route(&[0, 1]), vec![1]);
    assert_eq!(d.routed_pending(), vec![(1, 1), (1, 1), (3, 3)]);
    let r = c.call(json!({"v": 1, "op": "route", "among": [7]}));
    assert_eq!(r["error"]["code"], json!("invalid_rank"), "{r}");
    let r = c.call(json!({"v": 1, "op": "route", "among": "2"}));
    assert_eq!(r["error"]["code"], json!("bad_request"), "{r}");
    // Finished on the rank placed: pending falls at once.
    let ok = |q| assert_eq!(c.call(q)["ok"], json!(true));
    ok(json!({"v": 1, "op": "finished", "rank": 2, "n": 2}));
    // Served by rank 0 instead of rank 1: the placement moves and is over.
    ok(json!({"v": 1, "op": "finished", "rank": 0, "placed": 1}));
    assert_eq!(d.routed_pending(), vec![(2, 1), (0, 0), (3, 1)]);
    // Placed on rank 2, sent nowhere dpcoord counts: withdrawn, nothing charged.
    ok(json!({"v": 1, "op": "finished", "placed": 2}));
    assert_eq!(d.routed_pending(), vec![(2, 1), (0, 0), (2, 0)]);
    let r = c.call(json!({"v": 1, "op": "finished"}));
    assert_eq!(r["error"]["code"], json!("bad_request"), "{r}");
    let r = d.health_client().call(json!({"v": 1, "op": "finished", "rank": 0}));
    assert_eq!(r["error"]["code"], json!("unknown_op"), "{r}");
}

#[test]
fn among_with_no_routable_rank_is_no_engine_available() {
    let d = Daemon::frozen_up("3", &[0]);
    let r = d.client().call(json!({"v": 1, "op": "route", "among": [1, 2]}));
    assert_eq!(r["error"]["code"], json!("no_engine_available"), "{r}");
    assert_eq!(d.routed_pending(), vec![(0, 0); 3]);
}

#[test]
fn fallbacks_list_the_next_ranks_and_shed_waiting_refuses_full_queues() {
    let d = Daemon::frozen_up("3", &[0, 1, 2]);
    let c = d.client();
    let r = c.call(json!({"v": 1, "op": "route", "fallbacks": 2}));
    assert_eq!((&r["ranks"], &r["fallbacks"]), (&json!([0]), &json!([1, 2])), "{r}");
    // Rank 0 holds a pending placement: it comes after the idle rank 2.
    let r = c.call(json!({"v": 1, "op": "route", "fallbacks": 16}));
    assert_eq!((&r["ranks"], &r["fallbacks"]), (&json!([1]), &json!([2, 0])), "{r}");
    let r = c.call(json!({"v": 1, "op": "route", "rank": 1, "fallbacks": 2}));
    assert_eq!((&r["ranks"], &r["fallbacks"]), (&json!([1]), &json!([])), "a pin has none: {r}");
    let r = c.call(json!({"v": 1, "op": "route"}));
    assert!(r.get("fallbacks").is_none(), "not asked for: {r}");
    let r = c.call(json!({"v": 1, "op": "route", "fallbacks": 17}));
    assert_eq!(r["error"]["code"], json!("bad_request"), "{r}");
    // Queues (pending; the engines report none waiting): [1, 2, 1].
    assert_eq!(d.routed_pending(), vec![(1, 1), (2, 2), (1, 1)]);
    let r = c.call(json!({"v": 1, "op": "route", "shed_waiting": 1, "session": "s"}));
    assert_eq!(r["error"]["code"], json!("saturated"), "{r}");
    let says = "every candidate rank has at least shed_waiting = 1 requests queued (the shortest queue is 1)";
    assert!(r["error"]["message"].as_str().unwrap().starts_with(says), "{r}");
    assert_eq!(d.routed_pending(), vec![(1, 1), (2, 2), (1, 1)], "nothing placed");
    // Rank 2's queue of 1 is below 2: not shed; round robin's turn is rank 1.
    assert_eq!(c.route(json!({"v": 1, "op": "route", "shed_waiting": 2, "among": [1, 2]})), vec![1]);
    assert_eq!(c.route(json!({"v": 1, "op": "route", "shed_waiting": 1, "rank": 0})), vec![0], "pins are not shed");
    let r = c.call(json!({"v": 1, "op": "route", "shed_waiting": 0}));
    assert_eq!(r["error"]["code"], json!("bad_request"), "{r}");
}
