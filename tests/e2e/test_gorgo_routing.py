"""GORGO's choices through real Envoy and the emulated fleet (default engine profile)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from emulator.stack.stack import Stack
from loadgen.client.stream import Result, chat_body, send_chat
from tests.e2e.conftest import fast_settings
from tests.e2e.stack_harness import (
    ASHBURN,
    FRANKFURT,
    SEOUL,
    router_state,
    rtt,
    spread_regions,
    wait_for,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def gorgo_stack() -> Iterator[Stack]:
    stack = Stack(
        fast_settings(
            "gorgo",
            engine_args=(),  # the default engine profile: prefill long enough to queue
            wan_control=True,
            probe_interval_s=0.2,  # follow RTT changes within a second
        )
    )
    stack.start()
    yield stack
    stack.stop()


def words(n_tokens: int, tag: str) -> str:
    """Text of n_tokens tokens (4 bytes each) unique to tag."""
    return "".join(f"{tag[:3]:>3} " if i % 7 else f"{i % 1000:03d} " for i in range(n_tokens))


async def chats(url: str, texts: list[str], max_tokens: int = 3) -> list[Result]:
    async with aiohttp.ClientSession() as s:
        return list(
            await asyncio.gather(
                *(send_chat(s, url, chat_body(t, max_tokens), f"q{i}") for i, t in enumerate(texts))
            )
        )


def test_idle_fleet_equal_caches_the_nearest_wins(gorgo_stack: Stack) -> None:
    # regions far enough apart that probe noise on a busy machine cannot reorder them
    spread_regions(gorgo_stack)
    for i in range(4):  # one at a time: equal (empty) caches, no load
        # idle means idle: the previous request's completion has reached the router
        wait_for(lambda: router_state(gorgo_stack)["in_flight"] == 0)
        (r,) = asyncio.run(chats(gorgo_stack.front_door_url, [words(300, f"solo{i}")]))
        assert r.ok and r.backend == ASHBURN


@pytest.mark.long  # `make test-long`
def test_a_session_follows_its_cache_unless_that_backend_is_overloaded(gorgo_stack: Stack) -> None:
    url = gorgo_stack.front_door_url
    history = words(4000, "history")
    # 1. ashburn is far away for a while: the session's first turn lands elsewhere
    #    (frankfurt and seoul are 6 ms apart on a ~400 ms prefill: a near-tie, drawn)
    gorgo_stack.set_rtt_ms(0, 400)
    wait_for(lambda: rtt(gorgo_stack, ASHBURN) > 200, timeout_s=10)
    (first,) = asyncio.run(chats(url, [history]))
    assert first.ok and first.backend in (FRANKFURT, SEOUL)
    home = first.backend
    # 2. ashburn is near again; the second turn still goes where its 4k-token prefix is
    #    cached: a few ms more RTT beats ~400 ms of prefill
    gorgo_stack.set_rtt_ms(0, 1)
    wait_for(lambda: rtt(gorgo_stack, ASHBURN) < 20, timeout_s=10)
    (second,) = asyncio.run(chats(url, [history + words(50, "turn2")]))
    assert second.ok and second.backend == home
    assert second.cached_tokens >= 3500  # the engine agrees: the prefix was there
    # 3. many turns of the session at once: home's queue grows past the cache's
    #    advantage and the rest spill to other regions
    burst = asyncio.run(chats(url, [history + words(2000, f"b{i}") for i in range(8)]))
    assert all(r.ok for r in burst)
    where = [r.backend for r in burst]
    assert home in where and set(where) - {home}


def test_a_backend_whose_probes_fail_stops_being_chosen(gorgo_stack: Stack) -> None:
    spread_regions(gorgo_stack)
    gorgo_stack.kill("wan-us-ashburn")  # its link is gone: probes and requests fail
    wait_for(lambda: router_state(gorgo_stack)["backends"][ASHBURN]["suspect"], timeout_s=5)
    results = asyncio.run(
        chats(gorgo_stack.front_door_url, [words(200, f"x{i}") for i in range(6)])
    )
    assert all(r.ok for r in results), [r.error for r in results]
    assert ASHBURN not in {r.backend for r in results}
    # the link comes back: so does the backend
    gorgo_stack.start_wan(0)
    wait_for(lambda: not router_state(gorgo_stack)["backends"][ASHBURN]["suspect"], timeout_s=5)
    time.sleep(0.5)
    (r,) = asyncio.run(chats(gorgo_stack.front_door_url, [words(200, "back")]))
    assert r.ok and r.backend == ASHBURN
