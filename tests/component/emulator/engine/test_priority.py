"""The twin's priority scheduling over real HTTP on 127.0.0.1: the body's `priority` as each
flavor takes it (vLLM 0.32 as measured here, SGLang from its source), the engines' flags,
what /server_info, /stats, /metrics and the log show, and a request that overtakes a
burst. The schedule itself is tests/unit/emulator/engine/test_model_priority.py's."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from emulator.engine.config import SGLANG, VLLM, EngineConfig
from emulator.engine.priority import PriorityScheduling
from ext_proc.cli import build_parser
from tests.component.engine_harness import CHAT, COMPLETIONS, FAST, GENERATE, MESSAGES, NAME
from tests.component.engine_harness import running as engine_running

# One slot, ~0.1 s per 1,000-token prefill: a burst queues in the engine.
ONE_SLOT = replace(FAST, name="one-slot", prefill_tokens_per_s=10_000.0, max_running_requests=1)
PROMPT = "x " * 2_000  # ~1,000 tokens with the 4-byte approximation


def cfg_of(flavor: str, **overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = {"name": NAME, "profile": FAST, "flavor": flavor}
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@pytest.mark.parametrize("flavor", [VLLM, SGLANG])
async def test_without_the_flag_a_priority_is_taken_and_ignored(
    flavor: str, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.32 answers 200 to a non-zero priority without --scheduling-policy priority
    (measured here: 5 and -3 on chat and completions; v1 has no check of it), SGLang
    ignores it unless --abort-on-priority-when-disabled (scheduler.py
    _set_or_validate_priority). The log and /stats show what it carried."""
    caplog.set_level(logging.INFO, logger="emulator.engine.server")
    async with engine_running(cfg_of(flavor)) as srv:
        body = {"model": "emulated", "messages": MESSAGES, "max_tokens": 2, "priority": 5}
        status, data = await post(http, srv.url + CHAT, body)
        assert status == 200, data
        status, _ = await post(http, srv.url + COMPLETIONS, {"prompt": "hi", "priority": -3})
        assert status == 200
        stats = await get(http, srv.url + "/stats")
    assert stats["priority"] == {
        "scheduling": False,
        "requests_by_priority": {"5": 1, "-3": 1},
        "preempted_total": 0,
        "preempted_by_priority": {},
    }
    logged = [r.getMessage() for r in caplog.records if "priority" in r.getMessage()]
    assert len(logged) == 2 and logged[0].endswith("priority 5")


@pytest.mark.parametrize("flavor", [VLLM, SGLANG])
async def test_a_priority_that_is_not_an_integer_is_400(
    flavor: str, http: aiohttp.ClientSession
) -> None:
    """Measured on vLLM 0.32: {"error": {"message": "1 validation error: ... int_parsing
    ... body.priority", "type": "Bad Request", "param": "body.priority", "code": 400}}."""
    async with engine_running(cfg_of(flavor)) as srv:
        body = {"messages": MESSAGES, "priority": "high"}
        status, data = await post(http, srv.url + CHAT, body)
    assert status == 400
    if flavor == VLLM:
        assert data["error"]["param"] == "body.priority"
        assert data["error"]["type"] == "Bad Request"
    else:
        assert data["object"] == "error" and "priority" in data["message"]


async def test_vllm_reads_the_priority_header_before_the_body(
    http: aiohttp.ClientSession,
) -> None:
    """entrypoints/generate/base/serving.py _get_priority: X-Vllm-Priority, if an integer."""
    async with engine_running(cfg_of(VLLM)) as srv:
        body = {"model": "emulated", "prompt": "hi", "max_tokens": 1, "priority": 4}
        await post(http, srv.url + COMPLETIONS, body, **{"X-Vllm-Priority": "-7"})
        await post(http, srv.url + COMPLETIONS, body, **{"X-Vllm-Priority": "soon"})
        stats = await get(http, srv.url + "/stats")
    assert stats["priority"]["requests_by_priority"] == {"-7": 1, "4": 1}


SGLANG_DEFAULTS = {
    "schedule_policy": "fcfs",
    "enable_priority_scheduling": False,
    "schedule_low_priority_values_first": False,
    "priority_scheduling_preemption_threshold": 10,
    "disable_priority_preemption": False,
}


