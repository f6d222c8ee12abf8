"""Runs the real dpcoord binary on private ipc:// endpoints for the client tests.

The binary is ``$DPCOORD_BIN`` when set, else it is built once per session with
``cargo build`` from the repository this package lives in.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest
import zmq

from dpcoord import StatsPublisher

REPO = Path(__file__).resolve().parents[3]
#: How long any single wait in a test may take before it fails.
DEADLINE = 10.0


def eventually(what: str, f: Callable[[], Any], deadline: float = DEADLINE, interval: float = 0.005) -> Any:
    """Polls ``f`` until it returns something truthy; fails the test after ``deadline`` s."""
    end = time.monotonic() + deadline
    while True:
        value = f()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline} s waiting for: {what}")
        time.sleep(interval)


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (a signal is delivered after ``kill`` returns)."""
    tasks = Path(f"/proc/{pid}/task")
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for t in tasks.iterdir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def dpcoord_bin() -> str:
    env = os.environ.get("DPCOORD_BIN")
    if env:
        assert os.access(env, os.X_OK), f"DPCOORD_BIN={env} is not an executable"
        return env
    subprocess.run(["cargo", "build", "--quiet", "--bin", "dpcoord"], cwd=REPO, check=True, timeout=1800)
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    path = Path(json.loads(meta.stdout)["target_directory"]) / "debug" / "dpcoord"
    assert path.exists(), f"cargo build did not produce {path}"
    return str(path)


def raw_call(
    endpoint: str, query: dict[str, Any], timeout_ms: int = 1000, context: zmq.Context | None = None
) -> dict[str, Any] | None:
    """One query on a fresh REQ socket of ``context`` (``zmq.Context.instance()``
    by default); None when nothing answers within the timeout."""
    sock = (context or zmq.Context.instance()).socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(msgpack.packb(query))
        if sock.poll(timeout_ms, zmq.POLLIN):
            return msgpack.unpackb(sock.recv())
        return None
    finally:
        sock.close()


