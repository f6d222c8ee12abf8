"""The state and the I/O-free parts the sync and asyncio clients share.

:class:`RouterClient` and :class:`AsyncRouterClient` differ only in how they wait
(blocking calls and a :class:`threading.Lock`, or ``await`` and an
:class:`asyncio.Lock`); their configuration, endpoint bookkeeping, public
properties and the decisions taken on a reply live here, once.
"""

from __future__ import annotations

from typing import Any, Iterable

import zmq

from . import _core
from ._core import Endpoint, LocalRouter, log
from .errors import DpcoordError, NoEngineAvailableError, RankUnavailableError


class ClientBase:
    """What both clients hold; subclasses add the calls that wait on sockets.

    ``_context_class`` is the ZeroMQ context type whose shared instance is used
    when no ``context`` is given; ``_new_lock`` makes the lock that serializes calls.
    """

    _context_class: type[zmq.Context] = zmq.Context

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
        self._ctx = context or self._context_class.instance()
        pairs = [(route_endpoint, health_endpoint)] + _core.normalize_standby(standby)
        self._eps = {
            "route": [Endpoint(r, "route") for r, _ in pairs],
            "health": [Endpoint(h, "health") for _, h in pairs if h],
        }
        self._local = LocalRouter(dp_size=dp_size, log_period_s=log_period_s)
        #: Route locally when dpcoord refuses only because no engine has reported to it yet.
        self.fallback_when_uninformed = fallback_when_uninformed
        self._why: str | None = None
        self._lock = self._new_lock()
        self._closed = False
        #: "dpcoord" or "fallback": who answered the last route call.
        self.last_source: str | None = None
        #: The endpoint that answered the last call dpcoord answered.
        self.last_endpoint: str | None = None
        #: health_report calls that could not be delivered (no endpoint answered).
        self.dropped_reports = 0

    def _new_lock(self) -> Any:
        raise NotImplementedError

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

    # -- decisions on what a call got back (no waiting) -------------------------------

    def _check_channel(self, channel: str) -> None:
        if channel not in self._eps:
            raise ValueError(f"channel must be 'route' or 'health', got {channel!r}")

    def _routed(self, reply: dict[str, Any], n: int) -> list[int]:
        """The ranks of a route reply dpcoord gave, noted for the fallback pool."""
        ranks = _core.ranks_of(reply, n)
        self._local.observe_ranks(ranks)
        self._local.note_answered(self.last_endpoint)
        return ranks

    def _route_locally(self, n, rank, bootstrap_room, session, where: str) -> list[int]:
        ranks = self._local.route(n, rank, bootstrap_room, session, where)
        self.last_source = "fallback"
        return ranks

    def _may_be_uninformed(self, err: DpcoordError) -> bool:
        """Whether a refusal is worth asking the endpoint for its ``state``."""
        return self.fallback_when_uninformed and isinstance(err, (NoEngineAvailableError, RankUnavailableError))

    def _skip_uninformed(
        self, ep: Endpoint, raw: bytes | None, err: DpcoordError, rank: Any, bootstrap_room: Any
    ) -> bool:
        """Given the endpoint's answer ``raw`` to a ``state`` query (None: no
        answer), whether the refusal ``err`` is passed over (see ``_uninformed``)."""
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

    def _needs_state(self, reply: dict[str, Any]) -> bool:
        """Whether a reply shows an epoch the fallback snapshot has not seen."""
        epoch = reply.get("epoch")
        source = self.last_endpoint or ""
        return self.track_state and isinstance(epoch, int) and self._local.needs_refresh(epoch, source)

    def _answered(self, ep: Endpoint, raw: bytes, query: dict[str, Any]) -> dict[str, Any]:
        """The checked reply ``ep`` sent to ``query``; raises the typed error of a refusal."""
        self._mark_up(ep)
        reply = _core.decode(raw, query.get("id"))
        self.last_endpoint = ep.address
        return reply

    # -- endpoint bookkeeping ---------------------------------------------------------

    def _where(self, channel: str) -> str:
        eps = self._eps[channel]
        if not eps:
            return f"no {channel} endpoint configured"
        return "no answer within {} ms from {}".format(self.timeout_ms, ", ".join(ep.address for ep in eps))

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

    def _reset_all(self) -> None:
        self._closed = True
        for eps in self._eps.values():
            for ep in eps:
                self._reset(ep)

    def _mark_down(self, ep: Endpoint) -> None:
        if not ep.down:
            log.warning("dpcoord %s endpoint %s: no answer within %d ms", ep.channel, ep.address, self.timeout_ms)
            ep.down = True

    def _mark_up(self, ep: Endpoint) -> None:
        if ep.down:
            log.info("dpcoord %s endpoint %s answers again", ep.channel, ep.address)
            ep.down = False
            self._local.forget_source()  # it may have restarted: refresh the snapshot
