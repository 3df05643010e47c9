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
from ext_proc.learn.settings import StateSink, TunerSettings, TunerState
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
    router = Router(cfg, clock, policy, weights, tuner)
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
    if tuner is not None:
        failure_ms = cfg.request_timeout_s * 1000
        would_pick = getattr(router.policy, "would_pick", None)
        out.append(TunerLearner(tuner, failure_ms, state.profiles, would_pick))
    return out
