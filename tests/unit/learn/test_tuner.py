"""The (1+1)-ES tuner: bounds, the 1/5 rule, both modes' acceptance, persistence."""

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.learn.settings import CHILD, PAIRED, PAPER, PARENT, TunerSettings
from ext_proc.learn.tuner import Tuner
from ext_proc.service.tuner_file import TunerStateFile
from ext_proc.vocab.types import Weights
from loadgen.bench.tuner.study import false_accept_rate

PAIRED_S = TunerSettings(arm_size=8, bootstrap=200)


def feed(t: Tuner, ttft_for, n: int, e2e_for=None, start: int = 0) -> None:  # type: ignore[no-untyped-def]
    """n requests: each is routed (gets an arm), then completes with the given timings."""
    for i in range(start, start + n):
        rid = f"r{i}"
        w = t.weights_for(rid)
        arm = CHILD if w == Weights(*t.state.child) and t.arm_for(rid) == CHILD else PARENT
        ttft = ttft_for(w, arm)
        t.observe(rid, ttft, e2e_for(w, arm) if e2e_for else ttft * 5)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([PAIRED, PAPER]))
def test_weights_and_sigma_stay_in_bounds(seed: int, mode: str) -> None:
    s = TunerSettings(mode=mode, arm_size=4, window=16, rescore_every=4, bootstrap=50)
    rng = random.Random(seed)
    t = Tuner(s, Weights(1.0, 1.0), random.Random(seed))
    feed(t, lambda w, arm: rng.uniform(100, 5000), 400)
    for w in (t.state.parent, t.state.child):
        assert s.rtt_bounds[0] <= w[0] <= s.rtt_bounds[1]
        assert s.queue_bounds[0] <= w[1] <= s.queue_bounds[1]
    if mode == PAIRED:
        assert s.sigma_min <= t.state.sigma <= s.sigma_max


def test_one_fifth_rule_moves_sigma_as_specified() -> None:
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0))
    t.state.outcomes = [False] * 7
    t.finish_round(False, 1.0, 1.0, bounded=True)  # 0 of 8 succeeded: shrink
    assert t.state.sigma == pytest.approx(0.5 * 0.817)
    t.state.outcomes = [True, True, False, False, False, False, False]
    t.finish_round(False, 1.0, 1.0, bounded=True)  # 2 of 8 > 1/5: grow
    assert t.state.sigma == pytest.approx(0.5)
    t.state.outcomes = [True, False, False, False, False, False, False]
    t.finish_round(False, 1.0, 1.0, bounded=True)  # 1 of 8 < 1/5: shrink
    assert t.state.sigma == pytest.approx(0.5 * 0.817)
    t.state.sigma = 0.9
    t.state.outcomes = [True] * 7
    t.finish_round(True, 1.0, 1.0, bounded=True)
    assert t.state.sigma == PAIRED_S.sigma_max  # bounded in paired mode


def test_paired_accepts_a_clearly_better_child_and_moves_towards_it() -> None:
    # TTFT falls as w_queue rises (up to the bound): the tuner should climb w_queue
    rng = random.Random(1)
    t = Tuner(replace(PAIRED_S, arm_size=16), Weights(1.0, 0.1), random.Random(3))
    feed(t, lambda w, arm: 1000 / w.queue * rng.uniform(0.9, 1.1), 1200)
    assert t.state.parent[1] > 0.5
    assert any(h["accepted"] for h in t.state.history)


def test_paired_rejects_noise_and_respects_the_e2e_guard() -> None:
    rng = random.Random(2)
    # pure noise: no child is better; the 80 % bootstrap confidence lets few through
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(4))
    feed(t, lambda w, arm: rng.uniform(100, 1000), 800)
    steps = t.state.history
    assert len(steps) >= 40 and sum(h["accepted"] for h in steps) <= 0.3 * len(steps)
    # a child with better TTFT but much worse E2E is rejected
    g = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(5))
    feed(
        g,
        lambda w, arm: 500 if arm == CHILD else 1000,
        200,
        e2e_for=lambda w, arm: 20_000 if arm == CHILD else 10_000,
    )
    assert not any(h["accepted"] for h in g.state.history)
    assert all("E2E guard" in h["note"] for h in g.state.history)


