"""dpcoord's route hook in vLLM 0.33.0's own request path: installed by vLLM's plugin
loader, driving vLLM's real DPLBAsyncMPClient, OutputProcessor and AsyncLLM (built
without engines, vllm_engine.py), against the real dpcoord."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import DEADLINE, bring_up, eventually

HERE = Path(__file__).parent
WRAPPED = (
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient", "add_request_async"),
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient", "get_core_engine_for_request"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "abort_requests"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
)


def wrapped(vllm_modules) -> list[str]:
    """The modules whose code now runs for each of vLLM's wrapped methods."""
    return [getattr(getattr(vllm_modules[m], c), f).__module__ for m, c, f in WRAPPED]


@pytest.fixture
def vllm_modules(real):
    import importlib

    return {m: importlib.import_module(m) for m, _, _ in WRAPPED} | {"plugins": importlib.import_module("vllm.plugins")}


@pytest.fixture
def hook(real, vllm_modules, monkeypatch, tmp_path):
    """``hook(env)``: vLLM's own ``load_general_plugins()`` run with ``env``; the
    process's hook (or None). Everything vLLM had is put back at teardown."""
    from dpcoord import vllm_route
    from dpcoord.ledger import TALLY

    classes = {(m, c): getattr(vllm_modules[m], c) for m, c, _ in WRAPPED}
    saved = {(m, c, f): classes[(m, c)].__dict__.get(f) for m, c, f in WRAPPED}

    def install(**env: str):
        for name in ("DPCOORD_ROUTE_ENDPOINT", "DPCOORD_STATS_ENDPOINT", "DPCOORD_ROUTE_TIMEOUT_MS", "DPCOORD_ROUTE_SEND"):
            monkeypatch.delenv(name, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(vllm_modules["plugins"], "plugins_loaded", False)
        vllm_modules["plugins"].load_general_plugins()
        return vllm_route.HOOK

    yield install
    for hook in [vllm_route.HOOK]:
        if hook is not None:
            for link in hook.links.values():
                if link is not None:
                    link.close()
    for (m, c, f), fn in saved.items():
        if fn is None:
            if f in classes[(m, c)].__dict__:
                delattr(classes[(m, c)], f)
        else:
            setattr(classes[(m, c)], f, fn)
    vllm_route.HOOK = None
    TALLY.active = False
    for rank in range(64):
        TALLY.take(rank)


def client_for(real, dp: int, **kw):
    import vllm_engine

    client = vllm_engine.make_dplb_client(real, dp, **kw)
    client.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    return client


def add(real, client, *requests) -> list[int]:
    """Adds ``requests`` at once through the client's (wrapped) ``add_request_async``;
    the engine each was sent to."""
    import vllm_engine

    before = len(client.sent)

    async def all_at_once():
        await asyncio.gather(*(client.add_request_async(r) for r in requests))

    asyncio.run(asyncio.wait_for(all_at_once(), DEADLINE))
    return [vllm_engine.rank_of(e) for _, _, e in client.sent[before:]]


def request(real, rid: str | None = None, tokens=(1, 2, 3), **kw):
    import vllm_engine

    return vllm_engine.make_request(real, rid or uuid.uuid4().hex, list(tokens), **kw)


def hook_metric(outcome: str) -> float:
    """``dpcoord_hook_requests_total{outcome}`` as vLLM's own ``/metrics`` registry shows it."""
    from prometheus_client import generate_latest
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    line = f'dpcoord_hook_requests_total{{outcome="{outcome}"}} '
    text = generate_latest(get_prometheus_registry()).decode()
    return next((float(x[len(line):]) for x in text.splitlines() if x.startswith(line)), 0.0)


# -- installed by vLLM, only where tested ------------------------------------------------


def test_vllms_plugin_loader_installs_the_hook_only_when_asked(hook, vllm_modules):
    assert hook() is None  # no DPCOORD_* variable: vLLM's classes stay as they are
    assert wrapped(vllm_modules) == ["vllm.v1.engine.core_client"] * 2 + ["vllm.v1.engine.output_processor"] * 2
    assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is not None
    assert wrapped(vllm_modules) == ["dpcoord.vllm_route"] * 4


def test_an_untested_vllm_is_left_as_it_is(hook, vllm_modules, monkeypatch, caplog):
    from dpcoord import vllm_route

    changed = dict(vllm_route.TESTED["0.33.0"], **{"OutputProcessor.abort_requests": "0" * 16})
    monkeypatch.setattr(vllm_route, "TESTED", {"0.33.0": changed})
    with caplog.at_level(logging.WARNING, logger="dpcoord.vllm"):
        assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is None
    assert wrapped(vllm_modules) == ["vllm.v1.engine.core_client"] * 2 + ["vllm.v1.engine.output_processor"] * 2
    assert [r.getMessage() for r in caplog.records] == [
        "dpcoord: not installed in vLLM's request path: OutputProcessor.abort_requests is not the one it was"
        " tested against in vLLM 0.33.0; vLLM runs as without dpcoord"
    ]
    monkeypatch.setattr(vllm_route, "TESTED", {"0.34.0": changed})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dpcoord.vllm"):
        assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is None
    assert "vLLM 0.33.0 is not a version it is tested against (0.34.0)" in caplog.records[0].getMessage()


# -- dpcoord decides, vLLM books ---------------------------------------------------------


def test_dpcoord_picks_the_engine_and_vllm_keeps_its_books(real, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    e = bring_up(d, engines, [0, 1, 2, 3])
    for r, waiting in ((0, 9), (1, 9), (2, 0), (3, 9)):
        e.set(r, waiting=waiting)
    eventually("rank 2 is the least loaded", lambda: [r["counts"][0] for r in d.state()["ranks"]] == [9, 9, 0, 9])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    client = client_for(real, 4)
    before = hook_metric("dpcoord")
    r = request(real)
    assert add(real, client, r) == [2]  # vLLM's rule, from its empty snapshot, would take 0
    assert r.data_parallel_rank is None  # the request vLLM sends is the one it built
    assert client.reqs_in_flight == {r.request_id: client.core_engines[2]}  # vLLM's abort routing
    assert client.engine_inflight == Counter({client.core_engines[2]: 1})
    assert [x["routed"] for x in d.state()["ranks"]] == [0, 0, 1, 0]
    assert h.counts == Counter(dpcoord=1)
    assert hook_metric("dpcoord") == before + 1


def test_vllms_own_pins_are_kept_and_never_asked(real, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    bring_up(d, engines, [0, 1, 2, 3])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    client = client_for(real, 4)
    assert add(real, client, request(real, data_parallel_rank=3)) == [3]  # X-data-parallel-rank
    session = request(real, "session-1", resumable=True)
    [first] = add(real, client, session)
    # The session's later chunks stay on its engine (vLLM's streaming-input affinity).
    assert add(real, client, request(real, "session-1", resumable=True)) == [first]
    assert add(real, client, request(real, "session-1")) == [first]
    assert sum(x["routed"] for x in d.state()["ranks"]) == 1  # only the session's first chunk asked
    assert h.counts == Counter(pinned=3, dpcoord=1)


def test_late_interaction_requests_keep_vllms_engine(real, hook, start_daemon, engines):
    import importlib

    late = importlib.import_module("vllm.v1.pool.late_interaction")
    pooling = importlib.import_module("vllm.pooling_params")
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    bring_up(d, engines, [0, 1, 2, 3])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    client = client_for(real, 4)
    r = request(real)
    r.pooling_params = pooling.PoolingParams(late_interaction_params=late.build_late_interaction_query_params("q7", 2))
    # vLLM keeps one query key's requests on one engine (its worker caches the query there).
    assert add(real, client, r) == [late.get_late_interaction_engine_index(r.pooling_params, 4)]
    assert h.counts == Counter(pinned=1) and sum(x["routed"] for x in d.state()["ranks"]) == 0


def test_a_bad_endpoint_leaves_vllm_running_on_its_rule(real, hook, caplog):
    client = client_for(real, 4)
    with caplog.at_level(logging.ERROR, logger="dpcoord.vllm"):
        h = hook(DPCOORD_ROUTE_ENDPOINT="not-an-endpoint")
        assert add(real, client, *(request(real) for _ in range(4))) == [0, 1, 2, 3]
    assert h.counts == Counter(unreachable=4)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["dpcoord: cannot connect to not-an-endpoint"]


def test_a_bad_setting_keeps_the_books_and_asks_nothing(real, hook, caplog):
    client = client_for(real, 4)
    with caplog.at_level(logging.ERROR, logger="dpcoord.vllm"):
        h = hook(DPCOORD_ROUTE_ENDPOINT="tcp://127.0.0.1:5570", DPCOORD_ROUTE_TIMEOUT_MS="0")
    assert [r.getMessage() for r in caplog.records] == [
        "dpcoord: DPCOORD_ROUTE_TIMEOUT_MS must be a positive number of milliseconds, got 0;"
        " vLLM balances its engines by itself"
    ]
    assert h.settings.endpoint is None  # the books are kept; nothing is asked
    assert add(real, client, request(real)) == [0] and h.counts == Counter()


def test_a_rank_beyond_vllms_engines_goes_by_vllms_rule(real, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "8", "--policy", "least_load")
    e = bring_up(d, engines, list(range(8)))
    for r in range(4):
        e.set(r, waiting=9)
    eventually("ranks 0-3 loaded", lambda: [r["counts"][0] for r in d.state()["ranks"]] == [9] * 4 + [0] * 4)
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    client = client_for(real, 4)  # this vLLM has 4 engines; dpcoord was told 8
    assert add(real, client, *(request(real) for _ in range(4))) == [0, 1, 2, 3]  # vLLM's rule
    assert h.counts == Counter(out_of_range=4)


def test_requests_flow_on_vllms_rule_while_dpcoord_is_down_and_come_back(real, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    e = bring_up(d, engines, [0, 1, 2, 3])
    e.set(0, waiting=9)
    eventually("rank 0 loaded", lambda: d.state()["ranks"][0]["counts"][0] == 9)
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="50")
    client = client_for(real, 4)
    assert 0 not in add(real, client, *(request(real) for _ in range(3)))
    d.kill()
    started = time.monotonic()
    during = add(real, client, *(request(real) for _ in range(8)))
    took = time.monotonic() - started
    # vLLM's rule (its snapshot here is empty): the rotating scan.
    assert during == [0, 1, 2, 3, 0, 1, 2, 3] and h.counts["dpcoord"] == 3
    assert h.counts["unreachable"] + h.counts["timeout"] == 8
    assert took < 8 * 0.05  # no request waited a whole deadline: nothing is queued for a dead dpcoord
    d.restart()
    e.set(0, waiting=0)
    bring_up(d, engines, [0, 1, 2, 3])

    def via_dpcoord():
        add(real, client, request(real))
        return h.counts["dpcoord"] == 4

    eventually("a request goes through dpcoord again", via_dpcoord, interval=0.02)
    assert sum(x["routed"] for x in d.state()["ranks"]) == 1


# -- aborts, from vLLM's own signal ------------------------------------------------------


def test_an_abort_then_an_arrival_in_the_next_step_are_both_counted(real, hook, start_daemon, tmp_path, monkeypatch):
    import vllm_engine

    d = start_daemon("--dp-size", "2")
    hook(DPCOORD_STATS_ENDPOINT=d.stats)
    loggers_mod, stats = real["vllm.v1.metrics.loggers"], real["vllm.v1.metrics.stats"]
    monkeypatch.setenv("DPCOORD_STATE_DIR", str(tmp_path / "ledgers"))
    monkeypatch.setenv("DPCOORD_GROUP", uuid.uuid4().hex)
    config = SimpleNamespace(parallel_config=SimpleNamespace(_api_process_count=1))
    [factory] = loggers_mod.load_stat_logger_plugin_factories()
    server = loggers_mod.PerEngineStatLoggerAdapter(config, [0, 1], per_engine_stat_logger_factory=factory)
    llm = vllm_engine.make_async_llm(real, client_for(real, 2))
    stop = real["vllm.v1.engine"].FinishReason.STOP

    def step(waiting=0, running=0, finished=()):
        it = None
        if finished:
            it = stats.IterationStats()
            it.finished_requests = [stats.FinishedRequestStats(finish_reason=r) for r in finished]
        server.record(stats.SchedulerStats(num_waiting_reqs=waiting, num_running_reqs=running), it, engine_idx=1)

    async def run():
        await vllm_engine.add_request(real, llm, request(real, "a", data_parallel_rank=1))
        step(running=1)
        await llm.abort("a")  # the client went away: vLLM's own abort signal
        await vllm_engine.add_request(real, llm, request(real, "b", data_parallel_rank=1))
        step(running=1)  # one step later: b runs where a ran; the gauges never showed a leave
        await llm.abort("a")  # aborted twice: counted once
        await llm.abort("b")
        await vllm_engine.add_request(real, llm, request(real, "c", data_parallel_rank=1))

    asyncio.run(run())
    step(running=1)
    eventually("a and b aborted, c running", lambda: d.state()["ranks"][1]["counts"] == [0, 1, 3, 0, 2])
    step(finished=(stop,))
    eventually("c finished", lambda: d.state()["ranks"][1]["counts"] == [0, 0, 3, 1, 2])
    for lg in server.per_engine_stat_loggers.values():
        lg.close()


# -- prefix-aware through vLLM's request path ---------------------------------------------


def test_a_prompt_goes_to_the_rank_holding_its_prefix(real, hook, start_daemon, engines, monkeypatch):
    import vllm_engine
    from test_kv_events import free_ports

    import importlib

    events_mod = importlib.import_module("vllm.distributed.kv_events")
    config_mod = importlib.import_module("vllm.config.kv_events")
    monkeypatch.setattr(events_mod.ZmqEventPublisher, "_is_bind_endpoint", staticmethod(lambda endpoint: True))
    base = free_ports(8)
    d = start_daemon("--dp-size", "4", "--policy", "cache_aware",
                     "--kv-events-connect", f"tcp://127.0.0.1:{base}+rank")
    bring_up(d, engines, [0, 1, 2, 3])
    publishers = [
        events_mod.EventPublisherFactory.create(
            config_mod.KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{base}"),
            data_parallel_rank=r,
        )
        for r in range(4)
    ]
    try:
        rng = random.Random(7)
        held = {r: [rng.randrange(1, 150_000) for _ in range(256)] for r in (2, 1)}

        def holds(rank: int) -> bool:
            # A fresh engine prefills the prompt and publishes its blocks, until dpcoord's
            # subscription is wired and has them (PUB drops what it sends before).
            events = vllm_engine.kv_events_for_prompt(real, held[rank] + [rank])
            publishers[rank].publish(events_mod.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank))
            reply = d.call("health", {"v": 1, "op": "prefix", "tokens": held[rank]})
            return reply.get("matched", [0] * 4)[rank] == 16

        for rank in held:
            eventually(f"dpcoord holds rank {rank}'s prefix", lambda: holds(rank), interval=0.05)
        h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
        client = client_for(real, 4)
        # Equally loaded ranks; vLLM's rule would take 0, then 1 (its rotating scan).
        assert add(real, client, request(real, tokens=held[2] + [5, 6, 7])) == [2]
        assert add(real, client, request(real, tokens=held[1] + [9])) == [1]
        assert h.counts == Counter(dpcoord=2)
    finally:
        for p in publishers:
            p.shutdown()


# -- several API servers ------------------------------------------------------------------


class ApiServers:
    """``n`` API-server processes (api_server.py), each with ``requests`` requests."""

    def __init__(self, n: int, dp: int, requests: int, env: dict[str, str]):
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(HERE / "api_server.py"), str(n), str(i), str(dp), str(requests)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
            )
            for i in range(n)
        ]

    def ask(self, command: str, servers=None) -> list[dict]:
        procs = self.procs if servers is None else [self.procs[i] for i in servers]
        for p in procs:
            p.stdin.write(command + "\n")
            p.stdin.flush()
        return [json.loads(p.stdout.readline()) for p in procs]

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait(DEADLINE)


