"""dpcoord's route hook in vLLM 0.33.0's own request path: installed by vLLM's plugin
loader, driving vLLM's real DPLBAsyncMPClient, OutputProcessor and AsyncLLM (built
without engines, vllm_engine.py), against the real dpcoord."""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
import time
from collections import Counter

import pytest

import vllm_engine
from conftest import DEADLINE, PINNED, bring_up, eventually
from hook_fixtures import HERE, add, client_for, hook, hook_metric, request, vllm_modules, wrapped  # noqa: F401 - fixtures


# -- installed by vLLM, only where tested ------------------------------------------------


def test_vllms_plugin_loader_installs_the_hook_only_when_asked(hook, vllm_modules):
    assert hook() is None  # no DPCOORD_* variable: vLLM's classes stay as they are
    assert wrapped(vllm_modules) == ["vllm.v1.engine.core_client"] * 4 + ["vllm.v1.engine.output_processor"] * 2
    assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is not None
    assert wrapped(vllm_modules) == ["dpcoord.vllm_route"] * 6


def test_an_untested_vllm_is_left_as_it_is(hook, vllm_modules, monkeypatch, caplog):
    from dpcoord import vllm_route

    release = PINNED["vllm"]
    changed = dict(vllm_route.TESTED[release], **{"OutputProcessor.abort_requests": "0" * 16})
    monkeypatch.setattr(vllm_route, "TESTED", {release: changed})
    with caplog.at_level(logging.WARNING, logger="dpcoord.vllm"):
        assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is None
    assert wrapped(vllm_modules) == ["vllm.v1.engine.core_client"] * 4 + ["vllm.v1.engine.output_processor"] * 2
    assert [r.getMessage() for r in caplog.records] == [
        "dpcoord: not installed in vLLM's request path: OutputProcessor.abort_requests is not the one it was"
        f" tested against in vLLM {release}; vLLM runs as without dpcoord"
    ]
    monkeypatch.setattr(vllm_route, "TESTED", {"0.31.0": changed, "0.9.1": changed})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dpcoord.vllm"):
        assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is None
    assert [r.getMessage() for r in caplog.records] == [
        f"dpcoord: not installed in vLLM's request path: vLLM {release} is not a release it is tested against"
        " (0.31.0, 0.9.1); install one of them (pip install 'vllm==0.31.0'), or let a frontend or gateway ask"
        " dpcoord (docs/engines.md); vLLM runs as without dpcoord"
    ]


def test_the_support_window_is_vllms_last_three_minor_releases():
    """And, outside it, the vLLM that vLLM Ascend's latest release runs on."""
    from dpcoord import vllm_route

    def releases(name):
        return [line.strip() for line in (HERE / name).read_text().splitlines() if line[:1].isdigit()]

    window, ascend = releases("vllm-releases.txt"), releases("ascend-releases.txt")
    assert window == ["0.32.0", "0.33.0", "0.34.0"] and ascend == ["0.23.0"]
    assert sorted(vllm_route.TESTED) == ascend + window


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
    assert vllm_engine.engine_inflight(client) == Counter({client.core_engines[2]: 1})
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
    # The session's later chunks stay on its engine (vLLM's streaming-input affinity;
    # vLLM 0.23, vLLM Ascend's, has none: its own rule places them, as without dpcoord).
    later = add(real, client, request(real, "session-1", resumable=True)) + add(real, client, request(real, "session-1"))
    if vllm_engine.SESSION_AFFINITY:
        assert later == [first, first]
    assert sum(x["routed"] for x in d.state()["ranks"]) == 1  # only the session's first chunk asked
    assert h.counts == Counter(pinned=3, dpcoord=1)


