"""The engine side: publish a DP rank's stats to dpcoord (``StatsUpdate`` over PUB)."""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import threading
import time
from typing import Any, Sequence

import msgpack
import zmq

from . import _refusal

VERSION = 1
U64 = 2**64

COUNTS = ("waiting", "running", "received", "finished", "failed")
COUNTERS = ("received", "finished", "failed")

log = logging.getLogger("dpcoord.publisher")


def _uint(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an integer, got {value!r}")
    value = int(value)
    if not 0 <= value < U64:
        raise ValueError(f"`{name}` must be a non-negative 64-bit integer, got {value}")
    return value


def _float(name: str, value: Any, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value}")
    if value < 0 or (high is not None and value > high):
        bound = f"within 0..{high}" if high is not None else ">= 0"
        raise ValueError(f"`{name}` must be {bound}, got {value}")
    return value


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class StatsPublisher:
    """Publishes one DP rank's ``StatsUpdate`` messages.

    ``bind=True``: the engine binds ``endpoint`` and dpcoord connects to it
    (``--stats-connect``; several dpcoords, e.g. a standby, can subscribe to one
    engine). ``bind=False``: the engine connects to dpcoord's ``--stats-bind``.

    ``boot`` identifies this incarnation (default: now, in ms) and ``seq`` counts
    the updates sent within it. :meth:`publish` checks the contract's rules before
    anything is sent and raises :class:`ValueError` on a breach, so dpcoord never
    has to drop an update as malformed. PUB/SUB drops what is sent before a
    subscriber is connected: publish periodically (every 50-100 ms), not once.

    With ``bind=False``, a connection dpcoord refuses (its stats bind already
    holds ``server.stats_max_peers`` peers, or this address is not in
    ``server.stats_allow``) is never retried by libzmq: :meth:`publish` sees the
    refusal on the socket's monitor, counts it in :attr:`refusals`, logs it
    (``dpcoord.publisher``, once per run of refusals) and, from the first
    :meth:`publish` after a backoff (0.1 s, doubling up to 2 s), sends on a new
    socket. ``boot`` and ``seq`` carry on, so the publisher stays one incarnation:
    the updates sent meanwhile are lost, a ``seq`` gap that dpcoord counts in
    ``dpcoord_stats_missed_total`` when it had already heard this boot.
    Over tcp://, a connection beyond ``server.stats_max_peers`` or
    ``server.max_peers_per_address`` is closed by dpcoord before its handshake
    instead: :meth:`publish` counts it in :attr:`drops` and logs it the same
    way, and libzmq connects the same socket again by itself (the updates sent
    meanwhile are lost too). Thread-safe.
    """

    def __init__(
        self,
        endpoint: str,
        rank: int,
        bind: bool = True,
        boot: int | None = None,
        *,
        context: zmq.Context | None = None,
        linger_ms: int = 100,
    ):
        self.rank = _uint("rank", rank)
        self.boot = _uint("boot", now_ms() if boot is None else boot)
        self.seq = 0
        self.endpoint = endpoint
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()
        self._ctx = context or zmq.Context.instance()
        self._linger_ms = linger_ms
        #: Connections dpcoord refused during their handshake (``bind=False`` only).
        self.refusals = 0
        #: Connections dpcoord closed before their handshake (``bind=False``, tcp:// only).
        self.drops = 0
        self._watch: _refusal.Watch | None = None
        self._refusal = _refusal.Refusals()
        self._sock = self._new_socket()
        if bind:
            self._sock.bind(endpoint)
            # The bound address, resolved (e.g. "tcp://127.0.0.1:*" -> a real port).
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._connect()

    def _new_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        return sock

    def _connect(self) -> None:
        """Connects ``self._sock``, watching its handshakes."""
        self._watch = _refusal.Watch(self._sock)
        self._sock.connect(self.endpoint)

    def _recover(self) -> None:
        """Takes in the refusals and drops the monitor saw; once the backoff allows,
        replaces a refused socket by a new one (libzmq would not connect it again;
        a dropped one it connects again by itself)."""
        if self._watch is None:
            return
        seen, change = self._refusal.take(self._watch)
        self.refusals += seen["refused"]
        self.drops += seen["dropped"]
        if change == "refused":
            log.warning(
                "stats publisher of rank %d: dpcoord at %s refused the connection (%s); its updates are lost"
                " until one is admitted: a new connection in %.2f s, then every %g s at most",
                self.rank,
                self.endpoint,
                _refusal.MEANING.format(channel="stats"),
                self._refusal.delay_s(),
                self._refusal.backoff.max_s,
            )
        elif change == "dropped":
            log.warning(
                "stats publisher of rank %d: dpcoord at %s closed the connection before its handshake (%s);"
                " its updates are lost until one is admitted: libzmq connects again by itself",
                self.rank,
                self.endpoint,
                _refusal.DROP_MEANING.format(channel="stats"),
            )
        elif change == "admitted":
            log.info("stats publisher of rank %d: dpcoord at %s admitted the connection", self.rank, self.endpoint)
        if self._watch.outcome == "refused" and not self._refusal.waiting():
            self._watch.close()  # before the socket: see Watch.close
            self._sock.close(linger=0)  # nothing it holds can reach dpcoord
            self._sock = self._new_socket()
            self._connect()

    def build(
        self,
        waiting: int,
        running: int,
        received: int,
        finished: int,
        failed: int,
        tokens: Sequence[int] | None = None,
        kv_usage: float | None = None,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
        progress: int | None = None,
    ) -> dict[str, Any]:
        """The update :meth:`publish` would send next (checked, not sent, seq not taken).

        ``progress`` is a counter that moves whenever the engine works (steps,
        tokens) and never goes backwards within a boot: with it, dpcoord takes a
        rank that has work and no progress out of rotation (``stalled``)."""
        values = dict(waiting=waiting, running=running, received=received, finished=finished, failed=failed)
        counts = [_uint(name, values[name]) for name in COUNTS]
        for name in COUNTERS:
            before, now = self._last.get(name, 0), counts[COUNTS.index(name)]
            if now < before:
                raise ValueError(
                    f"counter `{name}` went backwards within boot {self.boot} ({before} -> {now});"
                    " counters only grow within one boot: call restart() when the engine restarts"
                )
        update: dict[str, Any] = {
            "v": VERSION,
            "rank": self.rank,
            "boot": self.boot,
            "seq": self.seq + 1,
            "counts": counts,
        }
        if tokens is not None:
            if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or len(tokens) != 2:
                raise ValueError(f"`tokens` must be [waiting_tokens, running_tokens], got {tokens!r}")
            update["tokens"] = [_uint("waiting_tokens", tokens[0]), _uint("running_tokens", tokens[1])]
        if kv_usage is not None:
            update["kv_usage"] = _float("kv_usage", kv_usage, 1.0)
        if ttft_ms is not None:
            update["ttft_ms"] = _float("ttft_ms", ttft_ms)
        if tpot_ms is not None:
            update["tpot_ms"] = _float("tpot_ms", tpot_ms)
        if progress is not None:
            update["progress"] = _uint("progress", progress)
        return update

    def publish(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Checks and sends one update (the arguments of :meth:`build`); returns it.
        Raises ValueError (nothing sent, ``seq`` unchanged) when a value breaks the contract.

        ``waiting``/``running`` are gauges; ``received``/``finished``/``failed``
        count user requests since this boot and never go backwards. Health-probe
        requests belong in none of them."""
        with self._lock:
            update = self.build(*args, **kwargs)
            self._recover()
            self._sock.send(msgpack.packb(update, use_bin_type=True))
            self.seq = update["seq"]
            self._last = dict(zip(COUNTS, update["counts"]))
            return update

    publish.__signature__ = inspect.signature(build)  # what help() and IDEs show

    def restart(self, boot: int | None = None) -> int:
        """Starts a new incarnation (counters start over): a ``boot`` above the
        current one (default: now in ms, or current + 1), ``seq`` back to 0."""
        with self._lock:
            new = now_ms() if boot is None else _uint("boot", boot)
            if boot is None:
                new = max(new, self.boot + 1)
            elif new <= self.boot:
                raise ValueError(f"a new boot must be above the current {self.boot}, got {new}")
            self.boot, self.seq, self._last = new, 0, {}
            return new

    def resume(self, boot: int, seq: int, counters: Sequence[int] = (0, 0, 0)) -> None:
        """Continues a sequence that another publisher of the same rank sent: the
        next update carries ``boot`` and ``seq + 1``, and ``counters``
        (``received, finished, failed``) are the floor its counters are checked against.
        Several processes publishing one rank in turn (vLLM's API servers) stay one incarnation."""
        with self._lock:
            self.boot, self.seq = _uint("boot", boot), _uint("seq", seq)
            self._last = dict(zip(COUNTERS, (_uint(n, c) for n, c in zip(COUNTERS, counters))))

    def close(self) -> None:
        with self._lock:
            if self._watch is not None:
                self._watch.close()  # before the socket: see Watch.close
            self._sock.close()

    def __enter__(self) -> "StatsPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
