"""Endpoint bookkeeping the sync and asyncio clients share: opening and closing
each endpoint's REQ socket, marking endpoints down and up, and what dpcoord's
refusals of a connection, and its closes before a handshake (see
:mod:`dpcoord._refusal`), do to an endpoint."""

from __future__ import annotations

from typing import Any

import zmq

from . import _refusal
from ._core import Endpoint, log
from ._fallback import LocalRouter


class Endpoints:
    """The endpoint half of :class:`dpcoord._base.ClientBase` (which sets the
    attributes named below in its constructor)."""

    _eps: dict[str, list[Endpoint]]
    _ctx: Any
    _closed: bool
    _local: LocalRouter
    timeout_ms: int
    #: Connections dpcoord refused during their handshake (its socket was full, or
    #: this address is not allowed), over every endpoint, since the client was made.
    refusals: int
    #: Connections dpcoord closed before their handshake (over tcp://, its socket
    #: was full, or this address held its share of it; libzmq connects again by
    #: itself), over every endpoint, since the client was made.
    drops: int

    def _where(self, channel: str) -> str:
        eps = self._eps[channel]
        if not eps:
            return f"no {channel} endpoint configured"
        silent = [ep.address for ep in eps if ep.refusal.run is None]
        refused = [ep.address for ep in eps if ep.refusal.run == "refused"]
        dropped = [ep.address for ep in eps if ep.refusal.run == "dropped"]
        parts = []
        if silent:
            parts.append("no answer within {} ms from {}".format(self.timeout_ms, ", ".join(silent)))
        if refused:
            meaning = _refusal.MEANING.format(channel=channel)
            parts.append("connection refused by {}: {}".format(", ".join(refused), meaning))
        if dropped:
            meaning = _refusal.DROP_MEANING.format(channel=channel)
            parts.append(
                "connection closed by {} before its handshake: {} (libzmq retries by itself)".format(
                    ", ".join(dropped), meaning
                )
            )
        return "; ".join(parts)

    def _open(self, ep: Endpoint) -> zmq.Socket:
        if self._closed:
            raise RuntimeError("the client is closed")
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        ep.watch = _refusal.Watch(sock)  # before connecting: the handshake's outcome is an event
        sock.connect(ep.address)
        ep.sock = sock
        return sock

    def _reset(self, ep: Endpoint) -> None:
        if ep.sock is not None:
            self._refused_now(ep)  # count what its monitor saw before it goes
            ep.watch.close()  # before the socket: see Watch.close
            ep.sock.close(linger=0)
        ep.sock = None
        ep.watch = None
        ep.probe_at = None

    def _reset_all(self) -> None:
        self._closed = True
        for eps in self._eps.values():
            for ep in eps:
                self._reset(ep)

    def _refused_now(self, ep: Endpoint) -> bool:
        """Reads what ``ep``'s socket monitor saw, without waiting: refusals and
        closes before a handshake are counted in :attr:`refusals` and
        :attr:`drops`, and the first of a run is logged. True when this socket's
        latest handshake was refused (libzmq will not connect it again: a new
        socket is needed; after a drop it connects again by itself)."""
        if ep.watch is None:
            return False
        seen, change = ep.refusal.take(ep.watch)
        self.refusals += seen["refused"]
        self.drops += seen["dropped"]
        if change == "refused":
            log.warning(
                "dpcoord %s endpoint %s refused this client's connection (%s): a new connection in %.2f s,"
                " then every %g s at most until one is admitted",
                ep.channel,
                ep.address,
                _refusal.MEANING.format(channel=ep.channel),
                ep.refusal.delay_s(),
                ep.refusal.backoff.max_s,
            )
        elif change == "dropped":
            log.warning(
                "dpcoord %s endpoint %s closed this client's connection before its handshake (%s):"
                " libzmq connects again by itself, and calls wait up to timeout_ms for room",
                ep.channel,
                ep.address,
                _refusal.DROP_MEANING.format(channel=ep.channel),
            )
        elif change == "admitted" and not ep.down:  # a down endpoint says it "answers again"
            log.info("dpcoord %s endpoint %s admitted this client's connection", ep.channel, ep.address)
        return ep.watch.outcome == "refused"

    def _mark_down(self, ep: Endpoint) -> None:
        if not ep.down:
            if ep.refusal.run is None:  # a refusal or a drop was logged as one
                log.warning("dpcoord %s endpoint %s: no answer within %d ms", ep.channel, ep.address, self.timeout_ms)
            ep.down = True

    def _mark_up(self, ep: Endpoint) -> None:
        if ep.refusal.run is not None:
            self._refused_now(ep)  # count the run's last events and end it (its info line)
        ep.refusal.clear()
        if ep.down:
            log.info("dpcoord %s endpoint %s answers again", ep.channel, ep.address)
            ep.down = False
            self._local.forget_source()  # it may have restarted: refresh the snapshot
