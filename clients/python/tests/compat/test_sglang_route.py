"""dpcoord's route hook in SGLang 0.5.23's own dispatch: installed by SGLang's plugin
loader (``load_plugins()``, through its ``HookRegistry``), driving SGLang's real
``DataParallelController`` (built without schedulers, sglang_controller.py),
against the real dpcoord."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections import Counter

import pytest

from conftest import bring_up, eventually, stopped
from sglang_controller import controller_module, dispatch, embedding, generate, health_check, make_controller
from test_kv_events import Prompt, free_ports, join, prefix, sglang_kv, start, tokens  # noqa: F401 - fixture

METHODS = ("round_robin_scheduler", "total_requests_scheduler", "total_tokens_scheduler")
VARIABLES = ("DPCOORD_ROUTE_ENDPOINT", "DPCOORD_ROUTE_TIMEOUT_MS", "DPCOORD_ROUTE_SEND", "SGLANG_PLUGINS")


@pytest.fixture
def dpc(real):
    return controller_module(real)


@pytest.fixture
def hook(dpc, monkeypatch):
    """``hook(env)``: SGLang's own ``load_plugins()`` run with ``env``; the process's
    hook (or None). SGLang's classes and hook registry are put back at teardown."""
    from dpcoord import sglang_route
    from sglang.srt import plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    cls = dpc.DataParallelController
    saved = {m: cls.__dict__[m] for m in METHODS}
    hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    patched = set(HookRegistry._patched)

    def install(**env: str):
        for name in VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(plugins, "_plugins_loaded", False)
        plugins.load_plugins()
        return sglang_route.HOOK

    yield install
    if sglang_route.HOOK is not None:
        sglang_route.HOOK.close()
    sglang_route.HOOK = None
    for m, fn in saved.items():
        setattr(cls, m, fn)
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(hooks)
    HookRegistry._patched.clear()
    HookRegistry._patched.update(patched)


def wrapped(dpc) -> list[str]:
    """The load-balance methods whose code is now a hook around SGLang's own."""
    return [m for m in METHODS if hasattr(dpc.DataParallelController.__dict__[m], "__wrapped__")]


def hook_metric(outcome: str) -> float:
    """``dpcoord_hook_requests_total{outcome}``, as the counter collects it (SGLang's
    ``/metrics`` reads the same samples from the processes' multiprocess files)."""
    from dpcoord import sglang_route

    [family] = sglang_route._metric().collect()
    return next(
        (s.value for s in family.samples if s.name == "dpcoord_hook_requests_total" and s.labels == {"outcome": outcome}),
        0.0,
    )


def routed(d) -> list[int]:
    return [x["routed"] for x in d.state()["ranks"]]


# -- installed by SGLang, only where tested ----------------------------------------------


def test_sglangs_plugin_loader_installs_the_hook_only_when_asked(dpc, hook):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    from dpcoord import sglang_route

    assert hook() is None  # no DPCOORD_ROUTE_ENDPOINT: SGLang's controller stays as it is
    assert wrapped(dpc) == []
    assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent", SGLANG_PLUGINS="another") is None  # not on SGLang's list
    assert wrapped(dpc) == []
    assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is not None
    assert wrapped(dpc) == list(METHODS)
    source = HookSource(plugin_name="dpcoord_route", dist_name="dpcoord")
    assert [(module, name) for module, name in sglang_route.SEAMS] == [
        ("sglang.srt.managers.data_parallel_controller", f"DataParallelController.{m}") for m in METHODS
    ]
    for module, name in sglang_route.SEAMS:
        assert HookRegistry._hooks[f"{module}.{name}"] == [(HookType.AROUND, sglang_route._around, source)]
        original = getattr(dpc.DataParallelController, name.split(".")[1]).__wrapped__
        assert sglang_route.fingerprint(original) == sglang_route.TESTED["0.5.23"][name]


