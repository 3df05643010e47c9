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
    # prefill and decode apart (loadgen/sim/rivals/pd.py)
    "smg_pd",
    "vllm_router_pd",
    "llmd_pd",
    "dynamo_pd",
)


def is_rival(policy: str) -> bool:
    return policy in RIVAL_NAMES
