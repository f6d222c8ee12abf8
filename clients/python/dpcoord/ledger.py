"""One DP rank's publication state, shared by every stat logger that reports it.

vLLM builds a stat logger for every engine in every API server, and hands each
engine step's stats to one of them (the first API server with output in that
step, API server 0 when there is none), and nothing at all while the engine is
idle. So the loggers of one rank share one :class:`RankLedger`: one ``boot``,
one rising ``seq``, counters summed over all API servers, the last gauges any of
them received. :class:`SharedLedger` keeps it in a small file under an exclusive
``flock``; :class:`RankLedger` itself does no I/O.

Exact books. Where dpcoord's hook is installed in vLLM's request path
(:mod:`dpcoord.vllm_route`, on the vLLM versions it is tested against), every API
server counts in its :data:`TALLY` each request it sends to an engine and each
client abort vLLM's ``OutputProcessor.abort_requests`` reports for one of them;
the stat loggers fold those counts into the rank's ledger (``exact``): ``received``
is the requests sent to the rank, ``failed`` includes the aborts.

Otherwise the counts are inferred from the gauges. A request a client aborts
leaves the engine without a finish reason (vLLM's ``OutputProcessor.abort_requests``
never reaches ``IterationStats``). The ledger then counts as aborted, so as
``failed``, each request it saw queued or running in the engine that left it with
no finish reported to any API server within ``grace_s`` (the grace covers another
API server's report of the same step arriving a little later). A request
finished by a stop string in the API server can still be listed by the engine
for a step or two: ``overlap`` keeps it from being counted twice. Inference
misses what the gauges never show, such as an abort followed within the grace by
a new arrival.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator

#: latency samples kept for the ``ttft_ms`` / ``tpot_ms`` means
WINDOW = 64


def _share(x: Any) -> float | None:
    """vLLM's KV usage clamped to [0, 1]; ``None`` for none or NaN (dpcoord
    refuses a NaN ``kv_usage``, and 0 would claim an empty KV cache)."""
    if x is None or math.isnan(x := float(x)):
        return None
    return min(1.0, max(0.0, x))


@dataclass
class RankLedger:
    boot: int
    seq: int = 0
    received: int = 0
    finished: int = 0
    failed: int = 0
    waiting: int = 0
    running: int = 0
    kv_usage: float | None = None
    #: engine steps whose stats reached an API server of this rank: dpcoord's `progress`
    steps: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    #: requests counted finished that the last gauges still listed in the engine
    overlap: int = 0
    #: when the current unexplained departure was first seen (wall clock, s)
    gone_since: float | None = None
    #: the logger that repeats the last gauges on the timer, and until when it holds that role
    holder: str | None = None
    lease_until: float = 0.0
    #: when any logger last sent an update for this rank
    last_sent: float = 0.0
    #: whether ``received`` and the aborts come from the API servers' exact books
    exact: bool = False

    @property
    def in_engine(self) -> int:
        return self.waiting + self.running

    def observe(
        self,
        now: float,
        gauges: tuple[int, int, float | None] | None = None,
        finished: int = 0,
        failed: int = 0,
        ttft_ms: tuple[float, ...] = (),
        tpot_ms: tuple[float, ...] = (),
        grace_s: float = 1.0,
    ) -> None:
        """Folds one ``record()``: the engine's ``(waiting, running, kv_usage)``
        when this step's stats came here, and the requests this API server saw finish."""
        if gauges is not None:
            self.steps += 1
        if self.exact:
            self.finished += finished
            self.failed += failed
            if gauges is not None:
                self.waiting, self.running, self.kv_usage = gauges
            self._latencies(ttft_ms, tpot_ms)
            return
        if gauges is not None:
            waiting, running, _ = gauges
            # Everything listed in the engine was received (less what already counts as finished).
            self.received = max(self.received, self.finished + self.failed + waiting + running - self.overlap)
        self.finished += finished
        self.failed += failed
        if gauges is not None:
            self.waiting, self.running, self.kv_usage = gauges
            self.overlap = max(0, self.finished + self.failed + self.in_engine - self.received)
        self.received = max(self.received, self.finished + self.failed)
        self._latencies(ttft_ms, tpot_ms)
        self.settle(now, grace_s)

    def _latencies(self, ttft_ms: tuple[float, ...], tpot_ms: tuple[float, ...]) -> None:
        self.ttft = (self.ttft + list(ttft_ms))[-WINDOW:]
        self.tpot = (self.tpot + list(tpot_ms))[-WINDOW:]

    def fold(self, added: int, aborted: int) -> None:
        """Takes one API server's exact books since its last fold: requests sent to
        this rank and client aborts of them. From the first fold on the ledger is
        ``exact``; the inference from the gauges is off."""
        self.exact = True
        self.received += added
        self.failed += aborted

    def settle(self, now: float, grace_s: float = 1.0) -> None:
        """Counts as failed the requests gone from the engine with no finish for ``grace_s``
        (not when ``exact``: the books say when a request leaves)."""
        if self.exact:
            return
        gone = self.received - self.finished - self.failed - self.in_engine
        if gone <= 0:
            self.gone_since = None
        elif self.gone_since is None:
            self.gone_since = now
        elif now - self.gone_since >= grace_s:
            self.failed += gone
            self.gone_since = None

    def publish_kwargs(self) -> dict[str, Any]:
        """:meth:`StatsPublisher.publish`'s arguments; no ``tokens`` (vLLM reports none)."""
        return dict(
            waiting=self.waiting,
            running=self.running,
            received=self.received,
            finished=self.finished,
            failed=self.failed,
            kv_usage=_share(self.kv_usage),
            ttft_ms=sum(self.ttft) / len(self.ttft) if self.ttft else None,
            tpot_ms=sum(self.tpot) / len(self.tpot) if self.tpot else None,
            progress=self.steps,
        )

    def claim_timer(self, who: str, now: float, lease_s: float) -> bool:
        """Whether ``who`` repeats this rank's gauges now: the holder renews its lease;
        anyone takes a lease that has lapsed (its holder stopped ticking)."""
        if self.holder == who or self.holder is None or now >= self.lease_until:
            self.holder, self.lease_until = who, now + lease_s
            return True
        return False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RankLedger":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


