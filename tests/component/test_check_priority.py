"""`gorgo check` and the priority the router writes for the engines: a vLLM backend with
`priority_scheduling: on` gets one request with a priority (max_tokens 1), and a vLLM that
answers it 400 (no `--scheduling-policy priority`) is a problem whose fix names the flag and
the key; an SGLang backend's /server_info says whether its priority is written, and `on`
against an SGLang that does not schedule by priority is a problem. Fakes with the engines'
behaviour on real sockets (vLLM validates `priority` against its scheduling policy)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from ext_proc.config.load import config_from_dict
from ext_proc.service.check.judge import judge
from ext_proc.service.check.probes import TRIAL_PRIORITY, look_at_fleet
from ext_proc.service.check.report import render_text
from ext_proc.service.check.verdict import Verdict

TIMEOUT_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeEngine:
    """/v1/models, /health, /metrics and /v1/completions as vLLM answers them (a non-zero
    priority refused 400 unless it schedules by priority), or SGLang's /server_info."""

    def __init__(self, priority: bool, sglang: bool = False) -> None:
        self.priority = priority
        self.sglang = sglang
        self.completions: list[dict[str, Any]] = []
        self.port = free_port()

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "root": "/m"}]})

    async def ok(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(self, _: web.Request) -> web.Response:
        name = "sglang:num_queue_reqs" if self.sglang else "vllm:num_requests_waiting"
        running = "sglang:num_running_reqs" if self.sglang else "vllm:num_requests_running"
        return web.Response(text=f"{name} 0\n{running} 0\n")

    async def completion(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.completions.append(body)
        if body.get("priority", 0) != 0 and not self.priority:
            # vLLM's words (v1/engine: a priority without the priority policy)
            return web.json_response(
                {"error": {"message": "Got priority 1 but Priority scheduling is not enabled."}},
                status=400,
            )
        return web.json_response({"choices": [{"text": "x"}]})

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "enable_priority_scheduling": self.priority,
                "schedule_low_priority_values_first": False,
            }
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.ok)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completion)
        if self.sglang:
            app.router.add_get("/server_info", self.server_info)
        return app


Start = Callable[..., Any]


@pytest.fixture
async def engines() -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def start(priority: bool, sglang: bool = False) -> FakeEngine:
        e = FakeEngine(priority, sglang)
        runner = web.AppRunner(e.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", e.port).start()
        runners.append(runner)
        return e

    yield start
    for r in runners:
        await r.cleanup()


async def check(backends: list[dict[str, Any]]) -> Verdict:
    cfg = config_from_dict({"backends": backends})
    look = await look_at_fleet(cfg, TIMEOUT_S)
    verdict = judge(cfg, look)
    render_text("gorgo.yaml", verdict, look)  # renders
    return verdict


def vllm(e: FakeEngine, setting: str, id: str = "a") -> dict[str, Any]:
    return {
        "id": id,
        "address": f"127.0.0.1:{e.port}",
        "engine": "vllm",
        "priority_scheduling": setting,
    }


async def test_a_vllm_that_refuses_a_priority_is_a_problem_with_its_fix(engines: Start) -> None:
    e = await engines(priority=False)
    verdict = await check([vllm(e, "on")])
    (problem,) = verdict.problems
    assert problem.where == "backend a"
    assert "answers 400 to a request with a priority" in problem.what
    assert "Priority scheduling is not enabled" in problem.what
    assert problem.fix == (
        "start vLLM with --scheduling-policy priority, or set backends[0].priority_scheduling: off"
    )
    # the one request it was sent: a priority, one token, the model it serves
    assert e.completions == [
        {"model": "tiny", "prompt": "gorgo check", "max_tokens": 1, "priority": TRIAL_PRIORITY}
    ]
    assert not verdict.backends[0].priority.precise


async def test_a_vllm_that_takes_it_is_all_well_and_others_are_not_sent_one(
    engines: Start,
) -> None:
    good, other = await engines(priority=True), await engines(priority=False)
    verdict = await check([vllm(good, "on"), vllm(other, "auto", "b")])
    assert verdict.problems == []
    on, auto = verdict.backends
    assert on.priority.precise and "took a request with a priority" in on.priority.how
    assert not auto.priority.precise and "does not report" in auto.priority.how
    assert len(good.completions) == 1 and other.completions == []  # auto: nothing sent


async def test_sglang_says_by_its_server_info(engines: Start) -> None:
    on, off = await engines(priority=True, sglang=True), await engines(priority=False, sglang=True)
    verdict = await check(
        [
            {"id": "a", "address": f"127.0.0.1:{on.port}", "engine": "sglang"},
            {"id": "b", "address": f"127.0.0.1:{off.port}", "engine": "sglang"},
        ]
    )
    assert verdict.problems == []
    a, b = verdict.backends
    assert a.priority.precise and "higher values first" in a.priority.how
    assert not b.priority.precise and "enable_priority_scheduling false" in b.priority.how
    # told on, against an SGLang whose scheduler ignores it: a problem
    verdict = await check(
        [{"id": "b", "address": f"127.0.0.1:{off.port}", "priority_scheduling": "on"}]
    )
    (problem,) = verdict.problems
    assert "ignores the priority" in problem.what
    assert problem.fix == (
        "start SGLang with --enable-priority-scheduling, or set "
        "backends[0].priority_scheduling: auto"
    )
