"""A connection dpcoord refuses during its handshake (its socket holds
``server.*_max_peers`` peers): libzmq does not connect that socket again, so the
client and the publisher see the refusal on the socket's monitor and open a new
socket, with a backoff, until one is admitted. Over tcp://, a connection beyond
a cap is closed before its handshake instead (a drop): libzmq connects the same
socket again by itself, and the client and the publisher count it and say why."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import msgpack
import pytest
import zmq

from conftest import DEADLINE, Daemon, eventually, free_port
from dpcoord import AsyncRouterClient, RouterClient, StatsPublisher, UnreachableError

A = dict(waiting=1, running=2, received=3, finished=1, failed=0)
B = dict(waiting=4, running=5, received=9, finished=2, failed=1)


def capped(start_daemon, tmp_path, **caps: int):
    """A dpcoord with one rank and the given ``server.*_max_peers`` caps."""
    cfg = tmp_path / "caps.toml"
    cfg.write_text("[engines]\ndp_size = 1\n[server]\n" + "".join(f"{k} = {v}\n" for k, v in caps.items()))
    return start_daemon("--config", str(cfg))


@pytest.fixture
def tcp_capped(dpcoord_bin, tmp_path):
    """``tcp_capped(route_max_peers=1)``: a dpcoord with one rank and the given
    ``[server]`` caps, its route and stats binds on tcp:// (where a peer beyond a
    cap is closed before its handshake); stopped at teardown."""
    started: list[Daemon] = []

    def start(**caps: int) -> Daemon:
        cfg = tmp_path / "caps.toml"
        cfg.write_text("[engines]\ndp_size = 1\n[server]\n" + "".join(f"{k} = {v}\n" for k, v in caps.items()))
        (tmp_path / "d").mkdir()
        d = Daemon(dpcoord_bin, tmp_path / "d", ["--config", str(cfg)])
        d.route, d.stats = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        started.append(d)
        return d.start()

    yield start
    for d in started:
        assert d.stop() == 0, d.log()


def holder(endpoint: str) -> zmq.Socket:
    """A REQ peer that is admitted (its ping answered) and holds its slot until
    closed. A peer that just left may still hold the slot for a moment (dpcoord
    counts it until it sees the disconnect), so a refused try is tried again."""

    def admitted():
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(msgpack.packb({"v": 1, "op": "ping"}))
        if sock.poll(200, zmq.POLLIN) and msgpack.unpackb(sock.recv())["ok"] is True:
            return sock
        sock.close()
        return None

    return eventually(f"a peer admitted at {endpoint}", admitted)


def rank0(d) -> dict:
    """Rank 0 of ``/state`` over HTTP: the route socket may be full."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/state", timeout=DEADLINE) as r:
        return json.loads(r.read())["ranks"][0]


def routed_up(d, engines) -> None:
    """Rank 0 published by a fake engine, and up."""
    engines(d.stats, [0])
    eventually("rank 0 up", lambda: rank0(d)["status"] == "up")


def refused_metric(d, socket: str) -> float:
    """``dpcoord_peers_refused_total`` of ``socket``, summed over its other labels."""
    series = [line for line in d.metrics().splitlines() if line.startswith("dpcoord_peers_refused_total{")]
    assert series, "no dpcoord_peers_refused_total series"
    return sum(float(line.split()[-1]) for line in series if f'socket="{socket}"' in line)


def test_a_publisher_refused_at_the_stats_bind_gets_through_once_the_slot_is_free(start_daemon, tmp_path, caplog):
    d = capped(start_daemon, tmp_path, stats_max_peers=1)
    first = StatsPublisher(d.stats, 0, bind=False, boot=1)
    eventually("the first publisher's updates", lambda: (first.publish(**A), rank0(d)["boot"] == 1)[1])
    second = StatsPublisher(d.stats, 0, bind=False, boot=2)  # refused while `first` holds the slot
    try:
        with caplog.at_level(logging.INFO, logger="dpcoord.publisher"):
            eventually("the second publisher refused", lambda: (second.publish(**B), second.refusals >= 1)[1])
            # It keeps being refused (a new socket after each backoff) and nothing of it gets through.
            eventually("two refusals", lambda: (first.publish(**A), second.publish(**B), second.refusals >= 2)[2])
            first.publish(**A)
            assert (rank0(d)["boot"], rank0(d)["counts"]) == (1, [1, 2, 3, 1, 0])
            first.close()
            eventually(
                "the second publisher's updates",
                lambda: (second.publish(**B), rank0(d)["boot"] == 2)[1],
            )
            assert (rank0(d)["status"], rank0(d)["counts"]) == ("up", [4, 5, 9, 2, 1])
            # The publisher counted the refusals it read: all of dpcoord's but one
            # still in flight on a socket it closed (libzmq, now and then, connects
            # a refused socket once more by itself). One warning for the run of
            # them, one line when it was admitted.
            assert first.refusals == 0
            assert 2 <= second.refusals <= refused_metric(d, "stats")
            records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "dpcoord.publisher"]
            prefix = f"stats publisher of rank 0: dpcoord at {d.stats}"
            assert [lvl for lvl, _ in records] == ["WARNING", "INFO"]
            assert records[0][1].startswith(
                f"{prefix} refused the connection (this address is not in server.stats_allow, or, over ipc,"
                " its socket holds server.stats_max_peers peers); its updates are lost until one is admitted"
            )
            assert records[1][1] == f"{prefix} admitted the connection"
    finally:
        second.close()


