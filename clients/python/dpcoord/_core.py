"""What the sync and asyncio clients share: the wire codec, query builders, reply
checks, per-endpoint state and the local fallback router. No I/O happens here."""

from __future__ import annotations

import logging
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgpack

from . import prefix
from ._refusal import Refusals
from .errors import (
    BadRequestError,
    InvalidRankError,
    NoEngineAvailableError,
    ProtocolError,
    RankUnavailableError,
    TooLargeError,
    UnreachableError,
    error_from_reply,
)

VERSION = 1
MAX_BATCH = 1024
ROUTABLE = ("up", "stale")

log = logging.getLogger("dpcoord.client")


# -- wire ---------------------------------------------------------------------------


def encode(query: dict[str, Any]) -> bytes:
    """One MessagePack map; keys whose value is None are left out (nil = absent)."""
    return msgpack.packb({k: v for k, v in query.items() if v is not None}, use_bin_type=True)


def decode(raw: bytes, sent_id: Any = None) -> dict[str, Any]:
    """Checks a reply against the contract; raises the typed error of a refusal."""
    try:
        reply = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - any decode failure is a protocol error
        raise ProtocolError(message=f"reply is not valid MessagePack: {e}") from None
    if not isinstance(reply, dict):
        raise ProtocolError(message=f"reply is not a map: {reply!r}")
    if reply.get("v") != VERSION:
        raise ProtocolError(message=f"reply has version {reply.get('v')!r}, expected {VERSION}")
    ok = reply.get("ok")
    if ok is False:
        # A refusal carries the id only when dpcoord could read it (not for an
        # undecodable or oversized query, or an id of the wrong type).
        raise error_from_reply(reply)
    if ok is not True:
        raise ProtocolError(message=f"reply has no boolean `ok`: {reply!r}")
    if sent_id is not None and reply.get("id") != sent_id:
        raise ProtocolError(message=f"reply id {reply.get('id')!r} does not echo the query id {sent_id!r}")
    return reply


def route_query(n, prompt_tokens, rank, bootstrap_room, session, id, prompt=None) -> dict[str, Any]:
    """A ``route`` query; ``prompt`` is what :func:`prompt_fields` made (or None)."""
    return {
        "v": VERSION,
        "op": "route",
        "id": id,
        "n": n,
        "prompt_tokens": prompt_tokens,
        "rank": rank,
        "bootstrap_room": bootstrap_room,
        "session": session,
        **(prompt or {}),
    }


# -- a route's prompt (PROTOCOL.md §4, §11a) ---------------------------------------------

SEND = ("tokens", "keys")


