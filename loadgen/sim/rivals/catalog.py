"""The rival policies by name (each module registers its own on import)."""

from __future__ import annotations

import random

from loadgen.sim.rivals import dynamo, llmd, pd, smg, vllm_router  # noqa: F401
from loadgen.sim.rivals.base import RIVALS, RivalPolicy
from loadgen.sim.rivals.names import RIVAL_NAMES

if set(RIVALS) != set(RIVAL_NAMES):  # the light list of names must say what is registered
    raise ImportError(f"rival names {sorted(RIVAL_NAMES)} != registered {sorted(RIVALS)}")


def make_rival(name: str, rng: random.Random) -> RivalPolicy:
    try:
        factory = RIVALS[name]
    except KeyError:
        raise ValueError(
            f"unknown rival policy {name!r} (known: {', '.join(RIVAL_NAMES)})"
        ) from None
    return factory(rng)