def test_a_router_client_refused_at_route_and_health_recovers_once_they_have_room(
    start_daemon, engines, tmp_path, caplog
):
    d = capped(start_daemon, tmp_path, route_max_peers=1, health_max_peers=1)
    routed_up(d, engines)
    held = [holder(d.route), holder(d.health)]
    # A long timeout: only the refusal, seen on the monitor, ends a call early.
    c = RouterClient(d.route, d.health, timeout_ms=60_000, dp_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="dpcoord.client"):
            with pytest.raises(UnreachableError) as e:
                c.ping()
        assert e.value.message == (
            f"connection refused by {d.route}: this address is not in server.route_allow, or, over ipc,"
            " its socket holds server.route_max_peers peers"
        )
        assert c.refusals == 1
        [warning] = [r.getMessage() for r in caplog.records if r.name == "dpcoord.client"]
        assert warning.startswith(
            f"dpcoord route endpoint {d.route} refused this client's connection (this address is not in"
            " server.route_allow, or, over ipc, its socket holds server.route_max_peers peers):"
            " a new connection in "
        )
        # Refused: route answers from the fallback, the report is not delivered.
        assert c.route() == [0] and c.last_source == "fallback"
        assert c.health_report(0, True) is False and c.dropped_reports == 1
        for sock in held:
            sock.close()
        calls = 0

        def routed_by_dpcoord():
            nonlocal calls
            calls += 1
            return c.route() == [0] and c.last_source == "dpcoord"

        eventually("route answered by dpcoord", routed_by_dpcoord)
        eventually("health_report delivered", lambda: c.health_report(0, True))
        # Each route call was answered exactly once: by dpcoord once, locally otherwise.
        # /state is as of the last tick: wait for the one placement, then it is exact.
        eventually("the placement in /state", lambda: rank0(d)["routed"] >= 1)
        # Local: the call made while refused, and all but the last of the loop's.
        assert (rank0(d)["routed"], c.fallbacks) == (1, 1 + calls - 1)
        assert 2 <= c.refusals <= refused_metric(d, "route") + refused_metric(d, "health")
        assert c.ping() == 1  # one rank came up
    finally:
        c.close()


def test_the_async_client_recovers_from_a_refusal_too(start_daemon, engines, tmp_path):
    d = capped(start_daemon, tmp_path, route_max_peers=1)
    routed_up(d, engines)
    held = holder(d.route)

    async def main():
        async with AsyncRouterClient(d.route, timeout_ms=60_000, dp_size=1) as c:
            assert await c.route() == [0] and c.last_source == "fallback"
            assert c.refusals == 1
            held.close()
            for _ in range(1000):
                if await c.route() == [0] and c.last_source == "dpcoord":
                    break
                await asyncio.sleep(0.01)
            assert c.last_source == "dpcoord"
            eventually("the placement in /state", lambda: rank0(d)["routed"] >= 1)
            assert rank0(d)["routed"] == 1
            assert 1 <= c.refusals <= refused_metric(d, "route")

    asyncio.run(main())


