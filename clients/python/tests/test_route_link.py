"""RouteLink, the lean asyncio link under the vLLM route hook: against the real
dpcoord, and against a route socket that answers badly or not at all."""

from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import zmq

from conftest import DEADLINE, bring_up, eventually
from dpcoord.route_link import DOWN_AFTER, RouteLink

ROUTE = {"v": 1, "op": "route"}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE))


def test_many_queries_in_flight_on_one_socket(start_daemon, engines):
    d = start_daemon("--dp-size", "4", "--policy", "least_load")
    bring_up(d, engines, [0, 1, 2, 3])

    async def main():
        link = RouteLink(d.route, timeout_s=DEADLINE)
        try:
            return await asyncio.gather(*(link.route(dict(ROUTE)) for _ in range(64)))
        finally:
            link.close()

    answers = run(main())
    assert all(reason is None for _, reason in answers), answers
    ranks = [rank for rank, _ in answers]
    # least_load counts each placement as pending: 64 placements spread 16 per rank.
    assert sorted(ranks.count(r) for r in range(4)) == [16] * 4
    assert [r["routed"] for r in d.state()["ranks"]] == [16] * 4


def test_no_dpcoord_is_answered_at_once_and_dpcoord_is_used_when_it_comes(start_daemon, engines):
    d = start_daemon("--dp-size", "2")
    bring_up(d, engines, [0, 1])
    d.stop()

    async def main():
        link = RouteLink(d.route, timeout_s=0.2)
        try:
            first = time.monotonic()
            outcomes = [await link.route(dict(ROUTE))]
            waited = time.monotonic() - first
            outcomes += [await link.route(dict(ROUTE)) for _ in range(4)]
            rest = time.monotonic() - first - waited
            d.restart()
            bring_up(d, engines, [0, 1])
            end = time.monotonic() + DEADLINE
            while (answer := await link.route(dict(ROUTE)))[1] is not None and time.monotonic() < end:
                await asyncio.sleep(0.01)
            return outcomes, waited, rest, answer
        finally:
            link.close()

    outcomes, waited, rest, answer = run(main())
    assert outcomes == [(None, "unreachable")] * 5
    # Only the link's first query waits for a connection, up to the deadline (0.2 s;
    # asyncio may fire a timer a little early: it was seen at 0.19994 s under load);
    # the others are answered without waiting: nothing is queued (ZMQ_IMMEDIATE).
    assert waited >= 0.19 and rest < 0.2, (waited, rest)
    assert answer[1] is None and answer[0] in (0, 1)


class Held:
    """An answer the fake sends only after it has answered the next query."""

    def __init__(self, reply: bytes):
        self.reply = reply


class FakeRoute:
    """A route socket that answers each query with ``answer(query)`` (bytes), not at
    all (None), or later (:class:`Held`); pings are answered only while ``pings`` is set."""

    def __init__(self, endpoint: str, answer):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.answer = answer
        self.pings = threading.Event()
        self.queries = 0
        self.held: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            *envelope, body = self.sock.recv_multipart()
            query = msgpack.unpackb(body)
            if query["op"] == "ping":
                if self.pings.is_set():
                    reply = msgpack.packb({"v": 1, "ok": True, "id": query["id"], "epoch": 0})
                    self.sock.send_multipart([*envelope, reply])
                continue
            self.queries += 1
            reply = self.answer(query)
            if isinstance(reply, Held):
                self.held.append([*envelope, reply.reply])
                continue
            if reply is not None:
                self.sock.send_multipart([*envelope, reply])
            while self.held:
                self.sock.send_multipart(self.held.pop(0))

    def close(self):
        self._stop.set()
        self._thread.join(DEADLINE)
        self.sock.close(0)


def ok(query, **extra):
    return msgpack.packb({"v": 1, "ok": True, "id": query["id"], "epoch": 0, **extra})


def test_bad_answers_are_told_apart_and_never_raise(tmp_path):
    answers = iter(
        [
            lambda q: b"\xc1 not msgpack",
            lambda q: ok(q, ranks=[]),
            lambda q: ok(q, ranks=["1"]),
            lambda q: msgpack.packb({"v": 1, "ok": False, "id": q["id"], "error": {"code": "no_engine_available", "message": "none"}}),
            lambda q: ok(q, ranks=[3]),
        ]
    )
    fake = FakeRoute(f"ipc://{tmp_path}/route", lambda q: next(answers)(q))
    try:

        async def main():
            link = RouteLink(fake.sock.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=0.5)
            try:
                return [await link.route(dict(ROUTE)) for _ in range(5)]
            finally:
                link.close()

        # Undecodable: no id to match, so that query times out; the others are told apart.
        assert run(main()) == [(None, "timeout"), (None, "bad_reply"), (None, "bad_reply"), (None, "refused"), (3, None)]
    finally:
        fake.close()


def test_a_silent_dpcoord_stops_being_waited_for_until_it_answers_a_ping(tmp_path):
    answering = threading.Event()
    fake = FakeRoute(f"ipc://{tmp_path}/route", lambda q: ok(q, ranks=[1]) if answering.is_set() else None)
    try:

        async def main():
            link = RouteLink(fake.sock.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=0.05)
            try:
                eventually("connected", lambda: link.sock.poll(0, zmq.POLLOUT))
                timed_out = [await link.route(dict(ROUTE)) for _ in range(DOWN_AFTER)]
                asked = fake.queries
                down = [await link.route(dict(ROUTE)) for _ in range(20)]
                not_asked = fake.queries - asked
                answering.set()
                fake.pings.set()
                end = time.monotonic() + DEADLINE
                while (answer := await link.route(dict(ROUTE)))[1] is not None and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                return timed_out, asked, down, not_asked, answer
            finally:
                link.close()

        timed_out, asked, down, not_asked, answer = run(main())
        assert timed_out == [(None, "timeout")] * DOWN_AFTER and asked == DOWN_AFTER
        # Down: answered without sending (so without waiting) until a ping is answered.
        assert down == [(None, "timeout")] * 20 and not_asked == 0
        assert answer == (1, None)
    finally:
        fake.close()


def test_a_request_id_is_the_query_id_when_dpcoord_can_take_it(tmp_path):
    seen = []

    def answer(q):
        seen.append(q["id"])
        # The first "same" is answered only after the next query arrives, so
        # both are in flight however fast the fake could answer.
        return Held(ok(q, ranks=[0])) if q["id"] == "same" else ok(q, ranks=[0])

    fake = FakeRoute(f"ipc://{tmp_path}/route", answer)
    try:

        async def main():
            link = RouteLink(fake.sock.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=DEADLINE)
            try:
                first = await link.route(dict(ROUTE, id="cmpl-7-a1"))
                both = await asyncio.gather(link.route(dict(ROUTE, id="same")), link.route(dict(ROUTE, id="same")))
                long = await link.route(dict(ROUTE, id="é" * 65))  # 130 bytes: above dpcoord's 128
                return [first, *both, long]
            finally:
                link.close()

        assert run(main()) == [(0, None)] * 4
        # Two queries in flight with one id: the second is numbered, so each answer finds its query.
        assert seen[:2] == ["cmpl-7-a1", "same"] and [type(i) for i in seen[2:]] == [int, int]
    finally:
        fake.close()
