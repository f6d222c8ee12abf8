"""Engine side: publish one DP rank's load to dpcoord.

Two hooks, written against the frameworks' names without importing them:

* ``DpcoordStatLogger`` has the shape of vLLM's ``StatLoggerBase`` (for code that
  builds its own ``AsyncLLM``; a ``vllm serve`` deployment needs none of this: the
  package's stat-logger plugin, ``dpcoord.vllm_plugin``, is loaded by vLLM itself)
  (``vllm/v1/metrics/loggers.py``): vLLM calls ``record(scheduler_stats,
  iteration_stats, ...)`` once per engine step, per engine. Pass a factory to
  ``AsyncLLM(..., stat_loggers=[factory])``; vLLM calls ``factory(vllm_config,
  engine_index)`` once per DP engine, so each logger publishes one rank.
* ``SglangLoadHook``: call it with each ``LoadSnapshot`` (or metrics
  ``SchedulerStats``) an SGLang scheduler produces for its DP rank.

Run as a script, it drives a toy engine so the loop can be watched against a
real dpcoord::

    dpcoord --dp-size 1 --stats-bind ipc:///tmp/dpcoord-stats &
    python examples/engine_publisher.py --stats ipc:///tmp/dpcoord-stats --rank 0 --connect
    curl -s 127.0.0.1:9570/state
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from types import SimpleNamespace
from typing import Any

from dpcoord import EngineCounters, StatsPublisher, publish_sglang
from dpcoord.adapters import is_sglang_health_check, vllm_count_iteration, vllm_publish_kwargs


class DpcoordStatLogger:
    """A vLLM stat logger that publishes each engine's SchedulerStats to dpcoord,
    for one process per rank (with several API servers per rank, use the package's
    plugin, ``dpcoord.vllm_plugin``, whose ranks share one sequence).

    vLLM steps far more often than dpcoord needs to hear: updates are sent at most
    every ``min_interval_s`` (iteration stats are still counted on every call). A
    timer repeats the last update every ``heartbeat_s`` while the engine does not
    step, so an idle rank stays ``up``; every update carries the steps counted so
    far as ``progress``, so a rank with work whose engine stopped stepping is
    ``stalled`` rather than kept in rotation by the repeats."""

    def __init__(
        self,
        vllm_config: Any = None,
        engine_index: int = 0,
        *,
        endpoint: str = "tcp://127.0.0.1:5572",
        bind: bool = False,
        min_interval_s: float = 0.02,
        heartbeat_s: float = 0.25,
    ):
        self.publisher = StatsPublisher(endpoint, engine_index, bind=bind)
        self.counters = EngineCounters()
        self.min_interval_s = min_interval_s
        self.steps = 0
        self._stats: Any = None
        self._sent = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._repeat, args=(heartbeat_s,), daemon=True)
        self._timer.start()

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
        with self._lock:
            if iteration_stats is not None:
                vllm_count_iteration(self.counters, iteration_stats)
            if scheduler_stats is None:
                return
            self.steps += 1
            self._stats = scheduler_stats
            if time.monotonic() - self._sent >= self.min_interval_s:
                self._send()

    def _send(self) -> None:
        self.publisher.publish(**vllm_publish_kwargs(self._stats, self.counters), progress=self.steps)
        self._sent = time.monotonic()

    def _repeat(self, heartbeat_s: float) -> None:
        while not self._stop.wait(heartbeat_s / 2):
            with self._lock:
                if self._stats is not None and time.monotonic() - self._sent >= heartbeat_s:
                    self._send()

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def close(self) -> None:
        self._stop.set()
        self._timer.join()
        self.publisher.close()


def vllm_stat_logger_factory(endpoint: str, bind: bool = False):
    """``stat_loggers=[vllm_stat_logger_factory("tcp://dpcoord-host:5572")]``."""
    return lambda vllm_config, engine_index=0: DpcoordStatLogger(
        vllm_config, engine_index, endpoint=endpoint, bind=bind
    )


class SglangLoadHook:
    """For an SGLang scheduler: count requests where they enter and leave, and
    publish every load report. Health checks (rids ``HEALTH_CHECK...``) are skipped."""

    def __init__(self, endpoint: str, dp_rank: int, *, bind: bool = False):
        self.publisher = StatsPublisher(endpoint, dp_rank, bind=bind)
        self.counters = EngineCounters()

    def on_request(self, rid: str) -> None:
        if not is_sglang_health_check(rid):
            self.counters.on_received()

    def on_finish(self, rid: str, finished_reason: Any) -> None:
        if not is_sglang_health_check(rid):
            self.counters.on_done(finished_reason)

    def on_load(self, load: Any) -> dict:
        return publish_sglang(self.publisher, load, self.counters)


class ToyEngine:
    """A queue model standing in for a real scheduler: Poisson-ish arrivals,
    a bounded running batch, geometric service; 2% of requests abort."""

    def __init__(self, seed: int = 0, arrival_p: float = 0.6, max_running: int = 8):
        self.rng = random.Random(seed)
        self.arrival_p, self.max_running = arrival_p, max_running
        self.waiting = self.running = 0
        self._finished: list[Any] = []

    def step(self) -> None:
        while self.rng.random() < self.arrival_p:
            self.waiting += 1
        admit = min(self.waiting, self.max_running - self.running)
        self.waiting -= admit
        self.running += admit
        self._finished = []
        for _ in range(self.running):
            if self.rng.random() < 0.2:
                reason = 2 if self.rng.random() < 0.02 else 0  # vLLM FinishReason ABORT / STOP
                self._finished.append(SimpleNamespace(finish_reason=reason))
        self.running -= len(self._finished)

    def scheduler_stats(self) -> SimpleNamespace:
        usage = self.running / self.max_running
        return SimpleNamespace(num_waiting_reqs=self.waiting, num_running_reqs=self.running, kv_cache_usage=usage)

    def iteration_stats(self) -> SimpleNamespace:
        return SimpleNamespace(
            finished_requests=self._finished,
            time_to_first_tokens_iter=[0.05 + self.rng.random() * 0.05 for _ in self._finished],
            inter_token_latencies_iter=[0.01 + self.rng.random() * 0.01],
        )


def run(
    endpoint: str,
    rank: int,
    bind: bool,
    period_s: float = 0.05,
    iterations: int | None = None,
    seed: int = 0,
    stop: threading.Event | None = None,
) -> DpcoordStatLogger:
    """Steps a toy engine and feeds the vLLM-shaped logger; returns the logger."""
    logger = DpcoordStatLogger(None, rank, endpoint=endpoint, bind=bind, min_interval_s=0.0)
    engine = ToyEngine(seed=seed + rank)
    n = 0
    while (iterations is None or n < iterations) and not (stop and stop.is_set()):
        engine.step()
        logger.record(engine.scheduler_stats(), engine.iteration_stats(), engine_idx=rank)
        n += 1
        time.sleep(period_s)
    return logger


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stats", required=True, help="dpcoord's --stats-bind (with --connect) or an endpoint to bind")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--connect", action="store_true", help="connect to dpcoord instead of binding")
    ap.add_argument("--period-ms", type=float, default=50.0)
    ap.add_argument("--iterations", type=int, default=None, help="stop after this many steps (default: run forever)")
    args = ap.parse_args(argv)
    logger = run(args.stats, args.rank, not args.connect, args.period_ms / 1000, args.iterations)
    p = logger.publisher
    print(f"rank {p.rank} boot {p.boot}: sent {p.seq} updates")


if __name__ == "__main__":
    main()