def next_step(t: Tuner, ttft_for, start: int) -> int:  # type: ignore[no-untyped-def]
    """Feed requests from index `start` until the tuner records a step; the next index."""
    steps = len(t.state.history)
    while len(t.state.history) == steps:
        feed(t, ttft_for, 1, start=start)
        start += 1
    return start


def test_a_winning_child_is_accepted_only_when_it_wins_again() -> None:
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0))
    child = t.state.child
    wins = lambda w, arm: 500.0 if arm == CHILD else 1000.0  # noqa: E731
    loses = lambda w, arm: 1000.0 if arm == CHILD else 500.0  # noqa: E731
    i = next_step(t, wins, 0)
    (first,) = t.state.history
    assert first["confirming"] and not first["accepted"] and "to confirm" in first["note"]
    assert t.state.parent == (1.0, 1.0) and t.state.child == child  # the same child again
    i = next_step(t, loses, i)
    assert t.state.parent == (1.0, 1.0) and not t.state.history[-1]["accepted"]
    assert t.state.wins == 0 and t.state.child != child  # a new child, from no wins
    child = t.state.child
    i = next_step(t, wins, next_step(t, wins, i))
    assert t.state.parent == child and t.state.history[-1]["accepted"]


def test_a_request_decided_before_its_round_ended_is_not_counted_in_the_next() -> None:
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0))
    old = {f"late{i}": t.weights_for(f"late{i}") for i in range(6)}  # still in flight
    child = t.state.child
    next_step(t, lambda w, arm: 1000.0, 0)  # the round ends: a new child
    assert t.state.child != child and any(w == Weights(*child) for w in old.values())
    samples = t.state.samples
    for rid in old:
        assert t.observe(rid, 1.0, 5.0) is None
    # the parent's weights did not change, so its late samples still count; the old
    # child's do not
    parents = sum(w == Weights(*t.state.parent) for w in old.values())
    assert t.state.samples == samples + parents and t.stale_samples == len(old) - parents


def test_a_round_that_is_already_sure_ends_early() -> None:
    s = replace(PAIRED_S, arm_size=24)
    rng = random.Random(1)
    t = Tuner(s, Weights(1.0, 1.0), random.Random(0))
    # the child's TTFTs are a tenth of the parent's: sure at 12 per arm, twice
    feed(t, lambda w, arm: rng.uniform(90, 110) * (1 if arm == CHILD else 10), 200)
    accepted = [h for h in t.state.history if h["accepted"]]
    assert accepted and all("decided at 12 per arm" in h["note"] for h in accepted)
    # noise is rarely sure at 12: its rounds run to arm_size
    n = Tuner(s, Weights(1.0, 1.0), random.Random(2))
    feed(n, lambda w, arm: rng.uniform(900, 1100), 400)
    assert n.state.history and sum("decided at" in h["note"] for h in n.state.history) <= 2


def test_confirmation_cuts_false_accepts_on_noise() -> None:
    rng = random.Random(7)
    pool = [(rng.lognormvariate(7, 0.8), 0.0) for _ in range(2000)]
    pool = [(t, t * 4) for t, _ in pool]
    one = false_accept_rate(pool, replace(TunerSettings(), confirm_rounds=1), rounds=400)
    two = false_accept_rate(pool, TunerSettings(), rounds=400)
    assert one > 0.08 and two < 0.05 and two < one / 3


def test_paper_mode_accepts_a_child_half_a_percent_worse() -> None:
    s = TunerSettings.paper()
    s = replace(s, window=8, rescore_every=8)
    t = Tuner(s, Weights(0.5, 0.1), random.Random(0))
    assert t.state.child == t.state.parent  # the initial weights are scored first
    feed(t, lambda w, arm: 1000.0, 8)
    assert t.state.parent_score_ms == 1000.0 and t.state.child != t.state.parent
    child = t.state.child
    feed(t, lambda w, arm: 1004.0, 8, start=8)  # 0.4 % worse: the paper keeps it
    assert t.state.parent == child and t.state.parent_score_ms == 1004.0
    assert s.rtt_bounds == (0.05, 2.0) and s.queue_bounds == (0.05, 0.5)


