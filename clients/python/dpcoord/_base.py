"""The state and the I/O-free logic the sync and asyncio clients share.

:class:`RouterClient` and :class:`AsyncRouterClient` differ only in how they wait
(blocking calls and a :class:`threading.Lock`, or ``await`` and an
:class:`asyncio.Lock`). Everything else lives here, once: configuration, endpoint
bookkeeping, public properties, the decisions taken on a reply, and every call's
flow, written as a generator of *steps* (sans-I/O). A step is a tuple naming the
one wait it needs, ``(name, *args)``; the client's driver performs it with its
``_io_<name>(*args)`` method and sends the result back in:

* ``("acquire",)``: take the call lock within ``timeout_ms`` -> bool;
* ``("exchange", ep, payload)``: send on ``ep.sock`` and wait ``timeout_ms`` for
  the reply -> bytes, or None (and ``ep``'s socket reset) when none came;
* ``("probe_answered", ep)``: without waiting, read the answer to ``ep``'s probe
  if it is there -> bool;
* ``("send_probe", ep, payload)``: send a probe on ``ep.sock`` without waiting -> bool.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator, Iterable

import zmq

from . import _core
from ._core import Endpoint
from ._endpoints import Endpoints
from ._fallback import LocalRouter
from .errors import DpcoordError, NoEngineAvailableError, RankUnavailableError, UnreachableError

#: A call's flow: yields steps, gets their results sent back, returns the call's result.
Steps = Generator[tuple, Any, Any]


class ClientBase(Endpoints):
    """What both clients hold; subclasses add the calls that wait on sockets.

    ``_context_class`` is the ZeroMQ context type whose shared instance is used
    when no ``context`` is given; ``_new_lock`` makes the lock that serializes calls.
    """

    _context_class: type[zmq.Context] = zmq.Context
    #: While dpcoord's ``kv_block_size`` is nil (no KV event yet: it keys prompts
    #: in blocks of 16), how often computing keys asks ``state`` again (seconds).
    block_size_refresh_s: float = 10.0

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
        max_prompt_tokens: int = 262_144,
    ):
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive")
        if max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be positive")
        #: dpcoord's ``limits.max_prompt_tokens``: longer ``tokens`` (and more than a
        #: sixteenth of it in ``block_keys``) raise TooLargeError before sending.
        self.max_prompt_tokens = int(max_prompt_tokens)
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
        self.refusals = 0
        self.drops = 0
        self._instance: str | None = None

    def _new_lock(self) -> Any:
        raise NotImplementedError

    def _release(self) -> None:
        self._lock.release()

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

    @property
    def instance(self) -> str | None:
        """The ``instance`` of the dpcoord process that answered the last ``ping``
        or ``state`` (16 hex digits, new at each start of dpcoord); None before
        the first, or from a dpcoord too old to send one. A change means dpcoord
        restarted: its epoch started again at 0 and it has not heard every engine yet."""
        return self._instance

    @property
    def kv_block_size(self) -> int | None:
        """dpcoord's ``kv_block_size`` in the last ``state`` seen (None while it
        had none, or before the first ``state``); keys are then computed in 16s."""
        return self._local.kv_block_size

    # -- every call's flow, as steps (see the module docstring) ----------------------

    def _route_steps(
        self, n, prompt_tokens, rank, bootstrap_room, session, id, tokens=None, block_keys=None, lora=None, salt=None,
        send="tokens",
    ) -> Steps:
        keys_here = _core.check_prompt(tokens, block_keys, lora, salt, send, self.max_prompt_tokens)
        block_size = (yield from self._block_size_steps()) if keys_here else None
        prompt = _core.prompt_fields(tokens, block_keys, lora, salt, send, block_size)
        if prompt_tokens is not None:
            prompt.pop("prompt_tokens", None)  # the caller's prompt_tokens wins
        query = _core.route_query(n, prompt_tokens, rank, bootstrap_room, session, id, prompt)
        if (yield ("acquire",)):
            try:
                skip = self._uninformed(rank, bootstrap_room)
                reply = yield from self._ask("route", query, fast=True, skip=skip)
                if reply is not None:
                    ranks = self._routed(reply, n)
                    yield from self._after_reply("route", reply)
                    self.last_source = "dpcoord"
                    return ranks
                where = self._why or self._where("route")
            finally:
                self._release()
        else:
            where = "client busy: another call holds it"
        return self._route_locally(n, rank, bootstrap_room, session, where)

    def _block_size_steps(self) -> Steps:
        """The block size to compute keys with: dpcoord's ``kv_block_size`` from the
        last ``state`` (16 while it is nil), asked for again when the client has
        none yet, or it was nil ``block_size_refresh_s`` ago. A ``state`` that gets
        no answer (endpoints down are not waited on) leaves the cached value."""
        if self._local.block_size_stale(self.block_size_refresh_s) and (yield ("acquire",)):
            try:
                state = yield from self._ask("route", {"v": _core.VERSION, "op": "state"}, fast=True)
            except DpcoordError:
                state = None
            finally:
                self._release()
            if state is not None:
                self._local.observe_state(state, self.last_endpoint)
        return self._local.checked_block_size()

    def _block_keys_steps(self, tokens, lora, salt) -> Steps:
        if tokens is None:
            raise TypeError("block_keys needs the prompt's token ids")
        _core.check_prompt(tokens, None, lora, salt, "keys", self.max_prompt_tokens)
        block_size = yield from self._block_size_steps()
        return _core.prompt_fields(tokens, None, lora, salt, "keys", block_size)["block_keys"]

    def _health_route_steps(self, rank, bootstrap_room) -> Steps:
        query = _core.health_route_query(rank, bootstrap_room)
        where = self._where("health")
        if self._eps["health"] and (yield ("acquire",)):
            try:
                reply = yield from self._ask("health", query, fast=True)
                if reply is not None:
                    result = _core.rank_of(reply)
                    yield from self._after_reply("health", reply)
                    return result
            finally:
                self._release()
        return self._local.health_route(rank, bootstrap_room, where)

    def _health_report_steps(self, rank, ok) -> Steps:
        query = _core.health_report_query(rank, ok)
        if self._eps["health"] and (yield ("acquire",)):
            try:
                if (yield from self._ask("health", query, fast=True)) is not None:
                    return True
            finally:
                self._release()
        self.dropped_reports += 1
        return False

    def _state_steps(self) -> Steps:
        reply = yield from self._call_steps("state", "route", {})
        self._local.observe_state(reply, self.last_endpoint)
        self._instance = _core.instance_of(reply)
        return reply

    def _ping_steps(self) -> Steps:
        reply = yield from self._call_steps("ping", "route", {})
        epoch = _core.epoch_of(reply)
        self._instance = _core.instance_of(reply)
        return epoch

    def _call_steps(self, op: str, channel: str, fields: dict[str, Any]) -> Steps:
        self._check_channel(channel)
        query = {"v": _core.VERSION, "op": op, **fields}
        if not (yield ("acquire",)):
            raise UnreachableError(message="the client is busy with a call that is waiting for dpcoord")
        try:
            reply = yield from self._ask(channel, query, fast=False)
        finally:
            self._release()
        if reply is None:
            raise UnreachableError(message=self._where(channel))
        return reply

    # -- the steps of those flows (called with the lock held) --------------------------

    def _uninformed(self, rank: Any, bootstrap_room: Any) -> Callable[[Endpoint, DpcoordError], Steps]:
        """The refusal filter of ``route``: ``no_engine_available`` or
        ``rank_unavailable`` from a dpcoord no engine has reported to yet (it just
        started) moves on to the next endpoint, then to the local fallback."""

        def skip(ep: Endpoint, err: DpcoordError) -> Steps:
            if not self._may_be_uninformed(err):
                return False
            raw = yield from self._exchange(ep, _core.encode({"v": _core.VERSION, "op": "state"}))
            return self._skip_uninformed(ep, raw, err, rank, bootstrap_room)

        return skip

    def _after_reply(self, channel: str, reply: dict[str, Any]) -> Steps:
        """Keeps the fallback pool current: a new epoch means the routable set changed."""
        if not self._needs_state(reply):
            return
        try:
            state = yield from self._ask(channel, {"v": _core.VERSION, "op": "state"}, fast=True)
        except DpcoordError:
            return
        if state is not None:
            self._local.observe_state(state, self.last_endpoint)

    def _exchange(self, ep: Endpoint, payload: bytes) -> Steps:
        """One request and its reply, or None after ``timeout_ms`` or as soon as
        dpcoord refuses the connection (socket reset either way). None at once,
        nothing sent, while a refused endpoint's backoff runs."""
        if ep.refusal.waiting():
            return None
        if ep.sock is None or ep.probe_at is not None:
            self._reset(ep)
            self._open(ep)
        return (yield ("exchange", ep, payload))

    def _check_probe(self, ep: Endpoint) -> Steps:
        """Without waiting: did the down endpoint answer its probe?"""
        if ep.probe_at is None or ep.sock is None:
            return
        if (yield ("probe_answered", ep)):
            ep.probe_at = None
            self._mark_up(ep)
            return
        if self._refused_now(ep):
            if not ep.refusal.waiting():
                self._reset(ep)  # refused sockets never connect again: a new one and probe now
        elif not ep.watch.queued() and time.monotonic() - ep.probe_at > self.timeout_ms / 1000:
            # Lazy pirate: a fresh socket and probe on the next call. Not for a socket only
            # ever closed before its handshake: libzmq connects it again, its probe queued.
            self._reset(ep)

    def _ensure_probe(self, ep: Endpoint) -> Steps:
        if ep.probe_at is not None or ep.refusal.waiting():
            return
        self._reset(ep)
        self._open(ep)
        if (yield ("send_probe", ep, _core.encode({"v": _core.VERSION, "op": "ping"}))):
            ep.probe_at = time.monotonic()
        else:
            self._reset(ep)

    def _ask(self, channel: str, query: dict[str, Any], fast: bool, skip=None) -> Steps:
        """The first usable answer among the channel's endpoints, in order, or None.

        ``fast`` passes over endpoints that are down (their probe is checked
        instead of waiting on them). A refusal for which ``skip(endpoint, error)``
        is true is passed over like a missing answer; any other refusal raises."""
        eps = self._eps[channel]
        for ep in eps:
            if ep.down:
                yield from self._check_probe(ep)
                if ep.down and fast:
                    yield from self._ensure_probe(ep)  # keep a probe in flight while others answer
        payload = _core.encode(query)
        self._why = None
        for ep in eps:
            if ep.down and fast:
                continue
            raw = yield from self._exchange(ep, payload)
            if raw is None:
                self._mark_down(ep)
                continue
            try:
                return self._answered(ep, raw, query)
            except DpcoordError as e:
                if skip is not None and (yield from skip(ep, e)):
                    continue
                raise
        for ep in eps:
            if ep.down:
                yield from self._ensure_probe(ep)
        return None

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
