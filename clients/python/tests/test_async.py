"""AsyncRouterClient: the same contract on zmq.asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import DEADLINE, bring_up
from dpcoord import AsyncRouterClient, BadRequestError, InvalidRankError, UnreachableError


async def eventually_async(what, f, deadline=DEADLINE):
    end = time.monotonic() + deadline
    while True:
        value = await f()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline} s waiting for: {what}")
        await asyncio.sleep(0.005)


def test_async_routing_errors_and_concurrency(start_daemon, engines):
    d = start_daemon("--dp-size", "2", "--policy", "round_robin")
    bring_up(d, engines, [0, 1])

    async def main():
        async with AsyncRouterClient(d.route, d.health, timeout_ms=2000) as c:
            assert await c.ping() == d.state()["epoch"]
            assert await c.route(n=4) == [0, 1, 0, 1]
            assert await c.route(rank=1, n=2) == [1, 1]
            assert await c.route(bootstrap_room=4) == [0]
            assert [await c.health_route() for _ in range(3)] == [0, 1, 0]
            assert await c.health_report(1, True) is True
            with pytest.raises(BadRequestError) as e:
                await c.route(n=0, id="x")
            assert (e.value.code, e.value.id) == ("bad_request", "x")
            with pytest.raises(InvalidRankError):
                await c.route(rank=2)
            state = await c.state()
            assert [r["status"] for r in state["ranks"]] == ["up", "up"]
            assert c.routable_ranks == [0, 1]
            got = await asyncio.gather(*(c.route() for _ in range(40)))
            flat = [r for rs in got for r in rs]
            assert (flat.count(0), flat.count(1)) == (20, 20)
            assert c.fallbacks == 0 and c.last_source == "dpcoord"

    asyncio.run(main())


def test_async_fallback_cancellation_and_recovery(start_daemon, engines, tmp_path):
    nothing = f"ipc://{tmp_path}/nothing"

    async def unreachable():
        c = AsyncRouterClient(nothing, nothing + "-h", timeout_ms=300, dp_size=3)
        # Cancelled mid-wait: the lock is released and the socket reset.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.route(), 0.05)
        t0 = time.monotonic()
        assert await c.route() == [0]
        assert time.monotonic() - t0 < 0.3 + 1.0
        t0 = time.monotonic()
        assert await c.route(n=2) == [1, 2]
        assert await c.route(rank=2) == [2]
        assert time.monotonic() - t0 < 0.3, "calls waited on a dpcoord known to be down"
        assert await c.health_route() == 0
        assert await c.route() == [0]
        with pytest.raises(UnreachableError):
            await c.ping()
        assert (c.fallbacks, c.health_fallbacks) == (4, 1)
        c.close()

    asyncio.run(unreachable())

    d = start_daemon("--dp-size", "2", "--policy", "round_robin")
    bring_up(d, engines, [0, 1])

    async def restart():
        c = AsyncRouterClient(d.route, d.health, timeout_ms=1000)
        assert await c.route(n=2) == [0, 1]
        assert d.stop() == 0
        answers = [await c.route() for _ in range(10)]
        assert answers == [[0], [1]] * 5 and c.fallbacks == 10
        d.restart()

        async def back():
            ranks = await c.route()
            assert len(ranks) == 1 and ranks[0] in (0, 1)
            return c.last_source == "dpcoord"

        await eventually_async("dpcoord answers again", back)
        c.close()

    asyncio.run(restart())
