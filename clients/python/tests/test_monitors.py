"""The socket monitors the client and the publisher watch their connections with
(dpcoord._refusal.Watch) never stop the libzmq context they share with the
application. libzmq sends a monitor event from its I/O thread with a blocking
send: to a reader that is gone, or into a full pipe, that send never returns,
and no socket of the context connects or sends again."""

from __future__ import annotations

import threading
import time

import zmq

from conftest import DEADLINE, raw_call
from dpcoord import RouterClient, StatsPublisher
from dpcoord._refusal import Watch


def answers_ping(ctx: zmq.Context, endpoint: str) -> bool:
    """A fresh REQ socket of ``ctx`` gets dpcoord's ping answered within the deadline."""
    reply = raw_call(endpoint, {"v": 1, "op": "ping"}, int(DEADLINE * 1000), context=ctx)
    return reply is not None and reply["ok"] is True


def terminates(ctx: zmq.Context) -> bool:
    """``ctx.term()`` returns within the deadline (it waits for the I/O thread)."""
    done = threading.Thread(target=ctx.term, daemon=True)
    done.start()
    done.join(DEADLINE)
    return not done.is_alive()


def test_closing_clients_and_publishers_of_an_absent_dpcoord_leaves_the_context_working(start_daemon, tmp_path):
    d = start_daemon("--dp-size", "1")
    ctx = zmq.Context()
    absent = f"ipc://{tmp_path}/nobody-listens-here"
    for _ in range(10):
        # Each socket tries to connect every 100 ms, one monitor event a try; the
        # last events come while it is being closed.
        pub = StatsPublisher(absent, 0, boot=1, context=ctx)
        pub.publish(waiting=0, running=0, received=0, finished=0, failed=0)
        client = RouterClient(absent, absent, timeout_ms=150, dp_size=2, context=ctx)
        assert client.route() in ([0], [1])  # the local fallback: nobody answered
        pub.close()
        client.close()
    assert answers_ping(ctx, d.route)
    assert terminates(ctx)


def test_a_monitor_not_read_for_thousands_of_events_does_not_stop_the_context(start_daemon, tmp_path):
    d = start_daemon("--dp-size", "1")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)  # a try every 1-2 ms: an event each, hundreds a second
    watch = Watch(sock)
    sock.connect(f"ipc://{tmp_path}/nobody-listens-here")
    # Read none of them for 8 s, the context answering all along. libzmq's own
    # high-water marks would hold 2,000 events (1,000 each side of the pipe),
    # then its I/O thread would stop and the next ping go unanswered.
    end = time.monotonic() + 8.0
    while time.monotonic() < end:
        assert answers_ping(ctx, d.route)
        time.sleep(0.5)
    seen = watch.poll()["absent"]
    assert seen > 2000, f"only {seen} events in 8 s: the test did not pass libzmq's marks"
    assert watch.outcome == "absent"
    watch.close()
    sock.close()
    assert terminates(ctx)
