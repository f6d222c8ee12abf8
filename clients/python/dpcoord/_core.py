"""What the sync and asyncio clients share: the wire codec, query builders, reply
checks and per-endpoint state. No I/O happens here. The local fallback router is
in :mod:`dpcoord._fallback`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack

from . import prefix
from ._refusal import Refusals
from .errors import (
    BadRequestError,
    NoEngineAvailableError,
    ProtocolError,
    RankUnavailableError,
    TooLargeError,
    error_from_reply,
)

VERSION = 1

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
    ``watch`` reads the socket's connections; ``refusal`` says whether dpcoord
    refused the latest one or closed it before its handshake, and when a new
    socket may be opened.
    """

    address: str
    channel: str
    sock: Any = None
    down: bool = False
    probe_at: float | None = None
    watch: Any = None
    refusal: Refusals = field(default_factory=Refusals)
