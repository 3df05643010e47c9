"""The rival policies' names (light: every `gorgo` command builds its parsers)."""

from __future__ import annotations

RIVAL_NAMES = (
    "smg_cache_aware",
    "smg_least_load",
    "smg_prefix_hash",
    "vllm_router_cache_aware",
    "vllm_router_sticky_least_loaded",
    "llmd_weighted",
    "llmd_sticky",
    "dynamo_kv",
)


def is_rival(policy: str) -> bool:
    return policy in RIVAL_NAMES
