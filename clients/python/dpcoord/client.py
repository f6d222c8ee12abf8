"""The blocking client a frontend or a health prober uses to ask dpcoord for ranks."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable

import zmq

from . import _core
from ._core import Endpoint, LocalRouter, log
from .errors import DpcoordError, NoEngineAvailableError, RankUnavailableError, UnreachableError


class RouterClient:
    """Asks dpcoord which DP rank gets each request; never leaves a caller hanging.

    * Every attempt waits at most ``timeout_ms`` for an answer. An endpoint that
      did not answer has its REQ socket closed and reopened (lazy pirate) and is
      marked down; ``standby`` endpoints (a route endpoint, or a ``(route, health)``
      pair, each) are tried next, in order.
    * While no endpoint answers, ``route`` and ``health_route`` answer locally with
      a round-robin over the last known routable ranks (see :class:`LocalRouter`),
      counted in :attr:`fallbacks` and logged at most once per ``log_period_s``.
      A down endpoint costs no waiting: a ``ping`` probe stays in flight and is
      checked on each call, so routing returns to dpcoord as soon as it answers.
    * A refusal from dpcoord raises the :class:`~dpcoord.errors.DpcoordError`
      subclass of its code; a refusal is an answer and does not trigger fallback,
      with one exception (``fallback_when_uninformed``, on by default): a route
      refused ``no_engine_available`` / ``rank_unavailable`` by a dpcoord that no
      engine has reported to yet (every rank, or the pinned one, ``unknown``: it
      just restarted) goes to the next endpoint, then to the local fallback, so a
      dpcoord restart leaves no request without a rank.

    A call takes at most about ``timeout_ms`` per endpoint that is believed up (and
    ``timeout_ms`` when another thread holds the client, after which ``route`` falls
    back). Thread-safe: calls are serialized by a lock; the sockets never leave it.
    """

    def __init__(
        self,
        route_endpoint: str,
        health_endpoint: str | None = None,
        *,
        timeout_ms: int = 1000,
        dp_size: int | None = None,
        standby: Iterable[str | tuple[str, str | None]] = (),
        log_period_s: float = 30.0,
        track_state: bool = True,
        fallback_when_uninformed: bool = True,
        context: zmq.Context | None = None,
    ):
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive")
        self.timeout_ms = int(timeout_ms)
        self.track_state = track_state
        self._ctx = context or zmq.Context.instance()
        pairs = [(route_endpoint, health_endpoint)] + _core.normalize_standby(standby)
        self._eps = {
            "route": [Endpoint(r, "route") for r, _ in pairs],
            "health": [Endpoint(h, "health") for _, h in pairs if h],
        }
        self._local = LocalRouter(dp_size=dp_size, log_period_s=log_period_s)
        #: Route locally when dpcoord refuses only because no engine has reported to it yet.
        self.fallback_when_uninformed = fallback_when_uninformed
        self._why: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: "dpcoord" or "fallback": who answered the last route call.
        self.last_source: str | None = None
        #: The endpoint that answered the last call dpcoord answered.
        self.last_endpoint: str | None = None
        #: health_report calls that could not be delivered (no endpoint answered).
        self.dropped_reports = 0

    # -- public API ---------------------------------------------------------------

    @property
    def fallbacks(self) -> int:
        """Route calls answered by the local fallback, since the client was made."""
        return self._local.fallbacks

    @property
    def health_fallbacks(self) -> int:
        """health_route calls answered by the local fallback."""
        return self._local.health_fallbacks

    @property
    def routable_ranks(self) -> list[int] | None:
        """The routable ranks of the last ``state`` seen (None before the first)."""
        r = self._local.routable
        return None if r is None else list(r)

    @property
    def epoch(self) -> int | None:
        """The epoch of the last ``state`` seen."""
        return self._local.epoch

    def route(
        self,
        n: int = 1,
        prompt_tokens: int | None = None,
        rank: int | None = None,
        bootstrap_room: int | None = None,
        session: str | None = None,
        id: Any = None,
    ) -> list[int]:
        """The ranks for ``n`` requests, in placement order.

        ``rank`` pins (vLLM/SGLang ``data_parallel_rank``), ``bootstrap_room`` places
        on ``bootstrap_room % dp_size`` (PD disaggregation), ``session`` keeps
        affinity. In fallback a pin or room still goes to its rank, and a session
        maps to a fixed rank of the fallback pool.
        """
        query = _core.route_query(n, prompt_tokens, rank, bootstrap_room, session, id)
        if self._lock.acquire(timeout=self.timeout_ms / 1000):
            try:
                reply = self._call("route", query, fast=True, skip=self._uninformed(rank, bootstrap_room))
                if reply is not None:
                    ranks = _core.ranks_of(reply, n)
                    self._local.observe_ranks(ranks)
                    self._local.note_answered(self.last_endpoint)
                    self._after_reply("route", reply)
                    self.last_source = "dpcoord"
                    return ranks
                where = self._why or self._where("route")
            finally:
                self._lock.release()
        else:
            where = "client busy: another call holds it"
        ranks = self._local.route(n, rank, bootstrap_room, session, where)
        self.last_source = "fallback"
        return ranks

    def health_route(self, rank: int | None = None, bootstrap_room: int | None = None) -> int:
        """The rank a health probe should go to, by the health channel's own rotation."""
        query = _core.health_route_query(rank, bootstrap_room)
        where = self._where("health")
        if self._eps["health"] and self._lock.acquire(timeout=self.timeout_ms / 1000):
            try:
                reply = self._call("health", query, fast=True)
                if reply is not None:
                    result = _core.rank_of(reply)
                    self._after_reply("health", reply)
                    return result
            finally:
                self._lock.release()
        return self._local.health_route(rank, bootstrap_room, where)

    def health_report(self, rank: int, ok: bool) -> bool:
        """Reports a probe's outcome. False (and counted in :attr:`dropped_reports`)
        when no health endpoint answered, so the report was not delivered."""
        query = _core.health_report_query(rank, ok)
        if self._eps["health"] and self._lock.acquire(timeout=self.timeout_ms / 1000):
            try:
                if self._call("health", query, fast=True) is not None:
                    return True
            finally:
                self._lock.release()
        self.dropped_reports += 1
        return False

    def state(self) -> dict[str, Any]:
        """dpcoord's engine table: ``{"epoch": E, "ranks": [{"rank", "status", "counts", ...}]}``."""
        reply = self.call("state")
        self._local.observe_state(reply, self.last_endpoint)
        return reply

    def ping(self) -> int:
        """dpcoord's current epoch; raises :class:`UnreachableError` if no endpoint answers."""
        return _core.epoch_of(self.call("ping"))

    def call(self, op: str, channel: str = "route", **fields: Any) -> dict[str, Any]:
        """Sends any query (``v`` defaults to 1) and returns the raw reply map.

        Tries every endpoint of ``channel`` (``"route"`` or ``"health"``), down or
        not; raises the typed error of a refusal, or :class:`UnreachableError`."""
        if channel not in self._eps:
            raise ValueError(f"channel must be 'route' or 'health', got {channel!r}")
        query = {"v": _core.VERSION, "op": op, **fields}
        if not self._lock.acquire(timeout=self.timeout_ms / 1000):
            raise UnreachableError(message="the client is busy with a call that is waiting for dpcoord")
        try:
            reply = self._call(channel, query, fast=False)
        finally:
            self._lock.release()
        if reply is None:
            raise UnreachableError(message=self._where(channel))
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for eps in self._eps.values():
                for ep in eps:
                    self._reset(ep)

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals (called with the lock held) ----------------------------------------

    def _where(self, channel: str) -> str:
        eps = self._eps[channel]
        if not eps:
            return f"no {channel} endpoint configured"
        return "no answer within {} ms from {}".format(self.timeout_ms, ", ".join(ep.address for ep in eps))

    def _uninformed(self, rank: Any, bootstrap_room: Any):
        """The refusal filter of ``route``: ``no_engine_available`` or
        ``rank_unavailable`` from a dpcoord no engine has reported to yet (it just
        started) moves on to the next endpoint, then to the local fallback."""

        def skip(ep: Endpoint, err: DpcoordError) -> bool:
            if not self.fallback_when_uninformed or not isinstance(
                err, (NoEngineAvailableError, RankUnavailableError)
            ):
                return False
            raw = self._exchange(ep, _core.encode({"v": _core.VERSION, "op": "state"}))
            if raw is None:
                self._mark_down(ep)
                self._why = f"{ep.address} stopped answering"
                return True
            try:
                state = _core.decode(raw)
            except DpcoordError:
                return False
            self._local.observe_state(state, ep.address)
            if not _core.uninformed(state, err, rank, bootstrap_room):
                return False
            heard = "any engine" if isinstance(err, NoEngineAvailableError) else "that rank"
            self._why = f"{ep.address} has not heard from {heard} yet"
            return True

        return skip

    def _after_reply(self, channel: str, reply: dict[str, Any]) -> None:
        """Keeps the fallback pool current: a new epoch means the routable set changed."""
        epoch = reply.get("epoch")
        source = self.last_endpoint or ""
        if not self.track_state or not isinstance(epoch, int) or not self._local.needs_refresh(epoch, source):
            return
        try:
            state = self._call(channel, {"v": _core.VERSION, "op": "state"}, fast=True)
        except DpcoordError:
            return
        if state is not None:
            self._local.observe_state(state, self.last_endpoint)

    def _reset(self, ep: Endpoint) -> None:
        if ep.sock is not None:
            ep.sock.close(linger=0)
        ep.sock = None
        ep.probe_at = None

    def _open(self, ep: Endpoint) -> zmq.Socket:
        if self._closed:
            raise RuntimeError("the client is closed")
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ep.address)
        ep.sock = sock
        return sock

    def _mark_down(self, ep: Endpoint) -> None:
        if not ep.down:
            log.warning("dpcoord %s endpoint %s: no answer within %d ms", ep.channel, ep.address, self.timeout_ms)
            ep.down = True

    def _mark_up(self, ep: Endpoint) -> None:
        if ep.down:
            log.info("dpcoord %s endpoint %s answers again", ep.channel, ep.address)
            ep.down = False
            self._local.forget_source()  # it may have restarted: refresh the snapshot

    def _exchange(self, ep: Endpoint, payload: bytes) -> bytes | None:
        """One request and its reply, or None after ``timeout_ms`` (socket reset)."""
        if ep.sock is None or ep.probe_at is not None:
            self._reset(ep)
            self._open(ep)
        sock = ep.sock
        try:
            sock.send(payload, zmq.NOBLOCK)
            if sock.poll(self.timeout_ms, zmq.POLLIN):
                return sock.recv()
        except zmq.ZMQError:
            pass
        self._reset(ep)
        return None

    def _check_probe(self, ep: Endpoint) -> None:
        """Without blocking: did the down endpoint answer its probe?"""
        if ep.probe_at is None or ep.sock is None:
            return
        try:
            if ep.sock.poll(0, zmq.POLLIN):
                ep.sock.recv()
                ep.probe_at = None
                self._mark_up(ep)
                return
        except zmq.ZMQError:
            pass
        if time.monotonic() - ep.probe_at > self.timeout_ms / 1000:
            self._reset(ep)  # lazy pirate: a fresh socket and probe on the next call

    def _ensure_probe(self, ep: Endpoint) -> None:
        if ep.probe_at is not None:
            return
        self._reset(ep)
        sock = self._open(ep)
        try:
            sock.send(_core.encode({"v": _core.VERSION, "op": "ping"}), zmq.NOBLOCK)
            ep.probe_at = time.monotonic()
        except zmq.ZMQError:
            self._reset(ep)

    def _call(self, channel: str, query: dict[str, Any], fast: bool, skip=None) -> dict[str, Any] | None:
        """The first usable answer among the channel's endpoints, in order, or None.

        ``fast`` passes over endpoints that are down (their probe is checked
        instead of waiting on them). A refusal for which ``skip(endpoint, error)``
        is true is passed over like a missing answer; any other refusal raises."""
        eps = self._eps[channel]
        for ep in eps:
            if ep.down:
                self._check_probe(ep)
                if ep.down and fast:
                    self._ensure_probe(ep)  # keep a probe in flight while others answer
        payload = _core.encode(query)
        self._why = None
        for ep in eps:
            if ep.down and fast:
                continue
            raw = self._exchange(ep, payload)
            if raw is None:
                self._mark_down(ep)
                continue
            self._mark_up(ep)
            try:
                reply = _core.decode(raw, query.get("id"))
            except DpcoordError as e:
                if skip is not None and skip(ep, e):
                    continue
                raise
            self.last_endpoint = ep.address
            return reply
        for ep in eps:
            if ep.down:
                self._ensure_probe(ep)
        return None