def test_an_untested_sglang_is_left_as_it_is(dpc, hook, monkeypatch, caplog):
    from dpcoord import sglang_route

    name = "DataParallelController.maybe_external_dp_rank_routing"
    changed = dict(sglang_route.TESTED["0.5.23"], **{name: "0" * 16})
    monkeypatch.setattr(sglang_route, "TESTED", {"0.5.23": changed})
    with caplog.at_level(logging.WARNING, logger="dpcoord.sglang"):
        assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is None
    assert wrapped(dpc) == []
    assert [r.getMessage() for r in caplog.records if r.name == "dpcoord.sglang"] == [
        f"dpcoord: not installed in SGLang's dispatch: {name} is not the one it was tested against"
        " in SGLang 0.5.23; SGLang runs as without dpcoord"
    ]
    monkeypatch.setattr(sglang_route, "TESTED", {"0.5.24": changed})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dpcoord.sglang"):
        assert hook(DPCOORD_ROUTE_ENDPOINT="ipc:///nonexistent") is None
    assert wrapped(dpc) == []
    assert [r.getMessage() for r in caplog.records if r.name == "dpcoord.sglang"] == [
        "dpcoord: not installed in SGLang's dispatch: SGLang 0.5.23 is not a version it is tested against"
        " (0.5.24); SGLang runs as without dpcoord"
    ]


def test_a_bad_setting_leaves_sglang_as_it_is(dpc, hook, caplog):
    with caplog.at_level(logging.ERROR, logger="dpcoord.sglang"):
        assert hook(DPCOORD_ROUTE_ENDPOINT="tcp://127.0.0.1:5570", DPCOORD_ROUTE_TIMEOUT_MS="0") is None
    assert wrapped(dpc) == []
    assert [r.getMessage() for r in caplog.records if r.name == "dpcoord.sglang"] == [
        "dpcoord: DPCOORD_ROUTE_TIMEOUT_MS must be a positive number of milliseconds, got 0;"
        " SGLang balances its ranks by itself"
    ]


# -- dpcoord decides, SGLang sends -------------------------------------------------------