def test_freezes_when_nothing_better_turns_up_and_resumes_on_drift() -> None:
    s = replace(PAIRED_S, sigma0=0.05, freeze_after=3)
    t = Tuner(s, Weights(1.0, 1.0), random.Random(0))
    feed(t, lambda w, arm: 1000.0 if arm == PARENT else 2000.0, 200)
    assert t.state.frozen and t.arm_for("any") == PARENT
    assert t.state.history[-1]["note"].endswith("; frozen")  # /state and the plot say so
    feed(t, lambda w, arm: 4000.0, 32, start=1000)  # p95 doubles: drift
    assert not t.state.frozen and t.state.sigma == s.sigma0


def test_state_survives_a_restart_and_a_corrupt_file(tmp_path: Path) -> None:
    """The pure tuner hands every new state to its sink; the service's state file writes
    them in order off the event loop and restores the last one."""
    docs: list[dict[str, Any]] = []
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0), sink=docs.append)
    t.set_weights(Weights(2.5, 0.3))
    feed(t, lambda w, arm: 1000.0, 40)
    path = tmp_path / "tuner.json"
    state_file = TunerStateFile(str(path))
    for doc in docs:
        state_file.save(doc)
    state_file.close()
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(docs[-1]))  # the last state, not an older one
    again = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(1), state_file.load(PAIRED_S))
    assert again.state.parent == tuple(saved["parent"]) == t.state.parent
    # saved after every step: what the last step knew (samples since then are not)
    assert again.state.sigma == saved["sigma"] and again.state.samples == saved["samples"] == 32
    path.write_text("{not json")
    assert state_file.load(PAIRED_S) is None
    path.write_text(json.dumps({**saved, "sigma": -1}))
    assert state_file.load(PAIRED_S) is None
    path.write_text(json.dumps({**saved, "mode": "paper"}))
    assert state_file.load(PAIRED_S) is None  # another mode's state is not restored
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no debris


def test_freeze_unfreeze_and_set_from_operations() -> None:
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0))
    t.freeze()
    assert t.snapshot()["frozen"] and t.weights_for("x") == Weights(1.0, 1.0)
    t.set_weights(Weights(1000, 0.001))  # clipped into bounds
    assert t.weights == Weights(256.0, 1 / 16)
    t.unfreeze()
    assert not t.state.frozen and t.state.child != t.state.parent


def test_tail_mean_averages_the_slowest_fraction() -> None:
    import numpy as np

    from ext_proc.learn.settings import tail_mean

    assert tail_mean(np.arange(1.0, 9.0), 0.25) == pytest.approx(7.5)  # 7 and 8
    assert tail_mean(np.array([3.0, 1.0, 2.0]), 0.01) == 3.0  # at least one sample
    rows = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0]])
    assert np.asarray(tail_mean(rows, 0.5)).tolist() == pytest.approx([3.5, 5.0])


def test_default_bounds_hold_the_physical_weights_well_inside() -> None:
    """1.0 is a real millisecond of RTT or queue; the bounds reach from where a term
    stops changing decisions (1/16) to where it overrides the others, so the measured
    optimum (w_rtt 32-64 on the tuning window, docs/tuner.md) is inside them."""
    s = TunerSettings()
    (rlo, rhi), (qlo, qhi) = s.rtt_bounds, s.queue_bounds
    assert rlo <= 1 / 16 and rhi >= 256 and qlo <= 1 / 16 and qhi >= 16
    assert s.clip((1.0, 1.0)) == (1.0, 1.0)


def test_the_tail_score_also_climbs_and_also_rejects_a_worse_e2e() -> None:
    s = replace(PAIRED_S, arm_size=16, score="tail")
    rng = random.Random(1)
    t = Tuner(s, Weights(1.0, 0.1), random.Random(3))
    feed(t, lambda w, arm: 1000 / w.queue * rng.uniform(0.9, 1.1), 1200)
    assert t.state.parent[1] > 0.5
    g = Tuner(s, Weights(1.0, 1.0), random.Random(5))
    feed(
        g,
        lambda w, arm: 500 if arm == CHILD else 1000,
        200,
        e2e_for=lambda w, arm: 20_000 if arm == CHILD else 10_000,
    )
    assert not any(h["accepted"] for h in g.state.history)
    json.dumps(g.state.history)  # plain values: the state file can hold them


def _close_ok(learner, rid: str, tokens: int, ttft_ms: float, e2e_ms: float) -> None:  # type: ignore[no-untyped-def]
    from ext_proc.vocab.events import Closed
    from ext_proc.vocab.types import InFlight, Status

    rec = InFlight(rid, "a", 0.0, tokens)
    learner.on_close(Closed(rid, "a", Status.OK, ttft_ms, e2e_ms, rec, 0.0))


