"""The blocking client a frontend or a health prober uses to ask dpcoord for ranks."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from . import _core
from ._base import ClientBase
from ._core import Endpoint
from .errors import DpcoordError, UnreachableError


class RouterClient(ClientBase):
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

    _context_class = zmq.Context

    def _new_lock(self) -> threading.Lock:
        return threading.Lock()

    # -- public API ---------------------------------------------------------------

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
                    ranks = self._routed(reply, n)
                    self._after_reply("route", reply)
                    self.last_source = "dpcoord"
                    return ranks
                where = self._why or self._where("route")
            finally:
                self._lock.release()
        else:
            where = "client busy: another call holds it"
        return self._route_locally(n, rank, bootstrap_room, session, where)

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
        self._check_channel(channel)
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
            self._reset_all()

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals (called with the lock held) ----------------------------------------

    def _uninformed(self, rank: Any, bootstrap_room: Any):
        """The refusal filter of ``route``: ``no_engine_available`` or
        ``rank_unavailable`` from a dpcoord no engine has reported to yet (it just
        started) moves on to the next endpoint, then to the local fallback."""

        def skip(ep: Endpoint, err: DpcoordError) -> bool:
            if not self._may_be_uninformed(err):
                return False
            raw = self._exchange(ep, _core.encode({"v": _core.VERSION, "op": "state"}))
            return self._skip_uninformed(ep, raw, err, rank, bootstrap_room)

        return skip

    def _after_reply(self, channel: str, reply: dict[str, Any]) -> None:
        """Keeps the fallback pool current: a new epoch means the routable set changed."""
        if not self._needs_state(reply):
            return
        try:
            state = self._call(channel, {"v": _core.VERSION, "op": "state"}, fast=True)
        except DpcoordError:
            return
        if state is not None:
            self._local.observe_state(state, self.last_endpoint)

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
            try:
                return self._answered(ep, raw, query)
            except DpcoordError as e:
                if skip is not None and skip(ep, e):
                    continue
                raise
        for ep in eps:
            if ep.down:
                self._ensure_probe(ep)
        return None
