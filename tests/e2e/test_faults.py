"""Faults through real Envoy and the emulated fleet: the router never fails a request and
follows the fleet when a region fails, slows down, or comes back."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from emulator.stack.settings import Region
from emulator.stack.stack import Stack
from loadgen.client.stream import Result, chat_body
from tests.e2e.conftest import FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import chats, router_state, spread_regions, wait_for

pytestmark = pytest.mark.e2e

ASHBURN, FRANKFURT, SEOUL = (r.id for r in FAST_REGIONS)


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings("gorgo", wan_control=True, probe_interval_s=0.2, tuner_mode="off"))
    s.start()
    yield s
    s.stop()


def post_json(url: str, body: dict[str, object]) -> None:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    urllib.request.urlopen(req, timeout=5).close()


@pytest.mark.long  # `make test-long`
def test_a_backend_answering_5xx_is_avoided_within_3_requests(stack: Stack) -> None:
    url = stack.front_door_url
    spread_regions(stack)  # ashburn is clearly the best region...
    # ...until it starts failing every request
    post_json(f"{stack.engine_url(0)}/faults", {"error_rate": 1.0})
    results = []
    for i in range(8):  # one at a time, so each completion is seen before the next decision
        wait_for(lambda: router_state(stack)["in_flight"] == 0)
        (r,) = asyncio.run(chats(url, [chat_body(f"q{i} " * 20, 2)]))
        results.append(r)
    failed_on_ashburn = [i for i, r in enumerate(results) if r.backend == ASHBURN]
    assert len(failed_on_ashburn) <= 3 and failed_on_ashburn == list(range(len(failed_on_ashburn)))
    assert all(r.ok for r in results[3:])
    # recovered: re-admitted once its ejection cools down
    post_json(f"{stack.engine_url(0)}/faults", {"error_rate": 0.0})
    time.sleep(5.5)
    wait_for(lambda: router_state(stack)["in_flight"] == 0)
    (r,) = asyncio.run(chats(url, [chat_body("back", 2)]))
    assert r.ok and r.backend == ASHBURN


def test_a_stalled_backend_is_avoided_within_3_requests(stack: Stack) -> None:
    url = stack.front_door_url
    spread_regions(stack)
    (warm,) = asyncio.run(chats(url, [chat_body("warm-up", 2)]))  # first bytes are observed
    assert warm.ok
    # ashburn still answers probes but holds every generation for 3 s
    post_json(f"{stack.engine_url(0)}/faults", {"stall_rate": 1.0, "stall_ms": 3000})

    async def arrivals() -> list[Result]:  # one request every 0.5 s, not waiting for any
        async def one(i: int) -> Result:
            await asyncio.sleep(0.5 * i)
            (r,) = await chats(url, [chat_body(f"s{i} " * 20, 2)])
            return r

        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(arrivals())
    assert all(r.ok for r in results), [r.error for r in results]
    stalled = [i for i, r in enumerate(results) if r.backend == ASHBURN]
    print(f"requests sent to the stalled backend: {stalled} of 8")
    assert len(stalled) <= 3 and stalled == list(range(len(stalled))), stalled
    # the stall is over and its requests answered: ashburn is chosen again
    post_json(f"{stack.engine_url(0)}/faults", {"stall_rate": 0.0})
    wait_for(lambda: router_state(stack)["in_flight"] == 0)
    (r,) = asyncio.run(chats(url, [chat_body("after the stall", 2)]))
    assert r.ok and r.backend == ASHBURN


def test_a_link_whose_rtt_grows_is_followed_within_10_s(stack: Stack) -> None:
    wait_for(lambda: router_state(stack)["backends"][ASHBURN]["rtt_samples"] > 0)
    start = time.monotonic()
    stack.set_rtt_ms(0, 200)  # ashburn becomes the farthest region
    wait_for(lambda: router_state(stack)["backends"][ASHBURN]["rtt_ms"] > 100, timeout_s=10)
    (r,) = asyncio.run(chats(stack.front_door_url, [chat_body("after", 2)]))
    assert r.ok and r.backend != ASHBURN
    assert time.monotonic() - start < 10


# a 2 s bound on a restart: met alone, missed by 0.7 s with the other test worker busy
@pytest.mark.long  # `make test-long`, retried once in CI
def test_router_killed_during_load_fails_no_request_and_resumes_within_2_s(stack: Stack) -> None:
    url = stack.front_door_url
    results: list[object] = []
    stop = threading.Event()

    def load() -> None:  # a steady stream of requests while the router dies and returns
        while not stop.is_set():
            results.extend(asyncio.run(chats(url, [chat_body("load " * 30, 4)] * 4)))

    t = threading.Thread(target=load)
    t.start()
    try:
        time.sleep(0.5)
        stack.kill("gorgo-serve", signal.SIGKILL)
        time.sleep(1.0)
        restarted = time.monotonic()
        stack.start_router()
        stack.wait_router_ready()
        wait_for(lambda: router_state(stack)["decisions"] > 0, timeout_s=5)
        resumed_s = time.monotonic() - restarted
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(timeout=30)
    assert results and all(r.ok for r in results), [r.error for r in results if not r.ok]
    print(f"routing resumed {resumed_s:.2f} s after the restart, {len(results)} requests")
    assert resumed_s < 2.0


def test_sigterm_drains_in_flight_requests_within_the_deadline(stack: Stack) -> None:
    # every engine holds a request 1.5 s: one is still in flight when SIGTERM arrives
    for i in range(len(FAST_REGIONS)):
        post_json(f"{stack.engine_url(i)}/faults", {"stall_rate": 1.0, "stall_ms": 1500})
    proc = stack.procs["gorgo-serve"]
    log_path = stack.workdir / "gorgo-serve.log"
    t0 = 0.0

    async def request_then_sigterm() -> list[Result]:
        nonlocal t0
        routed = asyncio.ensure_future(chats(stack.front_door_url, [chat_body("drain", 2)]))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while "stopping:" not in log_path.read_text():  # draining now
            assert time.monotonic() - t0 < 3
            await asyncio.sleep(0.02)
        # a new request fails open to the fallback route
        late = await chats(stack.front_door_url, [chat_body("late", 2)])
        return [*await routed, *late]

    results = asyncio.run(request_then_sigterm())
    proc.wait(timeout=10)
    assert all(r.ok for r in results) and proc.returncode == 0
    assert time.monotonic() - t0 < 7  # drain deadline 5 s
    log = log_path.read_text()
    # the request was in flight at SIGTERM, and its completion was recorded in the drain;
    # the late one was never routed by the router (it would have been in flight too)
    assert re.search(r"stopping: \d+ ext_proc streams open, 1 requests in flight", log), log
    assert "stopped: 1 requests completed while draining, 0 still in flight" in log, log


@pytest.mark.long  # `make test-long`
@pytest.mark.parametrize("envoy_mode", ["cluster", "endpoint_picker"])
def test_connect_failures_are_retried_on_another_backend_and_the_backend_avoided(
    envoy_mode: str,
) -> None:
    # Probes slow enough that only the requests themselves can reveal the dead backend;
    # regions far enough apart that the nearest wins every decision while it is in rotation.
    regions = [
        Region(r.id, rtt_ms) for r, rtt_ms in zip(FAST_REGIONS, (1.0, 60.0, 120.0), strict=True)
    ]
    s = Stack(
        fast_settings(
            "gorgo", regions, probe_interval_s=60, tuner_mode="off", envoy_mode=envoy_mode
        )
    )
    s.start()
    try:
        # the two nearest regions now refuse connections: a request for either needs two
        # retries to reach the third
        s.kill("wan-us-ashburn")
        s.kill("wan-eu-frankfurt")
        results = []
        for i in range(6):
            wait_for(lambda: router_state(s)["in_flight"] == 0)
            (r,) = asyncio.run(chats(s.front_door_url, [chat_body(f"c{i} " * 20, 2)]))
            results.append(r)
        assert all(r.ok for r in results), [r.error for r in results]
        assert {r.backend for r in results} == {SEOUL}
        state = router_state(s)
        decided = [d["backend"] for d in state["recent_decisions"]][-6:]
        # each chosen while nothing said it was down, each ejected after 2 failovers
        assert decided == [ASHBURN, ASHBURN, FRANKFURT, FRANKFURT, SEOUL, SEOUL], decided
        for dead in (ASHBURN, FRANKFURT):
            assert state["backends"][dead]["failovers"] == 2
            assert state["backends"][dead]["ejected"]
    finally:
        s.stop()
