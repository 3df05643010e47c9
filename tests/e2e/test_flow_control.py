"""Flow control live, through real Envoy and the emulated engines (issue 41): a burst
beyond the fleet's room waits in the router and drains (/state and the operator page's
feed show it); an interactive request sent during the burst goes before the batch ones
ahead of it; a sheddable class past its longest wait gets 429 with Retry-After and the
reason; the OpenAI SDK in such a class retries as retry-after-ms says until its calls
succeed; a `regions` constraint is obeyed; a router killed with requests held fails none.

The engines admit two requests at a time and decode 30 tokens at 20 ms a step (~0.6 s a
request), and a backend has room for one request waiting for its first token: three
backends take nine of a burst, the rest wait in the router."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from emulator.stack.stack import Stack
from ext_proc.common.names import HEADER_FLOW_REASON
from ext_proc.config.flow import FlowControl, Objective
from loadgen.client.stream import Result, chat_body, send_chat
from tests.e2e.conftest import FAST_ENGINE, fast_settings
from tests.e2e.stack_harness import FRANKFURT, get_json, router_state, wait_for

pytestmark = pytest.mark.e2e

SLOW_DECODE = (
    *FAST_ENGINE,
    *("--set", "decode_base_ms=20", "--set", "max_running_requests=2"),
)
FLOW = FlowControl(
    enabled=True,
    max_waiting_requests=1,
    # a refused request comes back in 250 ms: Retry-After 1 (whole seconds, rounded up),
    # retry-after-ms 250
    retry_after_s=0.25,
    objectives=(
        Objective("interactive", priority=10),
        Objective("batch", priority=0, max_wait_s=60),
        Objective("impatient", priority=0, sheddable=True, max_wait_s=1),
        Objective("retrying", priority=0, sheddable=True, max_wait_s=0.2),
        Objective("eu", priority=10, regions=(FRANKFURT,)),
    ),
    default_objective="batch",
)
OUTPUT_TOKENS = 30


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings("gorgo", engine_args=SLOW_DECODE, tuner_mode="off"))
    s.config = dataclasses.replace(s.config, flow_control=FLOW)
    s.start()
    yield s
    s.stop()


def flow(stack: Stack) -> Any:
    return router_state(stack)["flow"]


async def timed_chat(
    session: aiohttp.ClientSession, url: str, rid: str, objective: str
) -> tuple[float, Result]:
    """(when its first token came, monotonic s; the result)."""
    start_s = time.monotonic()
    body = chat_body(f"{rid} write a story", OUTPUT_TOKENS)
    r = await send_chat(session, url, body, rid, {"x-gorgo-objective": objective}, 60)
    return start_s + (r.ttft_ms or 1e9) / 1000, r


async def burst_with(
    stack: Stack, n: int, during: Any, min_held: int = 10
) -> tuple[list[tuple[float, Result]], Any]:
    """n batch requests at once; once at least min_held wait in the router, `during()`
    (an async callable) runs beside them. (the burst's results, what `during` returned)"""
    async with aiohttp.ClientSession() as s:
        url = stack.front_door_url
        tasks = [asyncio.ensure_future(timed_chat(s, url, f"batch-{i}", "batch")) for i in range(n)]
        deadline = time.monotonic() + 10
        while (await asyncio.to_thread(flow, stack))["waiting"] < min_held:
            assert time.monotonic() < deadline, "the burst was never held"
            await asyncio.sleep(0.02)
        extra = await during(s)
        return list(await asyncio.gather(*tasks)), extra


def test_a_burst_is_held_and_drains_and_interactive_goes_first(stack: Stack) -> None:
    seen: list[int] = []

    async def interactive(s: aiohttp.ClientSession) -> tuple[int, float, Result]:
        held = (await asyncio.to_thread(flow, stack))["waiting"]
        page = await asyncio.to_thread(get_json, f"{stack.admin_url}/ui/feed")
        seen.append(page["flow"]["waiting"])
        first_s, r = await timed_chat(s, stack.front_door_url, "vip", "interactive")
        return held, first_s, r

    burst, (held, vip_first_s, vip) = asyncio.run(burst_with(stack, 30, interactive))
    assert vip.ok and all(r.ok for _, r in burst), [r.error for _, r in burst if not r.ok]
    # The batch requests still waiting when it came: it goes before nearly all of them
    # (up to one released to each other backend while its own slot frees may beat it).
    later = sum(1 for first_s, _ in burst if first_s > vip_first_s)
    print(
        f"\nburst of 30: {held} held when the interactive request came, {later} batch "
        f"first tokens after its; its TTFT {vip.ttft_ms:.0f} ms, the burst's last "
        f"{max(r.ttft_ms or 0 for _, r in burst):.0f} ms"
    )
    assert held >= 10 and later >= held - 4
    assert seen and seen[0] > 0  # the page showed the queue
    # drained: nothing waits, and what waited was released
    wait_for(lambda: flow(stack)["waiting"] == 0)
    state = flow(stack)
    assert state["outcomes"]["released"] >= held and state["oldest_wait_s"] == 0.0


def test_a_sheddable_class_past_its_longest_wait_gets_429_with_retry_after(
    stack: Stack,
) -> None:
    async def impatient(s: aiohttp.ClientSession) -> tuple[int, dict[str, str], Any, float]:
        start_s = time.monotonic()
        headers = {"content-type": "application/json", "x-gorgo-objective": "impatient"}
        body = chat_body("impatient: a story", OUTPUT_TOKENS)
        async with s.post(
            f"{stack.front_door_url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            return r.status, dict(r.headers), await r.json(), time.monotonic() - start_s

    burst, (status, headers, payload, took_s) = asyncio.run(burst_with(stack, 30, impatient))
    assert all(r.ok for _, r in burst)
    print(f"\nimpatient during a burst: {status} after {took_s:.2f} s, {headers}")
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert headers["retry-after-ms"] == "250"  # flow_control.retry_after_s, exact
    assert headers[HEADER_FLOW_REASON] == "rejected-ttl-expired"
    error = payload["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert 1.0 <= took_s < 3.0  # refused once its longest wait (1 s) passed, not later


def test_the_openai_sdk_retries_when_retry_after_ms_says_and_every_call_succeeds(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """Four calls of the OpenAI SDK (its own retries, max 20) in a class that waits at
    most 0.2 s, sent while a burst fills the queue: refused 429 until the burst drains,
    each refusal saying 250 ms in retry-after-ms (1 s in Retry-After). The SDK waits what
    the milliseconds say (its log, and the time each retry came after its refusal), and
    every call succeeds in the end."""
    # (when, which call, "request" or the response's status, its retry headers)
    seen: list[tuple[float, str, str, dict[str, str]]] = []

    async def on_request(request: Any) -> None:
        seen.append((time.monotonic(), request.headers["x-call"], "request", {}))

    async def on_response(response: Any) -> None:
        said = {k: response.headers.get(k, "") for k in ("retry-after", "retry-after-ms")}
        call = response.request.headers["x-call"]
        seen.append((time.monotonic(), call, str(response.status_code), said))

    async def sdk_calls(_: aiohttp.ClientSession) -> tuple[list[str], float]:
        client = openai.AsyncOpenAI(
            base_url=f"{stack.front_door_url}/v1",
            api_key="unused",
            max_retries=20,
            default_headers={"x-gorgo-objective": "retrying"},
            http_client=openai.DefaultAsyncHttpxClient(
                event_hooks={"request": [on_request], "response": [on_response]}
            ),
        )
        start_s = time.monotonic()
        try:
            answers = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="m",
                        messages=[{"role": "user", "content": f"sdk {i}"}],
                        max_tokens=3,
                        extra_headers={"x-call": str(i)},
                    )
                    for i in range(4)
                )
            )
        finally:
            await client.close()
        return [a.choices[0].message.content or "" for a in answers], time.monotonic() - start_s

    before = flow(stack)["outcomes"].get("rejected-ttl-expired", 0)
    with caplog.at_level(logging.INFO, logger="openai"):
        burst, (texts, took_s) = asyncio.run(burst_with(stack, 24, sdk_calls))
    assert all(r.ok for _, r in burst)
    assert texts == ["tok tok tok "] * 4  # every call succeeded in the end
    refused = [(t, call, h) for t, call, what, h in seen if what == "429"]
    waits = [r.args[0] for r in caplog.records if r.getMessage().startswith("Retrying request")]
    print(
        f"\nOpenAI SDK during a burst: 4 calls done in {took_s:.2f} s after "
        f"{len(refused)} refusals; the SDK's waits {sorted(set(waits))} s"
    )
    assert refused, "the burst never made the router refuse"
    assert {h["retry-after"] for _, _, h in refused} == {"1"}
    assert {h["retry-after-ms"] for _, _, h in refused} == {"250"}
    # the SDK waited what retry-after-ms said, once per refusal: not Retry-After's 1 s,
    # nor its own backoff (0.375-0.5 s for a first retry) ...
    assert waits == [0.25] * len(refused)
    # ... and the call came back then: its next request 0.25 s after the refusal (and the
    # scheduling of a loop that runs the burst's clients too), well before 1 s
    gaps = [
        min(r - t for r, c, what, _ in seen if c == call and what == "request" and r > t)
        for t, call, _ in refused
    ]
    print(f"each refused call's next request {min(gaps):.3f}-{max(gaps):.3f} s after the 429")
    assert min(gaps) >= 0.25 and max(gaps) < 0.6, gaps
    after = flow(stack)["outcomes"]["rejected-ttl-expired"]
    assert after - before == len(refused)


def test_a_regions_constraint_is_obeyed(stack: Stack) -> None:
    async def eu_only() -> list[Result]:
        async with aiohttp.ClientSession() as s:
            return list(
                await asyncio.gather(
                    *(
                        send_chat(
                            s,
                            stack.front_door_url,
                            chat_body(f"eu {i}", 4),
                            f"eu-{i}",
                            {"x-gorgo-objective": "eu"},
                        )
                        for i in range(12)
                    )
                )
            )

    results = asyncio.run(eu_only())
    assert all(r.ok for r in results)
    assert {r.backend for r in results} == {FRANKFURT}


def test_a_router_killed_while_holding_requests_fails_none(stack: Stack) -> None:
    killed: list[int] = []

    async def kill(_: aiohttp.ClientSession) -> None:
        killed.append((await asyncio.to_thread(flow, stack))["waiting"])
        os.kill(stack.procs["gorgo-serve"].pid, signal.SIGKILL)

    burst, _ = asyncio.run(burst_with(stack, 40, kill, min_held=20))
    failed = [r for _, r in burst if not r.ok]
    print(f"\nrouter kill -9 with {killed[0]} requests held: {len(failed)} of 40 failed")
    assert killed[0] >= 20 and not failed, [r.error for r in failed]
