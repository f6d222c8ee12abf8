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
* ``timeout``: no reply within the deadline; after ``DOWN_AFTER`` timeouts in a row,
  spread over at least ``DOWN_AFTER - 1`` deadlines (a burst that misses one deadline
  together does not count as a dead dpcoord), the link stops waiting (``down``:
  answered at once) and sends a ``ping`` every ``PROBE_EVERY_S`` until one is answered;
* ``refused``: dpcoord answered with an error (no routable rank, ...);
* ``bad_reply``: an answer that is not a valid route reply.

A rank dpcoord answers too late, or for a query the caller then drops, was
booked all the same: ``on_late(rank)`` is called with it (the vLLM hook
withdraws the placement at once). The block size dpcoord keys prompts in
(``block_size`` in a ``ping`` or ``explain`` reply) is kept in
:attr:`RouteLink.block_size`.

:meth:`RouteLink.explained` answers as :meth:`RouteLink.route` plus the prompt
tokens dpcoord predicted cached on the rank (the reply's ``explain``, asked for
with ``explain: true``), and :meth:`RouteLink.report` sends a query whose answer
nobody waits for (a ``delivered`` report).

The socket is read from the event loop's own reader callback (``add_reader`` on
the ZeroMQ descriptor), with no task and no lock per query. A link can be made
before any event loop runs (``loop=None``: it connects at once, so the
connection is there when the first request comes) and is attached to the
running loop on first use.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any, Callable

import msgpack
import zmq

from . import _core

#: timeouts in a row, over at least ``DOWN_AFTER - 1`` deadlines, after which the link
#: answers at once until dpcoord answers a ping
DOWN_AFTER = 3
#: how often a ``down`` link pings dpcoord
PROBE_EVERY_S = 0.1
#: queries queued towards a connected but silent dpcoord before sends fail (``unreachable``)
SEND_HWM = 1000
#: a string ``id`` longer than this (in UTF-8) is replaced: dpcoord refuses it
MAX_ID_BYTES = 128
#: queries given up on whose late answer still reaches ``on_late``, at most
LATE_KEPT = 4096
#: how long a query given up on waits for its late answer to be withdrawn
LATE_KEPT_S = 10.0
# Plain ints: pyzmq's flag enums cost a microsecond per ``&`` on this path.
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)


def dealer(endpoint: str, context: zmq.Context | None = None) -> zmq.Socket:
    """A DEALER connected to dpcoord's route socket at ``endpoint`` for a caller that
    must never wait on it: no linger, nothing queued while there is no connection
    (``ZMQ_IMMEDIATE``), at most ``SEND_HWM`` queued while dpcoord is silent."""
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    for opt, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, SEND_HWM), (zmq.RECONNECT_IVL_MAX, 1000)):
        sock.setsockopt(opt, value)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


