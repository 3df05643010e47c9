"""The class reaches the engine, live through real Envoy and `gorgo serve` (issue 52): a
vLLM backend with `priority_scheduling: on` and an SGLang backend whose /server_info says
it schedules by priority receive each request's objective in their own order (vLLM: the
negated priority, lower first; SGLang: as it is, higher first), over a client's own
`priority`; /state says per backend whether and why. Engines here are small fakes in the
test that record the bodies they receive (on the stack's engine ports, behind its WAN
links), so the test reads exactly what each engine was sent.

Then the twin (emulator/engine) with its flavours' own priority flags: an interactive
request sent behind a burst of batch requests gets its first token before the burst
requests still waiting when it arrived. It needs the twin's priority scheduling (issue
52, part A): skipped, saying so, while the twin has no such flags."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from emulator.stack.settings import Region
from emulator.stack.stack import Stack
from ext_proc.config.flow import FlowControl, Objective
from ext_proc.vocab.backend import EngineKind, PriorityScheduling
from loadgen.client.stream import Result, chat_body, send_chat
from tests.e2e.conftest import FAST_ENGINE, fast_settings
from tests.e2e.stack_harness import get_json, router_state, wait_for

pytestmark = pytest.mark.e2e

REGIONS = (Region("vllm-east", 1.0), Region("sglang-west", 4.0))
FLOW = FlowControl(
    # no gateway queue: the engines' own schedulers order what they are sent
    enabled=False,
    objectives=(Objective("interactive", priority=10), Objective("batch", priority=0)),
    default_objective="batch",
)


class RecordingEngine:
    """An engine that records every request body and streams a two-token answer: vLLM's
    routes, or SGLang's with a /server_info that says it schedules by priority."""

    def __init__(self, port: int, sglang: bool) -> None:
        self.port = port
        self.sglang = sglang
        self.bodies: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for delta in ({"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}):
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "default"}]})

    async def _ok(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def _server_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"enable_priority_scheduling": True, "schedule_low_priority_values_first": False}
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._ok)
        if self.sglang:
            app.router.add_get("/server_info", self._server_info)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10)

    def stop(self) -> None:
        if self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class RecordingStack(Stack):
    """The stack with recording engines in place of the emulated ones."""

    engines: dict[int, RecordingEngine]

    def start_engine(self, i: int) -> None:
        e = RecordingEngine(self.settings.ports.engine(i), sglang=i == 1)
        e.start()
        self.engines[i] = e


