"""Endpoints named by host name in `gateway.endpoints`: the picker hands the
gateway the address the name resolves to (Envoy forwards to an IP and port,
and its subset hint and served header name addresses), against the real binary."""

from __future__ import annotations

import ipaddress
import socket

from conftest import bring_up, eventually
from test_gateway_epp import Stream, pending, picked, request, respond, start


def test_a_name_is_answered_as_its_address_and_matched_as_one(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, dp=2, endpoints=["localhost:8000", "127.0.0.2:8001"])
    bring_up(d, engines, [0, 1])
    local = socket.getaddrinfo("localhost", 8000, type=socket.SOCK_STREAM)[0][4][0]
    address = f"[{local}]:8000" if ":" in local else f"{local}:8000"
    assert ipaddress.ip_address(local).is_loopback
    # The subset hint names the address: only rank 0 is in it.
    s = Stream(ch)
    request(s, subset=[address])
    endpoint, _ = picked(s)
    assert endpoint == address, "the destination is the address, not the name"
    respond(s, address)
    eventually("the request ended on rank 0", lambda: pending(d) == [0, 0] and d.state()["ranks"][0]["routed"] == 1)
    # The configured name itself is not an address the gateway could send: no rank.
    s = Stream(ch)
    request(s, subset=["localhost:8000"])
    r = s.recv()
    assert r.WhichOneof("response") == "immediate_response" and r.immediate_response.status.code == 503
