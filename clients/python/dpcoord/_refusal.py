"""Seeing dpcoord refuse or close a connection, and when to open a new socket.

dpcoord's bound sockets (route, health, stats bind) turn a new peer away in
one of two ways:

* **Refused** during its ZMTP handshake (ZAP status 400): the peer's address
  is not in the socket's allowlist, or, over ipc://, the socket already holds
  ``server.*_max_peers`` peers. libzmq 4.3 reports it on the refused socket's
  monitor as ``EVENT_HANDSHAKE_FAILED_AUTH`` (value 400) and then, almost
  always, never connects that socket again: only a new socket gets another
  chance.
* **Closed before its handshake** (a *drop*): over tcp://, a peer beyond
  ``server.*_max_peers``, or beyond ``server.max_peers_per_address`` from its
  address, is shut down as soon as it is accepted. The monitor reports
  ``EVENT_CONNECTED``, ``EVENT_HANDSHAKE_FAILED_NO_DETAIL`` (the value is the
  errno, ``EPIPE``), ``EVENT_DISCONNECTED``, ``EVENT_CONNECT_RETRIED``; libzmq
  connects the same socket again by itself (every 0.1-0.2 s), and what was
  given to it to send stays queued until a connection is admitted.

Neither looks like a dpcoord that is not running (the connection is not even
made: ``EVENT_CLOSED`` and a retry, no ``EVENT_CONNECTED``), nor like an
admitted connection lost later (``EVENT_HANDSHAKE_SUCCEEDED`` came first).
:class:`Watch` reads those events without waiting; :class:`Backoff` spaces
the new sockets so refused peers do not hammer a full dpcoord;
:class:`Refusals` follows one endpoint across the sockets opened to it.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections import Counter

import zmq
from zmq.utils.monitor import parse_monitor_message

#: Words for logs and error messages: what a refusal means, and the settings behind
#: it (the status text, which would tell them apart, is not in the monitor event).
MEANING = (
    "this address is not in server.{channel}_allow, or, over ipc, its socket holds"
    " server.{channel}_max_peers peers"
)
#: The same for a connection closed before its handshake (tcp:// only).
DROP_MEANING = (
    "its socket holds server.{channel}_max_peers peers, or this address holds"
    " server.max_peers_per_address of them"
)

_names = itertools.count()

#: A connection's end, by the monitor event that tells it.
_OUTCOMES = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "admitted",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "dropped",
    zmq.EVENT_CLOSED: "absent",  # the connection was not made: nothing listens there
}


class Watch:
    """The connections of one connecting socket, read without waiting.

    Attach it before the socket connects. ``outcome`` is the latest connection's:
    None before the first, ``"admitted"``, ``"refused"``, ``"dropped"`` (closed
    before its handshake) or ``"absent"`` (not made). libzmq connects a dropped
    or absent socket again by itself and may, rarely, reconnect a refused one:
    a later outcome wins."""

    def __init__(self, watched: zmq.Socket):
        address = f"inproc://dpcoord-watch-{os.getpid()}-{next(_names)}"
        mask = 0
        for event in _OUTCOMES:
            mask |= event
        watched.monitor(address, mask)
        self._watched = watched
        # A blocking PAIR on the same libzmq context, also under asyncio: it is
        # only ever read with NOBLOCK (or polled by the asyncio client's Poller).
        self.sock = zmq.Context.shadow(watched.context.underlying).socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        # libzmq sends each event from its I/O thread with a blocking send: once
        # the pipe holds its high-water mark (1000 + 1000 by default), that thread
        # stops, and with it every socket of the context. Unbounded (RCVHWM 0),
        # the pipe holds what arrives between two reads: one event (~130 B) per
        # connection attempt, about 7 a second (libzmq retries every 100-200 ms).
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.outcome: str | None = None
        #: A connection of this socket was admitted (what it sent may have reached dpcoord).
        self.ever_admitted = False

    def poll(self) -> Counter[str]:
        """Reads the events that arrived; returns how many connections ended each way."""
        seen: Counter[str] = Counter()
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return seen
            outcome = _OUTCOMES.get(parse_monitor_message(frames)["event"])
            if outcome is not None:
                seen[outcome] += 1
                self.outcome = outcome
                self.ever_admitted |= outcome == "admitted"

    def queued(self) -> bool:
        """Every connection so far was closed before its handshake: what the socket
        was given is still queued, and libzmq connects it again by itself."""
        return self.outcome == "dropped" and not self.ever_admitted

    def close(self) -> None:
        """Stops the monitor, then closes the reading end; call it before closing
        the watched socket. An event sent after the reading end is gone would
        block libzmq's I/O thread for good (a PAIR without a peer blocks), and a
        socket being closed still reports its connections' ends."""
        try:
            self._watched.disable_monitor()
        except zmq.ZMQError:  # the watched socket is already closed: its monitor with it
            pass
        self.sock.close(linger=0)


class Backoff:
    """When to open a new socket after a refusal: 0.1 s after the first, doubling
    with each refusal in a row up to 2 s, each delay drawn in ``[d/2, d]`` so
    peers refused together do not all come back at the same moment."""

    first_s = 0.1
    max_s = 2.0

    def __init__(self) -> None:
        self._next_s = self.first_s
        self.until = 0.0

    def refused(self, now: float) -> None:
        """Notes a refusal at ``now`` (``time.monotonic()``)."""
        self.until = now + random.uniform(self._next_s / 2, self._next_s)
        self._next_s = min(self._next_s * 2, self.max_s)

    def due(self, now: float) -> bool:
        return now >= self.until

    def reset(self) -> None:
        """Admitted: the next refusal starts from the shortest delay again."""
        self._next_s = self.first_s
        self.until = 0.0


class Refusals:
    """One endpoint's connections, across the sockets opened to it one after another."""

    def __init__(self) -> None:
        #: ``"refused"`` or ``"dropped"`` while the latest connection ended that way
        #: (a run of them), else None.
        self.run: str | None = None
        self.backoff = Backoff()

    @property
    def refused(self) -> bool:
        """The latest connection to the endpoint was refused."""
        return self.run == "refused"

    def take(self, watch: Watch) -> tuple[Counter[str], str | None]:
        """Takes in what ``watch`` (the current socket's) saw, without waiting.
        Returns how many connections ended each way (see :meth:`Watch.poll`) and
        the change to report: ``"refused"`` or ``"dropped"`` (a run began; after a
        refusal the new socket is due in ``delay_s()``), ``"admitted"`` (a run
        ended) or None."""
        seen = watch.poll()
        if seen["refused"]:
            self.backoff.refused(time.monotonic())
        outcome = watch.outcome
        if outcome is None:
            return seen, None
        if outcome == "admitted":
            self.backoff.reset()
        run = outcome if outcome in ("refused", "dropped") else None
        change = None
        if run != self.run:
            change = run or ("admitted" if outcome == "admitted" else None)
        self.run = run
        return seen, change

    def waiting(self) -> bool:
        """Refused, and the backoff does not allow a new socket yet."""
        return self.refused and not self.backoff.due(time.monotonic())

    def delay_s(self) -> float:
        """How long until a new socket is allowed."""
        return max(self.backoff.until - time.monotonic(), 0.0)

    def clear(self) -> None:
        """The endpoint answered: no run, and the backoff starts over."""
        self.run = None
        self.backoff.reset()
