"""Typed errors: one class per error code of the dpcoord wire contract.

Every refusal dpcoord sends is ``{"ok": false, "id": I, "epoch": E, "error": {"code": C,
"message": M}}``; the client raises ``ERRORS[C]`` (a :class:`DpcoordError` subclass)
carrying ``code``, ``message``, the echoed ``id`` and dpcoord's ``epoch``. A code this client does not know yet raises the
base class, so ``except DpcoordError`` always catches it.
"""

from __future__ import annotations

from typing import Any


class DpcoordError(Exception):
    """Base of every error this package raises about dpcoord.

    ``code`` is the contract's error code (``"bad_request"``, ``"invalid_rank"``, ...)
    or, for the two client-side conditions, ``"unreachable"`` / ``"protocol"``.
    ``id`` is the query's id as dpcoord echoed it (None when it could not read
    one); ``epoch`` is dpcoord's epoch when it refused (None when the refusal
    carries none, and for the client-side conditions).
    """

    code: str = "error"

    def __init__(self, code: str | None = None, message: str = "", id: Any = None, epoch: int | None = None):
        self.code = code or type(self).code
        self.message = message
        self.id = id
        self.epoch = epoch
        super().__init__(f"{self.code}: {message}" if message else self.code)


class BadRequestError(DpcoordError):
    """Undecodable query, or a missing or mistyped field (``bad_request``)."""

    code = "bad_request"


class UnsupportedVersionError(DpcoordError):
    """The query's ``v`` is not a version dpcoord speaks (``unsupported_version``)."""

    code = "unsupported_version"


class UnknownOpError(DpcoordError):
    """Unknown op, or an op sent to the wrong socket (``unknown_op``)."""

    code = "unknown_op"


class InvalidRankError(DpcoordError):
    """A ``rank`` that is negative or not below ``dp_size`` (``invalid_rank``)."""

    code = "invalid_rank"


class RankUnavailableError(DpcoordError):
    """A pin or bootstrap room on a rank that is not routable (``rank_unavailable``)."""

    code = "rank_unavailable"


class NoEngineAvailableError(DpcoordError):
    """No rank is up or stale (``no_engine_available``)."""

    code = "no_engine_available"


class TooLargeError(DpcoordError):
    """``n`` above ``max_batch``, or a payload above ``max_message_bytes`` (``too_large``)."""

    code = "too_large"


class UnreachableError(DpcoordError):
    """Client side: no dpcoord endpoint answered within the timeout, and the call
    has no local fallback (``state``, ``ping``, or ``route`` before any rank is known)."""

    code = "unreachable"


class ProtocolError(DpcoordError):
    """Client side: dpcoord's reply broke the wire contract (not a v1 map, wrong id)."""

    code = "protocol"


ERRORS: dict[str, type[DpcoordError]] = {
    cls.code: cls
    for cls in (
        BadRequestError,
        UnsupportedVersionError,
        UnknownOpError,
        InvalidRankError,
        RankUnavailableError,
        NoEngineAvailableError,
        TooLargeError,
    )
}


def error_from_reply(reply: dict) -> DpcoordError:
    """The exception for an ``ok: false`` reply."""
    epoch = reply.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        epoch = None
    err = reply.get("error")
    if not isinstance(err, dict):
        return ProtocolError(message=f"refusal without an error map: {reply!r}", id=reply.get("id"), epoch=epoch)
    code = err.get("code")
    message = err.get("message") or ""
    if not isinstance(code, str):
        return ProtocolError(message=f"refusal without a string code: {reply!r}", id=reply.get("id"), epoch=epoch)
    cls = ERRORS.get(code, DpcoordError)
    return cls(code, str(message), reply.get("id"), epoch)
