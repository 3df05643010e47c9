"""The (1+1)-ES tuner (learn/tuner.py): the arm and weights of each request, samples of
weights a round replaced left out, the objective, the operations (freeze, set), its
state's persistence, and its config keys. Each mode's rounds: test_paired.py,
test_paper.py; what they share: test_settings.py."""

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.learn.settings import CHILD, PAIRED, PAPER, TunerSettings
from ext_proc.learn.tuner import Tuner
from ext_proc.service.tuner_file import TunerStateFile
from ext_proc.vocab.types import Weights
from tests.unit.learn.arms import PAIRED_S, close_ok, feed, next_step


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
        close_ok(learner, rid, tokens, ttft, 10_000.0)
    steps = t.state.history
    assert steps and not any(h["accepted"] for h in steps)
    for h in steps:
        if objective == EXCESS_TTFT:
            assert h["parent_p95_ms"] == pytest.approx(300.0)
            assert h["child_p95_ms"] == pytest.approx(h["parent_p95_ms"])
        else:
            assert h["child_p95_ms"] - h["parent_p95_ms"] > 20_000


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


@pytest.mark.parametrize("ties", [False, True])
def test_a_huge_sigma_steps_to_a_bound_without_overflow(ties: bool) -> None:
    """Hypothesis found it: in the paper's mode sigma has no cap, and exp() of a step far
    past the bounds raised OverflowError (clipped after) instead of landing on a bound."""
    t = Tuner(replace(PAIRED_S, ties=ties), Weights(1.0, 1.0), random.Random(3))
    t.state.sigma = 1e6
    s = t.s
    for _ in range(20):
        w = t.mutate((1.0, 1.0))
        assert s.rtt_bounds[0] <= w[0] <= s.rtt_bounds[1]
        assert s.queue_bounds[0] <= w[1] <= s.queue_bounds[1]