def test_late_interaction_requests_keep_vllms_engine(real, hook, start_daemon, engines):
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
    d = start_daemon("--dp-size", "8", "--policy", "least_load", "--pending-ttl-ms", "60000")
    e = bring_up(d, engines, list(range(8)))
    for r in range(4):
        e.set(r, waiting=9)
    eventually("ranks 0-3 loaded", lambda: [r["counts"][0] for r in d.state()["ranks"]] == [9] * 4 + [0] * 4)
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    client = client_for(real, 4)  # this vLLM has 4 engines; dpcoord was told 8
    assert add(real, client, *(request(real) for _ in range(4))) == [0, 1, 2, 3]  # vLLM's rule
    assert h.counts == Counter(out_of_range=4) and sum(h.withdrawn.values()) == 4
    # dpcoord's placements on ranks vLLM does not have are withdrawn, not left to their TTL.
    eventually("nothing pending", lambda: [r["pending"] for r in d.state()["ranks"]] == [0] * 8)


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


def test_a_node_of_a_multi_node_deployment_gets_its_own_ranks(real, hook, start_daemon, engines):
    """Node 1 of 2 (``--data-parallel-hybrid-lb``, global ranks 4-7): node 0's idle ranks
    are not this API server's to choose; dpcoord picks the least loaded of ranks 4-7
    (rank 6), vLLM gets it as its engine index 2, and the books are on rank 6. A pin
    keeps vLLM's meaning in that mode: an index among the node's engines."""
    import vllm_engine

    d = start_daemon("--dp-size", "8", "--policy", "least_load")
    e = bring_up(d, engines, list(range(8)))
    for r, waiting in ((4, 9), (5, 9), (6, 1), (7, 9)):
        e.set(r, waiting=waiting)
    eventually("node 1 loaded", lambda: [r["counts"][0] for r in d.state()["ranks"]] == [0] * 4 + [9, 9, 1, 9])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    client = vllm_engine.make_dplb_client(real, 8, node_ranks=[4, 5, 6, 7])
    assert add(real, client, request(real)) == [6]
    assert add(real, client, request(real, data_parallel_rank=1)) == [5]  # X-data-parallel-rank: 1
    assert [x["routed"] for x in d.state()["ranks"]] == [0] * 6 + [1, 0]
    assert h.placed == {rid: rank for rid, rank in zip(client.reqs_in_flight, [6, 5])}
    assert h.counts == Counter(dpcoord=1, pinned=1)


# -- prefix-aware through vLLM's request path ---------------------------------------------


ENGINES = {
    "engines at 16": (16, lambda real, ve: ve.make_kv_cache_manager(real, 16)),
    "engines at 64": (64, lambda real, ve: ve.make_kv_cache_manager(real, 64)),
    "engines at 128": (128, lambda real, ve: ve.make_kv_cache_manager(real, 128)),  # vLLM Ascend's default
    "engines at 16 x dcp 2": (32, lambda real, ve: ve.make_kv_cache_manager(real, 16, dcp=2)),
    "hybrid, two groups of 32": (32, lambda real, ve: ve.make_hybrid_kv_cache_manager(real, 32, sliding_window=64)),
}