@pytest.mark.parametrize("objective", ["ttft", "excess_ttft"])
def test_excess_objective_ignores_the_prompts_own_cost(objective: str) -> None:
    """Two arms whose only difference is the length of the prompts they drew: the child
    gets 100k-token prompts, the parent 1k-token ones, and both wait the same 300 ms
    beyond what the prompt alone costs. `excess_ttft` scores them equal (and keeps the
    parent); `ttft` sees the child ~20 s slower."""
    from ext_proc.core.learners import TunerLearner
    from ext_proc.estimate.profile import load_profile
    from ext_proc.learn.settings import EXCESS_TTFT

    profile = load_profile()
    s = replace(PAIRED_S, objective=objective)
    t = Tuner(s, Weights(1.0, 1.0), random.Random(0))
    learner = TunerLearner(t, 60_000.0, {"a": profile, "b": replace(profile, name="slow")})
    for i in range(64):
        rid = f"r{i}"
        t.weights_for(rid)
        tokens = 100_000 if t.arm_for(rid) == CHILD else 1_000
        ttft = profile.lone_ttft_ms(tokens) + 300.0
        _close_ok(learner, rid, tokens, ttft, 10_000.0)
    steps = t.state.history
    assert steps and not any(h["accepted"] for h in steps)
    for h in steps:
        if objective == EXCESS_TTFT:
            assert h["parent_p95_ms"] == pytest.approx(300.0)
            assert h["child_p95_ms"] == pytest.approx(h["parent_p95_ms"])
        else:
            assert h["child_p95_ms"] - h["parent_p95_ms"] > 20_000


def test_excess_floor_is_the_fastest_profiles_idle_prefill_and_e2e_is_untouched() -> None:
    from ext_proc.core.learners import TunerLearner
    from ext_proc.estimate.profile import load_profile
    from ext_proc.learn.settings import EXCESS_TTFT

    fast = load_profile()
    slow = replace(fast, prefill_tokens_per_s=fast.prefill_tokens_per_s / 2)
    t = Tuner(replace(PAIRED_S, objective=EXCESS_TTFT), Weights(1.0, 1.0), random.Random(0))
    learner = TunerLearner(t, 60_000.0, {"slow": slow, "fast": fast})
    assert learner.floor_ms(50_000) == fast.lone_ttft_ms(50_000)  # not the chosen backend's
    assert learner.floor_ms(0) == 0.0 and TunerLearner(t, 1.0).floor_ms(50_000) == 0.0
    t.weights_for("x")
    arm = t.arm_for("x")
    _close_ok(learner, "x", 50_000, fast.lone_ttft_ms(50_000) + 120.0, 9_000.0)
    ttft, e2e = t._strategy.round[arm][0]  # type: ignore[attr-defined]
    assert ttft == pytest.approx(120.0) and e2e == 9_000.0  # the E2E guard sees raw E2E


