"""The gorgo policies (policy/gorgo.py: gorgo, gorgo_time3, gorgo_tokens) on a router:
what they choose from the terms, stalls, caches, sessions, health and token-id prompts.
The cost functions themselves: tests/unit/estimate/test_cost.py; each term:
tests/unit/core/terms/."""

import zlib
from collections import Counter

import numpy as np
import pytest

from ext_proc.core.router import Router
from ext_proc.estimate.cost import time_cost_ms
from ext_proc.prompt.parse import CHAT, COMPLETIONS, parse_body
from ext_proc.vocab.params import ConfigError
from ext_proc.vocab.types import RouteRequest, Status, Weights
from tests.builders import REGIONS, chat, load, make_config, make_router


@pytest.mark.parametrize("ttft_model", ["replay", "profile"])
def test_a_stalled_backend_is_avoided_while_it_answers_probes(ttft_model: str) -> None:
    r, clock = make_router("gorgo", backends=REGIONS, routing={"ttft_model": ttft_model})
    warm = r.decide(chat("warm-up"))
    r.first_byte(warm.request_id)  # first bytes are observed: lateness means something
    r.close(warm.request_id, Status.OK)
    stuck = r.decide(chat("first"))
    assert stuck.backend == "near"
    clock.advance(0.3)
    assert r.decide(chat("second")).backend == "near"  # not late yet
    clock.advance(1.0)  # the first request is over a second late: near is stalled
    assert r.decide(chat("third")).backend != "near"
    r.first_byte(stuck.request_id)  # it answers at last
    r.first_byte(r.recent.decisions[-2].request_id)
    assert r.decide(chat("fourth")).backend == "near"


def test_lateness_counts_only_for_streams_and_once_first_bytes_are_observed() -> None:
    r, clock = make_router("gorgo", backends=REGIONS)
    stuck = r.decide(chat("first"))
    clock.advance(2.0)  # no first byte ever seen: maybe no observer, lateness is no signal
    assert r.decide(chat("second")).backend == "near"
    r.first_byte(stuck.request_id)
    for d in r.recent.decisions:
        r.first_byte(d.request_id)
        r.close(d.request_id, Status.OK)
    body = b'{"messages": [{"role": "user", "content": "x"}], "stream": false}'
    whole = r.decide(RouteRequest("whole", parse_body(CHAT, body), None))
    assert whole.backend == "near"
    clock.advance(2.0)  # a non-streamed answer comes whole, at the end: not late
    assert r.decide(chat("third")).backend == "near"


def test_equal_caches_and_load_the_nearest_wins() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    for i in range(5):  # idle fleet, nothing cached anywhere: the nearest region
        d = r.decide(chat(f"unique prompt {i} " * 50))
        assert d.backend == "near"
        near = next(c for c in d.candidates if c.backend_id == "near")
        assert (near.rtt_ms, near.queue_ms, near.cached_tokens) == (1, 0, 0)
        r.close(d.request_id, Status.OK)
    # queued prefill on near: once it outweighs the RTT gap, the next region takes over
    for i in range(20):
        r.decide(chat(f"long document {i} " * 3000))
    assert Counter(d.backend for d in r.recent.decisions)["mid"] > 0


def test_a_session_follows_its_cache_unless_that_backend_is_overloaded() -> None:
    r, _clock = make_router("gorgo", backends=REGIONS)
    history = "a long shared conversation so far. " * 400  # ~3.5k tokens
    first = r.decide(chat(history))
    r.first_byte(first.request_id)
    r.close(first.request_id, Status.OK)
    # second turn: the prefix is cached where the first went; even if that is not the
    # nearest region, the cached prefill it saves outweighs the RTT
    r.inputs.record_probe("near", 150)  # make "near" no longer the obvious choice
    second = r.decide(chat(history + " and one more question"))
    assert second.backend == first.backend
    held = next(c for c in second.candidates if c.backend_id == first.backend)
    assert held.cached_tokens >= 3000 and held.uncached_tokens < 600
    r.close(second.request_id, Status.OK)
    # now that backend has 30 s of prefill queued: the session moves
    for i in range(3):
        load(r, f"load{i}", first.backend, 40_000, prefill_ms=10_000)
    third = r.decide(chat(history + " and yet another question"))
    assert third.backend != first.backend
    held = next(c for c in third.candidates if c.backend_id == first.backend)
    assert held.queue_ms > 25_000