class RouteLink:
    """One DEALER connected to ``endpoint``, owned by the running event loop."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float,
        context: zmq.Context | None = None,
        *,
        attach: bool = True,
        on_late: Callable[[int], None] | None = None,
    ):
        """Connects to ``endpoint``; with ``attach`` (the default) the running
        event loop owns the link now, else the one that first uses it."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.on_late = on_late
        self.loop: asyncio.AbstractEventLoop | None = None
        #: the process that made the socket (a forked child must not use it)
        self.pid = os.getpid()
        self.sock = dealer(endpoint, context)
        #: query id -> (future, deadline on the loop's clock), in the order sent: the
        #: first has the earliest deadline (one timeout for all)
        self.waiting: dict[int, tuple[asyncio.Future, float]] = {}
        #: one timer for all queries, due at the first one's deadline
        self.timer: asyncio.TimerHandle | None = None
        self.ids = itertools.count(1)
        self.timeouts = 0
        #: when the first and the last timeout of the current run of them happened
        self.timeouts_since = self.last_timeout = 0.0
        self.probe_id: int | None = None
        self.probe_at = 0.0
        #: ids of queries given up on (timed out, or dropped by the caller) -> when
        self.late: dict[int | str, float] = {}
        #: the block size dpcoord keys prompts in, once a reply said it
        self.block_size: int | None = None
        #: the first ``ping``, which every first query waits for (see :meth:`ready`)
        self.hello: asyncio.Future | None = None
        #: until a first send succeeds (or the first deadline passes), queries wait for a connection
        self.born = time.monotonic()
        self.connected = False
        if attach:
            self.attach()

    def attach(self) -> None:
        """Hands the link to the running event loop (once)."""
        if self.loop is not None:
            return
        self.loop = asyncio.get_running_loop()
        self.born = time.monotonic()
        self.loop.add_reader(self.sock.FD, self._drain)

    @property
    def down(self) -> bool:
        # A burst of queries that all miss one deadline together is one slow moment:
        # the link is down only when timeouts keep coming over several deadlines.
        return self.timeouts >= DOWN_AFTER and self.last_timeout - self.timeouts_since >= (DOWN_AFTER - 1) * self.timeout_s

    def unreachable(self) -> bool:
        """Whether a query now would be answered ``unreachable`` (no connection to dpcoord,
        once the first one was waited for): a caller can skip building it."""
        return self.connected and not self.sock.getsockopt(_EVENTS) & _POLLOUT

    async def ready(self) -> None:
        """Waits, the first time only, for dpcoord's answer to a ``ping`` (at most
        ``timeout_s``), so the block size is known before the first prompt is keyed;
        concurrent first callers share the one ping."""
        self.attach()
        if self.hello is None:
            self.hello = asyncio.ensure_future(self.explained({"v": _core.VERSION, "op": "ping"}))
        if not self.hello.done():
            await self.hello

    async def route(self, query: dict[str, Any]) -> tuple[int | None, str | None]:
        """``(rank, None)``, or ``(None, reason)``. ``query`` is a route query; its ``id``
        is kept if it is a string of at most ``MAX_ID_BYTES`` bytes not already
        waiting for an answer (a request's own id), else replaced by a number."""
        rank, reason, _ = await self.explained(query)
        return rank, reason

    async def explained(self, query: dict[str, Any]) -> tuple[int | None, str | None, int | None]:
        """As :meth:`route`, plus the prompt tokens predicted cached on the rank when
        the reply explains it (else None)."""
        self.attach()
        if self.down:
            self._probe()
            return None, "timeout", None
        qid = query.get("id")
        if not (isinstance(qid, str) and len(qid.encode()) <= MAX_ID_BYTES) or qid in self.waiting:
            qid = query["id"] = next(self.ids)
        payload = _core.encode(query)
        if not self._send(payload):
            if self.connected:
                return None, "unreachable", None
            # The link's first connection may still be being made: wait for it, at most
            # until the deadline after the link was made.
            while not (sent := self._send(payload)) and time.monotonic() < self.born + self.timeout_s:
                await asyncio.sleep(0.0005)
            if not sent:
                self.connected = True  # from now on, no query waits for a connection
                return None, "unreachable", None
        self.connected = True
        future = self.loop.create_future()
        self.waiting[qid] = (future, self.loop.time() + self.timeout_s)
        if self.timer is None:
            self.timer = self.loop.call_at(self.waiting[qid][1], self._expire)
        self._drain()  # a send may have taken the descriptor's edge for a reply already here
        return await future

    def report(self, query: dict[str, Any]) -> None:
        """Sends ``query`` (given a fresh numeric ``id``) without waiting: its answer is
        dropped, and so is the query if dpcoord cannot take it now."""
        query["id"] = next(self.ids)
        self._send(_core.encode(query))

    def _send(self, payload: bytes) -> bool:
        try:
            self.sock.send_multipart((b"", payload), _NOBLOCK)
            return True
        except zmq.ZMQError:  # EAGAIN: no connection (ZMQ_IMMEDIATE) or the send queue is full
            return False

    def _expire(self) -> None:
        """The timer: answers ``timeout`` to every query past its deadline, then waits
        for the next deadline."""
        self.timer = None
        self._drain()  # a reply that arrived as the timer fired still counts
        now = self.loop.time()
        while self.waiting:
            qid, (future, deadline) = next(iter(self.waiting.items()))
            if deadline > now:
                self.timer = self.loop.call_at(deadline, self._expire)
                break
            del self.waiting[qid]
            if self.timeouts == 0:
                self.timeouts_since = now
            self.timeouts += 1
            self.last_timeout = now
            self.given_up(qid)
            if not future.done():
                future.set_result((None, "timeout", None))

    def given_up(self, qid: int | str) -> None:
        """Query ``qid``'s answer, if it still comes, goes to ``on_late``."""
        if self.on_late is None:
            return
        now = time.monotonic()
        while self.late and (len(self.late) >= LATE_KEPT or next(iter(self.late.values())) < now - LATE_KEPT_S):
            del self.late[next(iter(self.late))]
        self.late[qid] = now

    def _probe(self) -> None:
        now = time.monotonic()
        if now - self.probe_at < PROBE_EVERY_S:
            return
        self.probe_at = now
        self.probe_id = next(self.ids)
        try:
            self.sock.send_multipart((b"", _core.encode({"v": _core.VERSION, "op": "ping", "id": self.probe_id})), _NOBLOCK)
        except zmq.ZMQError:
            pass

    def _drain(self) -> None:
        """Reads every reply that is there; called by the loop when the descriptor fires."""
        try:
            while self.sock.getsockopt(_EVENTS) & _POLLIN:
                frames = self.sock.recv_multipart(_NOBLOCK)
                self._answer(frames[-1])
        except zmq.ZMQError:  # closed, or nothing after all
            pass

    def _answer(self, raw: bytes) -> None:
        try:
            reply = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:  # noqa: BLE001 - an undecodable reply answers no query
            return
        if not isinstance(reply, dict):
            return
        qid = reply.get("id")
        explain = reply.get("explain")
        size = reply.get("block_size", explain.get("block_size") if isinstance(explain, dict) else None)
        if type(size) is int and size > 0:
            self.block_size = size
        if qid is not None and qid == self.probe_id:
            self.timeouts, self.probe_id = 0, None
            return
        entry = self.waiting.pop(qid, None) if isinstance(qid, (int, str)) else None
        if entry is None:
            if isinstance(qid, (int, str)) and self.late.pop(qid, None) is not None:
                self._late(reply)
            return  # the answer to a query that already timed out, or to none
        future = entry[0]
        self.timeouts = 0
        if not future.done():
            future.set_result(outcome(reply))

    def _late(self, reply: dict[str, Any]) -> None:
        """A rank booked for a query given up on goes to ``on_late``."""
        rank = outcome(reply)[0]
        if rank is not None and self.on_late is not None:
            try:
                self.on_late(rank)
            except Exception:  # noqa: BLE001 - a callback's failure must not stop the reader
                pass

    def close(self) -> None:
        if self.sock.closed:
            return
        try:
            if self.loop is not None:
                self.loop.remove_reader(self.sock.FD)
        except (RuntimeError, ValueError, zmq.ZMQError):  # the loop is closed already
            pass
        self.sock.close(0)
        if self.timer is not None:
            self.timer.cancel()
        for future, _ in self.waiting.values():
            if not future.done():
                future.set_result((None, "unreachable", None))
        self.waiting.clear()


def outcome(reply: dict[str, Any]) -> tuple[int | None, str | None, int | None]:
    """A decoded route reply's rank, or why there is none: ``refused`` (dpcoord's
    error reply: no routable rank, ...) or ``bad_reply`` (anything else); and the
    prompt tokens its ``explain`` predicted cached on the rank, if any."""
    if reply.get("v") != _core.VERSION:
        return None, "bad_reply", None
    if reply.get("ok") is False:
        return None, "refused", None
    ranks = reply.get("ranks")
    if reply.get("ok") is True and isinstance(ranks, list) and len(ranks) == 1:
        rank = ranks[0]
        if type(rank) is int and rank >= 0:
            return rank, None, predicted(reply.get("explain"), rank)
    return None, "bad_reply", None


def predicted(explain: Any, rank: int) -> int | None:
    """The prompt tokens an ``explain`` predicted cached on ``rank`` (None if it says nothing of it)."""
    chosen = explain.get("chosen") if isinstance(explain, dict) else None
    for entry in chosen if isinstance(chosen, list) else ():
        if isinstance(entry, dict) and entry.get("rank") == rank and type(entry.get("predicted")) is int:
            return entry["predicted"]
    return None
