"""The route hook's books in vLLM 0.33.0's request path: client aborts from vLLM's
own signal, several API-server processes sharing one dpcoord, and the bench that
measures what the hook adds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from types import SimpleNamespace

import pytest

from conftest import DEADLINE, bring_up, eventually, stopped
from hook_fixtures import HERE, client_for, hook, request, vllm_modules  # noqa: F401 - fixtures

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


@pytest.mark.parametrize(
    "kind, rank",
    [("internal LB", 1), ("external LB", 1), ("one engine", 0)],
)
def test_the_books_are_exact_on_every_client_class(real, hook, start_daemon, tmp_path, monkeypatch, kind, rank):
    """vLLM builds ``DPLBAsyncMPClient`` (``--data-parallel-size N``), ``DPAsyncMPClient``
    (``--data-parallel-external-lb``: this API server has rank ``rank``'s engine only) or
    ``AsyncMPClient`` (one engine); each request sent and each client abort is counted
    on its engine whichever it is."""
    import vllm_engine

    d = start_daemon("--dp-size", "2")
    h = hook(DPCOORD_STATS_ENDPOINT=d.stats)
    loggers_mod, stats = real["vllm.v1.metrics.loggers"], real["vllm.v1.metrics.stats"]
    monkeypatch.setenv("DPCOORD_STATE_DIR", str(tmp_path / "ledgers"))
    monkeypatch.setenv("DPCOORD_GROUP", uuid.uuid4().hex)
    config = SimpleNamespace(parallel_config=SimpleNamespace(_api_process_count=1))
    [factory] = loggers_mod.load_stat_logger_plugin_factories()
    server = loggers_mod.PerEngineStatLoggerAdapter(config, [rank], per_engine_stat_logger_factory=factory)
    core = {
        "internal LB": lambda: client_for(real, 2),
        "external LB": lambda: vllm_engine.make_external_lb_client(real, rank, 2),
        "one engine": lambda: vllm_engine.make_single_client(real),
    }[kind]()
    llm = vllm_engine.make_async_llm(real, core)
    pin = rank if kind == "internal LB" else None  # vLLM's own rule would spread them

    async def run():
        for rid in ("a", "b", "c"):
            await vllm_engine.add_request(real, llm, request(real, rid, data_parallel_rank=pin))
        await llm.abort("b")

    asyncio.run(run())
    assert [vllm_engine.rank_of(e) for t, _, e in core.sent if t.name == "ADD"] == [rank] * 3
    assert h.placed == {"a": rank, "c": rank}
    it = stats.IterationStats()
    stop = real["vllm.v1.engine"].FinishReason.STOP
    it.finished_requests = [stats.FinishedRequestStats(finish_reason=stop) for _ in range(2)]
    server.record(stats.SchedulerStats(), it, engine_idx=rank)
    eventually("3 received, 2 finished, 1 aborted", lambda: d.state()["ranks"][rank]["counts"] == [0, 0, 3, 2, 1])
    for lg in server.per_engine_stat_loggers.values():
        lg.close()


# -- placements vLLM did not use -------------------------------------------------------------


def test_an_answer_after_the_deadline_is_withdrawn_at_once(real, hook, start_daemon, engines):
    """dpcoord answers after the request went by vLLM's rule (dpcoord stopped, then
    resumed): the placement it booked is withdrawn by the late answer, not by its TTL."""
    d = start_daemon("--dp-size", "4", "--policy", "least_load", "--pending-ttl-ms", "60000")
    e = bring_up(d, engines, [0, 1, 2, 3])
    for r in (0, 1, 3):
        e.set(r, waiting=9)
    eventually("rank 2 is the least loaded", lambda: [r["counts"][0] for r in d.state()["ranks"]] == [9, 9, 0, 9])
    # A deadline long enough that only the stopped dpcoord misses it, even on a loaded machine.
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="1000")
    client = client_for(real, 4)

    async def late():
        await client.add_request_async(request(real))  # the link is up: rank 2
        d.proc.send_signal(signal.SIGSTOP)
        eventually("every thread of dpcoord stopped", lambda: stopped(d.proc.pid))
        try:
            await client.add_request_async(request(real, "late"))
        finally:
            d.proc.send_signal(signal.SIGCONT)
        # dpcoord books rank 2 for the query it reads now; its answer comes back late.
        end = asyncio.get_running_loop().time() + DEADLINE
        while h.withdrawn[2] == 0 and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.005)

    asyncio.run(asyncio.wait_for(late(), 2 * DEADLINE))
    assert h.counts == Counter(dpcoord=1, timeout=1) and h.withdrawn == Counter({2: 1})
    import vllm_engine

    assert vllm_engine.rank_of(client.sent[0][2]) == 2 and "late" in client.reqs_in_flight  # sent, by vLLM's rule
    eventually("only the first placement stands", lambda: [(r["routed"], r["pending"]) for r in d.state()["ranks"]]
               == [(0, 0), (0, 0), (1, 1), (0, 0)])


# -- several API servers ------------------------------------------------------------------


class ApiServers:
    """``n`` API-server processes (api_server.py), each with ``requests`` requests; with
    ``nodes``, ``n`` on each node of a hybrid-LB deployment, node ``k`` holding global
    ranks ``nodes[k]`` (``(first, count)``)."""

    def __init__(self, n: int, dp: int, requests: int, env: dict[str, str],
                 nodes: list[tuple[int, int]] | None = None):
        node_args = [[f"{first}:{count}"] for first, count in nodes] if nodes else [[]]
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(HERE / "api_server.py"), str(n), str(i), str(dp), str(requests), *node],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
            )
            for node in node_args
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


def test_two_nodes_of_two_api_servers_keep_the_books_exact(start_daemon, real, tmp_path):
    """A 2-node hybrid-LB deployment (``--data-parallel-size 8 --data-parallel-size-local 4
    --data-parallel-hybrid-lb``): each node's two API servers reach only that node's 4
    engines. Every request goes to a rank of its node, and dpcoord's books per global
    rank equal what each engine received; they settle to 0 pending when it finishes."""
    d = start_daemon("--dp-size", "8", "--policy", "least_load")
    env = {
        "DPCOORD_ROUTE_ENDPOINT": d.route, "DPCOORD_ROUTE_TIMEOUT_MS": "2000", "DPCOORD_STATS_ENDPOINT": d.stats,
        "DPCOORD_STATE_DIR": str(tmp_path / "ledgers"), "DPCOORD_GROUP": uuid.uuid4().hex,
    }
    servers = ApiServers(2, 8, 16, env, nodes=[(0, 4), (4, 4)])
    try:
        servers.ask("idle", servers=[0, 2])
        eventually("all 8 ranks up", lambda: d.statuses() == ["up"] * 8)
        answers = servers.ask("go")
        assert [set(a["ranks"]) <= set(node) for a, node in zip(answers, [range(4)] * 2 + [range(4, 8)] * 2)] == [True] * 4
        assert [a["outcomes"] for a in answers] == [{"dpcoord": 16}] * 4
        received = Counter(r for a in answers for r in a["ranks"])
        assert [received[r] for r in range(8)] == [8] * 8  # least_load over each node's ranks
        assert [(r["routed"], r["pending"] + r["counts"][2]) for r in d.state()["ranks"]] == [(8, 8)] * 8
        servers.ask("finish")
        expected = [([0, 0, 8, 8, 0], 8, 0)] * 8
        eventually(
            "the books agree on both nodes",
            lambda: [(r["counts"], r["routed"], r["pending"]) for r in d.state()["ranks"]] == expected,
        )
    finally:
        servers.close()


def test_the_added_latency_bench_runs(dpcoord_bin, real):
    """benches/route_hook.py at a tiny size, so it cannot rot (its numbers are docs/benchmarks.md's)."""
    out = subprocess.run(
        [sys.executable, str(HERE.parents[3] / "benches/route_hook.py"), dpcoord_bin, "--requests", "80", "--rounds", "2"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    # vLLM logs to stdout too (with vLLM Ascend, its platform plugin at INFO): the bench's own lines
    out = "\n".join(line for line in out.splitlines() if not line.startswith(("INFO ", "WARNING ", "DEBUG ")))
    rows = [line.split()[0:3] for line in out.splitlines()[2:7]]
    assert [r[0] for r in rows] == ["vLLM's", "dpcoord", "dpcoord", "dpcoord", "dpcoord"], out
    assert "dpcoord down: outcomes {'unreachable': 80}" in out, out
    assert [line.split()[0:2] for line in out.splitlines()[-3:]] == [["bare", "pyzmq"], ["bare", "zmq.asyncio"], ["RouteLink", "(the"]], out


def test_a_request_aborted_while_dpcoord_answers_is_sent_nowhere(real, hook, tmp_path):
    import vllm_engine
    from dpcoord.ledger import TALLY
    from test_route_link import FakeRoute, ok

    answer = threading.Event()
    replies = []

    def later(q):  # dpcoord answers only once the test says so
        replies.append(q)
        answer.wait(DEADLINE)
        return ok(q, ranks=[1])

    fake = FakeRoute(f"ipc://{tmp_path}/route", later)
    try:
        h = hook(DPCOORD_ROUTE_ENDPOINT=f"ipc://{tmp_path}/route", DPCOORD_ROUTE_TIMEOUT_MS="2000")
        client = client_for(real, 2)
        llm = vllm_engine.make_async_llm(real, client)

        async def run():
            adding = asyncio.ensure_future(vllm_engine.add_request(real, llm, request(real, "gone")))
            end = asyncio.get_running_loop().time() + DEADLINE
            while not replies:  # dpcoord has the query; vLLM awaits its answer
                assert asyncio.get_running_loop().time() < end, "the hook never asked dpcoord"
                await asyncio.sleep(0.005)
            await llm.abort("gone")  # the client went away meanwhile
            answer.set()
            await asyncio.wait_for(adding, DEADLINE)

        asyncio.run(run())
        assert client.sent == [] and client.reqs_in_flight == {}  # no engine got it
        assert TALLY.take(0) == TALLY.take(1) == (0, 0) and h.placed == {}
        assert h.counts == Counter()  # neither placed by dpcoord nor by vLLM's rule
        # dpcoord's placement on rank 1 is withdrawn at once.
        assert h.withdrawn == Counter({1: 1})
        eventually("the withdrawal reaches dpcoord", lambda: len(replies) == 2)
        assert {k: replies[1][k] for k in ("op", "placed")} == {"op": "finished", "placed": 1} and "rank" not in replies[1]
    finally:
        fake.close()
