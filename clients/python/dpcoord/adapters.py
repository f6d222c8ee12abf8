"""Map vLLM and SGLang scheduler stats onto a :meth:`StatsPublisher.publish` call.

Written against the frameworks' field names only; nothing here imports vllm or
sglang. Every reader accepts an object with attributes or a plain dict.

vLLM (``vllm/v1/metrics/stats.py``): ``SchedulerStats.num_running_reqs``,
``num_waiting_reqs`` plus ``num_skipped_waiting_reqs`` (deferred; vLLM's own
``num_requests_waiting`` gauge adds them in), ``kv_cache_usage``;
``IterationStats.finished_requests`` (each with a ``finish_reason``: ``FinishReason``
STOP/LENGTH/ABORT/ERROR/...), ``time_to_first_tokens_iter`` and
``inter_token_latencies_iter`` (seconds). vLLM reports no token counts. For a
whole deployment without code, use the stat-logger plugin (:mod:`dpcoord.vllm_plugin`).

SGLang (0.5.23): the per-rank ``LoadSnapshot`` (``num_running_reqs``,
``num_waiting_reqs``, ``num_used_tokens`` = KV in use, ``num_total_tokens`` = KV in
use + queued, ``token_usage``), or the metrics ``SchedulerStats``
(``num_running_reqs`` and ``num_queue_reqs`` are ``QueueCount(total, by_priority)``,
``num_used_tokens``, ``token_usage``).

Neither framework counts requests received/finished/failed per boot in those
structures, so the engine keeps an :class:`EngineCounters` (hooked where
requests are added and finish) and the adapters combine both.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any, Mapping

from .publisher import StatsPublisher

#: vLLM ``FinishReason`` values that mean the request did not complete (ABORT, ERROR).
VLLM_FAILED_REASON_VALUES = (2, 3)
FAILED_REASON_NAMES = ("abort", "error")
#: SGLang's internal health-check requests carry rids with this prefix; keep them out of the counts.
SGLANG_HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


def field(obj: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (and not None) on ``obj``, attribute or key."""
    for name in names:
        if isinstance(obj, Mapping):
            value = obj.get(name)
        else:
            value = getattr(obj, name, None)
        if value is not None:
            return value
    return default


def _clamp01(x: float | None) -> float | None:
    """A share in [0, 1]: the engine's value clamped; ``None`` for none or NaN
    (dpcoord refuses a NaN, and 0 would claim an empty KV cache)."""
    if x is None or math.isnan(x := float(x)):
        return None
    return min(1.0, max(0.0, x))


def is_failure(reason: Any) -> bool:
    """Whether a finish reason means the request failed (abort or error).

    Understands vLLM's ``FinishReason`` (an IntEnum, or its int / string form) and
    SGLang's ``FINISH_ABORT`` (the object, its class name, or its ``to_json()``
    dict with ``"type": "abort"``)."""
    if reason is None:
        return False
    if isinstance(reason, Mapping):
        return str(reason.get("type", "")).lower() in FAILED_REASON_NAMES
    name = getattr(reason, "name", None)
    if isinstance(name, str):
        return name.lower() in FAILED_REASON_NAMES
    if isinstance(reason, str):
        return reason.lower() in FAILED_REASON_NAMES
    if isinstance(reason, int):
        return reason in VLLM_FAILED_REASON_VALUES
    if type(reason).__name__.upper().startswith("FINISH_ABORT"):
        return True
    to_json = getattr(reason, "to_json", None)
    if callable(to_json):
        return is_failure(to_json())
    return False


class EngineCounters:
    """The per-boot request counts and recent latencies an engine reports.

    Call :meth:`on_received` where a user request enters the engine and
    :meth:`on_finished` / :meth:`on_failed` (or :meth:`on_done` with the finish
    reason) where it leaves; skip health probes. Latency means are over the last
    ``window`` observations. Thread-safe. Call :meth:`reset` with
    :meth:`StatsPublisher.restart` if the engine restarts in-process."""

    def __init__(self, window: int = 256):
        self._lock = threading.Lock()
        self._window = window
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.received = 0
            self.finished = 0
            self.failed = 0
            self._ttft: deque[float] = deque(maxlen=self._window)
            self._tpot: deque[float] = deque(maxlen=self._window)

    def on_received(self, n: int = 1) -> None:
        with self._lock:
            self.received += n

    def on_finished(self, n: int = 1) -> None:
        with self._lock:
            self.finished += n

    def on_failed(self, n: int = 1) -> None:
        with self._lock:
            self.failed += n

    def on_done(self, reason: Any) -> None:
        """One request left the engine with ``reason`` (see :func:`is_failure`)."""
        if is_failure(reason):
            self.on_failed()
        else:
            self.on_finished()

    def observe_ttft_ms(self, ms: float) -> None:
        with self._lock:
            self._ttft.append(float(ms))

    def observe_tpot_ms(self, ms: float) -> None:
        with self._lock:
            self._tpot.append(float(ms))

    @property
    def ttft_ms(self) -> float | None:
        with self._lock:
            return sum(self._ttft) / len(self._ttft) if self._ttft else None

    @property
    def tpot_ms(self) -> float | None:
        with self._lock:
            return sum(self._tpot) / len(self._tpot) if self._tpot else None

    def settle(self, waiting: int, running: int) -> tuple[int, int, int]:
        """``(received, finished, failed)``, with ``received`` raised to at least
        ``finished + failed + waiting + running``: every request that is queued,
        running or done was received, even where no hook counted its arrival."""
        with self._lock:
            self.received = max(self.received, self.finished + self.failed + waiting + running)
            return self.received, self.finished, self.failed