def check_prompt(tokens, block_keys, lora, salt, send, max_prompt_tokens: int) -> bool:
    """The cheap checks of a prompt, as dpcoord makes them (``bad_request``,
    ``too_large``), before anything is sent or answered locally. Returns whether
    the keys must be computed here (``tokens`` with ``send="keys"``), which needs
    the block size."""
    if send not in SEND:
        raise ValueError(f"send must be 'tokens' or 'keys', got {send!r}")
    for name, value in (("lora", lora), ("salt", salt)):
        if value is not None and not isinstance(value, str):
            raise BadRequestError(message=f"`{name}` must be a string, got {type(value).__name__}")
    if tokens is not None and block_keys is not None:
        raise BadRequestError(message="send `tokens` or `block_keys`, not both")
    if block_keys is not None and (lora is not None or salt is not None):
        raise BadRequestError(message="`lora` and `salt` are already in `block_keys`; send them only with `tokens`")
    if tokens is None and block_keys is None:
        if lora is not None or salt is not None:
            raise BadRequestError(message="`lora` and `salt` go with `tokens`")
        return False
    if tokens is not None:
        _check_len("tokens", tokens, max_prompt_tokens)
        return send == "keys"
    _check_len("block_keys", block_keys, max(max_prompt_tokens // prefix.TOKENS_PER_KEY, 1))
    return False


def _check_len(name: str, values, limit: int) -> None:
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise BadRequestError(message=f"`{name}` must be a list of integers, got {type(values).__name__}")
    if len(values) > limit:
        raise TooLargeError(message=f"`{name}` has {len(values)} elements, above the limit of {limit}")


def prompt_fields(tokens, block_keys, lora, salt, send, block_size: int | None) -> dict[str, Any]:
    """The query keys of a prompt that passed :func:`check_prompt`. With
    ``send="keys"`` the keys of ``tokens`` are computed with ``block_size``, and
    ``prompt_tokens`` is the prompt's true length (dpcoord would otherwise take
    ``len(block_keys) * kv_block_size``, losing the partial last block)."""
    if tokens is not None and send == "keys":
        try:
            keys = prefix.block_keys(tokens, block_size, lora, salt)
        except (TypeError, ValueError) as e:
            raise BadRequestError(message=f"`tokens`: {e}") from None
        return {"block_keys": keys, "prompt_tokens": len(tokens)}
    if tokens is not None:
        return {"tokens": tokens if isinstance(tokens, (list, tuple)) else list(tokens), "lora": lora, "salt": salt}
    if block_keys is not None:
        return {"block_keys": block_keys if isinstance(block_keys, (list, tuple)) else list(block_keys)}
    return {}


def health_route_query(rank, bootstrap_room, id=None) -> dict[str, Any]:
    return {"v": VERSION, "op": "health_route", "id": id, "rank": rank, "bootstrap_room": bootstrap_room}


def health_report_query(rank, ok, id=None) -> dict[str, Any]:
    if not isinstance(ok, bool):
        raise TypeError(f"health_report `ok` must be a bool, got {type(ok).__name__}")
    return {"v": VERSION, "op": "health_report", "id": id, "rank": rank, "ok": ok}


def ranks_of(reply: dict[str, Any], n: int) -> list[int]:
    ranks = reply.get("ranks")
    if (
        not isinstance(ranks, list)
        or len(ranks) != n
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        raise ProtocolError(message=f"route reply must hold {n} ranks, got {ranks!r}")
    return ranks


def rank_of(reply: dict[str, Any]) -> int:
    rank = reply.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ProtocolError(message=f"health_route reply must hold a rank, got {rank!r}")
    return rank


def uninformed(state: dict[str, Any], err: Exception, rank: Any, bootstrap_room: Any) -> bool:
    """Whether a ``no_engine_available`` / ``rank_unavailable`` refusal only means
    that dpcoord has not heard from the engines yet (it just started): for
    ``no_engine_available``, no rank is ``down`` and some are still ``unknown`` in its
    ``state`` (asked just after the refusal: engines may have reported in between,
    so some may be ``up`` by then); for a pin, that rank is still ``unknown``."""
    entries = state.get("ranks")
    if not isinstance(entries, list) or not entries:
        return False
    statuses = [e.get("status") if isinstance(e, dict) else None for e in entries]
    if isinstance(err, NoEngineAvailableError):
        return "unknown" in statuses and "down" not in statuses
    if isinstance(err, RankUnavailableError):
        target = rank if rank is not None else bootstrap_room
        if not isinstance(target, int) or isinstance(target, bool) or target < 0:
            return False
        if rank is None:
            target %= len(statuses)
        return target < len(statuses) and statuses[target] == "unknown"
    return False


def epoch_of(reply: dict[str, Any]) -> int:
    epoch = reply.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise ProtocolError(message=f"reply must hold an integer epoch, got {epoch!r}")
    return epoch


def instance_of(reply: dict[str, Any]) -> str | None:
    """The reply's ``instance`` (``ping``, ``state``); None when it has none."""
    instance = reply.get("instance")
    if instance is not None and not isinstance(instance, str):
        raise ProtocolError(message=f"reply's instance must be a string, got {instance!r}")
    return instance


def normalize_standby(standby) -> list[tuple[str, str | None]]:
    """``standby`` entries are a route endpoint, or a ``(route, health)`` pair."""
    out = []
    for s in standby or ():
        if isinstance(s, str):
            out.append((s, None))
        else:
            route, health = s
            out.append((route, health))
    return out


# -- endpoints ----------------------------------------------------------------------


@dataclass
class Endpoint:
    """One dpcoord socket address and what the client knows about it.

    ``down`` after a call found no answer within the timeout; while down, user calls
    do not wait on it: a ``ping`` probe is left in flight (``probe_at``) and checked
    without blocking on each call, so the endpoint is used again as soon as it answers.
    ``watch`` reads the socket's handshakes; ``refusal`` says whether dpcoord's
    latest one was a refusal, and when a new socket may be opened.
    """

    address: str
    channel: str
    sock: Any = None
    down: bool = False
    probe_at: float | None = None
    watch: Any = None
    refusal: Refusals = field(default_factory=Refusals)


# -- local fallback -------------------------------------------------------------------


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
        it is at least ``refresh_s`` old. A learned size is kept: dpcoord never
        changes it while it runs, and every ``state`` the client sees (a new
        epoch, an endpoint back) refreshes it anyway."""
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
