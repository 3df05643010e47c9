"""GORGO's cost, its features, and how the policies use them."""

import random
import zlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.core.learners import SETTLED_S
from ext_proc.core.router import Router
from ext_proc.estimate.cost import (
    PrefillModel,
    QueueItem,
    decode_stall_ms,
    estimate_queue_ms,
    kv_headroom_ms,
    time_cost_ms,
    token_cost,
)
from ext_proc.estimate.profile import load_profile
from ext_proc.prompt.parse import CHAT, COMPLETIONS, parse_body
from ext_proc.vocab.params import ConfigError
from ext_proc.vocab.types import RouteRequest, Status, Weights
from tests.builders import REGIONS, chat, load, make_config, make_router

PROFILE = load_profile()


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.05, 2),
    st.floats(0.05, 2),
    st.floats(0, 500),
    st.floats(0, 5000),
    st.floats(0, 5000),
    st.integers(0, 100_000),
    st.integers(0, 100_000),
    st.integers(0, 50_000),
)
def test_cost_never_falls_when_queue_or_uncached_tokens_grow(
    w_rtt: float, w_q: float, rtt: float, q1: float, q2: float, u1: int, u2: int, cached: int
) -> None:
    w = Weights(w_rtt, w_q)
    model = PrefillModel(PROFILE)
    lo_q, hi_q = sorted((q1, q2))
    lo_u, hi_u = sorted((u1, u2))
    p_lo, p_hi = model.prefill_ms(lo_u, cached), model.prefill_ms(hi_u, cached)
    assert p_lo <= p_hi
    assert time_cost_ms(w, rtt, lo_q, p_lo) <= time_cost_ms(w, rtt, hi_q, p_hi)
    assert token_cost(w, rtt, lo_u, int(lo_q)) <= token_cost(w, rtt, hi_u, int(hi_q))


def test_prefill_model_matches_the_profile_formula() -> None:
    m = PrefillModel(PROFILE)
    assert m.prefill_ms(10_000, 0) == pytest.approx(3 * 20 + 10_000 / 12 * (1 + 5_000 / 30_000))
    assert m.prefill_ms(0, 5_000) == 0


BIG_KV = 10**9


def test_queue_estimate_counts_prefill_still_owed() -> None:
    item = QueueItem(
        prefill_ms=400, kv_tokens=4100, output_tokens=100, dispatched_s=10.0, first_byte_s=None
    )
    assert estimate_queue_ms([], 20, 10.0, 0, BIG_KV, 100) == 0
    assert estimate_queue_ms([item], 20, 10.0, 0, BIG_KV, 100) == 400
    assert estimate_queue_ms([item, item], 20, 10.1, 0, BIG_KV, 100) == pytest.approx(
        700
    )  # 100 ms done
    # long past its own prefill (blocked engine): the head owes nothing, the rest is owed
    assert estimate_queue_ms([item, item], 20, 30.0, 0, BIG_KV, 100) == pytest.approx(400)
    decoding = QueueItem(0, 200, 100, dispatched_s=0, first_byte_s=9.0)
    assert estimate_queue_ms([decoding], 20, 10.0, 0, BIG_KV, 100) == 10  # half a decode step


def test_a_late_first_token_grows_the_queue_estimate_past_the_grace() -> None:
    # due 0.1 s after dispatch; grace 500 ms: lateness counts from 0.6 s on
    item = QueueItem(100, 4100, 100, dispatched_s=10.0, first_byte_s=None, due_s=10.1)
    assert estimate_queue_ms([item], 20, 10.6, 0, BIG_KV, 100, stall_grace_ms=500) == 0
    assert estimate_queue_ms([item], 20, 12.6, 0, BIG_KV, 100, stall_grace_ms=500) == pytest.approx(
        2000
    )
    assert estimate_queue_ms([item], 20, 12.6, 0, BIG_KV, 100, stall_grace_ms=0) == 0  # off
    # a long estimate is its own grace: 3 s due, late only after 6 s
    slow = QueueItem(3000, 4100, 100, dispatched_s=10.0, first_byte_s=None, due_s=13.0)
    assert estimate_queue_ms([slow], 20, 15.9, 0, BIG_KV, 100, stall_grace_ms=500) == 0
    assert estimate_queue_ms([slow], 20, 17.0, 0, BIG_KV, 100, stall_grace_ms=500) == pytest.approx(
        1000
    )


def test_a_stalled_backend_is_avoided_while_it_answers_probes() -> None:
    r, clock = make_router("gorgo", backends=REGIONS)
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