def test_suspect_backends_are_not_chosen_while_others_are_healthy() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    for _ in range(2):
        r.inputs.record_probe("near", None)
    assert r.backends["near"].health.suspect
    assert all(r.decide(chat(f"x{i}")).backend != "near" for i in range(20))
    r.inputs.record_probe("near", 1.2)  # one success clears it
    assert not r.backends["near"].health.suspect
    for name in ("mid", "far"):
        r.inputs.record_probe(name, None)
        r.inputs.record_probe(name, None)
    r.inputs.record_probe("near", None)
    r.inputs.record_probe("near", None)
    # every backend suspect: still route (to someone) rather than fail
    assert r.decide(chat("y")).backend in {"near", "mid", "far"}


def test_probes_smooth_rtt_after_replacing_the_prior() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    r.inputs.record_probe("mid", 100)
    assert r.backends["mid"].health.rtt_ms == 100  # first sample replaces the prior
    r.inputs.record_probe("mid", 200)
    assert r.backends["mid"].health.rtt_ms == pytest.approx(0.3 * 200 + 0.7 * 100)


def test_near_ties_are_broken_at_random() -> None:
    r, _ = make_router(
        "gorgo",
        backends=[
            {"id": f"b{i}", "address": f"127.0.0.1:{i + 1}", "rtt_prior_ms": 50} for i in range(3)
        ],
    )
    counts = Counter()
    for i in range(300):
        d = r.decide(chat(f"p{i}"))
        counts[d.backend] += 1
        r.close(d.request_id, Status.OK)
    assert set(counts) == {"b0", "b1", "b2"} and min(counts.values()) > 60


def test_paper_token_form_uses_its_own_weights() -> None:
    r, _ = make_router("gorgo_tokens", backends=REGIONS)
    d = r.decide(chat("hello " * 100))
    assert d.policy == "gorgo_tokens"
    near = next(c for c in d.candidates if c.backend_id == "near")
    assert d.scores["near"] == pytest.approx(0.5 * 1 + near.uncached_tokens + 0.1 * 0)


def test_decisions_explain_every_term_without_the_prompt() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    r.decide(chat("secret words here " * 10))
    snap = r.snapshot()
    (d,) = snap["recent_decisions"]
    for c in d["candidates"]:
        assert {"rtt_ms", "queue_ms", "prefill_ms", "cached_tokens", "score"} <= set(c)
    assert "secret" not in repr(snap)
    assert snap["weights"] == {"rtt": 1.0, "queue": 1.0}


def completion(prompt: object, rid: str) -> RouteRequest:
    import json

    return RouteRequest(rid, parse_body(COMPLETIONS, json.dumps({"prompt": prompt}).encode()), None)


def test_token_id_prompts_are_routed_by_their_exact_length_and_prefix() -> None:
    r, clock = make_router("gorgo", backends=REGIONS, policies={"gorgo": {"tie_fraction": 0.0}})
    ids = list(range(1, 3001))  # 3,000 tokens: 11 full blocks of 256
    d1 = r.decide(completion(ids, "a"))
    assert d1.input_tokens == 3000
    r.close("a", Status.OK)
    clock.advance(1)
    d2 = r.decide(completion([*ids, 7, 7, 7], "b"))  # the same ids, extended
    chosen = d2.chosen
    assert d2.backend == d1.backend and chosen.cached_tokens == 11 * 256
    assert chosen.cached_tokens + chosen.uncached_tokens == 3003