class Daemon:
    """One dpcoord process; ``restart()`` brings it back on the same endpoints."""

    def __init__(self, binary: str, dir: Path, args: list[str]):
        self.binary, self.dir, self.args = binary, dir, args
        self.route = f"ipc://{dir}/route"
        self.health = f"ipc://{dir}/health"
        self.stats = f"ipc://{dir}/stats"
        self.proc: subprocess.Popen | None = None
        self.metrics_port = 0
        self.starts = 0

    def start(self) -> "Daemon":
        assert self.proc is None, "already running"
        self.metrics_port = free_port()
        self.starts += 1
        log = open(self.dir / f"dpcoord.{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, "--route-bind", self.route, "--health-bind", self.health, "--stats-bind", self.stats]
            + ["--metrics-bind", f"127.0.0.1:{self.metrics_port}"]
            + self.args,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "RUST_LOG": "warn"},
        )
        log.close()

        def answers():
            if self.proc.poll() is not None:
                pytest.fail(f"dpcoord exited with {self.proc.returncode}: {self.log()}")
            reply = raw_call(self.route, {"v": 1, "op": "ping"}, timeout_ms=200)
            return reply is not None and reply.get("ok") is True

        eventually("dpcoord answers ping", answers)
        return self

    def stop(self) -> int:
        """SIGTERM, then the exit status (which the contract says is 0)."""
        proc, self.proc = self.proc, None
        assert proc is not None, "not running"
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail("dpcoord did not exit within the deadline after SIGTERM")

    def restart(self) -> "Daemon":
        return self.start()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.dir.glob("dpcoord.*.log")))

    def call(self, channel: str, query: dict[str, Any]) -> dict[str, Any]:
        reply = raw_call(self.route if channel == "route" else self.health, query, timeout_ms=int(DEADLINE * 1000))
        assert reply is not None, "dpcoord did not answer"
        return reply

    def state(self) -> dict[str, Any]:
        return self.call("route", {"v": 1, "op": "state"})

    def statuses(self) -> list[str]:
        return [r["status"] for r in self.state()["ranks"]]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=DEADLINE) as r:
            return r.read().decode()

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample, e.g. ``metric("dpcoord_stats_messages_total", 'result="ok"')``; 0 if absent."""
        prefix = f"{name}{{{labels}}}" if labels else name
        for line in self.metrics().splitlines():
            if line.startswith(prefix + " "):
                return float(line.split()[-1])
        return 0.0


class Engines:
    """Fake engines: one publisher per rank, publishing every ``period`` s from a
    background thread (PUB/SUB drops updates sent before the subscription is
    wired, and dpcoord marks silent ranks stale, then down)."""

    def __init__(self, endpoint: str, ranks: list[int], *, bind: bool = False, period: float = 0.05):
        self.pubs = {r: StatsPublisher(endpoint, r, bind=bind, boot=1) for r in ranks}
        self.counts = {r: dict(waiting=0, running=0, received=0, finished=0, failed=0) for r in ranks}
        self.period = period
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def set(self, rank: int, **counts: int) -> None:
        with self._lock:
            self.counts[rank].update(counts)

    def silence(self, rank: int) -> None:
        """Rank ``rank`` stops publishing (a dead engine)."""
        with self._lock:
            self.pubs.pop(rank).close()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                for r, pub in self.pubs.items():
                    pub.publish(**self.counts[r])
            self._stop.wait(self.period)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE)
        for pub in self.pubs.values():
            pub.close()


@pytest.fixture
def start_daemon(dpcoord_bin, tmp_path):
    """``start_daemon("--dp-size", "3", ...)`` starts a dpcoord in its own tmp dir."""
    daemons: list[Daemon] = []

    def start(*args: str) -> Daemon:
        d = tmp_path / f"d{len(daemons)}"
        d.mkdir()
        daemon = Daemon(dpcoord_bin, d, list(args))
        daemons.append(daemon)
        return daemon.start()

    yield start
    for daemon in daemons:
        if daemon.proc is not None:
            assert daemon.stop() == 0, daemon.log()


@pytest.fixture
def engines():
    """``engines(endpoint, [0, 1])`` starts fake engines, stopped at teardown."""
    made: list[Engines] = []

    def make(endpoint: str, ranks: list[int], **kw: Any) -> Engines:
        e = Engines(endpoint, ranks, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def bring_up(daemon: Daemon, engines_factory, ranks: list[int], **kw: Any) -> Engines:
    """Fake engines for ``ranks`` publishing to ``daemon``, once all are ``up``."""
    e = engines_factory(daemon.stats, ranks, **kw)
    eventually(f"ranks {ranks} up", lambda: all(daemon.statuses()[r] == "up" for r in ranks))
    return e


# -- the compatibility suite (tests/compat) --------------------------------------------
# dpcoord's vLLM plugin and SGLang adapter against the real vllm==0.33.0 and
# sglang==0.5.23 (installed with --no-deps plus tests/compat/requirements.txt, as
# .ci/test does). A missing or different package fails those tests: nothing is
# skipped, and nothing is installed from here.
#
# The other vLLM releases of the support window (compat/vllm-releases.txt) are
# installed by .ci/test into folders of their own (``pip install --no-deps
# --target``); ``DPCOORD_VLLM_HOME=<folder>`` runs the suite on that release
# instead: the folder comes first on this process's path and its children's
# (compat/test_vllm_window.py runs the hook's tests so on each release).
# A folder that also holds vLLM Ascend (compat/ascend-releases.txt) runs it as vLLM
# Ascend does in an API server: its platform plugin's patches first (compat/ascend.py).

#: the environment this run started with (before a release folder was put on PYTHONPATH)
BASE_ENV = dict(os.environ)
VLLM_HOME = os.environ.get("DPCOORD_VLLM_HOME")
if VLLM_HOME:
    sys.path.insert(0, VLLM_HOME)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (VLLM_HOME, os.environ.get("PYTHONPATH")) if p)


def vllm_release_of(home: str) -> str:
    """The vLLM version installed in ``home`` (a ``pip install --target`` folder)."""
    [dist] = Path(home).glob("vllm-*.dist-info")
    return dist.name[len("vllm-") : -len(".dist-info")]


PINNED = {"vllm": vllm_release_of(VLLM_HOME) if VLLM_HOME else "0.33.0", "sglang": "0.5.23"}


@pytest.fixture(scope="session")
def real():
    """The real engine modules, imported with stand-ins for torch and the other heavy imports."""
    for name, version in PINNED.items():
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name}=={version} is not installed: run .ci/test (pip install --no-deps -r tests/compat/requirements.txt)")
        if found != version:
            pytest.fail(f"{name} {found} is installed; this suite is written against {name}=={version}")
    sys.path.insert(0, str(Path(__file__).parent / "compat"))
    import standins

    standins.install()
    import ascend

    try:
        if ascend.installed():  # vLLM as vLLM Ascend runs it: its platform's patches applied
            ascend.start_api_server()
        mods = {
            name: importlib.import_module(name)
            for name in (
                "vllm.v1.metrics.loggers",
                "vllm.v1.metrics.stats",
                "vllm.v1.engine",
                "vllm.v1.engine.core_client",  # DPLBAsyncMPClient (tests/compat/vllm_engine.py)
                "vllm.v1.engine.async_llm",
                "vllm.v1.core.kv_cache_manager",
                "sglang.srt.managers.load_snapshot",
                "sglang.srt.observability.metrics_collector",
            )
        }
    except Exception as e:  # an import the stand-ins or requirements.txt do not cover
        pytest.fail(f"importing the real engine modules failed: {e!r}")
    yield mods
    standins.uninstall()