@pytest.mark.parametrize("engines_kind", list(ENGINES))
def test_a_prompt_goes_to_the_rank_holding_its_prefix(real, hook, start_daemon, engines, monkeypatch, engines_kind):
    """The API server's ``cache_config.block_size`` is 16; the engines' KV events come
    in their own blocks: vLLM 0.34's default block is 64, vLLM Ascend's 128, decode-context parallelism
    multiplies it, a hybrid model publishes each of its KV cache groups. The hook keys
    prompts in dpcoord's size, so every request goes to the rank holding its prefix."""
    import vllm_engine
    from test_kv_events import free_ports

    events_mod = importlib.import_module("vllm.distributed.kv_events")
    config_mod = importlib.import_module("vllm.config.kv_events")
    if hasattr(events_mod.ZmqEventPublisher, "_is_bind_endpoint"):
        monkeypatch.setattr(events_mod.ZmqEventPublisher, "_is_bind_endpoint", staticmethod(lambda endpoint: True))
        host = "127.0.0.1"
    else:
        host = "*"  # vLLM 0.23 (vLLM Ascend's) binds a wildcard endpoint only
    base = free_ports(8)
    d = start_daemon("--dp-size", "4", "--policy", "cache_aware",
                     "--kv-events-connect", f"tcp://127.0.0.1:{base}+rank")
    bring_up(d, engines, [0, 1, 2, 3])
    publishers = [
        events_mod.EventPublisherFactory.create(
            config_mod.KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://{host}:{base}"),
            data_parallel_rank=r,
        )
        for r in range(4)
    ]
    try:
        rng = random.Random(7)
        held = {r: [rng.randrange(1, 150_000) for _ in range(256)] for r in (2, 1)}
        size, manager_for = ENGINES[engines_kind]

        def holds(rank: int) -> bool:
            # A fresh engine prefills the prompt and publishes its blocks, until dpcoord's
            # subscription is wired and has them (PUB drops what it sends before).
            events = vllm_engine.kv_events_for_prompt(real, held[rank] + [rank], manager=manager_for(real, vllm_engine))
            assert events[0].block_size == size
            publishers[rank].publish(events_mod.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank))
            reply = d.call("health", {"v": 1, "op": "prefix", "tokens": held[rank]})
            return reply.get("matched", [0] * 4)[rank] == 256 // size

        for rank in held:
            eventually(f"dpcoord holds rank {rank}'s prefix", lambda: holds(rank), interval=0.05)
        h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
        client = client_for(real, 4)
        assert client.vllm_config.cache_config.block_size == 16
        # Equally loaded ranks; vLLM's rule would take 0, then 1 (its rotating scan).
        assert add(real, client, request(real, tokens=held[2] + [5, 6, 7])) == [2]
        assert add(real, client, request(real, tokens=held[1] + [9])) == [1]
        assert h.counts == Counter(dpcoord=2)
        assert [link.block_size for link in h.links.values()] == [size]
    finally:
        for p in publishers:
            p.shutdown()


def test_what_vllm_delivered_of_dpcoords_prediction_goes_back_to_dpcoord(real, hook, start_daemon, engines):
    """vLLM's own ``OutputProcessor`` takes the engine's first output of each request,
    carrying its real ``PrefillStats``; the hook reports ``num_cached_tokens`` with
    the tokens dpcoord predicted cached on that rank (its ``explain``)."""
    import vllm_engine

    stats_mod = importlib.import_module("vllm.v1.metrics.stats")
    engine_mod = importlib.import_module("vllm.v1.engine")
    d = start_daemon("--dp-size", "2", "--policy", "cache_aware")
    bring_up(d, engines, [0, 1])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    llm = vllm_engine.make_async_llm(real, client_for(real, 2))
    prompt = list(range(1, 49))  # 3 blocks of 16

    def first_output(rid: str, cached: int):
        stats = stats_mod.PrefillStats()
        stats.set(num_prompt_tokens=len(prompt), num_local_cached_tokens=cached, num_external_cached_tokens=0)
        return engine_mod.EngineCoreOutput(request_id=rid, new_token_ids=[7], prefill_stats=stats)

    async def run():
        # No KV events: dpcoord predicts from its own placements, so the second
        # request of the prompt is predicted whole (48) on the first one's rank.
        for rid, cached in (("a", 0), ("b", 32)):
            await vllm_engine.add_request(real, llm, request(real, rid, tokens=prompt))
            llm.output_processor.process_outputs([first_output(rid, cached)])

    asyncio.run(asyncio.wait_for(run(), DEADLINE))
    assert h.placed == {"a": 0, "b": 0} and h.predicted == {}

    def reported(kind: str) -> float:
        return d.metric("dpcoord_prefix_reported_tokens_total", f'dp_rank="0",kind="{kind}"')

    eventually("both reports counted", lambda: d.metric("dpcoord_prefix_prediction_error_tokens_count") == 2)
    assert [reported("predicted"), reported("delivered")] == [48, 32]
    assert d.metric("dpcoord_prefix_prediction_error_tokens_sum") == 16
    assert d.metric("dpcoord_prefix_predicted_tokens_total", 'dp_rank="0",of="chosen"') == 48
