"""A vLLM stat-logger plugin that publishes every engine's load to dpcoord.

vLLM loads it from the ``vllm.stat_logger_plugins`` entry point (registered by
this package) and calls ``DpcoordStatLogger(vllm_config, engine_index)`` once per
engine in every API server. Set ``DPCOORD_STATS_ENDPOINT`` to dpcoord's stats
bind (e.g. ``tcp://127.0.0.1:5572``); without it the plugin does nothing.

Environment (all optional except the endpoint):

``DPCOORD_STATS_ENDPOINT``  where to connect the PUB socket (dpcoord's ``--stats-bind``)
``DPCOORD_PUBLISH_MS``      timer period, default 250: how often the last gauges are repeated
``DPCOORD_ABORT_GRACE_MS``  default 1000: see :mod:`dpcoord.ledger` (aborts, where the books are not exact)
``DPCOORD_STATE_DIR``       where the per-rank ledgers live, default ``/dev/shm`` (else the temp dir)
``DPCOORD_GROUP``           names one deployment's ledgers; default: the process that started
                            the API servers (pid and start time)

One rank, one publisher sequence: every logger of a rank on this host shares a
:class:`~dpcoord.ledger.SharedLedger` (one ``boot``, one rising ``seq``, summed
counters). A logger that receives an engine step's stats publishes it at once;
between steps exactly one logger, the lease holder, repeats the last gauges every
``DPCOORD_PUBLISH_MS``, so an idle rank stays ``up``. See the package README.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

from vllm.v1.metrics.loggers import StatLoggerBase

from .adapters import field, is_failure
from .ledger import TALLY, SharedLedger
from .publisher import StatsPublisher

log = logging.getLogger("dpcoord.vllm")

#: missed timer periods after which another logger takes over the timer
LEASE_PERIODS = 3


@dataclass(frozen=True)
class Settings:
    endpoint: str | None
    period_s: float = 0.25
    abort_grace_s: float = 1.0
    state_dir: str = ""
    group: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        def ms(name: str, default: int) -> float:
            value = int(env.get(name, default))
            if value <= 0:
                raise ValueError(f"{name} must be a positive number of milliseconds, got {value}")
            return value / 1000.0

        shm = "/dev/shm"
        default_dir = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
        return cls(
            endpoint=env.get("DPCOORD_STATS_ENDPOINT") or None,
            period_s=ms("DPCOORD_PUBLISH_MS", 250),
            abort_grace_s=ms("DPCOORD_ABORT_GRACE_MS", 1000),
            state_dir=env.get("DPCOORD_STATE_DIR") or default_dir,
            group=env.get("DPCOORD_GROUP", ""),
        )


def _start_time(pid: int) -> str:
    """A process's start time (clock ticks since boot), so a reused pid names another group."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def default_group(vllm_config: Any) -> str:
    """The process that started this deployment's API servers: their parent when
    vLLM runs several (``api_server_count > 1``), else this process."""
    count = field(getattr(vllm_config, "parallel_config", None), "_api_process_count", default=1)
    pid = os.getppid() if int(count) > 1 else os.getpid()
    return f"{pid}-{_start_time(pid)}"


def vllm_step(iteration_stats: Any) -> tuple[int, int, tuple[float, ...], tuple[float, ...]]:
    """``(finished, failed, ttft_ms, tpot_ms)`` from one vLLM ``IterationStats``:
    finish reasons ABORT and ERROR count as failed; latencies in ms from
    ``time_to_first_tokens_iter`` and ``inter_token_latencies_iter`` (seconds)."""
    if iteration_stats is None:
        return 0, 0, (), ()
    reasons = [field(r, "finish_reason") for r in field(iteration_stats, "finished_requests", default=())]
    failed = sum(1 for r in reasons if is_failure(r))
    ttft = tuple(s * 1000.0 for s in field(iteration_stats, "time_to_first_tokens_iter", default=()))
    tpot = tuple(s * 1000.0 for s in field(iteration_stats, "inter_token_latencies_iter", default=()))
    return len(reasons) - failed, failed, ttft, tpot


