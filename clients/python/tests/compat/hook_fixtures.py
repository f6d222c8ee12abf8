"""What the route-hook tests share: vLLM's own plugin loader run with chosen
variables (the ``hook`` fixture, which puts vLLM's methods back afterwards), and
requests added through vLLM's real (wrapped) DP client."""

from __future__ import annotations

import asyncio
import importlib
import uuid
from pathlib import Path

import pytest

import ascend
from conftest import DEADLINE

HERE = Path(__file__).parent
WRAPPED = (
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient", "add_request_async"),
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient", "get_core_engine_for_request"),
    ("vllm.v1.engine.core_client", "DPAsyncMPClient", "get_core_engine_for_request"),
    ("vllm.v1.engine.core_client", "AsyncMPClient", "add_request_async"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "abort_requests"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
)


def wrapped(vllm_modules) -> list[str]:
    """The modules whose code now runs for each of vLLM's wrapped methods."""
    return [getattr(getattr(vllm_modules[m], c), f).__module__ for m, c, f in WRAPPED]


@pytest.fixture
def vllm_modules(real):
    return {m: importlib.import_module(m) for m, _, _ in WRAPPED} | {"plugins": importlib.import_module("vllm.plugins")}


@pytest.fixture
def hook(real, vllm_modules, monkeypatch, tmp_path):
    """``hook(env)``: vLLM's own ``load_general_plugins()`` run with ``env``; the
    process's hook (or None). Everything vLLM had is put back at teardown."""
    from dpcoord import vllm_route
    from dpcoord.ledger import TALLY

    import prometheus_client

    # Another compat test renders vLLM's /metrics in this process from a cleared
    # default registry: put the hook's counter back where vLLM's /metrics reads it.
    if vllm_route._METRIC is not None and vllm_route._METRIC not in prometheus_client.REGISTRY._collector_to_names:
        prometheus_client.REGISTRY.register(vllm_route._METRIC)
    classes = {(m, c): getattr(vllm_modules[m], c) for m, c, _ in WRAPPED}
    saved = {(m, c, f): classes[(m, c)].__dict__.get(f) for m, c, f in WRAPPED}

    def install(**env: str):
        for name in ("DPCOORD_ROUTE_ENDPOINT", "DPCOORD_STATS_ENDPOINT", "DPCOORD_ROUTE_TIMEOUT_MS", "DPCOORD_ROUTE_SEND"):
            monkeypatch.delenv(name, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        if ascend.installed():  # vLLM Ascend's own plugins ran once, at start-up (ascend.py)
            monkeypatch.setenv("VLLM_PLUGINS", ascend.DPCOORD_PLUGINS)
        monkeypatch.setattr(vllm_modules["plugins"], "plugins_loaded", False)
        vllm_modules["plugins"].load_general_plugins()
        return vllm_route.HOOK

    yield install
    for hook in [vllm_route.HOOK]:
        if hook is not None:
            for link in [*hook.links.values(), hook.warm]:
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

    return vllm_engine.make_dplb_client(real, dp, **kw)


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


