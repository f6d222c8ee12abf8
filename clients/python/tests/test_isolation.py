"""The isolation invariant, seen through the client: for the same engine stats,
the user answers are the same with and without health queries interleaved."""

from __future__ import annotations

import pytest

from conftest import bring_up, eventually
from dpcoord import RouterClient

# Static, uneven engine load, so load-aware policies have something to weigh.
LOAD = {
    0: dict(waiting=3, running=2, received=9, finished=4, failed=0),
    1: dict(waiting=0, running=1, received=5, finished=4, failed=0),
    2: dict(waiting=1, running=0, received=2, finished=1, failed=0),
    3: dict(waiting=0, running=0, received=0, finished=0, failed=0),
}

# The user side: a frontend's route calls of every form.
USER = [
    dict(),
    dict(n=3),
    dict(prompt_tokens=700),
    dict(rank=2),
    dict(bootstrap_room=9),
    dict(session="alice"),
    dict(n=2, session="bob"),
    dict(),
    dict(n=5, prompt_tokens=10),
    dict(session="alice"),
    dict(rank=3, n=2),
    dict(),
] * 3

# The health side: every op a prober sends that must not move user routing.
HEALTH = [
    lambda c: c.health_route(),
    lambda c: c.health_route(rank=1),
    lambda c: c.health_route(bootstrap_room=6),
    lambda c: c.health_report(0, True),
    lambda c: c.call("ping", channel="health"),
    lambda c: c.call("state", channel="health"),
    lambda c: c.health_route(),
]


def run(start_daemon, engines, policy: str, interleave: bool) -> list[list[int]]:
    d = start_daemon("--dp-size", "4", "--policy", policy, "--pending-ttl-ms", "600000")
    e = bring_up(d, engines, list(LOAD))
    for rank, counts in LOAD.items():
        e.set(rank, **counts)

    def loaded():
        return all(r["counts"] == [LOAD[r["rank"]][k] for k in LOAD[0]] for r in d.state()["ranks"])

    eventually("engine stats applied", loaded)
    answers = []
    with RouterClient(d.route, d.health, timeout_ms=5000) as c:
        for i, kw in enumerate(USER):
            if interleave:
                for h in HEALTH[: 1 + i % len(HEALTH)]:
                    h(c)
            answers.append(c.route(**kw))
        assert c.fallbacks == 0 and c.health_fallbacks == 0
    assert d.stop() == 0
    return answers


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "least_tokens", "power_of_two"])
def test_user_answers_do_not_depend_on_health_traffic(start_daemon, engines, policy):
    plain = run(start_daemon, engines, policy, interleave=False)
    mixed = run(start_daemon, engines, policy, interleave=True)
    assert mixed == plain
    assert [len(r) for r in plain] == [kw.get("n", 1) for kw in USER]
    if policy == "round_robin":
        # Exact for the pure rotation: pins and rooms do not advance it.
        assert plain[:5] == [[0], [1, 2, 3], [0], [2], [1]]
