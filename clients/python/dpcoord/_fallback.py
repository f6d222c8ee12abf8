"""The local fallback router: the round-robin :class:`LocalRouter` that answers
``route`` and ``health_route`` while no dpcoord answers, over the ranks the last
``state`` showed. It is apart from :mod:`dpcoord._core` because it keeps state of
its own (the routable set, cursors, the block size learned) behind a lock, where
``_core`` only encodes, builds and checks messages. No I/O happens here."""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from . import prefix
from ._core import log
from .errors import BadRequestError, InvalidRankError, TooLargeError, UnreachableError

MAX_BATCH = 1024
ROUTABLE = ("up", "stale")


def _int_arg(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequestError(message=f"`{name}` must be an integer, got {type(value).__name__}")
    return value


@dataclass
class LocalRouter:
    """Round-robin used while no dpcoord answers. Thread-safe.

    Its pool is the routable ranks of the last ``state`` seen (refreshed whenever a
    reply shows a new epoch), else ``range(dp_size)`` (dpcoord's, from ``state``,
    or the configured one), else the ranks seen in replies. User and health calls
    keep separate cursors, so health probes never shift user placements here either.
    """

    dp_size: int | None = None
    log_period_s: float = 30.0
    max_batch: int = MAX_BATCH
    fallbacks: int = 0
    health_fallbacks: int = 0
    epoch: int | None = None
    source: str | None = None
    routable: list[int] | None = None
    state_dp_size: int | None = None
    seen: set[int] = field(default_factory=set)
    #: ``kv_block_size`` of the last ``state`` seen (None: nil, or no state yet).
    kv_block_size: int | None = None
    #: When (``time.monotonic()``) the block size was last asked for (a ``state``
    #: seen, or an attempt that got none); None: never.
    kv_checked_at: float | None = None
    _user_cursor: int = 0
    _health_cursor: int = 0
    _outage: bool = False
    _last_log: float = 0.0
    _since_log: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # what dpcoord told us

    def needs_refresh(self, epoch: int, source: str) -> bool:
        """Whether a reply from ``source`` at ``epoch`` may disagree with the snapshot."""
        with self._lock:
            return epoch != self.epoch or source != self.source

    def forget_source(self) -> None:
        """Forces a refresh at the next reply (an endpoint came back: maybe restarted)."""
        with self._lock:
            self.source = None

    def observe_state(self, reply: dict[str, Any], source: str | None = None) -> None:
        """Takes the routable set from a ``state`` reply. A dpcoord that no engine
        has reported to yet (every rank ``unknown``: just started) knows less than
        the snapshot, so the snapshot's ranks are kept."""
        ranks = reply.get("ranks")
        if not isinstance(ranks, list):
            return
        entries = [e for e in ranks if isinstance(e, dict)]
        routable = sorted(
            e["rank"] for e in entries if e.get("status") in ROUTABLE and isinstance(e.get("rank"), int)
        )
        uninformed = all(e.get("status") == "unknown" for e in entries)
        bs = reply.get("kv_block_size")
        with self._lock:
            self.kv_block_size = bs if isinstance(bs, int) and not isinstance(bs, bool) and bs > 0 else None
            self.kv_checked_at = time.monotonic()
            self.epoch = reply.get("epoch")
            self.source = source
            self.state_dp_size = len(ranks)
            if not (uninformed and self.routable):
                self.routable = routable

    def block_size_stale(self, refresh_s: float) -> bool:
        """Whether the block size must be asked for before keys are computed: no
        ``state`` seen yet, or the last had none (nil: 16 is used meanwhile) and
        it is at least ``refresh_s`` old. A learned size is kept: dpcoord's
        changes only when most ranks' engines come back with another block
        size, and every ``state`` the client sees (a new epoch, an endpoint
        back) refreshes it anyway."""
        with self._lock:
            if self.kv_checked_at is None:
                return True
            return self.kv_block_size is None and time.monotonic() - self.kv_checked_at >= refresh_s

    def checked_block_size(self) -> int:
        """The block size to key prompts in now: the learned one, else 16."""
        with self._lock:
            if self.kv_checked_at is None:
                self.kv_checked_at = time.monotonic()  # asked, got nothing: do not ask on every call
            return self.kv_block_size or prefix.DEFAULT_BLOCK_SIZE

    def observe_ranks(self, ranks) -> None:
        with self._lock:
            self.seen.update(ranks)

    def effective_dp_size(self) -> int | None:
        return self.state_dp_size or self.dp_size

    def pool(self) -> list[int]:
        if self.routable:
            return list(self.routable)
        dp = self.effective_dp_size()
        if dp:
            return list(range(dp))
        return sorted(self.seen)

    # answering locally

    def _fixed(self, rank, bootstrap_room) -> int | None:
        dp = self.effective_dp_size()
        if rank is not None:
            rank = _int_arg("rank", rank)
            if rank < 0 or (dp is not None and rank >= dp):
                bound = f"dp_size is {dp}" if dp is not None else "ranks are never negative"
                raise InvalidRankError(message=f"`rank` {rank} is out of range: {bound}")
            return rank
        if bootstrap_room is not None:
            room = _int_arg("bootstrap_room", bootstrap_room)
            if room < 0:
                raise BadRequestError(message=f"`bootstrap_room` must be non-negative, got {room}")
            if not dp:
                raise UnreachableError(
                    message="dpcoord is unreachable and dp_size is unknown, so bootstrap_room cannot be mapped"
                    " to a rank; pass dp_size= to the client"
                )
            return room % dp
        return None

    def route(self, n, rank, bootstrap_room, session, where: str) -> list[int]:
        n = _int_arg("n", n)
        if n < 1:
            raise BadRequestError(message="`n` must be at least 1")
        if n > self.max_batch:
            raise TooLargeError(message=f"`n` is {n}, above max_batch {self.max_batch}; split the batch")
        if session is not None and not isinstance(session, str):
            raise BadRequestError(message=f"`session` must be a string, got {type(session).__name__}")
        with self._lock:
            fixed = self._fixed(rank, bootstrap_room)
            if fixed is not None:
                out = [fixed] * n
            else:
                pool = self._fallback_pool(where)
                if session is not None:
                    out = [pool[zlib.crc32(session.encode()) % len(pool)]] * n
                else:
                    out = []
                    for _ in range(n):
                        out.append(pool[self._user_cursor % len(pool)])
                        self._user_cursor = (self._user_cursor + 1) % len(pool)
            self.fallbacks += 1
            self._note_fallback(where)
            return out

    def _fallback_pool(self, where: str) -> list[int]:
        """The pool to fall back on; raises UnreachableError when no rank is known."""
        pool = self.pool()
        if not pool:
            raise UnreachableError(
                message=f"dpcoord cannot place the request ({where}) and no rank is known to fall back on;"
                " pass dp_size= to the client"
            )
        return pool

    def health_route(self, rank, bootstrap_room, where: str) -> int:
        with self._lock:
            fixed = self._fixed(rank, bootstrap_room)
            if fixed is None:
                pool = self._fallback_pool(where)
                fixed = pool[self._health_cursor % len(pool)]
                self._health_cursor = (self._health_cursor + 1) % len(pool)
            self.health_fallbacks += 1
            return fixed

    # logging, at most once per period

    def _note_fallback(self, where: str) -> None:
        now = time.monotonic()
        self._since_log += 1
        if not self._outage:
            self._outage = True
            log.warning(
                "dpcoord cannot place requests (%s): routing locally, round-robin over ranks %s", where, self.pool()
            )
            self._last_log, self._since_log = now, 0
        elif now - self._last_log >= self.log_period_s:
            log.warning(
                "dpcoord still cannot place requests (%s): %d requests routed locally in the last %.0f s",
                where,
                self._since_log,
                now - self._last_log,
            )
            self._last_log, self._since_log = now, 0

    def note_answered(self, address: str) -> None:
        with self._lock:
            if self._outage:
                self._outage = False
                log.info(
                    "dpcoord answering again at %s; back to dpcoord routing (%d requests routed locally in all)",
                    address,
                    self.fallbacks,
                )