@pytest.mark.parametrize(
    ("priority", "expected"),
    [
        (None, SGLANG_DEFAULTS),
        (
            PriorityScheduling(low_values_first=True, preemption_threshold=3),
            {
                **SGLANG_DEFAULTS,
                "enable_priority_scheduling": True,
                "schedule_low_priority_values_first": True,
                "priority_scheduling_preemption_threshold": 3,
            },
        ),
    ],
)
async def test_sglang_server_info_reports_its_priority_args(
    priority: PriorityScheduling | None, expected: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    """server_args.py's names, on /server_info and /get_server_info (http_server.py)."""
    async with engine_running(cfg_of(SGLANG, priority=priority)) as srv:
        for path in ("/server_info", "/get_server_info"):
            info = await get(http, srv.url + path)
            assert {k: info[k] for k in expected} == expected


async def test_vllm_twin_reports_its_scheduling_policy(http: aiohttp.ClientSession) -> None:
    for priority, policy in ((None, "fcfs"), (PriorityScheduling.vllm(), "priority")):
        async with engine_running(cfg_of(VLLM, priority=priority)) as srv:
            info = await get(http, srv.url + "/server_info")
            assert info["scheduling_policy"] == policy
            async with http.get(srv.url + "/metrics") as resp:
                assert "vllm:num_preemptions_total{" in await resp.text()


@pytest.mark.parametrize(
    ("flavor", "priority", "low", "urgent"),
    [
        (VLLM, PriorityScheduling.vllm(), 0, -1),  # lower first
        (SGLANG, PriorityScheduling(), 0, 5),  # higher first (5: within the threshold)
        (SGLANG, PriorityScheduling(low_values_first=True), 0, -5),
    ],
)
async def test_an_urgent_request_overtakes_the_waiting_burst(
    flavor: str,
    priority: PriorityScheduling,
    low: int,
    urgent: int,
    http: aiohttp.ClientSession,
) -> None:
    """One slot; four low requests, then an urgent one while the first runs: it finishes
    before the three still waiting when it arrived (with the flag off: after them all)."""
    for on in (True, False):
        cfg = cfg_of(flavor, profile=ONE_SLOT, priority=priority if on else None)
        async with engine_running(cfg) as srv:
            done: dict[str, float] = {}

            async def send(
                rid: str, prio: int, url: str = srv.url, done: dict[str, float] = done
            ) -> None:
                body = {"model": "emulated", "prompt": PROMPT, "max_tokens": 2, "priority": prio}
                status, _ = await post(http, url + COMPLETIONS, body)
                assert status == 200
                done[rid] = time.perf_counter()

            burst = [asyncio.create_task(send(f"low{i}", low)) for i in range(4)]
            await asyncio.sleep(0.03)  # low0 is prefilling
            await send("urgent", urgent)
            await asyncio.gather(*burst)
        later = [r for r in ("low1", "low2", "low3") if done[r] > done["urgent"]]
        assert later == (["low1", "low2", "low3"] if on else [])


async def test_sglang_generate_takes_a_priority(http: aiohttp.ClientSession) -> None:
    """GenerateReqInput.priority (io_struct.py), top level of the /generate body."""
    async with engine_running(cfg_of(SGLANG, priority=PriorityScheduling())) as srv:
        status, _ = await post(http, srv.url + GENERATE, {"text": "hi", "priority": 9})
        assert status == 200
        stats = await get(http, srv.url + "/stats")
    assert stats["priority"]["requests_by_priority"] == {"9": 1}
    assert stats["priority"]["scheduling"] is True


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--flavor", "sglang", "--scheduling-policy", "priority"], "--scheduling-policy is vllm"),
        (["--flavor", "vllm", "--enable-priority-scheduling"], "--enable-priority-scheduling"),
        (["--flavor", "vllm", "--schedule-low-priority-values-first"], "is sglang's flag"),
    ],
)
def test_the_other_engines_priority_flag_is_refused(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["engine", "--name", "x", "--port", "0", *argv])
    assert args.func(args) == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--flavor", "vllm"], None),
        (["--flavor", "vllm", "--scheduling-policy", "priority"], PriorityScheduling.vllm()),
        (["--flavor", "sglang", "--schedule-low-priority-values-first"], None),
        (
            [
                "--flavor",
                "sglang",
                "--enable-priority-scheduling",
                "--schedule-low-priority-values-first",
                "--priority-scheduling-preemption-threshold",
                "2",
                "--disable-priority-preemption",
            ],
            PriorityScheduling(low_values_first=True, preemption_threshold=2, preemption=False),
        ),
    ],
)
def test_the_engines_flags_set_the_twins_priority(
    argv: list[str], expected: PriorityScheduling | None
) -> None:
    from emulator.cli import _priority_setting

    args = build_parser().parse_args(["engine", "--name", "x", "--port", "0", *argv])
    assert _priority_setting(args) == expected