def vllm_gauges(scheduler_stats: Any) -> tuple[int, int, float | None] | None:
    """``(waiting, running, kv_usage)`` from a vLLM ``SchedulerStats``; waiting
    includes the deferred (``num_skipped_waiting_reqs``), as vLLM's own gauge does."""
    if scheduler_stats is None:
        return None
    waiting = int(field(scheduler_stats, "num_waiting_reqs", default=0))
    waiting += int(field(scheduler_stats, "num_skipped_waiting_reqs", default=0))
    running = int(field(scheduler_stats, "num_running_reqs", default=0))
    return waiting, running, field(scheduler_stats, "kv_cache_usage", "gpu_cache_usage")


class _Ticker:
    """One daemon thread per process calling ``tick()`` on every live logger."""

    _lock = threading.Lock()
    _loggers: "weakref.WeakSet[DpcoordStatLogger]" = weakref.WeakSet()
    _thread: threading.Thread | None = None

    @classmethod
    def add(cls, logger: "DpcoordStatLogger") -> None:
        with cls._lock:
            cls._loggers.add(logger)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="dpcoord-stats", daemon=True)
                cls._thread.start()

    @classmethod
    def _run(cls) -> None:
        while True:
            with cls._lock:
                loggers = list(cls._loggers)
            period = min((lg.settings.period_s for lg in loggers), default=0.25)
            for lg in loggers:
                try:
                    lg.tick()
                except Exception:  # never let one rank stop the others' timer
                    log.exception("dpcoord: publishing rank %s failed", lg.rank)
            time.sleep(period / 2)


_blind_logged = False


class DpcoordStatLogger(StatLoggerBase):
    """Publishes engine ``engine_index``'s load as DP rank ``engine_index``."""

    def __init__(self, vllm_config: Any, engine_index: int = 0):
        global _blind_logged
        self.rank = engine_index
        self.settings = Settings.from_env()
        self.publisher: StatsPublisher | None = None
        if self.settings.endpoint is None:
            log.info("dpcoord: DPCOORD_STATS_ENDPOINT is not set; engine %d is not published", engine_index)
            return
        group = self.settings.group or default_group(vllm_config)
        path = os.path.join(self.settings.state_dir, f"dpcoord-{group}-rank{engine_index}.json")
        self.ledger = SharedLedger(path)
        self.me = uuid.uuid4().hex
        self.publisher = StatsPublisher(self.settings.endpoint, engine_index, bind=False, boot=0)
        if not _blind_logged:
            _blind_logged = True
            log.warning(
                "dpcoord: vLLM reports no token counts, so updates carry no `tokens`: dpcoord's token-load"
                " policies count these ranks' waiting and running requests at the mean prompt length of its placements"
            )
        _Ticker.add(self)

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if self.publisher is None:
            return
        finished, failed, ttft, tpot = vllm_step(iteration_stats)
        gauges = vllm_gauges(scheduler_stats)
        if gauges is None and not (finished or failed or ttft or tpot):
            return
        with self.ledger.locked() as ledger:
            now = time.time()
            self._fold(ledger)
            ledger.observe(now, gauges, finished, failed, ttft, tpot, self.settings.abort_grace_s)
            self._send(ledger, now)

    def tick(self) -> None:
        """The timer: the lease holder repeats the last gauges when nothing was sent for a period."""
        if self.publisher is None:
            return
        with self.ledger.locked() as ledger:
            now = time.time()
            self._fold(ledger)
            if not ledger.claim_timer(self.me, now, LEASE_PERIODS * self.settings.period_s):
                return
            ledger.settle(now, self.settings.abort_grace_s)
            if now - ledger.last_sent >= self.settings.period_s:
                self._send(ledger, now)

    def _fold(self, ledger) -> None:
        """This API server's exact books for the rank (requests sent, client aborts),
        when dpcoord's hook keeps them here (:mod:`dpcoord.vllm_route`)."""
        if TALLY.active:
            ledger.fold(*TALLY.take(self.rank))

    def _send(self, ledger, now: float) -> None:
        """One update continuing the rank's shared sequence (called under the ledger's lock)."""
        self.publisher.resume(ledger.boot, ledger.seq, (ledger.received, ledger.finished, ledger.failed))
        update = self.publisher.publish(**ledger.publish_kwargs())
        ledger.seq, ledger.last_sent = update["seq"], now

    def log_engine_initialized(self) -> None:
        pass

    def close(self) -> None:
        """Stops publishing (tests; vLLM keeps loggers for the process's life)."""
        _Ticker._loggers.discard(self)
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