def test_a_client_outside_the_allowlist_is_told_why(dpcoord_bin, tmp_path):
    cfg = tmp_path / "allow.toml"
    cfg.write_text('[engines]\ndp_size = 1\n[server]\nhealth_allow = ["10.9.9.9"]\n')
    (tmp_path / "d").mkdir()
    d = Daemon(dpcoord_bin, tmp_path / "d", ["--config", str(cfg)])
    d.health = f"tcp://127.0.0.1:{free_port()}"  # an allowlist applies to tcp:// peers
    d.start()
    c = RouterClient(d.route, d.health, timeout_ms=60_000, dp_size=1)
    try:
        assert c.health_report(0, True) is False and c.dropped_reports == 1
        with pytest.raises(UnreachableError) as e:
            c.call("ping", channel="health")  # refused again, or not tried while the backoff runs
        assert e.value.message == (
            f"connection refused by {d.health}: this address is not in server.health_allow, or, over ipc,"
            " its socket holds server.health_max_peers peers"
        )
        # Each refused socket was closed as soon as its refusal was read: none was tried twice.
        assert 1 <= c.refusals == d.metric("dpcoord_access_denied_total", 'socket="health"')
        assert c.ping() == 0  # the route socket has no allowlist
    finally:
        c.close()
        assert d.stop() == 0, d.log()


#: What a drop at the route socket means, in the client's words.
FULL = "its socket holds server.route_max_peers peers, or this address holds server.max_peers_per_address of them"


def test_a_router_client_closed_before_its_handshake_says_why_and_gets_in_once_there_is_room(tcp_capped, caplog):
    d = tcp_capped(route_max_peers=1, max_peers_per_address=1)
    held = holder(d.route)
    c = RouterClient(d.route, timeout_ms=1000, dp_size=1)
    try:
        with caplog.at_level(logging.INFO, logger="dpcoord.client"):
            with pytest.raises(UnreachableError) as e:
                c.ping()  # libzmq connects again by itself: the call waits out its timeout
            assert e.value.message == f"connection closed by {d.route} before its handshake: {FULL} (libzmq retries by itself)"
            assert c.refusals == 0 and 1 <= c.drops <= refused_metric(d, "route")
            held.close()
            assert c.ping() == 0  # no engine reported yet
        assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "dpcoord.client"] == [
            (
                "WARNING",
                f"dpcoord route endpoint {d.route} closed this client's connection before its handshake ({FULL}):"
                " libzmq connects again by itself, and calls wait up to timeout_ms for room",
            ),
            ("INFO", f"dpcoord route endpoint {d.route} answers again"),
        ]
        assert c.refusals == 0 and c.drops <= refused_metric(d, "route")
    finally:
        c.close()


def test_a_publisher_closed_before_its_handshake_keeps_its_socket_and_gets_through(tcp_capped, caplog):
    d = tcp_capped(stats_max_peers=1, max_peers_per_address=1)
    first = StatsPublisher(d.stats, 0, bind=False, boot=1)
    eventually("the first publisher's updates", lambda: (first.publish(**A), rank0(d)["boot"] == 1)[1])
    second = StatsPublisher(d.stats, 0, bind=False, boot=2)  # closed at accept while `first` holds the slot
    sock = second._sock
    try:
        with caplog.at_level(logging.INFO, logger="dpcoord.publisher"):
            eventually("two drops", lambda: (first.publish(**A), second.publish(**B), second.drops >= 2)[2])
            first.publish(**A)
            assert (rank0(d)["boot"], rank0(d)["counts"]) == (1, [1, 2, 3, 1, 0])
            first.close()
            eventually("the second publisher's updates", lambda: (second.publish(**B), rank0(d)["boot"] == 2)[1])
        assert second._sock is sock  # libzmq connected the same socket again
        assert (second.refusals, first.drops) == (0, 0)
        assert 2 <= second.drops <= refused_metric(d, "stats")
        prefix = f"stats publisher of rank 0: dpcoord at {d.stats}"
        assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "dpcoord.publisher"] == [
            (
                "WARNING",
                f"{prefix} closed the connection before its handshake (its socket holds server.stats_max_peers"
                " peers, or this address holds server.max_peers_per_address of them); its updates are lost"
                " until one is admitted: libzmq connects again by itself",
            ),
            ("INFO", f"{prefix} admitted the connection"),
        ]
    finally:
        second.close()


def test_the_async_client_says_why_too(tcp_capped):
    d = tcp_capped(route_max_peers=1, max_peers_per_address=1)
    held = holder(d.route)

    async def main():
        async with AsyncRouterClient(d.route, timeout_ms=1000, dp_size=1) as c:
            with pytest.raises(UnreachableError) as e:
                await c.ping()
            assert e.value.message == f"connection closed by {d.route} before its handshake: {FULL} (libzmq retries by itself)"
            assert c.refusals == 0 and 1 <= c.drops <= refused_metric(d, "route")
            held.close()
            assert await c.ping() == 0

    asyncio.run(main())
