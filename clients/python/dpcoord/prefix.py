"""dpcoord's block keys (docs/PROTOCOL.md §11a), computed client-side.

A prompt of ``block_size``-token blocks has one key per *whole* block, each
covering the whole prefix up to it::

    seed   = xxh3_64(b"dpcoord-kv-2\\0" + le_u64(len(lora)) + lora
                     + le_u64(len(salt)) + salt, seed=0)
    key[0] = xxh3_64(le_u32(tokens[0:B]), seed=seed)
    key[i] = xxh3_64(le_u32(tokens[i*B:(i+1)*B]), seed=key[i-1])

``le_u32`` writes each token id as 4 little-endian bytes, ``le_u64(len(..))`` a
name's UTF-8 byte count as 8 (so names with NUL bytes stay apart: ``"a\\0"+""``
and ``"a"+"\\0"`` differ); an absent LoRA name or salt is the empty string. A
partial last block has no key. This is
dpcoord's own function (``crates/daemon/src/engines/prefix/keys.rs``), so a ``route`` or
``prefix`` query may carry these keys instead of the token ids.
"""

from __future__ import annotations

import sys
from array import array
from typing import Iterable, Sequence

import xxhash

__all__ = ["DEFAULT_BLOCK_SIZE", "TOKENS_PER_KEY", "block_keys", "chain_seed"]

#: The block size dpcoord keys prompts in before a KV event has taught it the
#: engines' (``state``'s ``kv_block_size`` is nil until then).
DEFAULT_BLOCK_SIZE = 16
#: ``block_keys`` may hold at most ``limits.max_prompt_tokens // TOKENS_PER_KEY`` keys.
TOKENS_PER_KEY = 16

_PREFIX = b"dpcoord-kv-2\0"
_xxh3 = xxhash.xxh3_64_intdigest


def chain_seed(lora: str | None = None, salt: str | None = None) -> int:
    """The seed of a chain: ``xxh3_64(b"dpcoord-kv-2\\0" + le_u64(len(lora)) + lora +
    le_u64(len(salt)) + salt)``, lengths in UTF-8 bytes."""
    lora_b, salt_b = _utf8("lora", lora), _utf8("salt", salt)
    return _xxh3(_PREFIX + _le_u64(len(lora_b)) + lora_b + _le_u64(len(salt_b)) + salt_b, seed=0)


def _le_u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def block_keys(
    tokens: Iterable[int], block_size: int, lora: str | None = None, salt: str | None = None
) -> list[int]:
    """The chained keys of every whole block of ``tokens``, identical to dpcoord's.

    ``tokens`` are token ids in ``0..2**32`` (a list, an ``array('I')``, any
    iterable of ints); ``block_size`` is the engines' KV block size (dpcoord's
    ``kv_block_size``, or 16 while it has none). Raises ``ValueError`` for a
    block size below 1 or a token id out of range, ``TypeError`` for a
    non-integer token or a ``lora``/``salt`` that is not a string.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an integer, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    data = memoryview(_le_u32(tokens))
    step = 4 * block_size
    key = chain_seed(lora, salt)
    keys = []
    for start in range(0, len(data) - step + 1, step):
        key = _xxh3(data[start : start + step], seed=key)
        keys.append(key)
    return keys


def _utf8(name: str, value: str | None) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    return value.encode()


def _le_u32(tokens: Iterable[int]) -> bytes:
    """The token ids as little-endian u32s."""
    if isinstance(tokens, array) and tokens.typecode in "IL" and tokens.itemsize == 4:
        packed = tokens
    else:
        try:
            packed = array("I", tokens)
        except OverflowError:
            bad = next((t for t in tokens if not 0 <= t < 2**32), None) if isinstance(tokens, Sequence) else None
            raise ValueError("token ids must be in 0..2^32" + (f", got {bad}" if bad is not None else "")) from None
        except TypeError as e:
            raise TypeError(f"token ids must be integers: {e}") from None
    if packed.itemsize != 4:  # pragma: no cover - no mainstream platform
        raise RuntimeError("array('I') is not 4 bytes on this platform")
    if sys.byteorder == "big":  # pragma: no cover
        packed = array(packed.typecode, packed)
        packed.byteswap()
    return packed.tobytes()
