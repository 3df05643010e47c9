"""Endpoint-picker mode through real Envoy: override_host sends each request to the
endpoint the router named (Gateway API Inference Extension protocol)."""

from __future__ import annotations

import asyncio

import pytest

from emulator.stack.stack import Stack
from tests.e2e.conftest import FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import chats, engine_counts, router_state

pytestmark = pytest.mark.e2e

IDS = [r.id for r in FAST_REGIONS]


def test_override_host_routes_to_the_picked_endpoint() -> None:
    stack = Stack(fast_settings("round_robin", envoy_mode="endpoint_picker"))
    stack.start()
    try:
        from loadgen.client.stream import chat_body

        before = engine_counts(stack)
        forged = {"x-gateway-destination-endpoint": f"127.0.0.1:{stack.settings.backend_port(2)}"}
        results = asyncio.run(chats(stack.front_door_url, [chat_body("hi", 3)] * 6, forged))
        assert all(r.ok for r in results), [r.error for r in results]
        # round robin's choices, not the client's forged endpoint
        assert sorted(r.backend for r in results) == sorted(IDS * 2)
        after = engine_counts(stack)
        assert {b: after[b] - before[b] for b in IDS} == {b: 2 for b in IDS}
        decided = [d["backend"] for d in router_state(stack)["recent_decisions"]]
        assert decided[-6:] == [r.backend for r in results]
    finally:
        stack.stop()