# -- vLLM -----------------------------------------------------------------------------


def _publish_kwargs(
    counters: EngineCounters, waiting: int, running: int, tokens: tuple[int, int] | None, kv_usage: Any
) -> dict[str, Any]:
    """The :meth:`StatsPublisher.publish` arguments once an engine's gauges are read:
    ``counters`` settled against them, and ``kv_usage`` clamped to [0, 1]."""
    received, finished, failed = counters.settle(waiting, running)
    return dict(
        waiting=waiting,
        running=running,
        received=received,
        finished=finished,
        failed=failed,
        tokens=tokens,
        kv_usage=_clamp01(kv_usage),
        ttft_ms=counters.ttft_ms,
        tpot_ms=counters.tpot_ms,
    )


def vllm_count_iteration(counters: EngineCounters, iteration_stats: Any) -> None:
    """Folds one vLLM ``IterationStats`` into ``counters``: finished requests by
    ``finish_reason``, TTFT and inter-token latency samples (seconds -> ms)."""
    for req in field(iteration_stats, "finished_requests", default=()):
        counters.on_done(field(req, "finish_reason"))
    for s in field(iteration_stats, "time_to_first_tokens_iter", default=()):
        counters.observe_ttft_ms(s * 1000.0)
    for s in field(iteration_stats, "inter_token_latencies_iter", default=()):
        counters.observe_tpot_ms(s * 1000.0)


def vllm_publish_kwargs(
    scheduler_stats: Any, counters: EngineCounters, *, tokens: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The :meth:`StatsPublisher.publish` arguments for a vLLM ``SchedulerStats``."""
    waiting = int(field(scheduler_stats, "num_waiting_reqs", default=0)) + int(
        field(scheduler_stats, "num_skipped_waiting_reqs", default=0)
    )
    running = int(field(scheduler_stats, "num_running_reqs", default=0))
    kv_usage = field(scheduler_stats, "kv_cache_usage", "gpu_cache_usage")
    return _publish_kwargs(counters, waiting, running, tokens, kv_usage)


def publish_vllm(
    publisher: StatsPublisher,
    scheduler_stats: Any,
    counters: EngineCounters,
    iteration_stats: Any = None,
    *,
    tokens: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Publishes one update from vLLM's per-step stats (e.g. from a stat logger's
    ``record(scheduler_stats, iteration_stats, ...)``); returns what was sent."""
    if iteration_stats is not None:
        vllm_count_iteration(counters, iteration_stats)
    return publisher.publish(**vllm_publish_kwargs(scheduler_stats, counters, tokens=tokens))


# -- SGLang ---------------------------------------------------------------------------


def is_sglang_health_check(rid: Any) -> bool:
    """Whether an SGLang request id is one of its own health-check generations."""
    return isinstance(rid, str) and rid.startswith(SGLANG_HEALTH_CHECK_RID_PREFIX)


def count(value: Any) -> int:
    """A request count that may be SGLang's ``QueueCount(total, by_priority)`` or a plain int."""
    return int(field(value, "total", default=0)) if hasattr(value, "total") or isinstance(value, Mapping) else int(value)


def sglang_publish_kwargs(
    load: Any,
    counters: EngineCounters,
    *,
    waiting_tokens: int | None = None,
    kv_usage: float | None = None,
) -> dict[str, Any]:
    """The :meth:`StatsPublisher.publish` arguments for an SGLang load report.

    ``load`` is a ``LoadSnapshot`` or the metrics ``SchedulerStats`` (whose request
    counts are ``QueueCount`` objects). Tokens: from a ``LoadSnapshot``,
    ``[num_total_tokens - num_used_tokens, num_used_tokens]`` (queued, KV in use),
    which sums to SGLang's own ``total_tokens`` load; from ``SchedulerStats``,
    which has no queued tokens, ``[waiting_tokens (default 0), num_used_tokens]``."""
    waiting = count(field(load, "num_waiting_reqs", "num_queue_reqs", default=0))
    running = count(field(load, "num_running_reqs", default=0))
    used = field(load, "num_used_tokens")
    total = field(load, "num_total_tokens")
    if total is not None:
        used = min(int(used or 0), int(total))
        tokens: tuple[int, int] | None = (int(total) - used, used)
    else:
        tokens = None if used is None else (int(waiting_tokens or 0), int(used))
    kv_usage = kv_usage if kv_usage is not None else field(load, "token_usage")
    return _publish_kwargs(counters, waiting, running, tokens, kv_usage)


def publish_sglang(publisher: StatsPublisher, load: Any, counters: EngineCounters, **options: Any) -> dict[str, Any]:
    """Publishes one update from an SGLang scheduler's load report; returns what was sent.

    ``options`` are :func:`sglang_publish_kwargs`'s keywords (``waiting_tokens``, ``kv_usage``)."""
    return publisher.publish(**sglang_publish_kwargs(load, counters, **options))