def test_two_api_servers_spread_a_burst_exactly(start_daemon, engines, real):
    # Placements stay pending until the state is read (the engines never acknowledge them).
    d = start_daemon("--dp-size", "8", "--policy", "least_load", "--pending-ttl-ms", "60000")
    bring_up(d, engines, list(range(8)))  # equally loaded ranks whose counts do not move
    servers = ApiServers(2, 8, 32, {"DPCOORD_ROUTE_ENDPOINT": d.route, "DPCOORD_ROUTE_TIMEOUT_MS": "2000"})
    try:
        a, b = servers.ask("go")
    finally:
        servers.close()
    placed = Counter(a["ranks"] + b["ranks"])
    assert [placed[r] for r in range(8)] == [8] * 8  # each saw the other's placements
    assert [(r["routed"], r["pending"]) for r in d.state()["ranks"]] == [(8, 8)] * 8


def test_pending_settles_to_zero_when_the_books_agree(start_daemon, real, tmp_path):
    d = start_daemon("--dp-size", "8", "--policy", "least_load")
    env = {
        "DPCOORD_ROUTE_ENDPOINT": d.route, "DPCOORD_ROUTE_TIMEOUT_MS": "2000", "DPCOORD_STATS_ENDPOINT": d.stats,
        "DPCOORD_STATE_DIR": str(tmp_path / "ledgers"), "DPCOORD_GROUP": uuid.uuid4().hex,
    }
    servers = ApiServers(2, 8, 32, env)
    try:
        servers.ask("idle", servers=[0])
        eventually("all 8 ranks up", lambda: d.statuses() == ["up"] * 8)
        a, b = servers.ask("go")
        servers.ask("finish")
        placed = Counter(a["ranks"] + b["ranks"])
        # Every request received and finished, as the two servers' books say; dpcoord's
        # placements all acknowledged: nothing left pending.
        expected = [([0, 0, placed[r], placed[r], 0], placed[r], 0) for r in range(8)]
        eventually(
            "the books agree",
            lambda: [(r["counts"], r["routed"], r["pending"]) for r in d.state()["ranks"]] == expected,
        )
        assert sum(placed.values()) == 64
    finally:
        servers.close()


def test_the_added_latency_bench_runs(dpcoord_bin, real):
    """benches/route_hook.py at a tiny size, so it cannot rot (its numbers are docs/benchmarks.md's)."""
    out = subprocess.run(
        [sys.executable, str(HERE.parents[3] / "benches/route_hook.py"), dpcoord_bin, "--requests", "80", "--rounds", "2"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    rows = [line.split()[0:3] for line in out.splitlines()[2:7]]
    assert [r[0] for r in rows] == ["vLLM's", "dpcoord", "dpcoord", "dpcoord", "dpcoord"], out
    assert "dpcoord down: outcomes {'unreachable': 80}" in out, out
    assert [line.split()[0:2] for line in out.splitlines()[-3:]] == [["bare", "pyzmq"], ["bare", "zmq.asyncio"], ["RouteLink", "(the"]], out
