"""The rival policies' names (light: every `gorgo` command builds its parsers)."""

from __future__ import annotations

# Their rules for engines that take requests whole.
AGGREGATED_RIVALS = (
    "smg_cache_aware",
    "smg_least_load",
    "smg_prefix_hash",
    "vllm_router_cache_aware",
    "vllm_router_sticky_least_loaded",
    "llmd_weighted",
    "llmd_sticky",
    "dynamo_kv",
)
# Their P/D modes, for prefill and decode engines apart (loadgen/sim/rivals/pd.py).
PD_RIVALS = ("smg_pd", "vllm_router_pd", "llmd_pd", "dynamo_pd")
RIVAL_NAMES = AGGREGATED_RIVALS + PD_RIVALS


def is_rival(policy: str) -> bool:
    return policy in RIVAL_NAMES
