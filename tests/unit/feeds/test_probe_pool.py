"""What the router logs of a backend's KV pool once its engine's /metrics has been read:
loud (a warning) when the prefix index is sized to something other than the engine's own
pool, or to the profile's because the engine does not say."""

from __future__ import annotations

import logging

from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.service.loops.probe import kv_pool_note
from tests.builders import make_router


def note(pool: int | None, **backend: object) -> tuple[int, str]:
    router, _ = make_router(backends=[{"id": "a", "address": "127.0.0.1:1", **backend}])
    router.inputs.record_engine_report("a", EngineReport(0, 0, 0.0, kv_capacity_tokens=pool))
    return kv_pool_note(router.backends["a"])


def test_an_engine_pool_other_than_the_profiles_is_warned_of_and_used() -> None:
    level, text = note(1_048_576)
    assert level == logging.WARNING
    assert "reports a KV pool of 1048576 tokens" in text and "says 983549" in text


def test_an_engine_without_a_pool_on_its_page_is_warned_of_unless_the_config_sets_it() -> None:
    level, text = note(None)
    assert level == logging.WARNING and "set backends[].kv_capacity_tokens" in text
    assert note(None, kv_capacity_tokens=100_000)[0] == logging.DEBUG


def test_the_config_winning_over_a_different_engine_pool_is_warned_of() -> None:
    level, text = note(1_048_576, kv_capacity_tokens=100_000)
    assert level == logging.WARNING and "the config's is used" in text


def test_a_pool_that_matches_is_only_logged() -> None:
    # the emulated engine reports the profile's pool in whole 64-token blocks
    assert note(983_549 // 64 * 64)[0] == logging.INFO
    assert note(100_000, kv_capacity_tokens=100_000)[0] == logging.INFO
