"""vLLM and SGLang adapters: field mapping (exact), counters, and a real round trip."""

from __future__ import annotations

import enum
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import eventually
from dpcoord import EngineCounters, StatsPublisher, publish_sglang, publish_vllm
from dpcoord.adapters import (
    is_failure,
    is_sglang_health_check,
    sglang_publish_kwargs,
    vllm_count_iteration,
    vllm_publish_kwargs,
)


class FinishReason(enum.IntEnum):  # the shape of vllm.v1.engine.FinishReason
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


class FINISH_ABORT:  # the shape of SGLang's abort finish reason
    def to_json(self):
        return {"type": "abort", "message": "client went away"}


class FINISH_LENGTH:
    def to_json(self):
        return {"type": "length", "length": 16}


def test_package_imports_neither_vllm_nor_sglang():
    code = "import sys, dpcoord, dpcoord.adapters; print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    src = (Path(__file__).resolve().parents[1] / "dpcoord" / "adapters.py").read_text()
    assert "import vllm" not in src and "import sglang" not in src and "from vllm" not in src and "from sglang" not in src


def test_finish_reasons():
    assert [is_failure(r) for r in FinishReason] == [False, False, True, True, False]
    assert [is_failure(r) for r in (0, 1, 2, 3, "stop", "abort", "ERROR", None)] == [
        False, False, True, True, False, True, True, False,
    ]
    assert is_failure(FINISH_ABORT()) and not is_failure(FINISH_LENGTH())
    assert is_failure({"type": "abort"}) and not is_failure({"type": "stop"})
    assert is_sglang_health_check("HEALTH_CHECK_1f2e") and not is_sglang_health_check("chatcmpl-1")


def test_vllm_scheduler_stats_mapping():
    c = EngineCounters()
    stats = SimpleNamespace(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25, step_counter=9)
    assert vllm_publish_kwargs(stats, c) == dict(
        waiting=2, running=3, received=5, finished=0, failed=0, tokens=None, kv_usage=0.25, ttft_ms=None, tpot_ms=None
    )
    # Requests done since: two finished, one aborted, one error; latencies in seconds.
    it = SimpleNamespace(
        finished_requests=[
            SimpleNamespace(finish_reason=FinishReason.STOP),
            SimpleNamespace(finish_reason=FinishReason.LENGTH),
            SimpleNamespace(finish_reason=FinishReason.ABORT),
            SimpleNamespace(finish_reason=FinishReason.ERROR),
        ],
        time_to_first_tokens_iter=[0.1, 0.3],
        inter_token_latencies_iter=[0.02, 0.04, 0.03],
    )
    vllm_count_iteration(c, it)
    # Older releases: gpu_cache_usage; newer: skipped waiting requests also wait.
    old = {"num_running_reqs": 1, "num_waiting_reqs": 0, "gpu_cache_usage": 0.5}
    kw = vllm_publish_kwargs(old, c)
    assert (kw["waiting"], kw["running"], kw["received"], kw["finished"], kw["failed"]) == (0, 1, 5, 2, 2)
    assert kw["kv_usage"] == 0.5
    assert kw["ttft_ms"] == pytest.approx(200.0) and kw["tpot_ms"] == pytest.approx(30.0)
    new = SimpleNamespace(num_running_reqs=4, num_waiting_reqs=1, num_skipped_waiting_reqs=2, kv_cache_usage=1.0000001)
    kw = vllm_publish_kwargs(new, c, tokens=(7, 8))
    # received: at least finished + failed + waiting + running.
    assert (kw["waiting"], kw["running"], kw["received"], kw["tokens"], kw["kv_usage"]) == (3, 4, 11, (7, 8), 1.0)
    # Below 0 is sent as 0; NaN (which dpcoord would refuse, update and all) is left out.
    for kv, sent in [(-0.5, 0.0), (float("nan"), None), (float("inf"), 1.0)]:
        kw = vllm_publish_kwargs(SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=kv), c)
        assert kw["kv_usage"] == sent, kv


def test_counters_received_counts_explicit_arrivals():
    c = EngineCounters()
    c.on_received(10)
    c.on_finished(3)
    c.on_failed()
    assert c.settle(waiting=1, running=2) == (10, 3, 1)
    assert c.settle(waiting=9, running=9) == (22, 3, 1)
    assert c.settle(waiting=0, running=0) == (22, 3, 1)  # never goes backwards
    c.reset()
    assert c.settle(0, 0) == (0, 0, 0) and c.ttft_ms is None


def test_sglang_load_mapping():
    c = EngineCounters()
    # LoadSnapshot: num_total_tokens is KV in use (num_used_tokens) plus queued.
    load = SimpleNamespace(dp_rank=1, num_running_reqs=3, num_waiting_reqs=2, num_used_tokens=700, num_total_tokens=900)
    assert sglang_publish_kwargs(load, c) == dict(
        waiting=2, running=3, received=5, finished=0, failed=0, tokens=(200, 700), kv_usage=None, ttft_ms=None, tpot_ms=None
    )
    # The metrics SchedulerStats (counts may be QueueCount-like objects or ints).
    c.on_done(FINISH_ABORT())
    c.on_done(FINISH_LENGTH())
    stats = SimpleNamespace(num_running_reqs=SimpleNamespace(total=4, by_priority=None), num_queue_reqs=1, num_used_tokens=500, token_usage=0.3, gen_throughput=99.0)
    kw = sglang_publish_kwargs(stats, c, waiting_tokens=120)
    assert kw == dict(
        waiting=1, running=4, received=7, finished=1, failed=1, tokens=(120, 500), kv_usage=0.3, ttft_ms=None, tpot_ms=None
    )


def test_adapters_publish_to_a_real_dpcoord(start_daemon):
    d = start_daemon("--dp-size", "2")
    p0 = StatsPublisher(d.stats, 0, bind=False)
    p1 = StatsPublisher(d.stats, 1, bind=False)
    c0, c1 = EngineCounters(), EngineCounters()
    c0.on_finished(4)
    vstats = SimpleNamespace(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.4)
    sload = SimpleNamespace(dp_rank=1, num_running_reqs=2, num_waiting_reqs=4, num_used_tokens=1000, num_total_tokens=1234)

    def applied():
        sent0 = publish_vllm(p0, vstats, c0)
        sent1 = publish_sglang(p1, sload, c1)
        assert sent0["counts"] == [1, 2, 7, 4, 0] and sent0["kv_usage"] == 0.4
        assert sent1["counts"] == [4, 2, 6, 0, 0] and sent1["tokens"] == [234, 1000]
        ranks = d.state()["ranks"]
        return [(r["status"], r["counts"]) for r in ranks] == [("up", [1, 2, 7, 4, 0]), ("up", [4, 2, 6, 0, 0])]

    eventually("both adapters' updates applied", applied)
    assert d.metric("dpcoord_stats_messages_total", 'result="malformed"') == 0
    p0.close()
    p1.close()
