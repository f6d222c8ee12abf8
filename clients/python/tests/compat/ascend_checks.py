"""What vLLM Ascend's platform plugin changes of what dpcoord wraps and reads, in an
API server of vLLM Ascend 0.23.0 (its vLLM, 0.23.0, with vllm-ascend installed
beside it; see ascend.py). Run by test_vllm_window.py in the child pytest of each
release of ascend-releases.txt, after the hook's and the plugin's tests; not
collected on plain vLLM (its name is not test_*)."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from types import SimpleNamespace

import ascend

#: what dpcoord wraps (the route hook) or reads (the stats plugin's objects, the KV
#: events, the /metrics families)
SEAM_MODULES = (
    "vllm.v1.engine.core_client",
    "vllm.v1.engine.output_processor",
    "vllm.v1.metrics.loggers",
    "vllm.v1.metrics.stats",
    "vllm.v1.metrics.prometheus",
    "vllm.distributed.kv_events",
)


def test_vllms_plugin_loader_finds_vllm_ascend_and_its_patches_are_applied(real):
    [entry] = [e for e in importlib.metadata.entry_points(group="vllm.platform_plugins") if e.name == "ascend"]
    assert entry.value == "vllm_ascend:register"
    from vllm.platforms import current_platform

    assert type(current_platform).__module__ == "vllm_ascend.platform"
    assert importlib.metadata.version("vllm-ascend") == importlib.metadata.version("vllm") == "0.23.0"
    applied = ascend.patches()
    for patch in ("patch_balance_schedule", "patch_kv_cache_utils", "patch_kv_cache_coordinator",
                  "patch_async_swa_kv_lifetime", "patch_mamba_manager"):
        assert f"vllm_ascend.patch.platform.{patch}" in applied


def test_no_patch_replaces_what_dpcoord_wraps_or_reads(real):
    """Every class and function of those modules is vLLM's own, and the methods the
    hook wraps have the fingerprints of vLLM 0.23.0's source (TESTED)."""
    from dpcoord import vllm_route

    replaced = []
    for name in SEAM_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == name:
                for member, fn in vars(value).items():
                    fn = getattr(fn, "__func__", fn)
                    if inspect.isfunction(fn) and not fn.__module__.startswith(("vllm.", "dpcoord.")):
                        replaced.append(f"{name}.{attr}.{member} ({fn.__module__})")
            elif inspect.isfunction(value) or inspect.isclass(value):
                if value.__module__.startswith("vllm_ascend"):
                    replaced.append(f"{name}.{attr} ({value.__module__})")
    assert replaced == []
    methods = {n: vllm_route.seam(m, n) for m, n in vllm_route.SEAMS}
    if all(f.__module__ != "dpcoord.vllm_route" for f in methods.values()):
        assert vllm_route.untested("0.23.0", methods) is None


def test_the_engines_scheduler_is_vllm_ascends_and_its_stats_are_vllms(real):
    """The scheduler the engines build is vLLM Ascend's BalanceScheduler (its own
    ``schedule``); the SchedulerStats the stat loggers get are vLLM's ``make_stats``,
    attached by vLLM's ``update_from_output`` under vLLM Ascend's wrapper."""
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    balance = sys.modules["vllm_ascend.patch.platform.patch_balance_schedule"]
    swa = sys.modules["vllm_ascend.patch.platform.patch_async_swa_kv_lifetime"]
    assert scheduler.Scheduler is balance.BalanceScheduler
    vllms = balance.BalanceScheduler.__mro__[1]
    assert vllms.__module__ == "vllm.v1.core.sched.scheduler" and vllms.__name__ == "Scheduler"
    assert "schedule" in vars(balance.BalanceScheduler) and "make_stats" not in vars(balance.BalanceScheduler)
    assert balance.BalanceScheduler.make_stats.__module__ == "vllm.v1.core.sched.scheduler"
    assert vllms.update_from_output is swa._patched_update_from_output
    assert swa._original_update_from_output.__module__ == "vllm.v1.core.sched.scheduler"


def test_kv_events_are_vllms_through_vllm_ascends_free_block_patch(real):
    """vLLM's BlockPool publishes the events, with vLLM Ascend's ``free_blocks`` (it
    drops double frees): a prompt's blocks are stored, and evicted when the cache fills."""
    import vllm_engine

    pool = importlib.import_module("vllm.v1.core.block_pool")
    events = importlib.import_module("vllm.distributed.kv_events")
    assert pool.BlockPool.free_blocks.__module__ == "vllm_ascend.patch.platform.patch_kv_cache_utils"
    manager = vllm_engine.make_kv_cache_manager(real, 16, num_blocks=6)  # 5 usable: the second prompt evicts
    first = vllm_engine.kv_events_for_prompt(real, list(range(1, 65)), manager=manager)
    assert [type(e).__name__ for e in first] == ["BlockStored"] and len(first[0].block_hashes) == 4
    second = vllm_engine.kv_events_for_prompt(real, list(range(1001, 1065)), manager=manager)
    removed = [h for e in second if isinstance(e, events.BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(first[0].block_hashes)


def test_a_hybrid_models_kv_cache_is_vllm_ascends_coordinator_over_vllms_block_pool(real):
    """With prefix caching on, a hybrid model (full attention and a sliding window)
    gets vLLM Ascend's coordinator; vLLM's block pool still publishes the events
    (test_vllm_route.py routes a prompt to the rank holding its prefix under it)."""
    import vllm_engine

    manager = vllm_engine.make_hybrid_kv_cache_manager(real, 32, sliding_window=64)
    assert type(manager.coordinator).__name__ == "AscendHybridKVCacheCoordinator"
    assert type(manager.coordinator.block_pool).__module__ == "vllm.v1.core.block_pool"
    events = vllm_engine.kv_events_for_prompt(real, list(range(1, 129)), manager=manager)
    assert {type(e).__name__ for e in events} == {"BlockStored"}
    assert {e.block_size for e in events} == {32}


def test_vllm_ascends_default_block_is_128_tokens(real):
    """What an API server's config gets when no ``--block-size`` is given (vLLM Ascend's
    ``refresh_block_size``, from ``NPUPlatform.check_and_update_config``); the engines'
    KV events come in it, and test_vllm_route.py keys prompts in 128-token blocks."""
    from vllm_ascend.utils import refresh_block_size

    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=None), scheduler_config=None, model_config=None)
    refresh_block_size(config)
    assert config.cache_config.block_size == 128
