"""Driving a tuner as the router does, for the tuner's tests: requests routed to an arm
and completed with the timings a test gives each arm."""

import random
from collections.abc import Callable
from dataclasses import replace

from ext_proc.core.learners import TunerLearner
from ext_proc.learn.settings import CHILD, PARENT, TunerSettings
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.events import Closed
from ext_proc.vocab.types import InFlight, Status, Weights

# Paired rounds of 8 per arm, a short bootstrap: quick tests.
PAIRED_S = TunerSettings(arm_size=8, bootstrap=200)
# The same, with ties on.
TIES = replace(PAIRED_S, ties=True)

Timing = Callable[[Weights, str], float]


def feed(t: Tuner, ttft_for: Timing, n: int, e2e_for: Timing | None = None, start: int = 0) -> None:
    """n requests: each is routed (gets an arm), then completes with the given timings."""
    for i in range(start, start + n):
        rid = f"r{i}"
        w = t.weights_for(rid)
        arm = CHILD if w == Weights(*t.state.child) and t.arm_for(rid) == CHILD else PARENT
        ttft = ttft_for(w, arm)
        t.observe(rid, ttft, e2e_for(w, arm) if e2e_for else ttft * 5)


def next_step(t: Tuner, ttft_for: Timing, start: int) -> int:
    """Feed requests from index `start` until the tuner records a step; the next index."""
    steps = len(t.state.history)
    while len(t.state.history) == steps:
        feed(t, ttft_for, 1, start=start)
        start += 1
    return start


def route(t: Tuner, rid: str, alike: bool) -> None:
    """A request is routed and the router reports whether the other arm agreed."""
    t.weights_for(rid)
    t.decided(rid, alike)


def close_ok(learner: TunerLearner, rid: str, tokens: int, ttft_ms: float, e2e_ms: float) -> None:
    """A request of `tokens` prompt tokens on backend "a" completes."""
    rec = InFlight(rid, "a", 0.0, tokens)
    learner.on_close(Closed(rid, "a", Status.OK, ttft_ms, e2e_ms, rec, 0.0))


def tuner(settings: TunerSettings = PAIRED_S, seed: int = 0) -> Tuner:
    """A tuner from weights (1, 1)."""
    return Tuner(settings, Weights(1.0, 1.0), random.Random(seed))
