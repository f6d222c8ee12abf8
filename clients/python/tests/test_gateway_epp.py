"""The gateway endpoint picker: a client built from Envoy's own
generated protos (xds-protos, grpcio) drives the message sequence an
Envoy-based gateway sends on ``ext_proc``, against the real binary."""

from __future__ import annotations

import http.server
import json
import queue
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import DEADLINE, bring_up, eventually, free_port

# The ranks' endpoints: loopback ports nothing listens on (a rank failing
# through the gateway has its endpoint's /health tried, see reach.rs),
# in the order their names sort, as some tests compare sorted picks.
A, B, C = sorted(f"127.0.0.1:{free_port()}" for _ in range(3))
DEST = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
BODY = json.dumps({"model": "m", "prompt": "hello " * 40}).encode()


def config(
    port: int,
    dp: int,
    eps: list[str],
    rank_header: str = "",
    cap: int = 4 << 20,
    max_dp: int = 0,
    extra: str = "",
    limits: str = "",
    tls: str = "off",
    server: str = "",
) -> str:
    return (
        # Plaintext, asked for (the default is TLS: test_gateway_tls.py).
        f'[server]\nepp_bind = "127.0.0.1:{port}"\nepp_tls = "{tls}"\n{server}'
        f"[engines]\ndp_size = {dp}\nmax_dp_size = {max_dp}\n"
        # Placements stay pending until finished: the test sees exactly what the picker booked.
        "[routing]\npending_ttl_ms = 600000\n"
        f"[limits]\n{limits}"
        f"[gateway]\nendpoints = {json.dumps(eps)}\nrank_header = {json.dumps(rank_header)}\nmax_body_bytes = {cap}\n"
        + extra
    )


def start(
    start_daemon,
    tmp_path,
    *,
    dp: int = 2,
    endpoints=None,
    rank_header: str = "",
    cap: int = 4 << 20,
    max_dp=0,
    extra="",
    limits="",
):
    port = free_port()
    eps = endpoints if endpoints is not None else [A, B, C][:dp]
    cfg = tmp_path / "epp.toml"
    cfg.write_text(config(port, dp, eps, rank_header, cap, max_dp, extra, limits))
    d = start_daemon("--config", str(cfg))
    d.epp_port, d.epp_config = port, cfg
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=DEADLINE)
    return d, channel


class Stream:
    """One ext_proc stream, driven message by message as a gateway would."""

    def __init__(self, channel):
        self.out: queue.Queue = queue.Queue()
        self.call = ep_grpc.ExternalProcessorStub(channel).Process(iter(self.out.get, None), timeout=DEADLINE)
        self.replies: Iterator[ep.ProcessingResponse] = iter(self.call)

    def send(self, **kw: Any) -> None:
        self.out.put(ep.ProcessingRequest(**kw))

    def recv(self) -> ep.ProcessingResponse:
        return next(self.replies)

    def close(self) -> None:
        self.out.put(None)


def filter_md(namespace: str, key: str, value: Any) -> base_pb2.Metadata:
    """Filter metadata of one entry, as the gateway sends it to the picker."""
    s = struct_pb2.Struct()
    s.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: s})


def served_md(endpoint: str) -> base_pb2.Metadata:
    """The served endpoint where the protocol puts it: ``envoy.lb`` filter metadata."""
    return filter_md("envoy.lb", SERVED, endpoint)


