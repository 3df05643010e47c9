"""The paper's baselines (policy/baselines.py), each on its own: round robin, random,
least request, least load, session affinity and the prefix-cache baseline."""

import json
import random
from collections import Counter
from collections.abc import Sequence

import pytest

from ext_proc.policy.baselines import SessionAffinityParams
from ext_proc.policy.catalog import make_policy
from ext_proc.prompt.parse import COMPLETIONS, parse_body
from ext_proc.vocab.types import Candidate, RouteRequest, Status
from tests.builders import BACKENDS, REGIONS, candidate, chat, make_router

# Every case's request: one of user alice's session.
ALICE = chat("hello world", user="alice", rid="r1")


def choose(policy: str, candidates: Sequence[Candidate], request: RouteRequest = ALICE) -> str:
    return make_policy(policy, random.Random(0)).choose(request, candidates, None).backend_id


# (case, policy, candidates, the backend it chooses)
CASES = [
    # round robin: its first choice is the first candidate it is given
    ("round_robin starts at the first", "round_robin", [candidate("b"), candidate("a")], "b"),
    # least request: the fewest requests in flight, whatever their tokens or the cache
    (
        "least_request: the fewest in flight",
        "least_request",
        [candidate("a", in_flight=3), candidate("b", in_flight=1), candidate("c", in_flight=2)],
        "b",
    ),
    (
        "least_request counts requests, not tokens",
        "least_request",
        [
            candidate("a", in_flight=1, in_flight_tokens=90_000),
            candidate("b", in_flight=2, in_flight_tokens=100),
        ],
        "a",
    ),
    (
        "least_request ignores the cache",
        "least_request",
        [
            candidate("a", in_flight=2, cached_tokens=5000),
            candidate("b", in_flight=1, uncached_tokens=5000),
        ],
        "b",
    ),
    # least load: the fewest prompt tokens in flight, whatever the request count or RTT
    (
        "least_load counts tokens, not requests",
        "least_load",
        [
            candidate("a", in_flight=1, in_flight_tokens=90_000),
            candidate("b", in_flight=5, in_flight_tokens=500),
        ],
        "b",
    ),
    (
        "least_load ignores the RTT",
        "least_load",
        [
            candidate("a", in_flight_tokens=100, rtt_ms=200.0),
            candidate("b", in_flight_tokens=200, rtt_ms=1.0),
        ],
        "a",
    ),
    # session affinity: the highest crc32(backend, crc32("alice")): c (3,995,502,048),
    # then b (2,569,123,190), then a (2,680,012)
    (
        "session_affinity: the session's highest hash",
        "session_affinity",
        [candidate("a"), candidate("b"), candidate("c")],
        "c",
    ),
    (
        "session_affinity: its backend gone, the next highest",
        "session_affinity",
        [candidate("a"), candidate("b")],
        "b",
    ),
    (
        "session_affinity: another backend gone, it stays, whatever the load",
        "session_affinity",
        [candidate("b", in_flight=0), candidate("c", in_flight=50)],
        "c",
    ),
    # the prefix-cache baseline: the longest cached prefix when it covers at least half
    # the prompt (min_fraction) and load is balanced (a spread of at most 4 in flight,
    # balance_abs, or the most loaded at most 1.5 x the least, balance_rel)
    (
        "prefix_cache follows a match of 60 %",
        "prefix_cache",
        [
            candidate("a", in_flight=3, cached_tokens=600, uncached_tokens=400),
            candidate("b", in_flight=0, uncached_tokens=1000),
        ],
        "a",
    ),
    (
        "prefix_cache follows a match of exactly half",
        "prefix_cache",
        [
            candidate("a", in_flight=2, cached_tokens=500, uncached_tokens=500),
            candidate("b", in_flight=0, uncached_tokens=1000),
        ],
        "a",
    ),
    (
        "prefix_cache: a match of 40 % is too little, least request",
        "prefix_cache",
        [
            candidate("a", in_flight=2, cached_tokens=400, uncached_tokens=600),
            candidate("b", in_flight=1, uncached_tokens=1000),
        ],
        "b",
    ),
    (
        "prefix_cache: 6 against 1 in flight is imbalanced, least request",
        "prefix_cache",
        [
            candidate("a", in_flight=6, cached_tokens=900, uncached_tokens=100),
            candidate("b", in_flight=1, uncached_tokens=1000),
        ],
        "b",
    ),
    (
        "prefix_cache: a spread of 4 is balanced",
        "prefix_cache",
        [
            candidate("a", in_flight=5, cached_tokens=900, uncached_tokens=100),
            candidate("b", in_flight=1, uncached_tokens=1000),
        ],
        "a",
    ),
    (
        "prefix_cache: 15 against 10 is balanced (not over 1.5 x)",
        "prefix_cache",
        [
            candidate("a", in_flight=15, cached_tokens=900, uncached_tokens=100),
            candidate("b", in_flight=10, uncached_tokens=1000),
        ],
        "a",
    ),
    (
        "prefix_cache: an empty prompt, least request",
        "prefix_cache",
        [candidate("a", in_flight=2), candidate("b", in_flight=1)],
        "b",
    ),
]


