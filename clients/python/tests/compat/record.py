"""Opt-in capture of the raw bytes the real engines send or serve in this suite, the
seeds of dpcoord's fuzz corpus (fuzz/corpus/<target>/). Set ``DPCOORD_RECORD_CORPUS=DIR``
and each message is written to ``DIR/<target>/<sha1 of its bytes>``; unset, nothing is
written. The file formats are the fuzz targets' inputs (fuzz/fuzz_targets/*.rs):
``kv_batch`` a KVEventBatch payload, ``sglang_load`` the 8-byte seq frame then the
LoadStat payload, ``vllm_metrics`` a /metrics body."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def record(target: str, data: bytes) -> None:
    root = os.environ.get("DPCOORD_RECORD_CORPUS")
    if not root:
        return
    d = Path(root) / target
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha1(data).hexdigest()).write_bytes(data)


class Recorded:
    """A PUB socket whose every ``[topic, seq, payload]`` is recorded (as ``encode(frames)``
    under ``target``) before it is sent; everything else is the socket's own."""

    def __init__(self, sock, target: str, encode):
        self.sock, self.target, self.encode = sock, target, encode

    def send_multipart(self, frames, *args, **kwargs):
        record(self.target, self.encode(list(frames)))
        return self.sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sock, name)