def headers(pairs: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def subset_md(endpoints: list[str]) -> base_pb2.Metadata:
    return filter_md("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", endpoints)


def request(s: Stream, body: bytes = BODY, *, chunk: int = 100, buffered: bool = False, subset=None) -> None:
    mode = pm.ProcessingMode.BUFFERED if buffered else pm.ProcessingMode.FULL_DUPLEX_STREAMED
    first: dict[str, Any] = dict(
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
        request_headers=ep.HttpHeaders(headers=headers({":method": "POST", ":path": "/v1/completions"})),
    )
    if subset is not None:
        first["metadata_context"] = subset_md(subset)
    s.send(**first)
    if buffered:
        assert s.recv().WhichOneof("response") == "request_headers"
        s.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
        return
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    for i, p in enumerate(parts):
        s.send(request_body=ep.HttpBody(body=p, end_of_stream=i == len(parts) - 1))


def picked(s: Stream, body: bytes = BODY) -> tuple[str, dict[str, str]]:
    """The streamed pick: headers (with the endpoint) and the body handed back."""
    h = s.recv()
    assert h.WhichOneof("response") == "request_headers", h
    set_headers = {o.header.key: o.header.raw_value.decode() for o in h.request_headers.response.header_mutation.set_headers}
    lb = h.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert lb == set_headers[DEST], "the metadata and the header name the same endpoint"
    b = s.recv()
    assert b.request_body.response.body_mutation.streamed_response.body == body
    assert b.request_body.response.body_mutation.streamed_response.end_of_stream
    return set_headers[DEST], set_headers


def respond(s: Stream, served: str | None, status: str = "200") -> None:
    pairs = {":status": status}
    if served:
        pairs[SERVED] = served
    s.send(response_headers=ep.HttpHeaders(headers=headers(pairs)))
    assert s.recv().WhichOneof("response") == "response_headers"
    s.send(response_body=ep.HttpBody(body=b"data: {}\n\n", end_of_stream=False))
    assert s.recv().response_body.response.body_mutation.streamed_response.body == b"data: {}\n\n"
    s.send(response_body=ep.HttpBody(body=b"", end_of_stream=True))
    assert s.recv().WhichOneof("response") == "response_body"
    s.close()


def immediate(s: Stream) -> ep.ImmediateResponse:
    r = s.recv()
    assert r.WhichOneof("response") == "immediate_response", r
    s.close()
    return r.immediate_response


def pending(d) -> list[int]:
    return [r["pending"] for r in d.state()["ranks"]]


def routed(d) -> list[int]:
    return [r["routed"] for r in d.state()["ranks"]]


def test_a_streamed_request_is_picked_booked_and_finished(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path)
    bring_up(d, engines, [0, 1])
    s = Stream(ch)
    request(s)
    endpoint, _ = picked(s)
    rank = [A, B].index(endpoint)
    assert pending(d)[rank] == 1, "the pick is a route placement"
    respond(s, endpoint)
    eventually("the placement completes", lambda: pending(d) == [0, 0])
    assert routed(d)[rank] == 1
    assert d.metric("dpcoord_gateway_requests_total", 'outcome="routed"') == 1
    # Round robin through the gateway, exactly as the route op would.
    s = Stream(ch)
    request(s)
    assert picked(s)[0] == [A, B][1 - rank]
    respond(s, None)
    eventually("both complete", lambda: pending(d) == [0, 0])


def test_the_subset_hint_is_honoured_and_an_unknown_one_is_503(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, dp=3)
    bring_up(d, engines, [0, 1, 2])
    for _ in range(3):
        s = Stream(ch)
        request(s, subset=[C, "10.9.9.9:1"])
        assert picked(s)[0] == C
        respond(s, C)
    s = Stream(ch)
    request(s, subset=["10.9.9.9:1"])
    r = immediate(s)
    assert r.status.code == 503 and b"10.9.9.9:1" in r.body
    eventually("nothing left pending", lambda: pending(d) == [0, 0, 0])
    assert routed(d) == [0, 0, 3]


def test_no_routable_rank_is_503_and_readiness_follows_the_ranks(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path)
    health = health_pb2_grpc.HealthStub(ch)
    status = lambda svc: health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=DEADLINE).status
    assert status("liveness") == health_pb2.HealthCheckResponse.SERVING
    assert status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
    s = Stream(ch)
    request(s)
    r = immediate(s)
    assert r.status.code == 503 and b"no routable rank" in r.body
    bring_up(d, engines, [0, 1])
    SERVING = health_pb2.HealthCheckResponse.SERVING
    eventually("ready", lambda: status("readiness") == SERVING)
    assert status("envoy.service.ext_proc.v3.ExternalProcessor") == SERVING


def test_a_request_served_elsewhere_is_charged_there(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path)
    bring_up(d, engines, [0, 1])
    s = Stream(ch)
    request(s)
    endpoint, _ = picked(s)
    rank = [A, B].index(endpoint)
    other = 1 - rank
    respond(s, [A, B][other], status="503")
    eventually("the placement moved and ended", lambda: pending(d) == [0, 0] and routed(d)[other] == 1)
    assert routed(d)[rank] == 0
    assert d.metric("dpcoord_gateway_rank_errors_total", f'dp_rank="{other}",kind="status_5xx"') == 1


