"""StatsPublisher: validation before sending, boot/seq bookkeeping, delivery to dpcoord."""

from __future__ import annotations

import math
import time

import msgpack
import pytest
import zmq

from conftest import eventually
from dpcoord import StatsPublisher

OK = dict(waiting=1, running=2, received=5, finished=2, failed=0)


@pytest.fixture
def sub(tmp_path):
    """A SUB socket bound where a bind=False publisher connects, and a publisher."""
    ep = f"ipc://{tmp_path}/stats"
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.bind(ep)
    pub = StatsPublisher(ep, 3, bind=False, boot=100)
    yield s, pub
    pub.close()
    s.close()


def receive_all(s: zmq.Socket, pub: StatsPublisher, send) -> list[dict]:
    """Re-sends (PUB/SUB drops until connected) until one arrives, then drains."""
    got = eventually("an update arrives", lambda: (send(), s.poll(20, zmq.POLLIN))[1])
    assert got
    out = []
    while s.poll(50, zmq.POLLIN):
        out.append(msgpack.unpackb(s.recv()))
    return out


def test_boot_seq_and_the_wire_shape(sub):
    s, pub = sub
    assert (pub.rank, pub.boot, pub.seq) == (3, 100, 0)
    msgs = receive_all(s, pub, lambda: pub.publish(**OK))
    last = msgs[-1]
    assert last == {"v": 1, "rank": 3, "boot": 100, "seq": pub.seq, "counts": [1, 2, 5, 2, 0]}
    assert [m["seq"] for m in msgs] == list(range(pub.seq - len(msgs) + 1, pub.seq + 1))
    sent = pub.publish(**OK, tokens=(10, 20), kv_usage=0.5, ttft_ms=12.5, tpot_ms=3)
    assert sent == {
        "v": 1,
        "rank": 3,
        "boot": 100,
        "seq": last["seq"] + 1,
        "counts": [1, 2, 5, 2, 0],
        "tokens": [10, 20],
        "kv_usage": 0.5,
        "ttft_ms": 12.5,
        "tpot_ms": 3.0,
    }
    assert s.poll(1000, zmq.POLLIN) and msgpack.unpackb(s.recv()) == sent


def test_default_boot_is_now_in_ms_and_restart_moves_it_up(tmp_path):
    before = time.time_ns() // 1_000_000
    pub = StatsPublisher(f"ipc://{tmp_path}/p", 0)  # bind=True is the default
    assert before <= pub.boot <= time.time_ns() // 1_000_000
    assert pub.endpoint == f"ipc://{tmp_path}/p"
    pub.publish(**OK)
    old = pub.boot
    new = pub.restart()
    assert new > old and (pub.boot, pub.seq) == (new, 0)
    # Counters start over after a restart.
    assert pub.publish(waiting=0, running=0, received=0, finished=0, failed=0)["seq"] == 1
    with pytest.raises(ValueError):
        pub.restart(boot=new)  # not above the current boot
    assert pub.restart(boot=new + 10) == new + 10
    pub.close()


BAD = [
    dict(OK, waiting=-1),
    dict(OK, running=1.0),
    dict(OK, received=True),
    dict(OK, finished="2"),
    dict(OK, failed=None),
    dict(OK, received=2**64),
    dict(OK, tokens=(1,)),
    dict(OK, tokens=(1, 2, 3)),
    dict(OK, tokens=(1, -2)),
    dict(OK, tokens="ab"),
    dict(OK, kv_usage=1.5),
    dict(OK, kv_usage=-0.1),
    dict(OK, kv_usage=math.nan),
    dict(OK, ttft_ms=math.inf),
    dict(OK, ttft_ms=-1.0),
    dict(OK, tpot_ms=math.nan),
    dict(OK, tpot_ms="3"),
]


@pytest.mark.parametrize("kwargs", BAD, ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items() if OK.get(k) != v))
def test_invalid_values_raise_before_sending(sub, kwargs):
    s, pub = sub
    receive_all(s, pub, lambda: pub.publish(**OK))
    seq = pub.seq
    with pytest.raises(ValueError):
        pub.publish(**kwargs)
    assert pub.seq == seq
    assert not s.poll(100, zmq.POLLIN), "an invalid update was sent"
    # The next valid update follows without a gap.
    assert pub.publish(**OK)["seq"] == seq + 1


def test_counters_must_not_go_backwards_within_a_boot(sub):
    s, pub = sub
    pub.publish(waiting=5, running=5, received=10, finished=4, failed=1)
    for name in ("received", "finished", "failed"):
        bad = dict(waiting=0, running=0, received=10, finished=4, failed=1)
        bad[name] -= 1
        with pytest.raises(ValueError, match=f"counter `{name}` went backwards"):
            pub.publish(**bad)
    # Gauges may go down; counters may stay or grow.
    assert pub.publish(waiting=0, running=0, received=10, finished=4, failed=1)["seq"] == 2
    pub.restart()
    assert pub.publish(waiting=0, running=0, received=0, finished=0, failed=0)["seq"] == 1


def test_bad_constructor_arguments():
    with pytest.raises(ValueError):
        StatsPublisher("inproc://x", -1)
    with pytest.raises(ValueError):
        StatsPublisher("inproc://y", 0, boot=-5)


def test_dpcoord_applies_what_the_publisher_sends(start_daemon, tmp_path):
    # bind=False: the engine connects to dpcoord's stats bind.
    d = start_daemon("--dp-size", "2")
    pub = StatsPublisher(d.stats, 1, bind=False, boot=7)
    counts = dict(waiting=2, running=3, received=9, finished=3, failed=1)

    def applied():
        pub.publish(**counts, tokens=(100, 200), kv_usage=0.25, ttft_ms=40.0)
        r = d.state()["ranks"][1]
        return r["status"] == "up" and r["counts"] == [2, 3, 9, 3, 1]

    eventually("rank 1 applied", applied)
    # Invalid values never reach the wire, so dpcoord counted no malformed update.
    for bad in BAD:
        with pytest.raises(ValueError):
            pub.publish(**bad)
    pub.publish(**dict(counts, waiting=7))
    eventually("last update applied", lambda: d.state()["ranks"][1]["counts"][0] == 7)
    assert d.metric("dpcoord_stats_messages_total", 'result="malformed"') == 0
    assert d.metric("dpcoord_stats_messages_total", 'result="stale"') == 0
    assert d.metric("dpcoord_stats_messages_total", 'result="ok"') >= 2
    pub.close()

    # bind=True: the engine binds and dpcoord connects (--stats-connect).
    ep = f"ipc://{tmp_path}/engine0"
    pub0 = StatsPublisher(ep, 0, bind=True)
    d2 = start_daemon("--dp-size", "1", "--stats-connect", ep)

    def applied0():
        pub0.publish(waiting=0, running=1, received=1, finished=0, failed=0)
        r = d2.state()["ranks"][0]
        return r["status"] == "up" and r["counts"] == [0, 1, 1, 0, 0] and r.get("boot") in (None, pub0.boot)

    eventually("rank 0 applied via --stats-connect", applied0)
    pub0.close()
