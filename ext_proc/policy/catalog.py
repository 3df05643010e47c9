"""The policies known by name: the registry with every built-in policy registered (they
register themselves on import), and how one is built from the config.

Import policies from here, not from `base` (where the registry may still be empty).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Protocol

from ext_proc.policy import baselines, gorgo  # noqa: F401  (they register on import)
from ext_proc.policy.base import POLICIES, PolicyInfo
from ext_proc.vocab.policy import Policy

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


class Configured(Protocol):
    """What of a config names policies (ext_proc.config.schema.Config)."""

    @property
    def policy(self) -> str: ...

    @property
    def policies(self) -> Mapping[str, Any]: ...


def policy_params(cfg: Configured, name: str | None = None) -> Any:
    """The decoded parameters of a policy (the configured one by default)."""
    name = name or cfg.policy
    params = cfg.policies.get(name)
    return params if params is not None else policy_info(name).params()