@pytest.mark.parametrize("method", ["round_robin", "total_requests", "total_tokens"])
def test_dpcoord_picks_the_rank_and_sglang_sends_the_request_it_built(method, dpc, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    e = bring_up(d, engines, [0, 1, 2, 3])
    for r, waiting in ((0, 9), (1, 9), (2, 0), (3, 9)):
        e.set(r, waiting=waiting)
    eventually("rank 2 is the least loaded", lambda: [r["counts"][0] for r in d.state()["ranks"]] == [9, 9, 0, 9])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    c = make_controller(dpc, 4, method)
    before = hook_metric("dpcoord")
    r = generate(tokens=range(1, 40))
    assert dispatch(c, r) == [2]  # SGLang's own method, from its empty view, would take 0
    assert c.sent == [(2, r)] and r.routed_dp_rank is None  # the request SGLang built, unpinned
    assert c.round_robin_counter == 0 and c.dp_budget.total_requests == [0, 0, 0, 0]  # SGLang's rule untouched
    assert routed(d) == [0, 0, 1, 0]
    assert h.counts == Counter(dpcoord=1)
    assert hook_metric("dpcoord") == before + 1


def test_sglangs_pins_are_kept_and_never_asked(dpc, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    bring_up(d, engines, [0, 1, 2, 3])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    c = make_controller(dpc, 4)
    before = hook_metric("pinned")
    assert dispatch(c, generate(routed_dp_rank=3), generate(routed_dp_rank=1)) == [3, 1]  # routed_dp_rank
    with pytest.raises(ValueError, match=r"^DP rank 6 is not active\.$"):  # SGLang refuses it, as ever
        dispatch(c, generate(routed_dp_rank=6))
    assert routed(d) == [0, 0, 0, 0]
    assert h.counts == Counter(pinned=3)
    assert hook_metric("pinned") == before + 3


def test_health_checks_keep_sglangs_own_rotation_and_are_never_asked(dpc, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    e = bring_up(d, engines, [0, 1, 2, 3])
    for r in (0, 1, 2):
        e.set(r, waiting=9)
    eventually("rank 3 is the least loaded", lambda: [r["counts"][0] for r in d.state()["ranks"]] == [9, 9, 9, 0])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    c = make_controller(dpc, 4)
    assert dispatch(c, health_check(), health_check(), generate(), health_check()) == [0, 1, 3, 2]
    assert c.health_round_robin_counter == 3 and c.round_robin_counter == 0
    assert routed(d) == [0, 0, 0, 1]
    assert h.counts == Counter(dpcoord=1)


def test_a_rank_sglang_cannot_send_to_goes_by_sglangs_own_method(dpc, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "8", "--policy", "least_load")
    e = bring_up(d, engines, list(range(8)))
    for r in range(4):
        e.set(r, waiting=9)
    eventually("ranks 0-3 loaded", lambda: [r["counts"][0] for r in d.state()["ranks"]] == [9] * 4 + [0] * 4)
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    four = make_controller(dpc, 4)  # this SGLang has 4 ranks; dpcoord was told 8
    assert dispatch(four, *(generate() for _ in range(4))) == [0, 1, 2, 3]  # SGLang's round robin
    eight = make_controller(dpc, 8)
    eight.status[4:] = [False] * 4  # ranks SGLang holds inactive (its ActiveRanksOutput)
    eight._active_workers = [0, 1, 2, 3]
    assert dispatch(eight, *(generate() for _ in range(4))) == [0, 1, 2, 3]
    assert h.counts == Counter(out_of_range=4, inactive=4)
    # dpcoord's 8 placements went unused: withdrawn at once, not left pending.
    assert sum(h.link_of[1].withdrawn.values()) == 8
    eventually("nothing routed or pending", lambda: [(r["routed"], r["pending"]) for r in d.state()["ranks"]] == [(0, 0)] * 8)


def test_a_bad_endpoint_leaves_sglang_running_on_its_own_method(dpc, hook, caplog):
    with caplog.at_level(logging.ERROR, logger="dpcoord.sglang"):
        h = hook(DPCOORD_ROUTE_ENDPOINT="not-an-endpoint")
        c = make_controller(dpc, 4)  # after the plugins, as SGLang builds it
        assert dispatch(c, *(generate() for _ in range(4))) == [0, 1, 2, 3]
    assert h.counts == Counter(unreachable=4)
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "dpcoord.sglang"] == [
        "dpcoord: cannot connect to not-an-endpoint"
    ]


# -- dpcoord down or hung: SGLang's own method, without waiting ----------------------------


def test_requests_flow_on_sglangs_method_while_dpcoord_is_down_and_come_back(dpc, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    e = bring_up(d, engines, [0, 1, 2, 3])
    e.set(0, waiting=9)
    eventually("rank 0 loaded", lambda: d.state()["ranks"][0]["counts"][0] == 9)
    # A long deadline, so that a loaded machine cannot make 8 requests look like one deadline.
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="500")
    c = make_controller(dpc, 4)
    assert dispatch(c, *(generate() for _ in range(3))) == [1, 2, 3]
    d.kill()
    link = h.link()
    eventually("the link has no connection to dpcoord", lambda: not link.writable())
    started = time.monotonic()
    during = dispatch(c, *(generate() for _ in range(8)))
    took = time.monotonic() - started
    assert during == [0, 1, 2, 3, 0, 1, 2, 3]  # SGLang's round robin
    assert h.counts == Counter(dpcoord=3, unreachable=8)
    assert took < 0.5  # all 8 together waited less than one deadline: nothing is queued for a dead dpcoord
    d.restart()
    bring_up(d, engines, [0, 1, 2, 3])

    def via_dpcoord():
        dispatch(c, generate())
        return h.counts["dpcoord"] == 4

    eventually("a request goes through dpcoord again", via_dpcoord, interval=0.02)
    assert sum(routed(d)) == 1


def test_a_hung_dpcoord_holds_one_request_for_one_deadline(dpc, hook, start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    bring_up(d, engines, [0, 1, 2, 3])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="500")
    c = make_controller(dpc, 4)
    assert dispatch(c, generate()) == [0]
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        eventually("every thread of dpcoord stopped", lambda: stopped(d.proc.pid))
        took = []
        for _ in range(8):
            started = time.monotonic()
            dispatch(c, generate())
            took.append(time.monotonic() - started)
        assert h.counts == Counter(dpcoord=1, timeout=8)
        assert took[0] >= 0.5 and sum(took[1:]) < 0.5  # one deadline, then none
        assert [rank for rank, _ in c.sent[1:]] == [0, 1, 2, 3, 0, 1, 2, 3]  # SGLang's round robin
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)

    def via_dpcoord():
        dispatch(c, generate())
        return h.counts["dpcoord"] == 2

    eventually("dpcoord answers a ping and is asked again", via_dpcoord, interval=0.02)
    # dpcoord woke up to the query that timed out and placed it too; its late answer,
    # read by the next query, withdrew that placement: SGLang had placed the request.
    assert sum(h.link_of[1].withdrawn.values()) == 1
    eventually("the late placement withdrawn", lambda: sum(routed(d)) == 2)


# -- prefix-aware through SGLang's dispatch -----------------------------------------------


@pytest.mark.parametrize("page_size", [16, 1], ids=["page16-block-keys", "page1-token-ids"])
def test_a_prompt_goes_to_the_rank_whose_sglang_tree_cache_holds_its_prefix(
    page_size, dpc, hook, sglang_kv, start_daemon, engines  # noqa: F811
):
    """SGLang's default tree cache per rank, published by its scheduler's publisher;
    the hook sends block keys in SGLang's page size (16), or the token ids (page size
    1: a key per token is larger than the token), with the request's cache salt."""
    rng = random.Random(61)
    base = free_ports(4)
    pub, rep = base, base + 2
    d = start(start_daemon, 2, f"tcp://127.0.0.1:{pub}+rank", f"tcp://127.0.0.1:{rep}+rank", "--policy", "cache_aware")
    kv = [sglang_kv(r, 2, pub, rep, page_size=page_size, unified=True) for r in (0, 1)]
    bring_up(d, engines, [0, 1])
    for r, e in enumerate(kv):
        join(d, e, r, rng)
    a, b = Prompt(tokens(rng, 128)), Prompt(tokens(rng, 96), salt="tenant-7")
    kv[1].cache_prompt(a)
    kv[1].step()
    kv[0].cache_prompt(b)
    kv[0].step()
    held = [[0, 128 // page_size], [96 // page_size, 0]]
    eventually("dpcoord's index has both", lambda: [prefix(d, a)["matched"], prefix(d, b)["matched"]] == held)
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    c = make_controller(dpc, 2, page_size=page_size)
    # SGLang's round robin would take 0, then 1.
    assert dispatch(c, generate(tokens=a.tokens + tokens(rng, 32))) == [1]
    assert dispatch(c, generate(tokens=b.tokens + tokens(rng, 32), cache_salt="tenant-7")) == [0]
    assert h.counts == Counter(dpcoord=2)


def test_the_prompt_is_keyed_as_sglangs_cache_keys_it(dpc, hook, start_daemon, engines):
    """dpcoord's placements (its approximate index: no KV events here) show what each
    query carried: the LoRA name seeds the keys, an embedding request's prompt is
    sent too, and a prompt under an ``extra_key`` (which SGLang's cache keys by and
    its events do not carry) goes by its length only."""
    d = start_daemon("--dp-size", "2", "--policy", "cache_aware")
    bring_up(d, engines, [0, 1])
    h = hook(DPCOORD_ROUTE_ENDPOINT=d.route, DPCOORD_ROUTE_TIMEOUT_MS="2000")
    c = make_controller(dpc, 2)
    lora, plain, embed, extra = (tuple(range(start, start + 128)) for start in (1, 1001, 2001, 3001))

    def held(tokens, **seed) -> list[int]:
        return d.call("health", {"v": 1, "op": "prefix", "tokens": list(tokens), **seed})["matched"]

    [r1] = dispatch(c, generate(tokens=lora, lora_id="a" * 32, lora_name="adapter-x"))
    [r2] = dispatch(c, embedding(tokens=embed))
    [r3] = dispatch(c, generate(tokens=extra, extra_key="tenant-class"))
    assert held(lora, lora="adapter-x") == [8 if r == r1 else 0 for r in (0, 1)]
    assert held(lora) == [0, 0]  # keyed under the LoRA name only
    assert held(embed) == [8 if r == r2 else 0 for r in (0, 1)]
    assert held(extra) == [0, 0]  # its length only
    assert held(plain) == [0, 0]
    assert sum(routed(d)) == 3 and h.counts == Counter(dpcoord=3)
