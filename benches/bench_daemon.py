"""A release dpcoord for the Python benches: 8 ranks, ``least_load``, kept up by
fake publishers until :meth:`Daemon.stop`."""

from __future__ import annotations

import atexit
import os
import subprocess
import tempfile
import threading
import time

import msgpack
import zmq

from dpcoord.publisher import StatsPublisher


class Daemon:
    """dpcoord on private endpoints (its route socket at ``route``, by default an
    ``ipc://`` one), returned once its 8 ranks are ``up``."""

    def __init__(self, binary: str, route: str | None = None):
        d = tempfile.mkdtemp()
        self.route, self.stats = route or f"ipc://{d}/route", f"ipc://{d}/stats"
        self.p = subprocess.Popen(
            [binary, "--route-bind", self.route, "--health-bind", f"ipc://{d}/health", "--stats-bind", self.stats,
             "--metrics-bind", "127.0.0.1:0", "--dp-size", "8", "--policy", "least_load"],
            env={**os.environ, "RUST_LOG": "error"},
        )
        atexit.register(self.p.kill)  # a run that fails midway leaves no daemon behind
        self.pubs = [StatsPublisher(self.stats, r, bind=False, boot=1) for r in range(8)]
        s = zmq.Context.instance().socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.route)
        end = time.monotonic() + 10
        while True:  # until every rank is up
            self._publish_once()
            s.send(msgpack.packb({"v": 1, "op": "state"}))
            if s.poll(1000) and all(r["status"] == "up" for r in msgpack.unpackb(s.recv())["ranks"]):
                break
            assert time.monotonic() < end, "dpcoord's ranks did not come up"
            time.sleep(0.05)
        s.close()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._publish, daemon=True)  # the ranks stay up
        self.thread.start()

    def _publish_once(self):
        for pub in self.pubs:
            pub.publish(waiting=0, running=0, received=0, finished=0, failed=0)

    def _publish(self):
        while not self.done.wait(0.05):
            self._publish_once()

    def stop(self):
        self.p.kill()
        self.p.wait()
        self.done.set()
        self.thread.join()
        for pub in self.pubs:
            pub.close()
