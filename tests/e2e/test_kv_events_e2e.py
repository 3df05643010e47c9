"""Precise prefix state through real Envoy and the emulated fleet publishing KV events
(issue 14, done-when 2 and 3): the router falls back to its own estimate while an engine's
event stream is down and recovers the missed events from the replay endpoint when it is
back; a restarted router is warm from the engines' replay buffers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from emulator.stack.stack import Stack
from loadgen.client.stream import chat_body, send_chat
from tests.e2e.conftest import FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import router_state, wait_for

pytestmark = pytest.mark.e2e
IDS = [r.id for r in FAST_REGIONS]


@pytest.fixture
def precise_stack() -> Iterator[Stack]:
    stack = Stack(fast_settings("gorgo", kv_events=True, probe_interval_s=0.5))
    stack.start()
    wait_for(lambda: all(backend(stack, b)["prefix_state"] == "precise" for b in IDS), 10)
    yield stack
    stack.stop()


def backend(stack: Stack, b: str) -> dict[str, Any]:
    return dict(router_state(stack)["backends"][b])


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def direct_chat(stack: Stack, i: int, text: str) -> None:
    """A request straight to engine i (as another router's would be): only its events tell."""
    post(f"{stack.engine_url(i)}/v1/chat/completions", chat_body(text, 2, stream=False))


def test_a_dead_event_stream_falls_back_and_recovers_by_replay(precise_stack: Stack) -> None:
    stack = precise_stack
    direct_chat(stack, 1, "frankfurt's own document " * 200)
    wait_for(lambda: backend(stack, IDS[1])["kv_events"]["blocks"] > 0)
    t0 = time.monotonic()
    post(f"{stack.engine_url(1)}/faults", {"kv_events_down": True})
    wait_for(lambda: backend(stack, IDS[1])["prefix_state"] == "approximate", 0.5)
    print(f"approximate {time.monotonic() - t0:.2f} s after the stream died")
    before = backend(stack, IDS[1])["kv_events"]["blocks"]
    direct_chat(stack, 1, "stored while nobody listened " * 200)  # numbered, not sent
    post(f"{stack.engine_url(1)}/faults", {"kv_events_down": False})
    wait_for(lambda: backend(stack, IDS[1])["prefix_state"] == "precise", 2)
    # back: precise again only once what was missed is caught up from the replay buffer
    # (each prompt is ~1,450 tokens: 21-22 blocks of 64)
    assert backend(stack, IDS[1])["kv_events"]["blocks"] >= before + 20
    direct_chat(stack, 1, "after the stream came back " * 200)
    wait_for(lambda: backend(stack, IDS[1])["kv_events"]["blocks"] >= before + 40, 3)
    kv = backend(stack, IDS[1])["kv_events"]
    print(f"blocks {before} -> {kv['blocks']}, gaps {kv['gaps']}, resets {kv['resets']}")
    assert kv["resets"] == 0  # replayed, never reset
    assert all(backend(stack, b)["prefix_state"] == "precise" for b in IDS)


def test_a_restarted_router_is_warm_at_once_and_no_request_fails(precise_stack: Stack) -> None:
    stack = precise_stack
    for i in range(3):
        direct_chat(stack, i, f"history of region {i} " * 300)
    wait_for(lambda: all(backend(stack, b)["kv_events"]["blocks"] > 0 for b in IDS))
    blocks = {b: backend(stack, b)["kv_events"]["blocks"] for b in IDS}
    failures: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        async def run() -> None:
            async with aiohttp.ClientSession() as s:
                n = 0
                while not stop.is_set():
                    r = await send_chat(s, stack.front_door_url, chat_body("hello", 3), f"t{n}")
                    if not r.ok:
                        failures.append(r.error or str(r.status))
                    n += 1

        asyncio.run(run())

    sender = threading.Thread(target=traffic)
    sender.start()
    try:
        stack.kill("gorgo-serve")
        t0 = time.monotonic()
        stack.start_router()
        stack.wait_router_ready()
        wait_for(
            lambda: (
                all(backend(stack, b)["prefix_state"] == "precise" for b in IDS)
                and all(backend(stack, b)["kv_events"]["blocks"] >= blocks[b] for b in IDS)
            ),
            10,
        )
        warm_s = time.monotonic() - t0
    finally:
        stop.set()
        sender.join()
    print(f"restarted router warm (every backend precise, its blocks back) in {warm_s:.2f} s")
    assert failures == []


def test_precise_predictions_match_what_the_engines_report(precise_stack: Stack) -> None:
    """The router's predicted cached tokens on the chosen backend (its decisions on /state)
    against the engine's own report in the usage: within 2 % of the prompt."""
    stack = precise_stack
    doc = "a document every turn shares " * 300

    async def run() -> list[Any]:
        async with aiohttp.ClientSession() as s:
            out = []
            for i in range(4):
                body = chat_body(f"{doc} question {i}", 2)
                rid = f"prefix-{i}"
                out.append(
                    await send_chat(s, stack.front_door_url, body, rid, {"x-request-id": rid})
                )
            return out

    results = asyncio.run(run())
    decisions = {d["request_id"]: d for d in router_state(stack)["recent_decisions"]}
    errors = []
    for r in results:
        assert r.ok and r.input_tokens > 0, r.error
        d = decisions[r.id]
        predicted = next(c for c in d["candidates"] if c["backend"] == d["backend"])
        errors.append(abs(predicted["cached_tokens"] - r.cached_tokens) / r.input_tokens)
    print(f"prediction error per request: {[f'{e:.2%}' for e in errors]}")
    assert results[-1].cached_tokens > 0  # the shared document was a hit
    assert sum(errors) / len(errors) <= 0.02
