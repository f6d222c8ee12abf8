"""The asyncio client: :class:`RouterClient`'s API and behaviour on ``zmq.asyncio``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
import zmq.asyncio

from . import _core
from ._base import ClientBase
from ._core import Endpoint
from .errors import DpcoordError, UnreachableError


class AsyncRouterClient(ClientBase):
    """Same contract as :class:`dpcoord.RouterClient`, with ``async`` methods.

    Calls are serialized by an :class:`asyncio.Lock`; a call that cannot get it
    within ``timeout_ms`` answers from the local fallback (``route``,
    ``health_route``) or raises :class:`UnreachableError`. Cancelling a call
    resets the socket it was waiting on, so the next call starts clean.
    Use one instance per event loop.
    """

    _context_class = zmq.asyncio.Context

    def _new_lock(self) -> asyncio.Lock | None:
        return None  # made on first use, inside the event loop

    # -- public API ---------------------------------------------------------------

    async def route(
        self,
        n: int = 1,
        prompt_tokens: int | None = None,
        rank: int | None = None,
        bootstrap_room: int | None = None,
        session: str | None = None,
        id: Any = None,
    ) -> list[int]:
        query = _core.route_query(n, prompt_tokens, rank, bootstrap_room, session, id)
        if await self._acquire():
            try:
                reply = await self._call("route", query, fast=True, skip=self._uninformed(rank, bootstrap_room))
                if reply is not None:
                    ranks = self._routed(reply, n)
                    await self._after_reply("route", reply)
                    self.last_source = "dpcoord"
                    return ranks
                where = self._why or self._where("route")
            finally:
                self._release()
        else:
            where = "client busy: another call holds it"
        return self._route_locally(n, rank, bootstrap_room, session, where)

    async def health_route(self, rank: int | None = None, bootstrap_room: int | None = None) -> int:
        query = _core.health_route_query(rank, bootstrap_room)
        where = self._where("health")
        if self._eps["health"] and await self._acquire():
            try:
                reply = await self._call("health", query, fast=True)
                if reply is not None:
                    result = _core.rank_of(reply)
                    await self._after_reply("health", reply)
                    return result
            finally:
                self._release()
        return self._local.health_route(rank, bootstrap_room, where)

    async def health_report(self, rank: int, ok: bool) -> bool:
        query = _core.health_report_query(rank, ok)
        if self._eps["health"] and await self._acquire():
            try:
                if await self._call("health", query, fast=True) is not None:
                    return True
            finally:
                self._release()
        self.dropped_reports += 1
        return False

    async def state(self) -> dict[str, Any]:
        reply = await self.call("state")
        self._local.observe_state(reply, self.last_endpoint)
        return reply

    async def ping(self) -> int:
        return _core.epoch_of(await self.call("ping"))

    async def call(self, op: str, channel: str = "route", **fields: Any) -> dict[str, Any]:
        self._check_channel(channel)
        query = {"v": _core.VERSION, "op": op, **fields}
        if not await self._acquire():
            raise UnreachableError(message="the client is busy with a call that is waiting for dpcoord")
        try:
            reply = await self._call(channel, query, fast=False)
        finally:
            self._release()
        if reply is None:
            raise UnreachableError(message=self._where(channel))
        return reply

    def close(self) -> None:
        self._reset_all()

    async def __aenter__(self) -> "AsyncRouterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------

    async def _acquire(self) -> bool:
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            await asyncio.wait_for(self._lock.acquire(), self.timeout_ms / 1000)
            return True
        except asyncio.TimeoutError:
            return False

    def _release(self) -> None:
        assert self._lock is not None
        self._lock.release()

    def _uninformed(self, rank: Any, bootstrap_room: Any):
        async def skip(ep: Endpoint, err: DpcoordError) -> bool:
            if not self._may_be_uninformed(err):
                return False
            raw = await self._exchange(ep, _core.encode({"v": _core.VERSION, "op": "state"}))
            return self._skip_uninformed(ep, raw, err, rank, bootstrap_room)

        return skip

    async def _after_reply(self, channel: str, reply: dict[str, Any]) -> None:
        if not self._needs_state(reply):
            return
        try:
            state = await self._call(channel, {"v": _core.VERSION, "op": "state"}, fast=True)
        except DpcoordError:
            return
        if state is not None:
            self._local.observe_state(state, self.last_endpoint)

    async def _exchange(self, ep: Endpoint, payload: bytes) -> bytes | None:
        if ep.sock is None or ep.probe_at is not None:
            self._reset(ep)
            self._open(ep)
        sock = ep.sock
        done = False
        try:
            await sock.send(payload, zmq.NOBLOCK)
            if await sock.poll(self.timeout_ms, zmq.POLLIN):
                raw = await sock.recv()
                done = True
                return raw
        except zmq.ZMQError:
            pass
        finally:
            if not done:  # timeout, error or cancellation: lazy pirate
                self._reset(ep)
        return None

    async def _check_probe(self, ep: Endpoint) -> None:
        if ep.probe_at is None or ep.sock is None:
            return
        try:
            if await ep.sock.poll(0, zmq.POLLIN):
                await ep.sock.recv()
                ep.probe_at = None
                self._mark_up(ep)
                return
        except zmq.ZMQError:
            pass
        if time.monotonic() - ep.probe_at > self.timeout_ms / 1000:
            self._reset(ep)

    async def _ensure_probe(self, ep: Endpoint) -> None:
        if ep.probe_at is not None:
            return
        self._reset(ep)
        sock = self._open(ep)
        try:
            await sock.send(_core.encode({"v": _core.VERSION, "op": "ping"}), zmq.NOBLOCK)
            ep.probe_at = time.monotonic()
        except zmq.ZMQError:
            self._reset(ep)

    async def _call(self, channel: str, query: dict[str, Any], fast: bool, skip=None) -> dict[str, Any] | None:
        eps = self._eps[channel]
        for ep in eps:
            if ep.down:
                await self._check_probe(ep)
                if ep.down and fast:
                    await self._ensure_probe(ep)  # keep a probe in flight while others answer
        payload = _core.encode(query)
        self._why = None
        for ep in eps:
            if ep.down and fast:
                continue
            raw = await self._exchange(ep, payload)
            if raw is None:
                self._mark_down(ep)
                continue
            try:
                return self._answered(ep, raw, query)
            except DpcoordError as e:
                if skip is not None and await skip(ep, e):
                    continue
                raise
        for ep in eps:
            if ep.down:
                await self._ensure_probe(ep)
        return None
