"""Never hang a frontend: timeouts, local fallback, recovery, standby."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest

from conftest import DEADLINE, bring_up, eventually
from dpcoord import BadRequestError, InvalidRankError, RouterClient, TooLargeError, UnreachableError

TIMEOUT_MS = 1000  # generous: a loaded 2-core CI machine must not turn slow answers into fallbacks


class Frontend:
    """A frontend thread routing one request after another, recording each answer."""

    def __init__(self, client: RouterClient):
        self.client = client
        self.records: list[tuple[list[int], str, float]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                ranks = self.client.route()
            except BaseException as e:  # noqa: BLE001 - any failure is a request without a rank
                self.errors.append(e)
                ranks = []
            self.records.append((ranks, self.client.last_source, time.monotonic() - t0))
            time.sleep(0.002)

    def trailing(self, source: str) -> int:
        """How many of the last records in a row came from ``source``."""
        n = 0
        for _, s, _ in reversed(list(self.records)):
            if s != source:
                break
            n += 1
        return n

    def count(self, source: str) -> int:
        return sum(1 for _, s, _ in list(self.records) if s == source)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE)
        assert not self._thread.is_alive(), "a route call hung"


def test_dpcoord_stopped_then_restarted_leaves_no_request_without_a_rank(start_daemon, engines, caplog):
    caplog.set_level(logging.INFO, logger="dpcoord.client")
    d = start_daemon("--dp-size", "3", "--policy", "round_robin")
    bring_up(d, engines, [0, 1, 2])
    client = RouterClient(d.route, d.health, timeout_ms=TIMEOUT_MS, log_period_s=3600)
    f = Frontend(client)
    try:
        eventually("answers from dpcoord", lambda: f.count("dpcoord") >= 20)
        assert d.stop() == 0
        eventually("local fallback answers", lambda: f.count("fallback") >= 30)
        # Answered while dpcoord was away, from the last routable set it showed.
        while_away = f.count("fallback")
        d.restart()  # same endpoints; the engines keep publishing to it
        eventually("30 answers in a row from dpcoord again", lambda: f.trailing("dpcoord") >= 30)
    finally:
        f.stop()
        client.close()

    records = f.records
    assert f.errors == []
    assert all(len(r) == 1 and r[0] in (0, 1, 2) for r, _, _ in records), "a request without a valid rank"
    sources = [s for _, s, _ in records]
    # dpcoord, then the fallback while it was away, then dpcoord again, and it stays.
    runs = [(k, len(list(g))) for k, g in itertools.groupby(sources)]
    assert [k for k, _ in runs] == ["dpcoord", "fallback", "dpcoord"], runs
    assert runs[2][1] >= 30, runs
    # The fallback is a round-robin over the last known routable ranks, counted exactly,
    # while dpcoord is away. (Once it is back but has not heard every engine yet, an
    # uninformed answer may fall back over the routable set its fresh state shows.)
    fallback_ranks = [r[0] for r, s, _ in records if s == "fallback"]
    assert fallback_ranks[:while_away] == [i % 3 for i in range(while_away)]
    assert client.fallbacks == len(fallback_ranks)
    # Only the call that found dpcoord gone waited for the timeout; none hung.
    assert max(dt for _, _, dt in records) < TIMEOUT_MS / 1000 + 1.0
    slow = [dt for _, s, dt in records if s == "fallback" and dt >= TIMEOUT_MS / 1000]
    assert len(slow) <= 2, slow
    # Logged once when it started (not once per request), and once on recovery.
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("routing locally" in m for m in msgs) == 1, msgs
    assert sum("still cannot place" in m for m in msgs) == 0, msgs
    assert sum("answering again" in m for m in msgs) == 1, msgs


def test_unreachable_dpcoord_with_dp_size(tmp_path):
    nothing = f"ipc://{tmp_path}/nothing"
    c = RouterClient(nothing, nothing + "-health", timeout_ms=100, dp_size=4)
    t0 = time.monotonic()
    assert c.route() == [0]
    assert 0.1 <= time.monotonic() - t0 < 1.1  # waited once for the timeout
    t0 = time.monotonic()
    assert c.route(n=3) == [1, 2, 3]
    # Health fallback keeps its own rotation: it does not shift the user's.
    assert c.health_route() == 0  # the health endpoint's first try waits for the timeout
    t0 = time.monotonic()
    assert c.health_route() == 1
    assert c.route() == [0]
    assert c.health_route() == 2
    # A pin or a bootstrap room still goes to its rank; a session sticks.
    assert c.route(n=2, rank=3) == [3, 3]
    assert c.route(bootstrap_room=10) == [2]
    assert c.health_route(rank=1) == 1
    assert c.health_route(bootstrap_room=7) == 3
    s = c.route(session="alice")
    assert c.route(session="alice") == s and c.route(n=2, session="alice") == s * 2
    assert time.monotonic() - t0 < 0.1, "calls waited on a dpcoord known to be down"
    assert (c.fallbacks, c.health_fallbacks, c.last_source) == (8, 5, "fallback")
    # Bad arguments are refused locally with the contract's codes.
    with pytest.raises(InvalidRankError):
        c.route(rank=4)
    with pytest.raises(BadRequestError):
        c.route(n=0)
    with pytest.raises(TooLargeError):
        c.route(n=1025)
    assert c.fallbacks == 8
    # A report cannot be delivered; state and ping have no local answer.
    assert c.health_report(0, False) is False and c.dropped_reports == 1
    with pytest.raises(UnreachableError) as e:
        c.ping()
    assert e.value.code == "unreachable" and nothing in e.value.message
    with pytest.raises(UnreachableError):
        c.state()
    c.close()


def test_unreachable_dpcoord_without_any_known_rank(tmp_path):
    c = RouterClient(f"ipc://{tmp_path}/nothing", timeout_ms=50)
    with pytest.raises(UnreachableError) as e:
        c.route()
    assert "dp_size" in e.value.message
    assert c.route(rank=5) == [5]  # a pin needs no pool
    with pytest.raises(UnreachableError):
        c.route(bootstrap_room=3)  # a room needs dp_size
    with pytest.raises(UnreachableError):
        c.health_route()  # no health endpoint, no rank known
    assert c.fallbacks == 1
    c.close()


def test_fallback_logged_once_per_period(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dpcoord.client")
    c = RouterClient(f"ipc://{tmp_path}/nothing", timeout_ms=50, dp_size=2, log_period_s=1.0)
    for _ in range(50):
        c.route()
    started = time.monotonic()
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("routing locally" in m for m in msgs) == 1, msgs
    assert sum("still cannot place" in m for m in msgs) == 0, msgs
    eventually("a log period", lambda: time.monotonic() - started > 1.0)
    c.route()
    msgs = [r.getMessage() for r in caplog.records]
    still = [m for m in msgs if "still cannot place" in m]
    assert len(still) == 1 and "50 requests routed locally" in still[0], still
    assert c.fallbacks == 51
    c.close()


def test_standby_takes_over_and_primary_takes_back(start_daemon, engines, tmp_path):
    # The engines bind; both dpcoords subscribe to them (--stats-connect).
    eps = [f"ipc://{tmp_path}/engine{r}" for r in (0, 1)]
    for r, ep in enumerate(eps):
        engines(ep, [r], bind=True)
    connect = [a for ep in eps for a in ("--stats-connect", ep)]
    primary = start_daemon("--dp-size", "2", "--policy", "round_robin", *connect)
    standby = start_daemon("--dp-size", "2", "--policy", "round_robin", *connect)
    for d in (primary, standby):
        eventually("ranks up", lambda: d.statuses() == ["up", "up"])
    c = RouterClient(primary.route, primary.health, timeout_ms=TIMEOUT_MS, standby=[(standby.route, standby.health)])
    assert c.route(n=2) == [0, 1] and c.last_endpoint == primary.route
    assert c.health_route() == 0 and c.last_endpoint == primary.health

    assert primary.stop() == 0
    assert c.route(n=2) == [0, 1] and c.last_endpoint == standby.route
    t0 = time.monotonic()
    for _ in range(20):
        c.route()
        assert c.last_endpoint == standby.route
    assert time.monotonic() - t0 < TIMEOUT_MS / 1000, "calls waited on the primary known to be down"
    assert c.health_route() == 0 and c.last_endpoint == standby.health
    assert c.fallbacks == 0 and c.health_fallbacks == 0

    primary.restart()

    def back_on_primary():
        c.route()
        return c.last_endpoint == primary.route

    eventually("routing back on the primary", back_on_primary)
    assert c.fallbacks == 0 and c.last_source == "dpcoord"
    c.close()


def test_a_refusal_from_a_dpcoord_still_hearing_from_its_engines_is_uninformed():
    """The ``state`` asked after a ``no_engine_available`` may already show ranks that
    reported in between (dpcoord just restarted): still warming up while some rank is
    ``unknown`` and none is ``down``."""
    from dpcoord import _core
    from dpcoord.errors import NoEngineAvailableError

    err = NoEngineAvailableError(message="no routable rank")
    state = lambda *statuses: {"ranks": [{"status": s} for s in statuses]}  # noqa: E731
    assert _core.uninformed(state("unknown", "unknown"), err, None, None)
    assert _core.uninformed(state("up", "unknown", "unknown"), err, None, None)
    assert not _core.uninformed(state("up", "down", "unknown"), err, None, None)
    assert not _core.uninformed(state("down", "down"), err, None, None)
    assert not _core.uninformed(state("up", "up"), err, None, None)
