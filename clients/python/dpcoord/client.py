"""The blocking client a frontend or a health prober uses to ask dpcoord for ranks."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import zmq

from ._base import ClientBase, Steps
from ._core import Endpoint


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
    * A connection dpcoord refuses during its handshake (the socket is full, or
      this address is not allowed) ends the wait at once and marks the endpoint
      down, counted in :attr:`refusals`; libzmq would not connect that socket
      again, so a new one is probed after a backoff (0.1 s, doubling to 2 s).
    * A tcp:// connection dpcoord closes before its handshake (the socket, or
      this address's share of it, is full) is counted in :attr:`drops` and
      logged; libzmq connects the same socket again by itself, so the call
      waits, up to ``timeout_ms``, for room, and :class:`UnreachableError`
      says why when none came.

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
        *,
        tokens: Sequence[int] | None = None,
        block_keys: Sequence[int] | None = None,
        lora: str | None = None,
        salt: str | None = None,
        send: str = "tokens",
    ) -> list[int]:
        """The ranks for ``n`` requests, in placement order.

        ``rank`` pins (vLLM's ``data_parallel_rank``, SGLang's ``routed_dp_rank``), ``bootstrap_room`` places
        on ``bootstrap_room % dp_size`` (PD disaggregation), ``session`` keeps
        affinity. In fallback a pin or room still goes to its rank, and a session
        maps to a fixed rank of the fallback pool.

        The prompt, for ``cache_aware`` (a batch shares one): ``tokens`` (token
        ids, with the optional ``lora`` name and cache ``salt``) or ``block_keys``
        (see :func:`dpcoord.block_keys`). ``send="keys"`` sends the keys of
        ``tokens``, computed here with dpcoord's block size (see
        :meth:`block_keys`), and ``prompt_tokens=len(tokens)`` unless given.
        """
        return self._run(
            self._route_steps(n, prompt_tokens, rank, bootstrap_room, session, id, tokens, block_keys, lora, salt, send)
        )

    def block_keys(self, tokens: Sequence[int], lora: str | None = None, salt: str | None = None) -> list[int]:
        """The block keys of ``tokens`` in dpcoord's block size: ``kv_block_size``
        from its ``state``, or 16 while it has none (asked for again every
        ``block_size_refresh_s`` until it has one; a learned size is kept)."""
        return self._run(self._block_keys_steps(tokens, lora, salt))

    def health_route(self, rank: int | None = None, bootstrap_room: int | None = None) -> int:
        """The rank a health probe should go to, by the health channel's own rotation."""
        return self._run(self._health_route_steps(rank, bootstrap_room))

    def health_report(self, rank: int, ok: bool) -> bool:
        """Reports a probe's outcome. False (and counted in :attr:`dropped_reports`)
        when no health endpoint answered, so the report was not delivered."""
        return self._run(self._health_report_steps(rank, ok))

    def state(self) -> dict[str, Any]:
        """dpcoord's engine table: ``{"epoch": E, "ranks": [{"rank", "status", "counts", ...}]}``."""
        return self._run(self._state_steps())

    def ping(self) -> int:
        """dpcoord's current epoch; raises :class:`UnreachableError` if no endpoint answers."""
        return self._run(self._ping_steps())

    def call(self, op: str, channel: str = "route", **fields: Any) -> dict[str, Any]:
        """Sends any query (``v`` defaults to 1) and returns the raw reply map.

        Tries every endpoint of ``channel`` (``"route"`` or ``"health"``), down or
        not; raises the typed error of a refusal, or :class:`UnreachableError`."""
        return self._run(self._call_steps(op, channel, fields))

    def close(self) -> None:
        with self._lock:
            self._reset_all()

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the driver: each step of a call's flow, done with blocking calls ---------------

    def _run(self, steps: Steps) -> Any:
        result = None
        while True:
            try:
                step = steps.send(result)
            except StopIteration as done:
                return done.value
            try:
                result = getattr(self, "_io_" + step[0])(*step[1:])
            except BaseException:
                steps.close()  # the flow's `finally` releases the lock
                raise

    def _io_acquire(self) -> bool:
        return self._lock.acquire(timeout=self.timeout_ms / 1000)

    def _io_exchange(self, ep: Endpoint, payload: bytes) -> bytes | None:
        sock = ep.sock
        try:
            sock.send(payload, zmq.NOBLOCK)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(ep.watch.sock, zmq.POLLIN)  # the handshake's outcome
            end = time.monotonic() + self.timeout_ms / 1000
            while (left := end - time.monotonic()) > 0:
                if sock in dict(poller.poll(left * 1000)):
                    return sock.recv()
                if self._refused_now(ep):
                    break
        except zmq.ZMQError:
            pass
        self._reset(ep)
        return None

    def _io_probe_answered(self, ep: Endpoint) -> bool:
        try:
            if ep.sock.poll(0, zmq.POLLIN):
                ep.sock.recv()
                return True
        except zmq.ZMQError:
            pass
        return False

    def _io_send_probe(self, ep: Endpoint, payload: bytes) -> bool:
        try:
            ep.sock.send(payload, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False
