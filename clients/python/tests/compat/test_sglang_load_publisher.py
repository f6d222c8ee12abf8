"""SGLang 0.5.23's own scheduler load publisher (SchedulerLoadPublisher: its gating,
port derivation, LoadStat encoding, 3-frame framing, seq and 1 s heartbeat dedup)
feeding dpcoord's --sglang-load-connect, with no code of dpcoord's in between.

Only two things are stubbed: the parallel context (which rank this scheduler is)
and the bind address: the real code derives ``tcp://*:base+rank``; the stub binds
the same port number as an ipc:// path, so the test stays off the network."""

from __future__ import annotations

import importlib
import threading
import time
from types import SimpleNamespace

from conftest import eventually
from record import Recorded

DP = 8
BASE = 6100
KV_CONFIG = '{"publisher": "zmq", "endpoint": "tcp://*:6000"}'


def publishers(monkeypatch, tmp_path):
    """Eight real SchedulerLoadPublishers, rank r bound where SGLang would bind base + r."""
    lp = importlib.import_module("sglang.srt.managers.scheduler_components.load_publisher")
    kv = importlib.import_module("sglang.srt.disaggregation.kv_events")
    real_open = lp._open_pub_socket
    monkeypatch.setattr(lp, "_open_pub_socket", lambda ep: Recorded(
        real_open(f"ipc://{tmp_path}/load-{ep.rsplit(':', 1)[1]}"), "sglang_load", lambda f: bytes(f[1]) + bytes(f[2])))
    pubs = []
    for rank in range(DP):
        ctx = SimpleNamespace(
            num_dp_ranks=DP, attn_dp_size=DP, attn_dp_rank=rank, dp_rank=rank, pp_rank=0, attn_tp_rank=0, attn_cp_rank=0
        )
        monkeypatch.setattr(lp, "get_parallel", lambda ctx=ctx: ctx)
        monkeypatch.setattr(kv, "get_parallel", lambda ctx=ctx: ctx)
        pub = lp.SchedulerLoadPublisher(kv_events_config=KV_CONFIG, load_publish_endpoint=f"tcp://*:{BASE}")
        assert pub.enable, "SGLang's gating declined the load publisher"
        pubs.append(pub)
    endpoints = [f"ipc://{tmp_path}/load-{BASE + r}" for r in range(DP)]
    return pubs, endpoints


def test_sglangs_load_publisher_keeps_8_idle_ranks_up_and_routes_by_their_load(real, start_daemon, monkeypatch, tmp_path):
    snapshot = real["sglang.srt.managers.load_snapshot"].LoadSnapshot
    pubs, endpoints = publishers(monkeypatch, tmp_path)
    args = ["--dp-size", str(DP), "--policy", "least_tokens"]
    for ep in endpoints:
        args += ["--sglang-load-connect", ep]
    d = start_daemon(*args)
    # Rank r holds r queued requests: KV in use 100 r, KV + queued 1000 r.
    loads = [snapshot(dp_rank=r, num_waiting_reqs=r, num_used_tokens=100 * r, num_total_tokens=1000 * r,
                      max_total_num_tokens=10_000) for r in range(DP)]
    stop = threading.Event()

    def idle_loop():
        # A scheduler with nothing to do calls publish_load_stat(force=True) on
        # every idle iteration; SGLang's own dedup sends an unchanged stat once a second.
        while not stop.is_set():
            for pub, load in zip(pubs, loads):
                pub.publish_load_stat(lambda load=load: load, force=True)
            time.sleep(0.05)

    loop = threading.Thread(target=idle_loop, daemon=True)
    loop.start()
    try:
        eventually("all 8 ranks up", lambda: d.statuses() == ["up"] * DP)
        ranks = d.state()["ranks"]
        assert [r["counts"] for r in ranks] == [[r, 0, 0, 0, 0] for r in range(DP)]
        assert [r["load"] for r in ranks] == [1000 * r for r in range(DP)]
        epoch = d.state()["epoch"]
        # Ten idle seconds at dpcoord's default liveness (stale 1 s, down 3 s):
        # SGLang's 1 s heartbeat keeps every rank up, and the epoch never moves.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert d.statuses() == ["up"] * DP
            time.sleep(0.25)
        assert d.state()["epoch"] == epoch
        assert d.metric("dpcoord_stats_messages_total", 'result="malformed"') == 0
        # least_tokens places on the rank with the smallest SGLang total_tokens load.
        reply = d.call("route", {"v": 1, "op": "route"})
        assert reply["ranks"] == [0], reply
    finally:
        stop.set()
        loop.join()
        for pub in pubs:
            pub.close()
