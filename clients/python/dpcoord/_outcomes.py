"""How a route hook's requests were placed, counted and, when not by dpcoord, logged."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any


class Outcomes:
    """Each request counted by its outcome (``dpcoord``, ``pinned``, or why the
    engine's own rule placed it) in :attr:`counts` and in ``metric`` (a labelled
    Prometheus counter, or None); one placed by the engine's rule is logged on
    ``log``, at most once a second, as placed by ``rule``."""

    def __init__(self, outcomes: tuple[str, ...], metric: Any, log: logging.Logger, rule: str, endpoint: str | None):
        self.counts: Counter[str] = Counter()
        self.metric = None if metric is None else {o: metric.labels(outcome=o) for o in outcomes}
        self.log, self.rule, self.endpoint = log, rule, endpoint
        self.logged_at = 0.0
        self.unlogged: Counter[str] = Counter()

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.metric is not None:
            self.metric[outcome].inc()
        if outcome in ("dpcoord", "pinned"):
            return
        self.unlogged[outcome] += 1
        now = time.monotonic()
        if now - self.logged_at >= 1.0:
            self.logged_at = now
            what = ", ".join(f"{n} {k}" for k, n in sorted(self.unlogged.items()))
            self.unlogged.clear()
            self.log.warning("dpcoord: requests placed by %s since the last report: %s (%s)", self.rule, what, self.endpoint)