@pytest.mark.parametrize(
    ("case", "policy", "candidates", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_each_baselines_choice(
    case: str, policy: str, candidates: list[Candidate], expected: str
) -> None:
    assert choose(policy, candidates) == expected


def test_the_scores_say_what_each_baseline_counted() -> None:
    a = candidate("a", in_flight=2, in_flight_tokens=700, cached_tokens=300, uncached_tokens=200)
    b = candidate("b", in_flight=1, in_flight_tokens=900, uncached_tokens=500)
    rng = random.Random(0)
    scores = {
        name: make_policy(name, rng).choose(ALICE, [a, b], None).scores
        for name in ("least_request", "least_load", "prefix_cache", "round_robin", "random")
    }
    assert scores["least_request"] == {"a": 2.0, "b": 1.0}
    assert scores["least_load"] == {"a": 700.0, "b": 900.0}
    assert scores["prefix_cache"] == {"a": -300.0, "b": 0.0}  # a 60 % match: the cache
    assert scores["round_robin"] == scores["random"] == {}
    # an empty prompt has no share cached: least request
    empty = [candidate("a", in_flight=2), candidate("b", in_flight=1)]
    assert make_policy("prefix_cache", rng).choose(ALICE, empty, None).scores == {
        "a": 2.0,
        "b": 1.0,
    }


def test_equal_loads_are_drawn_at_random_never_the_busier() -> None:
    policy = make_policy("least_request", random.Random(0))
    tied = [candidate("a", in_flight=1), candidate("b", in_flight=1), candidate("c", in_flight=5)]
    got = Counter(policy.choose(ALICE, tied, None).backend_id for _ in range(200))
    assert set(got) == {"a", "b"} and min(got.values()) > 60


def test_round_robin_counts_its_calls_over_whatever_candidates_it_is_given() -> None:
    policy = make_policy("round_robin", random.Random(0))
    abc, ac, ab = ([candidate(b) for b in ids] for ids in (("a", "b", "c"), ("a", "c"), ("a", "b")))
    # calls 0, 1, 2, 3: the candidate at call % len(candidates)
    got = [policy.choose(ALICE, cands, None).backend_id for cands in (abc, ac, abc, ab)]
    assert got == ["a", "c", "c", "b"]


def test_random_draws_with_the_rng_it_is_given() -> None:
    abc = [candidate(b) for b in ("a", "b", "c")]
    policy = make_policy("random", random.Random(7))
    same = random.Random(7)
    assert [policy.choose(ALICE, abc, None).backend_id for _ in range(20)] == [
        same.choice(abc).backend_id for _ in range(20)
    ]


def completion(prompt: object, rid: str = "c1") -> RouteRequest:
    return RouteRequest(rid, parse_body(COMPLETIONS, json.dumps({"prompt": prompt}).encode()), None)


def test_session_affinity_keys_by_the_session_else_the_prompts_head() -> None:
    # the head: the first prefix_tokens (10) tokens, 4 bytes each for text
    policy = make_policy("session_affinity", random.Random(0), SessionAffinityParams(10))
    key = policy.affinity_key  # type: ignore[attr-defined]
    assert key(ALICE) == "alice"
    head = "x" * 40
    assert key(completion(head + "one tail")) == key(completion(head + "another"))
    assert key(completion(head)) != key(completion("y" + head[1:]))
    assert key(completion(head)).startswith("prompt:")
    ids = list(range(10))
    assert key(completion([*ids, 1, 2])) == key(completion([*ids, 3]))
    assert key(completion(ids)) != key(completion([99, *ids[1:]]))
    assert key(RouteRequest("no-body", None, None)) == "no-body"


# -- through a router ------------------------------------------------------------------------


def test_round_robin_cycles() -> None:
    router, _ = make_router("round_robin", seed=1)
    assert [router.decide(chat(rid=f"r{i}", stream=False)).backend for i in range(6)] == list(
        BACKENDS
    ) * 2


def test_least_request_spreads_then_follows_completions() -> None:
    router, _ = make_router("least_request", seed=1)
    first = [router.decide(chat(rid=f"r{i}", stream=False)).backend for i in range(3)]
    assert sorted(first) == sorted(BACKENDS)
    router.close("r1", Status.OK)
    assert router.decide(chat(rid="r3", stream=False)).backend == first[1]


def test_random_uses_every_backend() -> None:
    router, _ = make_router("random", seed=1)
    counts = Counter(router.decide(chat(rid=f"r{i}", stream=False)).backend for i in range(300))
    assert set(counts) == set(BACKENDS) and min(counts.values()) > 60


def test_session_affinity_is_sticky_and_spreads_sessions() -> None:
    r, _ = make_router("session_affinity", backends=REGIONS)
    first = {u: r.decide(chat("hi", user=u)).backend for u in (f"user{i}" for i in range(30))}
    again = {u: r.decide(chat("different text", user=u)).backend for u in first}
    assert first == again
    assert len(set(first.values())) == 3


def test_prefix_cache_baseline_follows_the_match_until_imbalanced() -> None:
    r, _ = make_router("prefix_cache", backends=REGIONS)
    doc = "shared document text. " * 300
    home = r.decide(chat(doc)).backend
    assert r.decide(chat(doc + "q1")).backend == home
    for i in range(8):  # pile requests on home: imbalance
        r.decide(RouteRequest(f"pile{i}", chat(doc + f"q{i}").llm, None))
    assert r.decide(chat(doc + "last")).backend != home
