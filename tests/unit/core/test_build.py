"""core.build.build_router: a policy the caller built takes the configured one's place, and
the RNG draws stay as they were (the simulator's peer baselines rely on both)."""

from __future__ import annotations

import random

from ext_proc.core.build import build_router
from ext_proc.policy.base import NoParams
from ext_proc.policy.baselines import LeastRequest
from tests.builders import make_config


def test_a_callers_policy_replaces_the_configured_one_and_the_draws_stay() -> None:
    cfg = make_config("round_robin")
    plain_rng, given_rng = random.Random(7), random.Random(7)
    plain = build_router(cfg, lambda: 0.0, plain_rng)
    given = build_router(
        cfg, lambda: 0.0, given_rng, policy=LeastRequest(random.Random(1), NoParams())
    )
    assert plain.policy.name == "round_robin" and given.policy.name == "least_request"
    assert plain_rng.random() == given_rng.random()