def test_objective_is_a_strict_config_key_wired_into_the_router(tmp_path: Path) -> None:
    """The router's tuner scores each request past its floor, from the fleet's profiles
    as they are now: a faster engine added later lowers the floor."""
    from dataclasses import asdict

    import yaml

    from ext_proc.config.load import backend_from_dict, config_from_dict
    from ext_proc.core.build import build_router
    from ext_proc.learn.settings import EXCESS_TTFT, TTFT
    from ext_proc.prompt.parse import CHAT, parse_body
    from ext_proc.vocab.params import ConfigError
    from ext_proc.vocab.types import RouteRequest, Status
    from tests.fakes import FakeClock

    backend = {"id": "a", "address": "127.0.0.1:1"}
    assert config_from_dict({"backends": [backend]}).tuner.objective == TTFT
    tuner = {"mode": "paired", "objective": "excess_ttft"}
    cfg = config_from_dict({"backends": [backend], "tuner": tuner})
    assert cfg.tuner.objective == EXCESS_TTFT
    with pytest.raises(ConfigError, match=r"tuner\.objective"):
        config_from_dict({"backends": [backend], "tuner": {"objective": "e2e"}})
    clock = FakeClock()
    router = build_router(cfg, clock, random.Random(0))
    t = router.tuner
    assert t is not None and t.s.objective == EXCESS_TTFT
    body = json.dumps({"messages": [{"role": "user", "content": "words " * 5000}]})

    def scored(rid: str) -> tuple[tuple[float, float], int]:
        """What the tuner holds of a request with a 2 s TTFT, and its prompt tokens."""
        d = router.decide(RouteRequest(rid, parse_body(CHAT, body.encode()), None))
        clock.advance(2.0)
        router.first_byte(rid)
        router.close(rid, Status.OK, e2e_ms=9_000.0)
        assert d.arm is not None
        return t._strategy.round[d.arm][-1], d.input_tokens  # type: ignore[attr-defined]

    slow = router.backends["a"].profile
    (ttft, e2e), tokens = scored("r1")
    assert ttft == pytest.approx(2000.0 - slow.lone_ttft_ms(tokens)) and e2e == 9_000.0
    fast = replace(slow, name="fast", prefill_tokens_per_s=2 * slow.prefill_tokens_per_s)
    path = tmp_path / "fast.yaml"
    path.write_text(yaml.safe_dump(asdict(fast)))
    router.fleet.add(backend_from_dict({**backend, "id": "b", "engine_profile": str(path)}))
    (ttft, _), tokens = scored("r2")
    assert fast.lone_ttft_ms(tokens) < slow.lone_ttft_ms(tokens)
    assert ttft == pytest.approx(2000.0 - fast.lone_ttft_ms(tokens))
    assert TunerSettings().objective == TTFT  # the default is unchanged


def test_session_arm_key_keeps_a_conversation_in_one_arm() -> None:
    from ext_proc.config.schema import TunerArmKey

    by_session = Tuner(
        replace(PAIRED_S, arm_key=TunerArmKey.SESSION), Weights(1, 1), random.Random(0)
    )
    by_request = Tuner(PAIRED_S, Weights(1, 1), random.Random(0))
    assert TunerSettings().arm_key == TunerArmKey.REQUEST  # the default is unchanged
    sessions = [f"s{k}" for k in range(40)]
    for s in sessions:
        turns = [f"{s}-turn{i}" for i in range(12)]
        assert len({by_session.arm_for(rid, s) for rid in turns}) == 1
        assert len({by_request.arm_for(rid, s) for rid in turns}) == 2
        assert by_session.weights_for(turns[0], s) == Weights(
            *(
                by_session.state.child
                if by_session.arm_for(turns[0], s) == CHILD
                else by_session.state.parent
            )
        )
    # Both arms still get sessions; a request without a session falls back to its id.
    assert {by_session.arm_for("x", s) for s in sessions} == {PARENT, CHILD}
    ids = [f"r{i}" for i in range(40)]
    assert [by_session.arm_for(r, None) for r in ids] == [by_request.arm_for(r) for r in ids]


def test_arm_key_is_a_strict_config_key_wired_into_the_router() -> None:
    from ext_proc.config.load import config_from_dict
    from ext_proc.config.schema import TunerArmKey
    from ext_proc.core.build import build_router
    from ext_proc.vocab.params import ConfigError

    backend = {"id": "a", "address": "127.0.0.1:1"}
    assert config_from_dict({"backends": [backend]}).tuner.arm_key == TunerArmKey.REQUEST
    tuner = {"mode": "paired", "arm_key": "session"}
    cfg = config_from_dict({"backends": [backend], "tuner": tuner})
    with pytest.raises(ConfigError, match=r"tuner\.arm_key"):
        config_from_dict({"backends": [backend], "tuner": {"arm_key": "user"}})
    router = build_router(cfg, lambda: 0.0, random.Random(0))
    assert router.tuner is not None and router.tuner.s.arm_key == TunerArmKey.SESSION


# -- a round whose arms decided alike tells nothing (issue 27) -------------------------

TIES = replace(PAIRED_S, ties=True)


def route(t: Tuner, rid: str, alike: bool) -> None:
    """A request is routed and the router reports whether the other arm agreed."""
    t.weights_for(rid)
    t.decided(rid, alike)


def test_a_child_that_decides_alike_ties_widens_sigma_and_is_no_failure() -> None:
    t = Tuner(TIES, Weights(1.0, 1.0), random.Random(0))
    child, sigma = t.state.child, t.state.sigma
    for i in range(TIES.tie_decisions - 1):
        route(t, f"r{i}", alike=True)
    assert not t.state.history  # not yet
    route(t, "last", alike=True)
    (step,) = t.state.history
    assert step["tie"] and not step["accepted"] and "decided alike" in step["note"]
    assert t.state.sigma == pytest.approx(sigma / TIES.factor)  # wider, not narrower
    assert t.state.outcomes == [] and t.state.child != child  # no verdict; a new child
    assert t.steps_tied == 1 and t.steps_rejected == 0