class Tally:
    """This process's exact books per rank, kept by the hook in vLLM's request path:
    requests sent to each engine and client aborts of them, until a stat logger of
    that rank folds them into the shared ledger (:meth:`take`). Thread-safe: the
    hook counts on the event loop, the loggers' timer takes on its own thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._added: Counter[int] = Counter()
        self._aborted: Counter[int] = Counter()
        #: set when the hook is installed: the loggers of this process fold from then on
        self.active = False

    def sent(self, rank: int) -> None:
        with self._lock:
            self._added[rank] += 1

    def aborted(self, rank: int) -> None:
        with self._lock:
            self._aborted[rank] += 1

    def take(self, rank: int) -> tuple[int, int]:
        """``(sent, aborted)`` for ``rank`` since the last take."""
        with self._lock:
            return self._added.pop(rank, 0), self._aborted.pop(rank, 0)


#: the books of this process (one per API server)
TALLY = Tally()


class SharedLedger:
    """A :class:`RankLedger` in a file, read and written under an exclusive lock.

    The first opener creates it with ``boot`` = now in ms, so a deployment started
    later (a new file) always has a higher boot."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    @contextmanager
    def locked(self) -> Iterator[RankLedger]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            text = f.read()
            ledger = RankLedger.from_json(text) if text.strip() else RankLedger(boot=time.time_ns() // 1_000_000)
            yield ledger
            f.seek(0)
            f.truncate()
            f.write(ledger.to_json())
            f.flush()
