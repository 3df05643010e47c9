"""The policies known by name: the registry with every built-in policy registered (they
register themselves on import), and how one is built from the config.

Import policies from here, not from `base` (where the registry may still be empty).
"""

from __future__ import annotations

import random
from typing import Any

from ext_proc.config.schema import Config
from ext_proc.policy import baselines, gorgo  # noqa: F401  (they register on import)
from ext_proc.policy.base import POLICIES, Policy, PolicyInfo

__all__ = ["POLICIES", "make_policy", "policy_info", "policy_params"]


def policy_info(name: str) -> PolicyInfo:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})"
        ) from None


def make_policy(name: str, rng: random.Random, params: Any = None) -> Policy:
    """The named policy with `params` (None: its defaults)."""
    info = policy_info(name)
    return info.factory(rng, params if params is not None else info.params())


def policy_params(cfg: Config, name: str | None = None) -> Any:
    """The decoded parameters of a policy (the configured one by default)."""
    name = name or cfg.policy
    params = cfg.policies.get(name)
    return params if params is not None else policy_info(name).params()
