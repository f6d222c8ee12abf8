"""A lean asyncio link to dpcoord's route socket, for callers that must never wait long.

:class:`RouteLink` is what vLLM's API servers use under :mod:`dpcoord.vllm_route`.
Unlike :class:`~dpcoord.AsyncRouterClient` it keeps many queries in flight at once
on one DEALER socket (replies are matched by ``id``), never raises into the caller,
and answers every :meth:`RouteLink.route` within ``timeout_s`` with a rank or with
the reason it has none:

* ``unreachable``: no connection to dpcoord (``ZMQ_IMMEDIATE``: nothing is queued
  for a dpcoord that is not there, so the answer is immediate, except while the
  link's first connection is being made: until the deadline after the link was
  made, a query waits for it);
* ``timeout``: no reply within the deadline; after ``DOWN_AFTER`` timeouts in a row
  the link stops waiting (``down``: answered at once) and sends a ``ping`` every
  ``PROBE_EVERY_S`` until one is answered;
* ``refused``: dpcoord answered with an error (no routable rank, ...);
* ``bad_reply``: an answer that is not a valid route reply.

The socket is read from the event loop's own reader callback (``add_reader`` on
the ZeroMQ descriptor), with no task and no lock per query.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import msgpack
import zmq

from . import _core
from .errors import DpcoordError

#: timeouts in a row after which the link answers at once until dpcoord answers a ping
DOWN_AFTER = 3
#: how often a ``down`` link pings dpcoord
PROBE_EVERY_S = 0.1
#: queries queued towards a connected but silent dpcoord before sends fail (``unreachable``)
SEND_HWM = 1000


class RouteLink:
    """One DEALER connected to ``endpoint``, owned by the running event loop."""

    def __init__(self, endpoint: str, timeout_s: float, context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, SEND_HWM), (zmq.RECONNECT_IVL_MAX, 1000)):
            self.sock.setsockopt(opt, value)
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError:
            self.sock.close(0)
            raise
        self.waiting: dict[Any, tuple[asyncio.Future, asyncio.TimerHandle]] = {}
        self.ids = itertools.count(1)
        self.timeouts = 0
        self.probe_id: int | None = None
        self.probe_at = 0.0
        #: until a first send succeeds (or the first deadline passes), queries wait for a connection
        self.born = time.monotonic()
        self.connected = False
        self.loop.add_reader(self.sock.FD, self._drain)

    @property
    def down(self) -> bool:
        return self.timeouts >= DOWN_AFTER

    async def route(self, query: dict[str, Any]) -> tuple[int | None, str | None]:
        """``(rank, None)``, or ``(None, reason)``; ``query`` is a route query without ``id``."""
        if self.down:
            self._probe()
            return None, "timeout"
        qid = next(self.ids)
        query["id"] = qid
        payload = _core.encode(query)
        if not self._send(payload):
            if self.connected:
                return None, "unreachable"
            # The link's first connection may still be being made: wait for it, at most
            # until the deadline after the link was made.
            while not (sent := self._send(payload)) and time.monotonic() < self.born + self.timeout_s:
                await asyncio.sleep(0.0005)
            if not sent:
                self.connected = True  # from now on, no query waits for a connection
                return None, "unreachable"
        self.connected = True
        future = self.loop.create_future()
        timer = self.loop.call_later(self.timeout_s, self._expire, qid)
        self.waiting[qid] = (future, timer)
        self._drain()  # a send may have taken the descriptor's edge for a reply already here
        return await future

    def _send(self, payload: bytes) -> bool:
        try:
            self.sock.send_multipart((b"", payload), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # EAGAIN: no connection (ZMQ_IMMEDIATE) or the send queue is full
            return False

    def _expire(self, qid: int) -> None:
        self._drain()  # a reply that arrived as the timer fired still counts
        entry = self.waiting.pop(qid, None)
        if entry is not None:
            self.timeouts += 1
            entry[0].set_result((None, "timeout"))

    def _probe(self) -> None:
        now = time.monotonic()
        if now - self.probe_at < PROBE_EVERY_S:
            return
        self.probe_at = now
        self.probe_id = next(self.ids)
        try:
            self.sock.send_multipart((b"", _core.encode({"v": _core.VERSION, "op": "ping", "id": self.probe_id})), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _drain(self) -> None:
        """Reads every reply that is there; called by the loop when the descriptor fires."""
        try:
            while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
                self._answer(frames[-1])
        except zmq.ZMQError:  # closed, or nothing after all
            pass

    def _answer(self, raw: bytes) -> None:
        try:
            reply = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            qid = reply.get("id") if isinstance(reply, dict) else None
        except Exception:  # noqa: BLE001 - an undecodable reply answers no query
            return
        if qid is not None and qid == self.probe_id:
            self.timeouts, self.probe_id = 0, None
            return
        entry = self.waiting.pop(qid, None) if isinstance(qid, int) else None
        if entry is None:
            return  # the answer to a query that already timed out, or to none
        future, timer = entry
        timer.cancel()
        self.timeouts = 0
        if not future.done():
            future.set_result(outcome(raw))

    def close(self) -> None:
        if self.sock.closed:
            return
        try:
            self.loop.remove_reader(self.sock.FD)
        except (RuntimeError, ValueError, zmq.ZMQError):  # the loop is closed already
            pass
        self.sock.close(0)
        for future, timer in self.waiting.values():
            timer.cancel()
            if not future.done():
                future.set_result((None, "unreachable"))
        self.waiting.clear()


def outcome(raw: bytes) -> tuple[int | None, str | None]:
    """A route reply's rank, or why there is none (``refused``, ``bad_reply``)."""
    try:
        return _core.ranks_of(_core.decode(raw), 1)[0], None
    except DpcoordError as e:
        return None, "bad_reply" if e.code == "protocol" else "refused"