def test_ties_grow_sigma_up_to_tie_sigma_max_and_a_verdict_bounds_it_again() -> None:
    s = replace(TIES, tie_sigma_max=3.0)
    t = Tuner(s, Weights(1.0, 1.0), random.Random(0))
    for i in range(40 * s.tie_decisions):
        route(t, f"r{i}", alike=True)
    assert t.state.sigma == pytest.approx(s.tie_sigma_max)
    t.finish_round(False, 1.0, 1.0, bounded=True)
    assert t.state.sigma == s.sigma_max


def test_a_round_with_few_differing_decisions_is_a_tie_not_a_failure() -> None:
    t = Tuner(TIES, Weights(1.0, 1.0), random.Random(0))
    sigma = t.state.sigma
    i = 0
    while not t.state.history:  # 1 decision in 20 differs: below tie_share (0.1)
        rid = f"r{i}"
        route(t, rid, alike=i % 20 != 0)
        t.observe(rid, 1000.0 if t.arm_for(rid) == CHILD else 500.0, 5000.0)
        i += 1
    (step,) = t.state.history
    assert step["tie"] and t.state.outcomes == [] and t.state.sigma > sigma
    # the same round with most decisions different is judged: the worse child rejected
    u = Tuner(TIES, Weights(1.0, 1.0), random.Random(0))
    i = 0
    while not u.state.history:
        rid = f"r{i}"
        route(u, rid, alike=i % 2 == 0)
        u.observe(rid, 1000.0 if u.arm_for(rid) == CHILD else 500.0, 5000.0)
        i += 1
    (step,) = u.state.history
    assert not step["tie"] and u.state.outcomes == [False]


def test_children_from_a_corner_are_reflected_inside_not_clipped_onto_it() -> None:
    s = TIES
    corner = Weights(s.rtt_bounds[1], s.queue_bounds[0])
    t = Tuner(s, corner, random.Random(0))
    children = [t.mutate(t.state.parent) for _ in range(200)]
    assert not any(c[0] == s.rtt_bounds[1] or c[1] == s.queue_bounds[0] for c in children)
    assert all(s.clip(c) == c for c in children)


def test_the_router_reports_whether_the_other_arm_would_have_decided_alike() -> None:
    from ext_proc.core.learners import TunerLearner

    t = Tuner(TIES, Weights(1.0, 1.0), random.Random(0))
    seen: list[Weights] = []

    def would_pick(candidates: Any, w: Weights, backend: str) -> bool:
        seen.append(w)
        return True

    learner = TunerLearner(t, 60_000.0, would_pick=would_pick)

    class Event:  # what TunerLearner reads of a Dispatched event
        def __init__(self, rid: str) -> None:
            self.decision = type("D", (), {"request_id": rid, "candidates": (), "backend": "a"})

    for i in range(TIES.tie_decisions):
        rid = f"r{i}"
        arm = t.arm_for(rid)
        t.weights_for(rid)
        learner.on_dispatch(Event(rid))  # type: ignore[arg-type]
        other = t.state.parent if arm == CHILD else t.state.child
        assert seen[-1] == Weights(*other) or t.state.history
    assert t.state.history[-1]["tie"]
    t.freeze()
    t.weights_for("frozen")
    learner.on_dispatch(Event("frozen"))  # type: ignore[arg-type]
    assert len(seen) == TIES.tie_decisions  # frozen: nothing to compare


def test_ties_are_off_by_default_and_the_router_then_reports_nothing() -> None:
    from ext_proc.core.learners import TunerLearner

    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0))
    asked: list[Weights] = []
    learner = TunerLearner(t, 60_000.0, would_pick=lambda c, w, b: bool(asked.append(w)) or True)
    decision = type("D", (), {"request_id": "r0", "candidates": (), "backend": "a"})
    t.weights_for("r0")
    learner.on_dispatch(type("E", (), {"decision": decision})())  # type: ignore[arg-type]
    assert not asked and t.other_weights("r0") is None and not t.state.history