def test_a_full_kv_pool_waits_for_the_first_finishers() -> None:
    # two decoding requests hold 6k tokens each of an 12k pool; a 3k-token request must
    # wait until one of them finishes: the one with 10 tokens left (10 steps of 20 ms)
    soon = QueueItem(0, 6000, 500, dispatched_s=0.0, first_byte_s=100.0 - 490 * 0.02)
    later = QueueItem(0, 6000, 500, dispatched_s=0.0, first_byte_s=100.0 - 100 * 0.02)
    assert estimate_queue_ms([soon, later], 20, 100.0, 0, 12_000, 3000) == pytest.approx(200)
    assert estimate_queue_ms([soon, later], 20, 100.0, 0, 20_000, 3000) == 10  # fits: no wait


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


def test_decisions_explain_every_term_without_the_prompt() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    r.decide(chat("secret words here " * 10))
    snap = r.snapshot()
    (d,) = snap["recent_decisions"]
    for c in d["candidates"]:
        assert {"rtt_ms", "queue_ms", "prefill_ms", "cached_tokens", "score"} <= set(c)
    assert "secret" not in repr(snap)
    assert snap["weights"] == {"rtt": 1.0, "queue": 1.0}


def test_learn_cached_trims_only_settled_evidence() -> None:
    r, clock = make_router(
        "gorgo", backends=REGIONS, policies={"gorgo": {"tie_fraction": 0.0}}
    )  # the nearest, always
    doc, other = "document " * 2000, "other text " * 2000
    d_other = r.decide(chat(other))
    r.close(d_other.request_id, Status.OK)
    clock.advance(1)
    d1 = r.decide(chat(doc))
    r.close(d1.request_id, Status.OK)
    assert d1.backend == d_other.backend == "near"
    other_blocks = r.features.prompt_blocks(chat(other))[0]
    clock.advance(SETTLED_S + 1)
    d2 = r.decide(chat(doc))
    assert d2.backend == "near"
    rec = r.in_flight[d2.request_id]
    assert rec.cached_tokens > 4000
    # The engine reports nothing cached: it evicted doc's blocks, so `other`, used even
    # earlier, is gone too (LRU). Doc's blocks stay: this very dispatch re-touched them
    # and its prefill computes them.
    near = r.backends["near"].prefix
    assert near.match(other_blocks) == len(other_blocks) > 0
    r.close(d2.request_id, Status.OK, cached_tokens=0)
    assert near.match(other_blocks) == 0
    doc_blocks = r.features.prompt_blocks(chat(doc))[0]
    assert near.match(doc_blocks) == len(rec.blocks)
    # a report right after a dispatch (prefill may still be running) is not evidence
    r.decide(RouteRequest("fresh-other", chat(other).llm, None))
    d3 = r.decide(chat(doc + " more"))
    r.close(d3.request_id, Status.OK, cached_tokens=0)
    assert near.match(other_blocks) == len(other_blocks)


def test_speed_learns_at_completion_and_only_from_the_chosen_backend() -> None:
    r, clock = make_router("gorgo", backends=REGIONS)
    speed = r.backends["near"].learned.speed

    def unqueued(served_by: str | None) -> None:
        d = r.decide(chat(f"sample {random.random()} " * 20))
        assert d.backend == "near"
        clock.advance(0.2)
        r.first_byte(d.request_id)
        before = speed.samples[0]
        status = Status.OK if served_by is None else Status.FAILED_OVER
        r.close(d.request_id, status, served_by=served_by)
        assert speed.samples[0] == before + (served_by is None)  # learned at completion only
        clock.advance(60)  # let the queue drain

    unqueued("mid")  # Envoy retried elsewhere: that TTFT is not near's
    unqueued(None)
    assert speed.samples[0] == 1


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


def test_decode_stall_is_the_prefill_time_times_the_requests_it_holds_up() -> None:
    assert decode_stall_ms(1500.0, 0) == 0
    assert decode_stall_ms(1500.0, 8) == 12_000


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


def test_kv_headroom_prices_the_wait_within_the_margin_beyond_the_queue() -> None:
    # 100k-token pool; two decoding requests hold 44k each (88 %), the first to finish
    # frees its KV in 10 steps of 20 ms, the other in 400
    soon = QueueItem(0, 44_000, 500, dispatched_s=0.0, first_byte_s=100.0 - 490 * 0.02)
    later = QueueItem(0, 44_000, 500, dispatched_s=0.0, first_byte_s=100.0 - 100 * 0.02)
    items = [soon, later]
    # 5k more fits the pool (93 %), not the pool less a 10 % margin: the first finisher
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 5_000, 0.1, 0.0) == pytest.approx(200)
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 1_000, 0.1, 0.0) == 0  # 89 %: room
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 5_000, 0.0, 0.0) == 0  # no margin
    # the wait overlaps the queue: only what lasts beyond it counts
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 5_000, 0.1, 150.0) == pytest.approx(50)
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 5_000, 0.1, 500.0) == 0
    # a request larger than what the first finisher frees waits for the second too
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 50_000, 0.1, 0.0) == pytest.approx(8000)


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
    from loadgen.sim.simulate import SimSettings, simulate
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
    unpaced = {"routing": {"pace_sigmas": 0}}
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
