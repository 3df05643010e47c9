"""The one way to build a router, for `gorgo serve` and the simulator alike."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import replace

from ext_proc.config.schema import Config, TunerMode
from ext_proc.core.learners import (
    Ejector,
    OutputLearner,
    PredictionLearner,
    PrefixLearner,
    SpeedLearner,
    TunerLearner,
)
from ext_proc.core.router import Router
from ext_proc.estimate.transfer import KNOB_BOUNDS, PairKnobs
from ext_proc.learn.settings import PAIRED, StateSink, TunerSettings, TunerState
from ext_proc.learn.tuner import Tuner
from ext_proc.policy.base import PolicyInfo
from ext_proc.policy.catalog import make_policy, policy_info, policy_params
from ext_proc.vocab.events import Listener
from ext_proc.vocab.policy import Policy
from ext_proc.vocab.types import Weights


def tuner_settings(cfg: Config, info: PolicyInfo) -> TunerSettings:
    """The tuner's settings for a weighted policy: the paper's bounds in paper mode, else
    the policy's own (or the time form's defaults)."""
    if not info.weighted:
        raise ValueError(f"policy {info.name!r} has no weights to tune")
    bounds = info.params.TUNER_BOUNDS
    if cfg.tuner.mode == TunerMode.PAPER:
        base = TunerSettings.paper()
    elif bounds is not None:
        base = TunerSettings(rtt_bounds=bounds[0], queue_bounds=bounds[1])
    else:
        base = TunerSettings()
    return replace(
        base,
        mode=cfg.tuner.mode,
        arm_size=cfg.tuner.arm_size,
        objective=cfg.tuner.objective,
        arm_key=cfg.tuner.arm_key,
    )


def pair_tuner_settings(cfg: Config) -> TunerSettings:
    """The paired tuner of a disaggregated fleet's two knobs (estimate.transfer.PairKnobs):
    the weights' round sizes and objective, the knobs' bounds, and arms of its own (a salt),
    so each tuner's two arms meet the other's alike."""
    return TunerSettings(
        mode=PAIRED,
        rtt_bounds=KNOB_BOUNDS[0],
        queue_bounds=KNOB_BOUNDS[1],
        arm_size=cfg.tuner.arm_size,
        objective=cfg.tuner.objective,
        arm_key=cfg.tuner.arm_key,
        label="knobs",
        names=("local_threshold_tokens", "remote_margin_ms"),
        arm_salt="pair-knobs:",
    )


def build_router(
    cfg: Config,
    clock: Callable[[], float],
    rng: random.Random,
    tuner_state: TunerState | None = None,
    tuner_sink: StateSink | None = None,
    listeners: Iterable[Listener] = (),
    policy: Policy | None = None,
) -> Router:
    """The policy and the tuner each get an RNG drawn from `rng`, in that order. `policy`:
    one the caller built, in place of the configured one (the simulator's comparison
    baselines, loadgen/sim/rivals; its RNG is drawn all the same, so the rest stay put)."""
    info = policy_info(cfg.policy)
    params = policy_params(cfg)
    built = make_policy(cfg.policy, random.Random(rng.random()), params)
    policy = built if policy is None else policy
    tuner_rng = random.Random(rng.random())
    weights: Weights | None = params.weights if info.weighted else None
    tuner = None
    if weights is not None and cfg.tuner.mode != TunerMode.OFF:
        settings = tuner_settings(cfg, info)
        tuner = Tuner(settings, weights, tuner_rng, tuner_state, tuner_sink)
    knobs = getattr(policy, "pair_knobs", None)
    pair_tuner = None
    if cfg.tuner.mode == PAIRED and isinstance(knobs, PairKnobs):
        # Its own RNG, seeded from the weights tuner's state without drawing from it (so
        # every other draw stays as it was); its state is not persisted (docs/tuner.md).
        knob_rng = random.Random(repr(("pair knobs", tuner_rng.getstate())))
        pair_tuner = Tuner(pair_tuner_settings(cfg), knobs.values(), knob_rng)
    router = Router(cfg, clock, policy, weights, tuner, pair_tuner)
    for listener in (*learners(router, tuner), *listeners):
        router.subscribe(listener)
    return router


def learners(router: Router, tuner: Tuner | None) -> list[Listener]:
    """What learns from each outcome, in the order it hears: the prefix index, each
    backend's speed, the output lengths, ejection, the prediction figures, the tuner's arms."""
    state, cfg = router.fleet.state, router.cfg
    out: list[Listener] = [
        PrefixLearner(state, cfg.routing.block_tokens),
        SpeedLearner(state),
        OutputLearner(state),
        Ejector(state, cfg.routing),
        PredictionLearner(state),
    ]
    failure_ms = cfg.request_timeout_s * 1000
    if tuner is not None:
        would_pick = getattr(router.policy, "would_pick", None)
        out.append(TunerLearner(tuner, failure_ms, state.profiles, would_pick))
    if router.pair_tuner is not None:  # it hears only the requests it set knobs for
        out.append(TunerLearner(router.pair_tuner, failure_ms, state.profiles))
    return out
