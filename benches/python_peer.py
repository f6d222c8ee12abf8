#!/usr/bin/env python3
"""The Python peer of dpcoord's transport benchmark.

A routing loop modeled on today's Python data-parallel controllers (a
pyzmq ROUTER in one Python thread that decodes each request, picks a rank
round-robin and answers): msgpack decode, round-robin choice, msgpack encode,
reply along the request's envelope. It answers the same route queries as
dpcoord, with the same reply shape, so the load generator cannot tell them
apart.

Usage: python_peer.py ENDPOINT [DP_SIZE]
Exits when idle for 30 s, so an orphan cannot linger.
"""

import sys

import msgpack
import zmq

IDLE_EXIT_MS = 30_000


def error(query, code, message):
    reply = {"v": 1, "ok": False, "error": {"code": code, "message": message}}
    if isinstance(query, dict) and query.get("id") is not None:
        reply["id"] = query["id"]
    return reply


def answer(query, state):
    if not isinstance(query, dict):
        return error(None, "bad_request", "query must be a map")
    if query.get("v") != 1:
        return error(query, "unsupported_version", "v must be 1")
    if query.get("op") != "route":
        return error(query, "unknown_op", "only route is served")
    rank = state["cursor"]
    state["cursor"] = (rank + 1) % state["dp_size"]
    reply = {"v": 1, "ok": True, "ranks": [rank], "epoch": state["epoch"]}
    if query.get("id") is not None:
        reply["id"] = query["id"]
    return reply


def main():
    endpoint = sys.argv[1]
    state = {"cursor": 0, "dp_size": int(sys.argv[2]) if len(sys.argv) > 2 else 8, "epoch": 1}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, IDLE_EXIT_MS)
    sock.bind(endpoint)
    while True:
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            return
        envelope, payload = frames[:-1], frames[-1]
        try:
            reply = answer(msgpack.unpackb(payload, raw=False), state)
        except ValueError as e:  # msgpack's decode errors are ValueErrors
            reply = error(None, "bad_request", f"query is not valid MessagePack: {e}")
        sock.send_multipart(envelope + [msgpack.packb(reply)])


if __name__ == "__main__":
    main()
