"""A backend's KV pool, which sizes its prefix index: the config's kv_capacity_tokens wins,
then the pool its engine reports on /metrics, then its engine profile's; the engine's
resizes the index when it first arrives, and /state says which one is used."""

from __future__ import annotations

from dataclasses import replace

from ext_proc.feeds.engine_metrics import EngineReport
from tests.builders import make_router

PROFILE_POOL = 983_549  # the default profile's (l40s-qwen3.5-35b-a3b-fp8)


def report(pool: int | None) -> EngineReport:
    return EngineReport(0, 0, 0.0, kv_capacity_tokens=pool)


def test_config_beats_engine_beats_profile() -> None:
    router, _ = make_router(
        backends=[
            {"id": "set", "address": "127.0.0.1:1", "kv_capacity_tokens": 200_000},
            {"id": "unset", "address": "127.0.0.1:2"},
        ]
    )
    bt = router.cfg.routing.block_tokens
    set_, unset = router.backends["set"], router.backends["unset"]
    assert (set_.kv_capacity, unset.kv_capacity) == ((200_000, "config"), (PROFILE_POOL, "profile"))
    # the engines report 1,048,576 tokens (a real vLLM's 8192 blocks of 128)
    assert router.inputs.record_engine_report("set", report(1_048_576))
    assert router.inputs.record_engine_report("unset", report(1_048_576))
    assert set_.kv_capacity == (200_000, "config")
    assert unset.kv_capacity == (1_048_576, "engine")
    assert unset.prefix.capacity_blocks == 1_048_576 // bt  # resized at run time
    assert set_.prefix.capacity_blocks == 200_000 // bt
    # the same pool again is no news; a report without one keeps what was said
    assert not router.inputs.record_engine_report("unset", report(1_048_576))
    assert not router.inputs.record_engine_report("unset", report(None))
    assert unset.kv_capacity == (1_048_576, "engine")
    shown = router.snapshot()["backends"]
    assert (shown["unset"]["kv_capacity_tokens"], shown["unset"]["kv_capacity_source"]) == (
        1_048_576,
        "engine",
    )
    assert shown["set"]["kv_capacity_source"] == "config"


def test_another_engine_behind_the_id_forgets_the_old_engines_pool() -> None:
    router, _ = make_router(backends=[{"id": "a", "address": "127.0.0.1:1"}])
    router.inputs.record_engine_report("a", report(5120))
    a = router.backends["a"]
    assert a.kv_capacity == (5120, "engine")
    router.fleet.reconcile([replace(a.config, address="127.0.0.1:5")])
    a = router.backends["a"]
    assert a.kv_capacity == (PROFILE_POOL, "profile")
    assert a.prefix.capacity_blocks == PROFILE_POOL // router.cfg.routing.block_tokens
