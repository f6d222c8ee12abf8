"""RouterClient against the real dpcoord: routing answers and typed errors."""

from __future__ import annotations

import threading

import pytest

import dpcoord
from conftest import bring_up, eventually
from dpcoord import (
    BadRequestError,
    DpcoordError,
    InvalidRankError,
    NoEngineAvailableError,
    RankUnavailableError,
    RouterClient,
    TooLargeError,
    UnknownOpError,
    UnsupportedVersionError,
)


@pytest.fixture
def client_for():
    made = []

    def make(d, **kw):
        c = RouterClient(d.route, d.health, timeout_ms=kw.pop("timeout_ms", 2000), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_ping_and_state_before_any_engine(start_daemon, client_for):
    d = start_daemon("--dp-size", "2")
    c = client_for(d)
    assert c.ping() == 0
    s = c.state()
    assert s["epoch"] == 0
    assert [(r["rank"], r["status"], r["counts"], r["age_ms"]) for r in s["ranks"]] == [
        (0, "unknown", [0, 0, 0, 0, 0], None),
        (1, "unknown", [0, 0, 0, 0, 0], None),
    ]
    assert c.routable_ranks == [] and c.epoch == 0


def test_instance_is_stable_within_a_process_and_changes_across_a_restart(start_daemon, client_for):
    d = start_daemon("--dp-size", "2")
    c = client_for(d)
    assert c.instance is None
    assert c.ping() == 0
    first = c.instance
    assert isinstance(first, str) and len(first) == 16 and int(first, 16) >= 0
    assert c.state()["instance"] == first and c.instance == first
    assert d.call("health", {"v": 1, "op": "ping"})["instance"] == first
    assert d.stop() == 0
    d.restart()
    # The client's REQ socket reconnects by itself; the first answer is the new process's.
    assert eventually("a ping answered by the restarted dpcoord", lambda: c.ping() == 0 and c.instance != first)
    second = c.instance
    assert len(second) == 16 and second != first
    assert c.state()["instance"] == second


def test_route_round_robin_pins_rooms_and_sessions(start_daemon, engines, client_for):
    d = start_daemon("--dp-size", "3", "--policy", "round_robin")
    bring_up(d, engines, [0, 1, 2])
    c = client_for(d)
    assert c.route(n=4) == [0, 1, 2, 0]
    assert c.route() == [1]
    # A pin or a room places all n there and does not advance the round-robin.
    assert c.route(n=3, rank=2) == [2, 2, 2]
    assert c.route(bootstrap_room=7) == [1]
    assert c.route(rank=0, bootstrap_room=7) == [0]  # rank wins
    assert c.route(n=2, prompt_tokens=100, id="req-1") == [2, 0]
    first = c.route(session="alice")
    assert c.route(session="alice") == first
    assert c.route(n=3, session="alice") == first * 3
    assert c.last_source == "dpcoord" and c.last_endpoint == d.route
    assert c.fallbacks == 0
    # The client learned the routable set (and epoch) from the replies.
    assert c.routable_ranks == [0, 1, 2] and c.epoch == d.state()["epoch"]


def test_typed_errors_carry_the_contract_code(start_daemon, engines, client_for):
    d = start_daemon("--dp-size", "2", "--pending-ttl-ms", "60000")
    # Strict: every refusal raises, even from a dpcoord no engine has reported to yet.
    c = client_for(d, fallback_when_uninformed=False)
    with pytest.raises(NoEngineAvailableError) as e:
        c.route()
    assert e.value.code == "no_engine_available" and "no routable rank" in e.value.message
    assert e.value.epoch == 0  # dpcoord's epoch when it refused: no rank has come up yet
    assert isinstance(e.value, DpcoordError)
    with pytest.raises(NoEngineAvailableError):
        c.health_route()

    bring_up(d, engines, [0])
    assert d.state()["epoch"] == 1
    cases = [
        (lambda: c.route(n=0), BadRequestError, "bad_request"),
        (lambda: c.route(n="2"), BadRequestError, "bad_request"),
        (lambda: c.route(session=5), BadRequestError, "bad_request"),
        (lambda: c.route(n=1025), TooLargeError, "too_large"),
        (lambda: c.route(rank=2), InvalidRankError, "invalid_rank"),
        (lambda: c.route(rank=-1), InvalidRankError, "invalid_rank"),
        (lambda: c.route(rank=1), RankUnavailableError, "rank_unavailable"),
        (lambda: c.route(bootstrap_room=3), RankUnavailableError, "rank_unavailable"),
        (lambda: c.health_route(rank=1), RankUnavailableError, "rank_unavailable"),
        (lambda: c.health_report(9, False), InvalidRankError, "invalid_rank"),
        (lambda: c.call("fly"), UnknownOpError, "unknown_op"),
        (lambda: c.call("health_route"), UnknownOpError, "unknown_op"),
        (lambda: c.call("route", channel="health"), UnknownOpError, "unknown_op"),
        (lambda: c.call("ping", v=2), UnsupportedVersionError, "unsupported_version"),
    ]
    for call, cls, code in cases:
        with pytest.raises(cls) as e:
            call()
        assert (type(e.value), e.value.code, e.value.epoch) == (cls, code, 1)
        assert e.value.message, f"{code} without a message"
        assert dpcoord.ERRORS[code] is cls
    # The id is echoed on refusals too, when dpcoord could read it.
    with pytest.raises(BadRequestError) as e:
        c.route(n=0, id=41)
    assert (e.value.id, e.value.epoch) == (41, 1)
    with pytest.raises(BadRequestError) as e:
        c.route(id=3.5)  # an id must be a string or an integer
    assert (e.value.id, e.value.epoch) == (None, 1)
    with pytest.raises(TooLargeError) as e:
        c.route(session="s" * 70_000, id="big")  # above max_message_bytes
    assert e.value.message and e.value.epoch == 1
    # A refusal without an epoch (a dpcoord older than the field) gives None.
    old = dpcoord.errors.error_from_reply({"v": 1, "ok": False, "error": {"code": "bad_request", "message": "m"}})
    assert (type(old), old.id, old.epoch) == (BadRequestError, None, None)
    # A refusal is an answer: nothing was routed locally, and nothing was half-applied.
    assert c.fallbacks == 0 and c.health_fallbacks == 0
    assert c.route(n=2) == [0, 0]
    assert [r["pending"] for r in c.state()["ranks"]] == [2, 0]


def test_health_calls_through_the_client(start_daemon, engines, client_for):
    d = start_daemon("--dp-size", "3")
    bring_up(d, engines, [0, 2])
    c = client_for(d)
    assert [c.health_route() for _ in range(3)] == [0, 2, 0]
    assert c.health_route(rank=2) == 2
    assert c.health_route(bootstrap_room=5) == 2
    assert c.health_route() == 2
    assert c.health_report(0, True) is True
    assert c.health_report(2, False) is True
    assert c.dropped_reports == 0
    with pytest.raises(TypeError):
        c.health_report(0, 1)


def test_many_threads_share_one_client(start_daemon, engines, client_for):
    d = start_daemon("--dp-size", "2", "--policy", "round_robin")
    bring_up(d, engines, [0, 1])
    c = client_for(d)
    got: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker():
        try:
            for _ in range(50):
                r = c.route()
                with lock:
                    got.extend(r)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(got) == 400
    assert (got.count(0), got.count(1)) == (200, 200)
    assert c.fallbacks == 0


def test_refusals_of_an_uninformed_dpcoord_fall_back_others_raise(start_daemon, engines, client_for):
    d = start_daemon("--dp-size", "2", "--stale-after-ms", "100", "--down-after-ms", "300")
    c = client_for(d)
    # No engine has reported yet (a dpcoord that just started): route locally.
    assert c.route(n=3) == [0, 1, 0]
    assert c.route(rank=1) == [1]
    assert (c.fallbacks, c.last_source) == (2, "fallback")
    e = bring_up(d, engines, [0, 1])
    assert c.route(n=2) == [0, 1] and c.last_source == "dpcoord"
    # Rank 1 goes silent, then down: dpcoord knows it, so its refusal stands.
    e.silence(1)
    eventually("rank 1 down", lambda: d.statuses() == ["up", "down"])
    with pytest.raises(RankUnavailableError):
        c.route(rank=1)
    assert c.route() == [0]
    assert c.fallbacks == 2