def test_a_batch_is_matched_prompt_by_prompt_not_as_one_joined_prompt() -> None:
    r, clock = make_router("gorgo", backends=REGIONS, policies={"gorgo": {"tie_fraction": 0.0}})
    a, b = "first document " * 400, "second document " * 400  # ~1,500 / 1,600 tokens
    for i, doc in enumerate((a, b)):
        r.decide(completion(doc, f"warm{i}"))
        r.close(f"warm{i}", Status.OK)
    clock.advance(1)
    batch = r.decide(completion([a, b], "batch"))
    c = batch.chosen
    # each prompt's own prefix is cached (all but its partial last block)
    per_prompt = [(len(p.encode()) // 4 // 256) * 256 for p in (a, b)]
    assert c.cached_tokens == sum(per_prompt) > 0
    assert c.cached_tokens + c.uncached_tokens == batch.input_tokens
    joined = r.decide(completion(a + b, "joined"))  # one prompt: only a's blocks lead it
    assert joined.chosen.cached_tokens < c.cached_tokens


# -- what a decision does to the others (issue 15) ------------------------------------------

# Two backends at the same RTT: `busy` and `idle`.
TWINS = (
    {"id": "busy", "address": "127.0.0.1:1", "rtt_prior_ms": 10},
    {"id": "idle", "address": "127.0.0.1:2", "rtt_prior_ms": 10},
)


def decoding_on(r: Router, backend: str, n: int) -> None:
    """n requests past their first token on `backend` (nothing owed to prefill)."""
    for i in range(n):
        rid = f"{backend}-dec{i}"
        load(r, rid, backend, 2000, 300, prefill_ms=200, decoding=True)


def test_a_long_uncached_prompt_avoids_the_backend_decoding_many() -> None:
    # busy decodes 12 requests and owes no prefill; idle still owes 1 s of prefill to one
    # request. For the newcomer's own TTFT busy is 1 s better (beyond gorgo_time3's 20 %
    # band), but its ~20k-token prefill (2.3 s) would stall all 12 decodes.
    long_prompt = chat("a long uncached document " * 3200)
    for policy, expected in (("gorgo", "idle"), ("gorgo_time3", "busy")):
        r, clock = make_router(policy, backends=TWINS)
        decoding_on(r, "busy", 12)
        load(r, "owed", "idle", 4000, 300, prefill_ms=1000)
        clock.advance(0.01)
        d = r.decide(long_prompt)
        busy = next(c for c in d.candidates if c.backend_id == "busy")
        idle = next(c for c in d.candidates if c.backend_id == "idle")
        assert busy.queue_ms < 50 and idle.queue_ms > 990
        assert busy.prefill_ms > 2000
        assert busy.term("decode_stall") == pytest.approx(12 * busy.prefill_ms)
        assert idle.term("decode_stall") == pytest.approx(idle.prefill_ms)
        assert d.backend == expected, policy
    # a short prompt stalls the decodes for a few ms: gorgo takes the nearer one
    r, clock = make_router("gorgo", backends=TWINS)
    r.inputs.record_probe("idle", 400.0)
    decoding_on(r, "busy", 12)
    assert r.decide(chat("hi")).backend == "busy"


def test_the_overtake_weight_names_what_replaced_it() -> None:
    with pytest.raises(ConfigError, match=r"policies.gorgo.overtake_weight: moved to routing.pace"):
        make_config("gorgo", policies={"gorgo": {"overtake_weight": 1.0}})


def test_a_nearly_full_kv_pool_is_priced_and_avoided() -> None:
    r, _clock = make_router("gorgo", backends=TWINS)
    capacity = r.backends["busy"].prefix.capacity_blocks * r.cfg.routing.block_tokens
    # busy holds 92 % of its KV in 4 decoding requests, idle nothing
    for i in range(4):
        load(r, f"big{i}", "busy", capacity * 23 // 100 - 200, 200, decoding=True)
    d = r.decide(chat("a question " * 200))
    busy = next(c for c in d.candidates if c.backend_id == "busy")
    assert busy.term("kv") > 0 and busy.queue_ms < busy.term(
        "kv"
    )  # full pool: not yet; margin: yes
    assert next(c for c in d.candidates if c.backend_id == "idle").term("kv") == 0
    assert d.backend == "idle"


def test_gorgo_time3_is_the_three_term_form_and_reproduces_the_old_gorgo() -> None:
    from loadgen.sim.settings import SimSettings
    from loadgen.sim.simulate import simulate
    from loadgen.traces.synthetic import synthetic

    r, _ = make_router("gorgo_time3", backends=REGIONS)
    d = r.decide(chat("hello " * 3000))
    for c in d.candidates:
        assert d.scores[c.backend_id] == time_cost_ms(
            Weights(1.0, 1.0), c.rtt_ms, c.queue_ms, c.prefill_ms
        )
    # a loaded run: the very choices `gorgo` made before it priced what it does to the
    # others (issue 15), and the same tail (before dispatch pacing, too)
    trace = synthetic(
        sessions=40, turns=5, rate_rps=12.0, turn_tokens=3000, output_tokens=200, seed=3
    )
    unpaced = {"routing": {"pace_sigmas": 0, "ttft_model": "profile"}}
    res = simulate(trace, SimSettings(policy="gorgo_time3", router=unpaced))
    choices = ",".join(q.backend for q in res.requests)
    assert zlib.crc32(choices.encode()) == 394211401
    ttft = sorted(q.ttft_ms or 0.0 for q in res.requests)
    assert float(np.percentile(ttft, 95)) == pytest.approx(26539.438, abs=1e-3)
    # and the default gorgo, pricing what each prefill does to the others, is far ahead
    new = simulate(trace, SimSettings(policy="gorgo"))
    assert np.percentile([q.ttft_ms for q in new.requests], 95) < 0.5 * np.percentile(ttft, 95)
    assert np.percentile([q.e2e_ms for q in new.requests], 95) < np.percentile(
        [q.e2e_ms for q in res.requests], 95
    )
