"""The asyncio client: :class:`RouterClient`'s API and behaviour on ``zmq.asyncio``."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

import zmq
import zmq.asyncio

from ._base import ClientBase, Steps
from ._core import Endpoint


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
        *,
        tokens: Sequence[int] | None = None,
        block_keys: Sequence[int] | None = None,
        lora: str | None = None,
        salt: str | None = None,
        send: str = "tokens",
    ) -> list[int]:
        return await self._run(
            self._route_steps(n, prompt_tokens, rank, bootstrap_room, session, id, tokens, block_keys, lora, salt, send)
        )

    async def block_keys(self, tokens: Sequence[int], lora: str | None = None, salt: str | None = None) -> list[int]:
        return await self._run(self._block_keys_steps(tokens, lora, salt))

    async def health_route(self, rank: int | None = None, bootstrap_room: int | None = None) -> int:
        return await self._run(self._health_route_steps(rank, bootstrap_room))

    async def health_report(self, rank: int, ok: bool) -> bool:
        return await self._run(self._health_report_steps(rank, ok))

    async def state(self) -> dict[str, Any]:
        return await self._run(self._state_steps())

    async def ping(self) -> int:
        return await self._run(self._ping_steps())

    async def call(self, op: str, channel: str = "route", **fields: Any) -> dict[str, Any]:
        return await self._run(self._call_steps(op, channel, fields))

    def close(self) -> None:
        self._reset_all()

    async def __aenter__(self) -> "AsyncRouterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # -- the driver: each step of a call's flow, awaited ---------------------------------

    async def _run(self, steps: Steps) -> Any:
        result = None
        while True:
            try:
                step = steps.send(result)
            except StopIteration as done:
                return done.value
            try:
                result = await getattr(self, "_io_" + step[0])(*step[1:])
            except BaseException:  # cancellation too
                steps.close()  # the flow's `finally` releases the lock
                raise

    async def _io_acquire(self) -> bool:
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            await asyncio.wait_for(self._lock.acquire(), self.timeout_ms / 1000)
            return True
        except asyncio.TimeoutError:
            return False

    async def _io_exchange(self, ep: Endpoint, payload: bytes) -> bytes | None:
        sock = ep.sock
        done = False
        try:
            await sock.send(payload, zmq.NOBLOCK)
            poller = zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(ep.watch.sock, zmq.POLLIN)  # the handshake's outcome
            end = time.monotonic() + self.timeout_ms / 1000
            while (left := end - time.monotonic()) > 0:
                if sock in dict(await poller.poll(left * 1000)):
                    raw = await sock.recv()
                    done = True
                    return raw
                if self._refused_now(ep):
                    break
        except zmq.ZMQError:
            pass
        finally:
            if not done:  # timeout, error or cancellation: lazy pirate
                self._reset(ep)
        return None

    async def _io_probe_answered(self, ep: Endpoint) -> bool:
        try:
            if await ep.sock.poll(0, zmq.POLLIN):
                await ep.sock.recv()
                return True
        except zmq.ZMQError:
            pass
        return False

    async def _io_send_probe(self, ep: Endpoint, payload: bytes) -> bool:
        try:
            await ep.sock.send(payload, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False
