"""One ext_proc stream is one request to the gateway picker, whatever a peer
sends on it: a body after the body's end, or a second request's headers, ends
the stream with INVALID_ARGUMENT and books nothing more than the one pick; a
`user` longer than a route query holds is still a session key (its hash), not
a refused request. Driven over gRPC from Envoy's protos, as test_gateway_epp.py."""

from __future__ import annotations

import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from conftest import bring_up, eventually
from test_gateway_epp import BODY, Stream, headers, pending, picked, request, respond, routed, start


@pytest.mark.parametrize("extra", ["body", "headers"])
def test_one_stream_is_one_pick_whatever_it_sends(start_daemon, engines, tmp_path, extra):
    d, ch = start(start_daemon, tmp_path)
    bring_up(d, engines, [0, 1])
    s = Stream(ch)
    request(s)
    picked(s)
    for _ in range(50):
        if extra == "body":
            s.send(request_body=ep.HttpBody(body=BODY, end_of_stream=True))
        else:
            s.send(request_headers=ep.HttpHeaders(headers=headers({":method": "POST", ":path": "/v1/completions"})))
    with pytest.raises(grpc.RpcError) as e:
        s.recv()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "one request" in e.value.details()
    s.close()
    # The one pick is booked, then ended with the stream.
    eventually("the stream's placement ended", lambda: pending(d) == [0, 0])
    assert sum(routed(d)) == 1


def test_a_user_longer_than_a_query_holds_keeps_its_session(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path)
    bring_up(d, engines, [0, 1])
    body = json.dumps({"model": "m", "prompt": "hello", "user": "u" * (70 << 10)}).encode()
    ranks = []
    for _ in range(3):
        s = Stream(ch)
        request(s, body, chunk=16 << 10)
        endpoint, hs = picked(s, body)
        ranks.append(endpoint)
        respond(s, endpoint)
    assert len(set(ranks)) == 1, f"one session, one rank: {ranks}"
    assert d.metric("dpcoord_gateway_requests_total", 'outcome="routed"') == 3
