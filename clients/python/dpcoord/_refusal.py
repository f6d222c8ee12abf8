"""Seeing dpcoord refuse a connection, and when to open a new socket.

dpcoord's bound sockets (route, health, stats bind) refuse a new peer during
its ZMTP handshake (ZAP status 400) when the peer's address is not in the
socket's allowlist, or, over ipc://, when the socket already holds
``server.*_max_peers`` peers. (A tcp:// peer beyond ``server.*_max_peers`` or
``server.max_peers_per_address`` is disconnected as soon as it is accepted
instead, before any handshake; libzmq connects it again by itself.)
libzmq 4.3 reports a refusal on the refused socket's monitor as
``EVENT_HANDSHAKE_FAILED_AUTH`` (value 400) and then, almost always, never
connects that socket again: only a new socket gets another chance.
:class:`Watch` reads those events without waiting; :class:`Backoff` spaces
the new sockets so refused peers do not hammer a full dpcoord;
:class:`Refusals` follows one endpoint across the sockets opened to it.
"""

from __future__ import annotations

import itertools
import os
import random
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

#: Words for logs and error messages: what a refusal means, and the settings behind
#: it (the status text, which would tell them apart, is not in the monitor event).
MEANING = (
    "this address is not in server.{channel}_allow, or, over ipc, its socket holds"
    " server.{channel}_max_peers peers"
)

_names = itertools.count()


class Watch:
    """The handshake outcomes of one connecting socket, read without waiting.

    Attach it before the socket connects. ``outcome`` is the latest handshake's
    (None before the first, ``"refused"`` or ``"admitted"``); libzmq may, rarely,
    reconnect a refused socket by itself, and a later admission wins."""

    def __init__(self, watched: zmq.Socket):
        address = f"inproc://dpcoord-watch-{os.getpid()}-{next(_names)}"
        watched.monitor(address, zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        # A blocking PAIR on the same libzmq context, also under asyncio: it is
        # only ever read with NOBLOCK (or polled by the asyncio client's Poller).
        self.sock = zmq.Context.shadow(watched.context.underlying).socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.outcome: str | None = None

    def poll(self) -> int:
        """Reads the events that arrived; returns how many were refusals."""
        refused = 0
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return refused
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                refused += 1
                self.outcome = "refused"
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.outcome = "admitted"

    def close(self) -> None:
        """Closes the reading end (close the watched socket first: that ends its monitor)."""
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
    """One endpoint's handshakes, across the sockets opened to it one after another."""

    def __init__(self) -> None:
        #: The latest handshake with the endpoint was refused.
        self.refused = False
        self.backoff = Backoff()

    def take(self, watch: Watch) -> tuple[int, str | None]:
        """Takes in what ``watch`` (the current socket's) saw, without waiting.
        Returns the number of refusals read and the change to report: ``"refused"``
        (the first of a run; the new socket is due in ``delay_s()``), ``"admitted"``
        (a run ended) or None."""
        refused = watch.poll()
        change = None
        if refused:
            self.backoff.refused(time.monotonic())
            if not self.refused:
                change = "refused"
        if watch.outcome == "admitted":
            if self.refused:
                change = "admitted"
            self.backoff.reset()
        if watch.outcome is not None:
            self.refused = watch.outcome == "refused"
        return refused, change

    def waiting(self) -> bool:
        """Refused, and the backoff does not allow a new socket yet."""
        return self.refused and not self.backoff.due(time.monotonic())

    def delay_s(self) -> float:
        """How long until a new socket is allowed."""
        return max(self.backoff.until - time.monotonic(), 0.0)

    def clear(self) -> None:
        """The endpoint answered: not refused, and the backoff starts over."""
        self.refused = False
        self.backoff.reset()