@pytest.fixture(scope="module")
def stack() -> Iterator[RecordingStack]:
    s = RecordingStack(fast_settings("round_robin", REGIONS, tuner_mode="off"))
    s.engines = {}
    vllm, sglang = s.config.backends
    s.config = dataclasses.replace(
        s.config,
        flow_control=FLOW,
        backends=(
            dataclasses.replace(
                vllm, engine=EngineKind.VLLM, priority_scheduling=PriorityScheduling.ON
            ),
            dataclasses.replace(sglang, engine=EngineKind.SGLANG),  # auto: /server_info
        ),
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()
        for e in s.engines.values():
            e.stop()


def send(stack: Stack, n: int, objective: str, **fields: Any) -> list[Result]:
    async def run() -> list[Result]:
        async with aiohttp.ClientSession() as session:
            out = []
            for i in range(n):  # one at a time: round robin alternates the backends
                body = {**chat_body(f"{objective} {i}", 2), **fields}
                rid = f"{objective}-{i}-{time.monotonic_ns()}"
                headers = {"x-gorgo-objective": objective}
                out.append(await send_chat(session, stack.front_door_url, body, rid, headers, 20))
            return out

    return asyncio.run(run())


def received(stack: RecordingStack, i: int, objective: str) -> list[Any]:
    """The `priority` of each body engine i received for `objective` (None: absent)."""
    return [
        b.get("priority", None)
        for b in stack.engines[i].bodies
        if b["messages"][0]["content"].startswith(objective)
    ]


def test_each_engine_receives_the_class_in_its_own_order(stack: RecordingStack) -> None:
    # the router read the SGLang engine's /server_info before it took requests
    state = router_state(stack)["backends"]
    vllm_id, sglang_id = (r.id for r in REGIONS)
    assert state[vllm_id]["priority"]["writes"] and state[sglang_id]["priority"]["writes"]
    assert state[vllm_id]["priority"]["order"] == "lower_first"
    assert state[sglang_id]["priority"]["order"] == "higher_first"
    assert "/server_info says enable_priority_scheduling" in state[sglang_id]["priority"]["reason"]

    results = send(stack, 4, "interactive") + send(stack, 4, "batch")
    assert all(r.ok for r in results), [r.error for r in results]
    assert {r.backend for r in results} == {vllm_id, sglang_id}
    # vLLM: lower first, so the interactive class is -10; batch (0) is vLLM's default and
    # its bodies go as they came. SGLang: higher first, and a body without a priority is
    # served last there, so batch's 0 is written.
    assert received(stack, 0, "interactive") == [-10, -10]
    assert received(stack, 0, "batch") == [None, None]
    assert received(stack, 1, "interactive") == [10, 10]
    assert received(stack, 1, "batch") == [0, 0]
    # the rest of each body as the client sent it
    body = next(b for b in stack.engines[0].bodies if b.get("priority") == -10)
    assert body["stream"] is True and body["max_tokens"] == 2 and body["model"] == "default"


def test_a_clients_own_priority_gives_way_to_its_class(stack: RecordingStack) -> None:
    for e in stack.engines.values():
        e.bodies.clear()
    results = send(stack, 2, "batch", priority=-50)  # asks vLLM to serve it first
    assert all(r.ok for r in results), [r.error for r in results]
    assert received(stack, 0, "batch") == [0]
    assert received(stack, 1, "batch") == [0]


# -- the twin's priority scheduling: interactive overtakes the burst ---------------------

# The twin's flags for priority scheduling, as its flavours' engines name them.
TWIN_FLAGS = {
    "vllm": ("--scheduling-policy", "priority"),
    "sglang": ("--enable-priority-scheduling",),
}


def twin_has(flavor: str) -> bool:
    """Whether `gorgo engine` takes the flavour's priority flag (part A of issue 52)."""
    out = subprocess.run(
        [sys.executable, "-m", "ext_proc.cli", "engine", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return TWIN_FLAGS[flavor][0] in out


# One request at a time in the engine and a prefill of ~0.3 s: a burst queues there.
SLOW_ONE_AT_A_TIME = {
    "vllm": (*FAST_ENGINE, "--max-num-seqs", "1", "--set", "prefill_base_ms=300"),
    "sglang": (*FAST_ENGINE, "--max-running-requests", "1", "--set", "prefill_base_ms=300"),
}
BURST = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.long
@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_interactive_overtakes_the_burst_in_the_twin(flavor: str) -> None:
    if not twin_has(flavor):
        pytest.skip(
            f"the twin has no {' '.join(TWIN_FLAGS[flavor])} yet (issue 52 part A, branch "
            "h-prio-twin): run again after it is merged"
        )
    args = (*SLOW_ONE_AT_A_TIME[flavor], *TWIN_FLAGS[flavor])
    s = Stack(fast_settings("round_robin", (Region("one", 1.0),), engine_args=args, flavor=flavor))
    (b,) = s.config.backends
    # vLLM reports nothing: on; SGLang's twin says so on /server_info: auto finds it
    setting = PriorityScheduling.ON if flavor == "vllm" else PriorityScheduling.AUTO
    s.config = dataclasses.replace(
        s.config, flow_control=FLOW, backends=(dataclasses.replace(b, priority_scheduling=setting),)
    )
    s.start()
    try:
        wait_for(lambda: router_state(s)["backends"]["one"]["priority"]["writes"], 10)
        # the model the engine serves (vLLM's twin answers 404 to any other name)
        model = get_json(f"{s.front_door_url}/v1/models")["data"][0]["id"]

        async def run() -> tuple[float, float, list[tuple[float, Result]]]:
            async with aiohttp.ClientSession() as session:

                async def one(tag: str, objective: str) -> tuple[float, Result]:
                    start = time.monotonic()
                    r = await send_chat(
                        session,
                        s.front_door_url,
                        chat_body(f"{tag} write", 4, model=model),
                        f"{tag}-{time.monotonic_ns()}",
                        {"x-gorgo-objective": objective},
                        60,
                    )
                    return start + (r.ttft_ms or 1e9) / 1000, r

                burst = [asyncio.create_task(one(f"b{i}", "batch")) for i in range(BURST)]
                await asyncio.sleep(0.5)  # the burst is in the engine: one served, the rest wait
                sent_s = time.monotonic()
                first_s, interactive = await one("i", "interactive")
                assert interactive.ok, interactive.error
                return sent_s, first_s, list(await asyncio.gather(*burst))

        sent_s, first_s, burst = asyncio.run(run())
        assert all(r.ok for _, r in burst), [r.error for _, r in burst]
        waiting = sorted(t for t, _ in burst if t > sent_s)  # no first token when it was sent
        print(
            f"{flavor}: interactive first token {first_s - sent_s:.2f} s after it was sent; "
            f"the {len(waiting)} burst requests waiting then got theirs "
            f"{', '.join(f'{t - sent_s:.2f}' for t in waiting)} s after"
        )
        assert len(waiting) >= 3, "the burst did not queue in the engine"
        # the one running (or being prefilled) when it came may finish first; no other
        assert sum(t < first_s for t in waiting) <= 1, (first_s - sent_s, waiting)
    finally:
        s.stop()
