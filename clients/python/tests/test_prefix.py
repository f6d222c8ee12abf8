"""Block keys computed in Python equal dpcoord's, and route takes a prompt.

The oracle is the real daemon: in ``cache_aware`` approximate mode a routed
prompt is recorded under dpcoord's own keys for the rank it picked, and the
health socket's ``prefix`` op tells which ranks hold the leading blocks of a
prompt given as ``tokens`` (dpcoord hashes) or as ``block_keys`` (Python
hashed). Before any KV event dpcoord keys in blocks of 16, so other block
sizes are checked against a plain re-implementation and against known answers
printed by dpcoord's ``chain_keys`` (crates/daemon/src/engines/prefix/keys.rs).
"""

from __future__ import annotations

import asyncio
import random
import struct
from array import array

import pytest
import xxhash

import dpcoord
from conftest import bring_up
from dpcoord import AsyncRouterClient, BadRequestError, RouterClient, TooLargeError, block_keys, chain_seed

BS = 16  # dpcoord's block size before any KV event


def reference_keys(tokens, block_size, lora=None, salt=None):
    """The documented algorithm, spelled out token by token (PROTOCOL.md §11a)."""
    lora_b, salt_b = (lora or "").encode(), (salt or "").encode()
    seed = xxhash.xxh3_64(
        b"dpcoord-kv-2\0" + struct.pack("<Q", len(lora_b)) + lora_b + struct.pack("<Q", len(salt_b)) + salt_b
    ).intdigest()
    keys, parent = [], seed
    for b in range(len(tokens) // block_size):
        data = b"".join(struct.pack("<I", t) for t in tokens[b * block_size : (b + 1) * block_size])
        parent = xxhash.xxh3_64(data, seed=parent).intdigest()
        keys.append(parent)
    return keys


# dpcoord's own `chain_keys(chain_seed(lora, salt), tokens, bs)` (keys.rs's tests
# hold SEED_NONE and the adapter-a/tenant-7 row too)
# (a scratch crate depending on this repository); `ramp(n)` is 0..n and
# `golden(n)` is i * 2654435761 mod 2^32.
def ramp(n):
    return list(range(n))


def golden(n):
    return [(i * 2654435761) % 2**32 for i in range(n)]


KNOWN = [
    # (tokens, block_size, lora, salt, keys)
    ([], 16, None, None, []),
    ([1, 2, 3, 256, 9], 2, None, None, [1053160952133747453, 3605727806782872156]),
    (ramp(16), 16, None, None, [3886069548371247]),
    (ramp(40), 16, "adapter-a", None, [12848939307511014517, 14804178159030767090]),
    (ramp(40), 16, None, "tenant-7", [13649824357302183897, 13458631472837062628]),
    (ramp(40), 16, "adapter-a", "tenant-7", [16454697871714256322, 10572151411282607089]),
    (
        [2**32 - 1 - i for i in range(7)],
        1,
        "",
        "é",
        [
            15283194270881185250,
            4973029467730800644,
            5411383493546627996,
            12965521285328863513,
            17026343221360538970,
            14807281371888163289,
            8302974961919139907,
        ],
    ),
    (golden(200), 64, None, None, [6444640874675056082, 8028085148064365389, 8799355993842623776]),
    (golden(200), 100, "x", "y", [2227731944577235152, 8273427659077576165]),
]
SEED_NONE = 1889521019268027495


def test_known_answers_from_dpcoords_chain_keys():
    assert chain_seed() == chain_seed(None, None) == chain_seed("", "") == SEED_NONE
    for tokens, bs, lora, salt, keys in KNOWN:
        assert block_keys(tokens, bs, lora, salt) == keys, (len(tokens), bs, lora, salt)
        assert reference_keys(tokens, bs, lora, salt) == keys


def test_names_with_nul_bytes_have_seeds_of_their_own():
    # Length prefixes: where a NUL falls cannot move bytes from one name to the other.
    pairs = [("a\0", ""), ("a", "\0"), ("", "a\0"), ("\0a", ""), ("a", ""), ("", "a"), ("\0", "\0")]
    assert len({chain_seed(lora, salt) for lora, salt in pairs}) == len(pairs)


def test_keys_equal_the_reference_for_any_block_size():
    rng = random.Random(1313)
    for case in range(400):
        tokens = random_tokens(rng, rng.choice([0, 1, 5, 17, 64, 100, 257]))
        bs = rng.choice([1, 2, 3, 7, 16, 32, 63, 64, 65, 128, 256])
        lora, salt = random_name(rng), random_name(rng)
        keys = block_keys(tokens, bs, lora, salt)
        assert keys == reference_keys(tokens, bs, lora, salt), case
        assert len(keys) == len(tokens) // bs
        # Any sized iterable of ints gives the same keys (an array('I'), a tuple, a generator).
        assert block_keys(array("I", tokens), bs, lora, salt) == keys
        assert block_keys(tuple(tokens), bs, lora=lora, salt=salt) == keys
        assert block_keys((t for t in tokens), bs, lora, salt) == keys
        # A key covers its whole prefix: the keys of a prefix are a prefix of the keys.
        cut = rng.randrange(len(tokens) + 1)
        assert block_keys(tokens[:cut], bs, lora, salt) == keys[: cut // bs]


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        block_keys([1, 2], 0)
    with pytest.raises(TypeError):
        block_keys([1, 2], 16.0)
    with pytest.raises(ValueError, match=r"0\.\.2\^32, got 4294967296"):
        block_keys([1, 2**32], 1)
    with pytest.raises(ValueError, match=r"0\.\.2\^32, got -1"):
        block_keys([-1], 1)
    with pytest.raises(TypeError, match="must be integers"):
        block_keys([1.5], 1)
    with pytest.raises(TypeError, match="lora must be a string"):
        block_keys([1], 1, lora=b"x")
    assert dpcoord.block_keys is block_keys


# -- against the daemon -------------------------------------------------------------------


def random_tokens(rng, n):
    pick = rng.randrange(3)
    if pick == 0:
        return [rng.randrange(2**32) for _ in range(n)]
    if pick == 1:
        return [rng.randrange(50_000) for _ in range(n)]
    return [rng.choice([0, 1, 2**31, 2**32 - 1]) for _ in range(n)]


def random_name(rng):
    return rng.choice([None, None, "", "a", "lora-7", "tenant/é", "a\0b", "x" * rng.randrange(1, 40)])


def held(recorded, keys):
    """How many of ``keys``, from the first, a rank's recorded key set holds."""
    m = 0
    while m < len(keys) and keys[m] in recorded:
        m += 1
    return m


@pytest.fixture
def cache_aware(start_daemon, engines, tmp_path):
    """A 4-rank ``cache_aware`` dpcoord in approximate mode, every rank up, and a client."""
    config = tmp_path / "cache_aware.toml"
    config.write_text('[routing]\npolicy = "cache_aware"\nprefix_mode = "approximate"\npending_ttl_ms = 60000\n')
    d = start_daemon("--config", str(config), "--dp-size", "4")
    bring_up(d, engines, [0, 1, 2, 3])
    c = RouterClient(d.route, d.health, timeout_ms=5000)
    yield d, c
    c.close()


def prefix(c, **prompt):
    reply = c.call("prefix", channel="health", **prompt)
    return reply["blocks"], reply["matched"]


def test_python_keys_are_dpcoords_keys(cache_aware):
    """Each case routes a random prompt (as tokens, or as keys computed here) and
    asks ``prefix`` with the other form: the picked ranks hold every whole block,
    and each rank holds exactly what a model of the placements so far says."""
    d, c = cache_aware
    assert d.state()["kv_block_size"] is None  # no KV event: dpcoord keys in 16s
    rng = random.Random(20260613)
    recorded = {r: set() for r in range(4)}  # rank -> keys placed there, computed here
    # The known answers in blocks of 16: dpcoord records its keys for the prompt's
    # tokens, and the known keys find them.
    for tokens, bs, lora, salt, keys in KNOWN:
        if bs == BS and keys:
            [r] = c.route(tokens=tokens, lora=lora, salt=salt)
            recorded[r].update(keys)
            assert prefix(c, block_keys=keys) == (len(keys), [held(recorded[x], keys) for x in range(4)])
            assert prefix(c, block_keys=keys)[1][r] == len(keys)
    for case in range(300):
        n_tokens = rng.choice([0, 3, 15, 16, 17, 31, 32, 48, 100, 160, rng.randrange(1000), 4096])
        tokens = random_tokens(rng, n_tokens)
        lora, salt = random_name(rng), random_name(rng)
        n = rng.choice([1, 1, 1, 2, 3])
        keys = block_keys(tokens, BS, lora, salt)
        assert keys == reference_keys(tokens, BS, lora, salt)
        send = rng.choice(["tokens", "keys"])
        ranks = c.route(n=n, tokens=tokens, lora=lora, salt=salt, send=send, id=case)
        assert c.last_source == "dpcoord"
        for r in ranks:
            recorded[r].update(keys)
        expected = [held(recorded[r], keys) for r in range(4)]
        # Every picked rank holds every whole block; the others hold what the model says.
        assert all(expected[r] == len(keys) for r in ranks)
        ctx = (case, n_tokens, lora, salt, send, ranks)
        assert prefix(c, block_keys=keys) == (len(keys), expected), ctx
        assert prefix(c, tokens=tokens, lora=lora, salt=salt) == (len(keys), expected), ctx
        if not keys:
            continue
        # A wrong key matches no further than the first block it changes.
        i = rng.randrange(n_tokens - n_tokens % BS)
        changed = list(tokens)
        changed[i] = (changed[i] + 1 + rng.randrange(2**32 - 1)) % 2**32
        wrong = block_keys(changed, BS, lora, salt)
        assert wrong[: i // BS] == keys[: i // BS] and wrong[i // BS] != keys[i // BS]
        got = prefix(c, block_keys=wrong)
        assert got == (len(keys), [held(recorded[r], wrong) for r in range(4)]), ctx
        assert prefix(c, tokens=changed, lora=lora, salt=salt) == got, ctx
        # Another salt starts another chain.
        other_salt = (salt or "") + "!"
        other = block_keys(tokens, BS, lora, other_salt)
        assert other[0] != keys[0]
        assert prefix(c, block_keys=other) == (len(keys), [held(recorded[r], other) for r in range(4)]), ctx
    # The model is not vacuous: ranks hold many blocks, and more than one rank was used.
    assert sum(len(v) > 100 for v in recorded.values()) >= 2


def test_route_with_a_prompt_and_keys_sent(cache_aware):
    d, c = cache_aware
    tokens = list(range(1000, 1040))  # 2 whole blocks and 8 tokens
    keys = block_keys(tokens, BS, "lora", "salt")
    assert c.kv_block_size is None
    [r] = c.route(tokens=tokens, lora="lora", salt="salt", send="keys")
    assert c.kv_block_size is None  # dpcoord has no block size yet: keys in 16s
    assert c.block_keys(tokens, lora="lora", salt="salt") == keys
    _, matched = prefix(c, tokens=tokens, lora="lora", salt="salt")
    assert matched == [2 if x == r else 0 for x in range(4)]
    # send="keys" also sends the true prompt length (40, not 2 blocks * 16):
    # the placement is pending with 40 prompt tokens on that rank.
    assert d.state()["ranks"][r]["load"] == 40.0
    # The caller's block_keys go as given; the caller's prompt_tokens win.
    [r2] = c.route(block_keys=keys, prompt_tokens=7)
    assert d.state()["ranks"][r2]["load"] == (40.0 if r2 == r else 0.0) + 7.0
    # Old calls are unchanged; a batch shares one prompt.
    assert len(c.route(n=3, tokens=tokens, lora="lora", salt="salt")) == 3


def test_prompt_errors_are_typed(cache_aware):
    d, c = cache_aware
    before = d.metric("dpcoord_route_errors_total", 'code="bad_request"')
    # Refused here, before anything is sent, as dpcoord would.
    with pytest.raises(BadRequestError, match="not both"):
        c.route(tokens=[1], block_keys=[2])
    with pytest.raises(BadRequestError, match="already in `block_keys`"):
        c.route(block_keys=[2], salt="s")
    with pytest.raises(BadRequestError, match="go with `tokens`"):
        c.route(lora="a")
    with pytest.raises(BadRequestError, match="`lora` must be a string"):
        c.route(tokens=[1], lora=3)
    with pytest.raises(BadRequestError, match="0..2\\^32"):
        c.route(tokens=[2**32], send="keys")
    with pytest.raises(ValueError, match="send must be"):
        c.route(tokens=[1], send="hashes")
    with pytest.raises(TooLargeError, match="`tokens` has 262145 elements, above the limit of 262144"):
        c.route(tokens=[0] * 262_145)
    with pytest.raises(TooLargeError, match="`block_keys` has 16385 elements, above the limit of 16384"):
        c.route(block_keys=[0] * 16_385)
    assert d.metric("dpcoord_route_errors_total", 'code="bad_request"') == before
    # Refused by dpcoord, raised as the typed error of its code.
    with pytest.raises(BadRequestError, match=r"`tokens\[1\]` must be a token id in 0..2\^32, got -1") as e:
        c.route(tokens=[1, -1])
    assert e.value.code == "bad_request"
    with pytest.raises(BadRequestError, match=r"`block_keys\[0\]` must be an unsigned 64-bit key"):
        c.route(block_keys=[-5])
    # A client that does not know dpcoord's limit is lower: dpcoord answers too_large.
    lax = RouterClient(d.route, d.health, timeout_ms=5000, max_prompt_tokens=1 << 24)
    try:
        with pytest.raises(TooLargeError) as e:
            lax.route(block_keys=[0] * 16_385)
        assert e.value.code == "too_large" and "above the limit of 16384" in e.value.message
        with pytest.raises(TooLargeError, match="max_message_bytes|bytes"):
            lax.route(tokens=[2**32 - 1] * 20_000)  # 100 kB: above the 64 KiB message limit
    finally:
        lax.close()
    assert d.metric("dpcoord_route_errors_total", 'code="bad_request"') == before + 2


def test_the_block_size_is_learned_from_state_and_refreshed_while_nil(cache_aware):
    d, c = cache_aware
    c.block_size_refresh_s = 3600.0
    asked = []
    real = c._ask

    def counting(channel, query, fast, skip=None):
        if query.get("op") == "state":
            asked.append(query["op"])
        return (yield from real(channel, query, fast, skip))

    c._ask = counting
    c.block_keys([1] * 16)
    assert asked == ["state"]  # the first keys ask for the block size
    c.block_keys([1] * 16)
    c.route(tokens=[1] * 16, send="keys")
    assert asked == ["state"]  # nil, and asked less than block_size_refresh_s ago
    c.block_size_refresh_s = 0.0
    c.block_keys([1] * 16)
    assert asked == ["state", "state"]  # nil and due: asked again
    # A learned size is kept (dpcoord never changes it while it runs) and used.
    c._local.observe_state({**d.state(), "kv_block_size": 4})
    assert c.kv_block_size == 4
    assert c.block_keys(list(range(10))) == block_keys(list(range(10)), 4)
    assert asked == ["state", "state"]


def test_async_client_takes_a_prompt(cache_aware):
    d, _ = cache_aware
    tokens = list(range(7, 7 + 64))
    keys = block_keys(tokens, BS, None, "s")

    async def main():
        async with AsyncRouterClient(d.route, d.health, timeout_ms=5000) as c:
            assert await c.block_keys(tokens, salt="s") == keys
            [r] = await c.route(tokens=tokens, salt="s", send="keys")
            [r2] = await c.route(block_keys=keys, n=1)
            with pytest.raises(BadRequestError):
                await c.route(tokens=tokens, block_keys=keys)
            return r, r2

    r, r2 = asyncio.run(main())
    with RouterClient(d.route, d.health, timeout_ms=5000) as c:
        _, matched = prefix(c, tokens=tokens, salt="s")
    assert matched == [4 if x in (r, r2) else 0 for x in range(4)]


def test_a_prompt_in_fallback(tmp_path):
    """No dpcoord answers: keys are computed in 16s without waiting on the down
    endpoint twice, the route answers locally, and the prompt checks still hold."""
    c = RouterClient(f"ipc://{tmp_path}/nobody", timeout_ms=200, dp_size=2)
    waited = []
    real = c._io_exchange

    def exchange(ep, payload):
        waited.append(ep.address)
        return real(ep, payload)

    c._io_exchange = exchange
    try:
        assert c.route(tokens=list(range(40)), salt="s", send="keys") == [0]
        assert c.route(tokens=list(range(40)), send="keys") == [1]
        assert c.route(block_keys=[1, 2], n=2) == [0, 1]
        assert c.last_source == "fallback" and c.fallbacks == 3
        # One wait in all: the first state query found no answer and marked the
        # endpoint down; calls after it do not wait on it (a probe stays in flight).
        assert waited == [f"ipc://{tmp_path}/nobody"]
        assert c.block_keys(list(range(40)), salt="s") == block_keys(list(range(40)), 16, None, "s")
        with pytest.raises(BadRequestError, match="not both"):
            c.route(tokens=[1], block_keys=[1])
        with pytest.raises(TooLargeError):
            c.route(tokens=[0] * 262_145, send="keys")
        assert c.fallbacks == 3
    finally:
        c.close()