class Health:
    """A rank's server as far as the picker's probe sees it: `GET /health` on 127.0.0.1 answers `status`."""

    def __init__(self):
        self.status = 503
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(owner.status if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_rank_failing_through_the_gateway_leaves_rotation_and_returns_when_healthy(start_daemon, engines, tmp_path):
    server = Health()
    try:
        d, ch = start(start_daemon, tmp_path, endpoints=[server.endpoint, B])
        bring_up(d, engines, [0, 1])
        # The gateway sees 503 from rank 0's server: each is reported as a
        # failed probe, and engines.probe_failures (3) in a row stall it.
        for _ in range(50):
            s = Stream(ch)
            request(s)
            endpoint, _ = picked(s)
            respond(s, endpoint, status="503" if endpoint == server.endpoint else "200")
            if d.statuses()[0] == "stalled":
                break
        assert d.statuses()[0] == "stalled"
        assert d.state()["ranks"][0]["stall"] == "probe"
        assert d.metric("dpcoord_gateway_rank_errors_total", 'dp_rank="0",kind="status_5xx"') >= 1
        # Its /health answers 503: it stays out, every pick is rank 1.
        for _ in range(4):
            s = Stream(ch)
            request(s)
            assert picked(s)[0] == B
            respond(s, B)
        # Healthy again: the picker's probe of /health readmits it.
        server.status = 200
        eventually("rank 0 back", lambda: d.statuses()[0] == "up")
        seen = set()
        for _ in range(4):
            s = Stream(ch)
            request(s)
            endpoint, _ = picked(s)
            seen.add(endpoint)
            respond(s, endpoint)
        assert server.endpoint in seen, seen
    finally:
        server.close()


def test_one_endpoint_with_the_rank_header(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, endpoints=[A], rank_header="x-data-parallel-rank")
    bring_up(d, engines, [0, 1])
    seen = []
    for _ in range(2):
        s = Stream(ch)
        request(s, subset=[A])
        endpoint, hs = picked(s)
        assert endpoint == A
        seen.append(int(hs["x-data-parallel-rank"]))
        respond(s, A)
    assert sorted(seen) == [0, 1]
    eventually("done", lambda: pending(d) == [0, 0])


def test_a_buffered_body(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path)
    bring_up(d, engines, [0, 1])
    s = Stream(ch)
    request(s, buffered=True)
    r = s.recv()
    assert r.WhichOneof("response") == "request_body"
    hs = {o.header.key: o.header.raw_value.decode() for o in r.request_body.response.header_mutation.set_headers}
    assert hs[DEST] in (A, B)
    assert r.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value == hs[DEST]
    s.send(response_headers=ep.HttpHeaders(headers=headers({":status": "200"}), end_of_stream=True))
    assert s.recv().WhichOneof("response") == "response_headers"
    s.close()
    eventually("done", lambda: pending(d) == [0, 0])


@pytest.mark.parametrize(
    "body,code,says",
    [
        (b'{"model": "m", "prompt": ', 400, b"not JSON"),
        (json.dumps({"prompt": "x"}).encode(), 400, b"no `model`"),
        (json.dumps({"model": "m"}).encode(), 400, b"neither `prompt` nor `messages`"),
        (json.dumps({"model": "m", "prompt": "x" * 3000}).encode(), 413, b"max_body_bytes = 2048"),
    ],
)
def test_bad_bodies_get_a_clear_answer_and_book_nothing(start_daemon, engines, tmp_path, body, code, says):
    d, ch = start(start_daemon, tmp_path, cap=2048)
    bring_up(d, engines, [0, 1])
    s = Stream(ch)
    request(s, body)
    r = immediate(s)
    assert r.status.code == code and says in r.body, r.body
    assert pending(d) == [0, 0] and routed(d) == [0, 0]
    # The daemon is unaffected: the next request goes through.
    s = Stream(ch)
    request(s)
    picked(s)
    respond(s, None)
    eventually("done", lambda: pending(d) == [0, 0])


def test_a_reset_mid_body_books_nothing_and_one_after_the_pick_completes(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path)
    bring_up(d, engines, [0, 1])
    s = Stream(ch)
    s.send(request_headers=ep.HttpHeaders(headers=headers({":method": "POST"})))
    s.send(request_body=ep.HttpBody(body=BODY[:10], end_of_stream=False))
    s.call.cancel()
    eventually("the reset is counted", lambda: d.metric("dpcoord_gateway_requests_total", 'outcome="rejected_reset"') == 1)
    assert pending(d) == [0, 0] and routed(d) == [0, 0]
    # Reset while the response streams: the placement completes, an error of that rank.
    s = Stream(ch)
    request(s)
    endpoint, _ = picked(s)
    rank = [A, B].index(endpoint)
    assert pending(d)[rank] == 1
    s.call.cancel()
    eventually("pending falls", lambda: pending(d) == [0, 0])
    assert d.metric("dpcoord_gateway_rank_errors_total", f'dp_rank="{rank}",kind="reset"') == 1


def test_a_rank_without_an_endpoint_is_never_picked_until_a_reload_names_it(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, max_dp=3)
    assert d.call("health", {"v": 1, "op": "resize", "dp_size": 3})["ok"]
    bring_up(d, engines, [0, 1, 2])

    def pick() -> str:
        s = Stream(ch)
        request(s)
        endpoint, _ = picked(s)
        respond(s, endpoint)
        return endpoint

    assert sorted(pick() for _ in range(4)) == [A, A, B, B], "rank 2 has no endpoint"
    assert routed(d)[2] == 0
    d.epp_config.write_text(config(d.epp_port, 3, [A, B, C], max_dp=3))
    r = d.call("health", {"v": 1, "op": "reload"})
    assert r["ok"], r
    assert sorted(pick() for _ in range(3)) == [A, B, C]
    eventually("done", lambda: pending(d) == [0, 0, 0])


def test_fallbacks_follow_the_pick_and_a_retry_elsewhere_moves_at_the_headers(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, dp=3, extra="fallbacks = 2\n")
    bring_up(d, engines, [0, 1, 2])
    first = Stream(ch)
    request(first)
    # Round robin picks rank 0; the idle ranks 1 and 2 follow, cheapest first.
    assert picked(first)[0] == f"{A},{B},{C}"
    second = Stream(ch)
    request(second)
    # Rank 0 holds a pending placement now: it comes last.
    assert picked(second)[0] == f"{B},{C},{A}"
    assert pending(d) == [1, 1, 0]
    # The gateway retried the first request on its first fallback, B, and
    # says so in the metadata: the placement moves before the response ends.
    first.send(
        response_headers=ep.HttpHeaders(headers=headers({":status": "200"})), metadata_context=served_md(B)
    )
    assert first.recv().WhichOneof("response") == "response_headers"
    assert pending(d) == [0, 1, 0] and routed(d) == [0, 2, 0]
    first.send(response_body=ep.HttpBody(body=b"", end_of_stream=True))
    assert first.recv().WhichOneof("response") == "response_body"
    first.close()
    respond(second, B)
    eventually("both done", lambda: pending(d) == [0, 0, 0])
    assert routed(d) == [0, 2, 0], "the moved request was booked once"
    # Reloadable: without fallbacks the pick alone is named.
    d.epp_config.write_text(config(d.epp_port, 3, [A, B, C]))
    r = d.call("health", {"v": 1, "op": "reload"})
    assert r["ok"], r
    s = Stream(ch)
    request(s)
    assert picked(s)[0] == C, "round robin's turn: rank 2, alone"
    respond(s, C)


def test_every_queue_at_shed_waiting_is_429_and_books_nothing(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, extra="shed_waiting = 3\n")
    e = bring_up(d, engines, [0, 1])
    e.set(0, waiting=3, received=3)
    e.set(1, waiting=4, received=4)
    waiting = lambda: [r["counts"][0] for r in d.state()["ranks"]]
    eventually("both queues reported", lambda: waiting() == [3, 4])
    s = Stream(ch)
    request(s)
    r = immediate(s)
    assert r.status.code == 429 and b"shed_waiting = 3" in r.body and b"shortest queue is 3" in r.body, r.body
    assert pending(d) == [0, 0] and routed(d) == [3, 4], "nothing booked"
    assert d.metric("dpcoord_gateway_requests_total", 'outcome="rejected_shed"') == 1
    assert d.metric("dpcoord_route_errors_total", 'code="saturated"') == 1
    # Reloadable: a mark above the queues, and the same request goes through.
    d.epp_config.write_text(config(d.epp_port, 2, [A, B], extra="shed_waiting = 5\n"))
    r = d.call("health", {"v": 1, "op": "reload"})
    assert r["ok"], r
    s = Stream(ch)
    request(s)
    assert picked(s)[0] == A, "not shed; round robin's turn is rank 0"
    respond(s, A)
    eventually("done", lambda: pending(d) == [0, 0])


def test_a_prompt_above_max_prompt_tokens_is_routed_on_its_leading_part(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, limits="max_prompt_tokens = 256\n")
    bring_up(d, engines, [0, 1])
    # 40,000 bytes of text: 625 text keys, cut to the 16 that 256 tokens allow.
    body = json.dumps({"model": "m", "prompt": "abcd" * 10_000}).encode()
    s = Stream(ch)
    request(s, body)
    assert picked(s, body)[0] in (A, B)
    respond(s, None)
    eventually("done", lambda: pending(d) == [0, 0])
    assert d.metric("dpcoord_route_errors_total", 'code="too_large"') == 0
    assert d.metric("dpcoord_gateway_requests_total", 'outcome="routed"') == 1


def test_a_burst_of_picks_is_answered_in_full(start_daemon, engines, tmp_path):
    # A large max_batch makes the route socket queue few replies per peer
    # (each could be that large); the picker keeps no more in flight.
    d, ch = start(start_daemon, tmp_path, limits="max_batch = 65536\n")
    bring_up(d, engines, [0, 1])
    streams = [Stream(ch) for _ in range(150)]
    for s in streams:
        request(s, chunk=1 << 20)
    got = [picked(s)[0] for s in streams]
    assert sorted(got) == [A] * 75 + [B] * 75, "round robin over a burst, every pick answered"
    assert pending(d) == [75, 75]
    for s, endpoint in zip(streams, got):
        respond(s, endpoint)
    eventually("all done", lambda: pending(d) == [0, 0])


def test_a_request_without_a_body_goes_to_a_routable_rank_in_turn(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, dp=3)
    e = bring_up(d, engines, [0, 1, 2])
    e.silence(1)
    eventually("rank 1 down", lambda: d.statuses()[1] == "down")
    got = []
    for _ in range(4):
        s = Stream(ch)
        mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
        s.send(
            protocol_config=ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
            request_headers=ep.HttpHeaders(headers=headers({":method": "GET", ":path": "/v1/models"}), end_of_stream=True),
        )
        r = s.recv()
        assert r.WhichOneof("response") == "request_headers", r
        hs = {o.header.key: o.header.raw_value.decode() for o in r.request_headers.response.header_mutation.set_headers}
        assert r.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value == hs[DEST]
        got.append(hs[DEST])
        respond(s, hs[DEST])
    assert got == [A, C, A, C], "routable ranks in turn, the down one skipped"
    assert pending(d) == [0, 0, 0] and routed(d) == [0, 0, 0], "no inference request: nothing booked"
    assert d.metric("dpcoord_gateway_requests_total", 'outcome="routed_bodyless"') == 4
    assert d.metric("dpcoord_gateway_requests_total", 'outcome="rejected_reset"') == 0
    # A POST without its body is an inference request missing it.
    s = Stream(ch)
    s.send(request_headers=ep.HttpHeaders(headers=headers({":method": "POST", ":path": "/v1/completions"}), end_of_stream=True))
    r = immediate(s)
    assert r.status.code == 400 and b"model" in r.body, r.body


def test_sigterm_is_not_ready_at_once_closes_open_streams_and_exits_zero_within_two_seconds(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path)
    bring_up(d, engines, [0, 1])
    # A picked request whose response never ends: the gateway holds its
    # stream open as long as the response lasts.
    s = Stream(ch)
    request(s)
    picked(s)
    health = health_pb2_grpc.HealthStub(ch)
    SERVING = health_pb2.HealthCheckResponse.SERVING
    ready = lambda: health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=DEADLINE).status
    eventually("ready", lambda: ready() == SERVING)
    started = time.monotonic()
    proc = d.proc
    proc.send_signal(signal.SIGTERM)

    def not_ready():
        # The picker's readiness: NOT_SERVING, or no new stream at all.
        try:
            answer = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=0.2).status
        except grpc.RpcError:
            answer = None
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/readyz", timeout=0.2)
            http = 200
        except urllib.error.HTTPError as e:
            http = (e.code, e.read())
        return answer != SERVING and http == (503, b"not ready: stopping\n")

    # Not ready from the first instant, while the open stream drains.
    eventually("not ready once SIGTERM arrived", not_ready, deadline=1.0)
    assert d.stop() == 0
    took = time.monotonic() - started
    assert took < 2.0, f"took {took:.2f} s"
    with pytest.raises(grpc.RpcError):
        s.recv()
