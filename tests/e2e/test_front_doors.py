"""A front door per region (issue 14, done-when 1): a session's first turn enters through
one region's Envoy and router, its second through another's; the second router, seeing the
engines' own KV events, sends it to the backend that holds the conversation's prefix."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from emulator.stack.settings import DEFAULT_REGIONS
from emulator.stack.stack import Stack
from loadgen.client.stream import Result, send_chat
from tests.e2e.conftest import fast_settings
from tests.e2e.stack_harness import wait_for

# Long (5 s and more a test): `make test-long`, which CI runs after `make test`.
pytestmark = [pytest.mark.e2e, pytest.mark.long]
IDS = [r.id for r in DEFAULT_REGIONS]


@pytest.fixture(params=[True, False], ids=["shared-kv-events", "private-estimates"])
def three_doors(request: pytest.FixtureRequest) -> Iterator[Stack]:
    stack = Stack(
        fast_settings(
            "gorgo",
            regions=DEFAULT_REGIONS,  # 1 / 90 / 180 ms from us-ashburn
            engine_args=(),  # the default profile: prefill is worth routing for
            kv_events=request.param,
            front_door_regions=("eu-frankfurt", "ap-seoul"),
            probe_interval_s=0.5,
            tuner_mode="off",
        )
    )
    stack.start()
    yield stack
    stack.stop()


def ask(url: str, messages: list[dict[str, str]], session: str) -> Result:
    body = {
        "model": "default",
        "stream": True,
        "max_tokens": 4,
        "stream_options": {"include_usage": True},
        "messages": messages,
    }

    async def run() -> Result:
        async with aiohttp.ClientSession() as s:
            return await send_chat(s, url, body, f"{session}-{len(messages)}",
                                   {"x-session-id": session})  # fmt: skip

    return asyncio.run(run())


def test_the_second_turn_finds_its_prefix_through_another_front_door(three_doors: Stack) -> None:
    stack = three_doors
    shared = stack.settings.kv_events
    seoul = stack.doors[1]
    for url in (stack.admin_url, seoul.admin_url):
        wait_for(
            lambda u=url: all(
                router_state_at(u)["backends"][b]["prefix_state"]
                == ("precise" if shared else "approximate")
                for b in IDS
            ),
            10,
        )
    turn1 = [{"role": "user", "content": "a long conversation so far " * 1100}]  # ~7k tokens
    first = ask(stack.front_door_url, turn1, "s1")  # through us-ashburn's front door
    assert first.ok, first.error
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "tok " * 4},
        {"role": "user", "content": "and?"},
    ]
    if shared:  # the engine's events reach seoul's router too
        wait_for(
            lambda: (
                router_state_at(seoul.admin_url)["backends"][first.backend]["kv_events"]["blocks"]
                > 0
            )
        )
    second = ask(seoul.url, turn2, "s1")  # through ap-seoul's front door
    assert second.ok, second.error
    print(
        f"turn 1 via us-ashburn -> {first.backend} ({first.input_tokens} tokens); turn 2 via "
        f"ap-seoul -> {second.backend}: {second.cached_tokens} of {second.input_tokens} cached"
    )
    if shared:
        assert second.backend == first.backend
        assert second.cached_tokens >= 0.9 * first.input_tokens
    else:  # seoul's router knows only what it routed itself: the prefix is lost
        assert second.backend != first.backend and second.cached_tokens == 0
    # Either way the routers told each other what they dispatched, over the stack's NATS.
    heard = [router_state_at(u)["fleet"] for u in (stack.admin_url, seoul.admin_url)]
    assert all(f["connected"] for f in heard), heard
    assert heard[0]["sent"] >= 3 and heard[1]["received"] >= 3, heard  # dispatch, byte, close


def router_state_at(admin_url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{admin_url}/state", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def three_doors_two_routers() -> Stack:
    """`gorgo up --front-doors 3 --routers 2`'s stack, the e2e tier's fast engines."""
    return Stack(
        fast_settings(
            "gorgo",
            regions=DEFAULT_REGIONS,
            routers=2,
            front_door_regions=("eu-frankfurt", "ap-seoul"),
            tuner_mode="off",
        )
    )


def test_three_doors_with_two_routers_each_decide_behind_their_own_envoy() -> None:
    """`gorgo up --front-doors 3 --routers 2` (issue 60): each door's Envoy reaches its own
    two routers (they pointed at the first door's routers, whose own made no decision):
    every request through a door is decided by that door's routers. (Not necessarily by
    both: a run saw one door's 8 sequential requests all decided by one of its two; Envoy
    round-robins the ext_proc streams, and each request opens more than one.)"""
    stack = three_doors_two_routers()
    stack.start()
    try:
        doors = [
            (stack.front_door_url, stack.admin_urls),
            *((d.url, d.admin_urls) for d in stack.doors),
        ]
        for k, (url, _) in enumerate(doors):
            for i in range(8):
                hi = [{"role": "user", "content": f"door {k} request {i}"}]
                assert ask(url, hi, f"d{k}-{i}").ok
        for url, admins in doors:
            made = [router_state_at(a)["decisions"] for a in admins]
            assert len(made) == 2 and sum(made) == 8, (url, made)
    finally:
        stack.stop()


def test_a_regions_nats_frozen_fails_no_request_and_its_door_rejoins_the_cluster() -> None:
    """Issue 60: a NATS server per door, one cluster. Seoul's server frozen (SIGSTOP):
    no request fails; Seoul's router leaves it within seconds for another member, and
    hears the other doors' dispatches again while it is still frozen."""
    import os
    import signal
    import time

    stack = Stack(
        fast_settings(
            "gorgo",
            regions=DEFAULT_REGIONS,
            front_door_regions=("eu-frankfurt", "ap-seoul"),
            tuner_mode="off",
        )
    )
    stack.start()
    seoul = stack.doors[1]
    nats = stack.procs["nats-ap-seoul"].pid
    urls = [stack.front_door_url, *(d.url for d in stack.doors)]

    def bus() -> dict:
        return router_state_at(seoul.admin_url)["fleet"]

    def load(rounds: int, tag: str) -> None:
        for i in range(rounds):
            for k, url in enumerate(urls):
                hi = [{"role": "user", "content": f"{tag} {i} through door {k}"}]
                got = ask(url, hi, f"{tag}-{k}-{i}")
                assert got.ok, got.error

    try:
        assert len(stack.settings.nats_ports) == 3
        assert seoul.config.bus.nats_url.split(",")[0].endswith(str(stack.settings.nats_ports[2]))
        wait_for(lambda: bus()["connected"], 10)
        load(2, "before")
        wait_for(lambda: bus()["received"] > 0, 5)
        os.kill(nats, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            own = f"127.0.0.1:{stack.settings.nats_ports[2]}"
            assert bus()["server"] == own
            # its pings went unanswered, and another member of the cluster took it
            wait_for(lambda: bus()["disconnects"] >= 1 and bus()["server"] not in (own, None), 15)
            heard = bus()["received"]
            load(2, "frozen")  # no request fails, whatever the bus does
            wait_for(lambda: bus()["received"] > heard, 5)
            assert time.monotonic() - t0 < 25
        finally:
            os.kill(nats, signal.SIGCONT)
        load(1, "after")
    finally:
        stack.stop()
