"""The emulated engine over real HTTP on 127.0.0.1 (no mocks), in its default flavor, the
twin of SGLang; tests/component/emulator/engine/test_flavors.py sets the two flavors side by side.

Timing comes from `emulator.engine.model.scheduler.EngineModel`. Tests where timing is not
the point run a fast profile (1 ms steps); tests about timing run the real default profile
and only check orderings and generous lower bounds: a token may leave late on a loaded
machine, but never before the model's schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from emulator.engine.config import EngineConfig, Faults, zero_delay_profile
from emulator.engine.runner import body_digest
from emulator.engine.server import (
    ENGINE_ID_HEADER,
    ENGINE_KEY,
    EngineServer,
    make_app,
    serve_engine,
)
from ext_proc.estimate.profile import EngineProfile
from ext_proc.prompt.tokens import count_tokens, render_chat
from tests.component.engine_harness import (
    CHAT,
    COMPLETIONS,
    DEFAULT,
    FAST,
    GENERATE,
    MESSAGES,
    NAME,
    filler,
    read_sse,
    running,
)

BLOCK = DEFAULT.block_tokens
CAP = 64


def error_message(data: dict[str, Any]) -> str:
    """The message of an SGLang error body: its OpenAI routes answer a flat ErrorResponse
    (serving_base.py create_error_response), its own routes {"error": {"message"}}."""
    if "error" in data:
        return str(data["error"]["message"])
    assert data["object"] == "error"
    return str(data["message"])


RID = re.compile(r"^[0-9a-f]{32}$")  # SGLang's request id, a uuid4 hex: no chatcmpl- prefix


def fast_cfg(**overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = {
        "name": NAME,
        "profile": FAST,
        "default_max_tokens": 5,
        "max_tokens_cap": CAP,
    }
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    async with running(fast_cfg()) as srv:
        yield srv


@pytest.fixture
async def reporting() -> AsyncIterator[EngineServer]:
    """An engine started with SGLang's --enable-cache-report: usage carries cached_tokens."""
    async with running(fast_cfg(cache_report=True)) as srv:
        yield srv


def cached_of(usage: dict[str, Any]) -> int:
    """SGLang reports prompt_tokens_details only for a cache hit (usage_processor.py):
    null stands for 0."""
    details = usage["prompt_tokens_details"]
    if details is None:
        return 0
    assert details["cached_tokens"] > 0
    return int(details["cached_tokens"])


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=8)) as session:
        yield session


def json_chunks(events: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """The JSON chunks of a finished stream (which must end with [DONE])."""
    assert events[-1][1] == "[DONE]"
    assert all(payload != "[DONE]" for _, payload in events[:-1])
    return [json.loads(payload) for _, payload in events[:-1]]


def long_chat(n_tokens: int, salt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": filler(n_tokens, salt)}]


def has_content(chunk: dict[str, Any]) -> bool:
    """A chat or completion chunk carrying output text."""
    if not chunk["choices"]:
        return False
    choice = chunk["choices"][0]
    return bool(choice.get("delta", {}).get("content") or choice.get("text"))


@dataclass
class Streamed:
    """One streamed OpenAI-style response, as the client saw it."""

    headers_s: float  # since the request left
    ttft_s: float  # first content chunk
    end_s: float
    chunks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def content_chunks(self) -> list[dict[str, Any]]:
        return [c for c in self.chunks if has_content(c)]

    @property
    def usage(self) -> dict[str, Any]:
        assert self.chunks[-1]["choices"] == []
        usage: dict[str, Any] = self.chunks[-1]["usage"]
        return usage


async def stream(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> Streamed:
    start = time.perf_counter()
    async with http.post(f"{url}{path}", json={**body, "stream": True}) as resp:
        headers_s = time.perf_counter() - start
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
    chunks = json_chunks(events)
    first_content = next(t for (t, _), c in zip(events, chunks, strict=False) if has_content(c))
    return Streamed(headers_s, first_content - start, events[-1][0] - start, chunks)


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


# -- configuration -----------------------------------------------------------------------


def test_zero_delay_profile_and_config() -> None:
    zero = zero_delay_profile(DEFAULT)
    assert zero.name == f"{DEFAULT.name}+zero-delay"
    assert zero.lone_ttft_ms(128_000) == 0.0
    assert zero.decode_ms(256, 10_000_000) == 0.0
    assert zero.jitter_sigma == 0.0
    # Cache and scheduler shape are kept.
    assert (zero.block_tokens, zero.chunk_tokens) == (DEFAULT.block_tokens, DEFAULT.chunk_tokens)
    cfg = EngineConfig.zero_delay("bench", max_tokens_cap=8)
    assert cfg.max_tokens_cap == 8
    assert cfg.profile == zero
    assert math.isinf(cfg.profile.prefill_tokens_per_s)


def test_default_profile_matches_design() -> None:
    assert EngineConfig(name="x").profile == DEFAULT
    # DESIGN section 7: 20 ms + U/P * (1 + (C + U/2)/30000) per chunk of 4,096.
    assert DEFAULT.lone_ttft_ms(1000) == pytest.approx(20 + 1000 / 12 * (1 + 500 / 30000))
    # 7 ms + 18 ms*(1-(1-8/256)^B) + 0.09 ms*B + 0.015 ms/1k context, +3 ms when B > 20.
    assert DEFAULT.decode_ms(1, 0) == pytest.approx(7 + 18 * 8 / 256 + 0.09)
    assert DEFAULT.decode_ms(21, 0) - DEFAULT.decode_ms(20, 0) > 3.0


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"name": ""}, "name"),
        ({"default_max_tokens": 0}, "default_max_tokens"),
        ({"max_tokens_cap": 0}, "max_tokens_cap"),
        ({"faults": Faults(error_rate=1.5)}, "error_rate"),
        ({"faults": Faults(stall_rate=-0.1)}, "stall_rate"),
        ({"faults": Faults(stall_ms=-1.0)}, "stall_ms"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        EngineConfig(**{"name": "x", **kwargs})


# -- OpenAI chat -----------------------------------------------------------------------


async def test_stream_chat_with_usage(server: EngineServer, http: aiohttp.ClientSession) -> None:
    n_tokens = 7
    body = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": n_tokens,
        "stream_options": {"include_usage": True},
    }
    async with http.post(f"{server.url}{CHAT}", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers[ENGINE_ID_HEADER] == NAME
        chunks = json_chunks(await read_sse(resp))

    assert len({c["id"] for c in chunks}) == 1
    # SGLang's id is the request id (serving_chat.py: meta_info["id"]), unprefixed.
    assert RID.match(chunks[0]["id"])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["model"] == "m" for c in chunks)
    # The first chunk: role and empty content, reasoning_content always there (null).
    assert chunks[0]["choices"][0]["delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])

    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == n_tokens
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert count_tokens(text) == n_tokens

    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    # SGLang chat: finish_reason on a separate chunk without content, after the last
    # token's (serving_chat.py), then the usage chunk.
    assert finals[0] is chunks[-2]
    assert finals[0]["choices"][0]["delta"] == {"reasoning_content": None}
    assert finals[0]["choices"][0]["matched_stop"] is None
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    prompt_tokens = count_tokens(render_chat(MESSAGES))
    # Without --enable-cache-report, prompt_tokens_details is null (usage_processor.py).
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n_tokens,
        "total_tokens": prompt_tokens + n_tokens,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


async def test_stream_chat_without_usage(server: EngineServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": MESSAGES, "max_completion_tokens": 3, "stream": True}
    async with http.post(f"{server.url}{CHAT}", json=body) as resp:
        chunks = json_chunks(await read_sse(resp))
    assert all(c["choices"] for c in chunks)  # no usage chunk
    assert all("usage" not in c for c in chunks)
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 3


async def test_chat_whole_response_and_cap(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 10_000}
    async with http.post(f"{server.url}{CHAT}", json=body) as resp:
        assert resp.status == 200
        assert resp.headers[ENGINE_ID_HEADER] == NAME
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert RID.match(data["id"])  # SGLang: the request id, unprefixed
    assert data["model"] == "m"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert count_tokens(choice["message"]["content"]) == CAP
    assert choice["finish_reason"] == "length"
    assert choice["matched_stop"] is None
    assert data["metadata"] == {"weight_version": "default"}
    prompt_tokens = count_tokens(render_chat(MESSAGES))
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": CAP,
        "total_tokens": prompt_tokens + CAP,
        "prompt_tokens_details": None,  # no --enable-cache-report
        "reasoning_tokens": 0,
    }


async def test_chat_default_max_tokens(server: EngineServer, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{server.url}{CHAT}", json={"messages": MESSAGES}) as r:
        data = await r.json()
    assert data["usage"]["completion_tokens"] == 5
    # SGLang echoes the request's model, "default" when it names none (protocol.py
    # DEFAULT_MODEL_NAME), whatever the served name.
    assert data["model"] == "default"


# -- OpenAI completions ----------------------------------------------------------------


async def test_completions_whole(server: EngineServer, http: aiohttp.ClientSession) -> None:
    prompt = ["The quick brown fox ", "jumps over the lazy dog."]
    body = {"prompt": prompt, "max_tokens": 4}
    async with http.post(f"{server.url}{COMPLETIONS}", json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert RID.match(data["id"])  # SGLang: the request id, unprefixed
    assert data["choices"][0]["text"] == "tok " * 4
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["prompt_tokens"] == count_tokens("".join(prompt))
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 4


async def test_completions_stream(server: EngineServer, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "x" * 4000, "max_tokens": 6, "stream_options": {"include_usage": True}}
    s = await stream(http, server.url, COMPLETIONS, body)
    assert all(c["object"] == "text_completion" for c in s.chunks)
    assert all(c["id"] == s.chunks[0]["id"] for c in s.chunks)
    text = "".join(c["choices"][0]["text"] for c in s.chunks if c["choices"])
    assert count_tokens(text) == 6
    assert len(s.content_chunks) == 6
    # SGLang completions: finish_reason on the last token's chunk, no separate chunk
    # (serving_completions.py).
    assert [c["choices"][0]["finish_reason"] for c in s.chunks if c["choices"]] == [None] * 5 + [
        "length"
    ]
    assert s.usage["prompt_tokens"] == 1000
    assert s.usage["completion_tokens"] == 6
    # Written with exclude_none: the null prompt_tokens_details is left out.
    assert "prompt_tokens_details" not in s.usage


async def test_completions_token_id_prompt(
    reporting: EngineServer, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": list(range(300)), "max_tokens": 2}
    for expect_cached in (0, (300 - 1) // BLOCK * BLOCK):
        async with http.post(f"{reporting.url}{COMPLETIONS}", json=body) as resp:
            data = await resp.json()
        assert data["usage"]["prompt_tokens"] == 300
        assert cached_of(data["usage"]) == expect_cached


# -- SGLang native ---------------------------------------------------------------------


async def test_generate_whole(server: EngineServer, http: aiohttp.ClientSession) -> None:
    body = {"text": "Hello there, engine.", "sampling_params": {"max_new_tokens": 9}}
    async with http.post(f"{server.url}{GENERATE}", json=body) as resp:
        assert resp.status == 200
        assert resp.headers[ENGINE_ID_HEADER] == NAME
        data = await resp.json()
    assert data["text"] == "tok " * 9
    meta = data["meta_info"]
    assert meta["prompt_tokens"] == count_tokens("Hello there, engine.")
    assert meta["completion_tokens"] == 9
    assert meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert isinstance(meta["id"], str) and meta["id"]


async def test_generate_stream(server: EngineServer, http: aiohttp.ClientSession) -> None:
    body = {"text": "abcd" * 10, "sampling_params": {"max_new_tokens": 4}, "stream": True}
    async with http.post(f"{server.url}{GENERATE}", json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        chunks = json_chunks(await read_sse(resp))
    assert [c["text"] for c in chunks] == ["tok " * i for i in range(1, 5)]  # cumulative
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert {c["meta_info"]["id"] for c in chunks} == {chunks[0]["meta_info"]["id"]}
    assert chunks[-1]["meta_info"]["prompt_tokens"] == 10
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 3
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


async def test_generate_input_ids_and_zero_new_tokens(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    """SGLang accepts max_new_tokens=0 (prefill only): no text, finished at once."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}}
    async with http.post(f"{server.url}{GENERATE}", json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["text"] == ""
    assert data["meta_info"]["prompt_tokens"] == 3
    assert data["meta_info"]["completion_tokens"] == 0
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


# -- errors ----------------------------------------------------------------------------


# What SGLang answers a bad body with: a schema error goes to its RequestValidationError
# handler, a flat ErrorResponse of type "Bad Request" on every route (http_server.py); a
# check in an OpenAI handler is a flat "BadRequestError" (serving_base.py); a ValueError
# inside /generate is {"error": {"message"}} (http_server.py _create_error_response).
SCHEMA, CHECK, NATIVE = "Bad Request", "BadRequestError", None


@pytest.mark.parametrize(
    ("path", "raw", "needle", "err_type"),
    [
        (CHAT, b"{not json", "JSON", SCHEMA),
        (CHAT, b"[1, 2]", "object", SCHEMA),
        (CHAT, b'{"model": "m"}', "messages", SCHEMA),
        (CHAT, b'{"messages": "hi"}', "messages", SCHEMA),
        (CHAT, b'{"messages": []}', "messages", CHECK),
        (CHAT, b'{"messages": [1]}', "messages[0]", SCHEMA),
        (CHAT, b'{"messages": [{"content": "x"}]}', "messages[0].role", SCHEMA),
        (CHAT, b'{"messages": [{"role": "user"}], "max_tokens": "5"}', "max_tokens", SCHEMA),
        (CHAT, b'{"messages": [{"role": "user"}], "max_tokens": 0}', "max_tokens", CHECK),
        (CHAT, b'{"messages": [{"role": "user"}], "stream": "yes"}', "stream", SCHEMA),
        (
            CHAT,
            b'{"messages": [{"role": "user"}], "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
            SCHEMA,
        ),
        (COMPLETIONS, b'{"max_tokens": 3}', "prompt", SCHEMA),
        (COMPLETIONS, b'{"prompt": 42}', "prompt", SCHEMA),
        (COMPLETIONS, b'{"prompt": "x", "model": 7}', "model", SCHEMA),
        (GENERATE, b'{"sampling_params": {}}', "text", NATIVE),
        (GENERATE, b'{"text": ["a"]}', "text", SCHEMA),
        (GENERATE, b'{"text": "a", "sampling_params": []}', "sampling_params", SCHEMA),
        (
            GENERATE,
            b'{"text": "a", "sampling_params": {"max_new_tokens": 1.5}}',
            "max_new_tokens",
            NATIVE,
        ),
        (GENERATE, b"\xff\xfe", "JSON", SCHEMA),
        (GENERATE, b"[" * 100_000, "JSON", SCHEMA),
    ],
)
async def test_bad_input_is_400_naming_the_problem(
    server: EngineServer,
    http: aiohttp.ClientSession,
    path: str,
    raw: bytes,
    needle: str,
    err_type: str | None,
) -> None:
    headers = {"Content-Type": "application/json"}
    async with http.post(f"{server.url}{path}", data=raw, headers=headers) as resp:
        assert resp.status == 400
        assert resp.headers[ENGINE_ID_HEADER] == NAME
        data = await resp.json()
    if err_type is NATIVE:
        assert set(data) == {"error"}
        assert set(data["error"]) == {"message"}
    else:
        assert set(data) == {"object", "message", "type", "param", "code"}
        assert data["type"] == err_type
        assert data["code"] == 400
        assert data["param"] is None  # SGLang's handlers do not say which
    assert needle in error_message(data)
    assert server.engine.stats.bad_requests_total == 1


@pytest.mark.parametrize(
    ("path", "body"), [(COMPLETIONS, {"prompt": ""}), (GENERATE, {"text": ""})]
)
async def test_empty_prompt_is_400(
    http: aiohttp.ClientSession, path: str, body: dict[str, Any]
) -> None:
    async with running(fast_cfg(), check_idle=False) as srv:
        async with http.post(f"{srv.url}{path}", json=body) as resp:
            status = resp.status
        assert srv.engine.stats.in_flight == 0
        assert status == 400


# -- other endpoints, stats, disconnects -----------------------------------------------


async def test_health_models_and_header(server: EngineServer, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{server.url}/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""
        assert resp.headers[ENGINE_ID_HEADER] == NAME
    async with http.get(f"{server.url}/v1/models") as resp:
        assert resp.headers[ENGINE_ID_HEADER] == NAME
        data = await resp.json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["emulated"]
    async with http.get(f"{server.url}/no/such/path") as resp:
        assert resp.status == 404
        assert resp.headers[ENGINE_ID_HEADER] == NAME


async def test_stats_count_generation_requests(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    for _ in range(2):
        async with http.post(
            f"{server.url}{CHAT}", json={"messages": MESSAGES, "max_tokens": 1}
        ) as resp:
            await resp.read()
    async with http.post(f"{server.url}{GENERATE}", json={"text": "hi"}) as resp:
        await resp.read()
    async with http.post(f"{server.url}{COMPLETIONS}", data=b"nope") as resp:
        assert resp.status == 400
    for path in ("/health", "/v1/loads", "/metrics", "/server_info"):  # probes: not traffic
        async with http.get(f"{server.url}{path}") as resp:
            await resp.read()

    stats = await get_json(http, f"{server.url}/stats")
    bodies = stats.pop("recent_bodies")
    assert stats == {
        "name": NAME,
        "requests_total": 4,
        "bad_requests_total": 1,
        "injected_errors_total": 0,
        "completed_total": 3,
        "in_flight": 0,
        "requests_by_path": {CHAT: 2, GENERATE: 1, COMPLETIONS: 1},
        # the probes, by path and query, apart (the /stats read itself is counted after)
        "gets": {"/health": 1, "/v1/loads": 1, "/metrics": 1, "/server_info": 1},
        # no body carried a priority (the health probe's generation is not counted)
        "priority": {
            "scheduling": False,
            "requests_by_priority": {"none": 3},
            "preempted_total": 0,
            "preempted_by_priority": {},
        },
    }
    # each generation request's body as received, the bad one too: its length and digest
    assert bodies[-2:] == [
        [len(b'{"text": "hi"}'), body_digest(b'{"text": "hi"}')],
        [4, body_digest(b"nope")],
    ]


def slow_decode_cfg(name: str = NAME) -> EngineConfig:
    """5 ms per decode step: a 400-token stream lasts ~2 s, long enough to cut it."""
    return EngineConfig(name=name, profile=replace(FAST, decode_base_ms=5.0), max_tokens_cap=1000)


async def test_in_flight_during_and_after_client_disconnect(
    http: aiohttp.ClientSession,
) -> None:
    async with running(slow_decode_cfg()) as srv:
        body = {"messages": MESSAGES, "max_tokens": 400, "stream": True}
        resp = await http.post(f"{srv.url}{CHAT}", json=body)
        await resp.content.readuntil(b"\n\n")  # first token: the request is mid-stream
        assert srv.engine.stats.in_flight == 1
        loads = (await get_json(http, f"{srv.url}/v1/loads"))["loads"][0]
        assert loads["num_running_reqs"] == 1
        assert loads["num_used_tokens"] > 0  # the request's KV
        resp.close()  # drop the connection mid-stream

        async with asyncio.timeout(1):  # well before the 2 s the full stream would take
            while srv.engine.stats.in_flight:
                await asyncio.sleep(0.005)
        assert srv.engine.stats.completed_total == 0
        # The scheduler dropped it and freed its KV (the short prompt fills no cache block).
        loads = (await get_json(http, f"{srv.url}/v1/loads"))["loads"][0]
        assert loads["num_running_reqs"] == 0
        assert loads["num_waiting_reqs"] == 0
        assert loads["num_used_tokens"] == 0


async def test_disconnect_without_handler_cancellation(http: aiohttp.ClientSession) -> None:
    """Under a plain aiohttp server the handler is not cancelled; the failed write must
    still release the request."""
    app = make_app(slow_decode_cfg("eu-frankfurt"))
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        body = {"messages": MESSAGES, "max_tokens": 400, "stream": True}
        resp = await http.post(f"http://127.0.0.1:{port}{CHAT}", json=body)
        await resp.content.readuntil(b"\n\n")
        resp.close()
        engine = app[ENGINE_KEY]
        async with asyncio.timeout(1):
            while engine.stats.in_flight:
                await asyncio.sleep(0.005)
        assert engine.stats.completed_total == 0
        assert engine.runner.model.num_running == 0
    finally:
        await runner.cleanup()


async def test_zero_delay_engine_is_fast(http: aiohttp.ClientSession) -> None:
    async with running(EngineConfig.zero_delay("bench")) as srv:
        body = {"messages": MESSAGES, "max_tokens": 2000, "stream": True}
        start = time.perf_counter()
        async with http.post(f"{srv.url}{CHAT}", json=body) as resp:
            events = await read_sse(resp)
        # The default profile would take ~16 s for 2000 tokens.
        assert time.perf_counter() - start < 3.0
        assert len(events) == 1 + 2000 + 2  # role chunk, tokens, finish chunk, [DONE]
        chunks = json_chunks(events)
        assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 2000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_serve_engine_runs_until_cancelled(http: aiohttp.ClientSession) -> None:
    port = free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(serve_engine(fast_cfg(name="ap-seoul"), "127.0.0.1", port, ready))
    async with asyncio.timeout(2):
        await ready.wait()
    async with http.get(f"http://127.0.0.1:{port}/health") as resp:
        assert resp.headers[ENGINE_ID_HEADER] == "ap-seoul"
    async with http.post(
        f"http://127.0.0.1:{port}{GENERATE}", json={"text": "hi", "sampling_params": {}}
    ) as resp:
        assert (await resp.json())["meta_info"]["completion_tokens"] == 5

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(OSError):  # the listener is gone
        await asyncio.open_connection("127.0.0.1", port)


# -- timing from the engine model ------------------------------------------------------


async def test_stream_timing_is_never_early(http: aiohttp.ClientSession) -> None:
    """Default profile: the first token after the modelled prefill, later tokens one
    decode step apart (lower bounds; the box may be slow). SGLang runs the stream's
    generator to its first output before it answers (serving_chat.py "kick-start"), so
    the headers leave with the first token, not before the prefill."""
    prompt_tokens, n_tokens = 2000, 8
    async with running(EngineConfig(name=NAME)) as srv:
        body = {"prompt": filler(prompt_tokens, "t"), "max_tokens": n_tokens}
        s = await stream(http, srv.url, COMPLETIONS, body)
    lone_ttft_s = DEFAULT.lone_ttft_ms(prompt_tokens) / 1e3  # ~0.19 s
    min_step_s = DEFAULT.decode_ms(1, prompt_tokens) / 1e3  # ~7.7 ms
    assert s.headers_s >= 0.9 * lone_ttft_s  # jitter sigma is 2%
    assert s.headers_s <= s.ttft_s
    assert s.ttft_s >= 0.9 * lone_ttft_s
    # the last token no earlier than the prefill and the steps after the first: counted
    # from the request, not from the first token, whose own arrival a stalled box may
    # delay until the later ones have come (all read at once: seen in a fresh clone)
    assert s.end_s >= 0.9 * (lone_ttft_s + (n_tokens - 1) * min_step_s)
    assert s.end_s < lone_ttft_s + n_tokens * min_step_s + 1.5  # generous
    assert len(s.content_chunks) == n_tokens


# -- prefix cache ----------------------------------------------------------------------


async def test_repeated_prompt_is_cached_and_faster(http: aiohttp.ClientSession) -> None:
    """Default profile, an ~8k-token chat: cold TTFT ~0.8 s (two prefill chunks), warm
    ~0.03 s (only the last partial block is computed)."""
    messages = long_chat(8000, "repeat")
    prompt_tokens = count_tokens(render_chat(messages))
    body = {"messages": messages, "max_tokens": 3, "stream_options": {"include_usage": True}}
    async with running(EngineConfig(name=NAME, cache_report=True)) as srv:
        cold = await stream(http, srv.url, CHAT, body)
        warm = await stream(http, srv.url, CHAT, body)
        loads = (await get_json(http, f"{srv.url}/v1/loads"))["loads"][0]
        cache_tokens = srv.engine.runner.model.cache.tokens

    assert cold.usage["prompt_tokens"] == warm.usage["prompt_tokens"] == prompt_tokens
    assert cold.usage["prompt_tokens_details"] is None  # no hit: null
    cached = cached_of(warm.usage)
    assert prompt_tokens - BLOCK <= cached < prompt_tokens
    assert cached % BLOCK == 0
    assert warm.ttft_s < cold.ttft_s
    assert cold.ttft_s >= 0.9 * DEFAULT.lone_ttft_ms(prompt_tokens) / 1e3
    # /v1/loads rounds it to 4 places, as SGLang's get_loads does
    assert loads["cache_hit_rate"] == pytest.approx(cached / (2 * prompt_tokens), abs=5e-5)
    assert cache_tokens >= prompt_tokens - BLOCK  # the cached prompt stays
    # ... but nobody holds it: SGLang's num_used_tokens leaves evictable cache out
    # (scheduler_runtime_checker_mixin.py _get_token_info).
    assert loads["num_used_tokens"] == 0


async def test_shared_prefix_is_partially_cached(
    reporting: EngineServer, http: aiohttp.ClientSession
) -> None:
    """A later turn of a chat reuses the earlier turn's blocks (render_chat keeps each
    turn a byte prefix of the next)."""
    first = long_chat(600, "turns")
    second = [*first, {"role": "assistant", "content": "tok " * 5}, *long_chat(300, "next")]
    opts = {"max_tokens": 2, "stream_options": {"include_usage": True}}
    a = await stream(http, reporting.url, CHAT, {"messages": first, **opts})
    b = await stream(http, reporting.url, CHAT, {"messages": second, **opts})
    assert cached_of(a.usage) == 0
    first_prompt = count_tokens(render_chat(first))
    # The first turn's whole rendered prompt is a byte prefix of the second's; only its
    # full blocks were cached.
    shared_blocks = len(render_chat(first)) // (4 * BLOCK)
    assert cached_of(b.usage) == shared_blocks * BLOCK
    assert cached_of(b.usage) < first_prompt


async def test_generate_reports_cached_tokens_and_flush_cache_resets(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    text = filler(1000, "flush")
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}}

    async def cached_whole() -> int:
        async with http.post(f"{server.url}{GENERATE}", json=body) as resp:
            meta = (await resp.json())["meta_info"]
        assert meta["prompt_tokens"] == 1000
        return int(meta["cached_tokens"])

    async def cached_streamed() -> list[int]:
        async with http.post(f"{server.url}{GENERATE}", json={**body, "stream": True}) as resp:
            chunks = json_chunks(await read_sse(resp))
        return [c["meta_info"]["cached_tokens"] for c in chunks]

    warm = (1000 - 1) // BLOCK * BLOCK
    assert await cached_whole() == 0
    assert await cached_whole() == warm
    assert await cached_streamed() == [warm, warm]

    cache = server.engine.runner.model.cache
    assert cache.tokens == 1000 // BLOCK * BLOCK  # only the cached full blocks remain
    # Evictable cache is not "used" to SGLang (scheduler_runtime_checker_mixin.py).
    used = (await get_json(http, f"{server.url}/v1/loads"))["loads"][0]["num_used_tokens"]
    assert used == 0
    async with http.post(f"{server.url}/flush_cache") as resp:
        assert resp.status == 200
        assert resp.headers[ENGINE_ID_HEADER] == NAME
        assert "flushed" in (await resp.text()).lower()
    assert cache.tokens == 0

    assert await cached_streamed() == [0, 0]
    assert await cached_whole() == warm


async def test_flush_cache_makes_chat_uncached(
    reporting: EngineServer, http: aiohttp.ClientSession
) -> None:
    body = {"messages": long_chat(500, "chat-flush"), "max_tokens": 1}
    body["stream_options"] = {"include_usage": True}

    async def cached() -> int:
        s = await stream(http, reporting.url, CHAT, body)
        return cached_of(s.usage)

    assert await cached() == 0
    assert await cached() > 2 * BLOCK
    async with http.post(f"{reporting.url}/flush_cache") as resp:
        assert resp.status == 200
    assert await cached() == 0
    assert await cached() > 2 * BLOCK


async def test_cancelled_prefill_caches_only_computed_blocks(
    http: aiohttp.ClientSession,
) -> None:
    messages = long_chat(8000, "cancel")
    body = {"messages": messages, "max_tokens": 2, "stream_options": {"include_usage": True}}
    async with running(EngineConfig(name=NAME, cache_report=True)) as srv:
        # SGLang answers a stream with its first token: the client leaves before any
        # headers came, inside the first ~0.38 s prefill chunk.
        post = asyncio.create_task(http.post(f"{srv.url}{CHAT}", json={**body, "stream": True}))
        await asyncio.sleep(0.1)
        assert not post.done()
        assert srv.engine.stats.in_flight == 1
        post.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await post
        async with asyncio.timeout(1):
            while srv.engine.stats.in_flight:
                await asyncio.sleep(0.005)
        again = await stream(http, srv.url, CHAT, body)
    # At most the chunk that was running when the client left can have been computed.
    assert cached_of(again.usage) <= DEFAULT.chunk_tokens


# -- metrics, loads, server info ---------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"(,|$)')
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> tuple[dict[str, str], list[Sample]]:
    """A strict little parser of the Prometheus text format (0.0.4): every sample parses,
    belongs to a family declared by a preceding # TYPE line, and has a numeric value."""
    types: dict[str, str] = {}
    samples: list[Sample] = []
    assert text.endswith("\n")
    for line in text.splitlines():
        assert line, "blank line"
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            if parts[1] == "TYPE":
                assert len(parts) == 4 and parts[3] in _TYPES, line
                assert parts[2] not in types, f"duplicate TYPE {parts[2]}"
                types[parts[2]] = parts[3]
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad sample line {line!r}"
        name, raw_labels, raw_value = m.groups()
        labels: dict[str, str] = {}
        pos = 0
        while raw_labels and pos < len(raw_labels):
            lm = _LABEL.match(raw_labels, pos)
            assert lm, f"bad labels in {line!r}"
            assert lm.group(1) not in labels
            labels[lm.group(1)] = lm.group(2)
            pos = lm.end()
        family = name
        if family not in types:
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix) and types.get(name.removesuffix(suffix)) == "histogram":
                    family = name.removesuffix(suffix)
        assert family in types, f"sample {name} has no # TYPE"
        samples.append(Sample(name, labels, float(raw_value)))
    return types, samples


@dataclass
class Metrics:
    types: dict[str, str]
    samples: list[Sample]

    def value(self, name: str) -> float:
        (only,) = [s.value for s in self.samples if s.name == name]
        return only

    def buckets(self, name: str) -> list[tuple[float, float]]:
        return [(float(s.labels["le"]), s.value) for s in self.samples if s.name == name]


async def get_metrics(http: aiohttp.ClientSession, url: str) -> Metrics:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    types, samples = parse_prometheus(text)
    metrics = Metrics(types, samples)
    for s in samples:
        # SGLang's scheduler labels (scheduler_metrics_mixin.py init_metrics).
        assert s.labels.get("model_name") == "emulated"
        assert s.labels.get("engine_type") == "unified"
        assert (s.labels.get("tp_rank"), s.labels.get("pp_rank")) == ("0", "0")
    for family, kind in types.items():
        if kind != "histogram":
            continue
        buckets = metrics.buckets(f"{family}_bucket")
        assert [le for le, _ in buckets] == sorted(le for le, _ in buckets)
        assert buckets[-1][0] == math.inf
        counts = [c for _, c in buckets]
        assert counts == sorted(counts)  # cumulative
        assert counts[-1] == metrics.value(f"{family}_count")
    return metrics


REQUIRED_METRICS = {
    "sglang:num_running_reqs": "gauge",
    "sglang:num_queue_reqs": "gauge",
    "sglang:num_used_tokens": "gauge",
    "sglang:cache_hit_rate": "gauge",
    # prometheus_client declares a counter under its _total name.
    "sglang:prompt_tokens_total": "counter",
    "sglang:num_requests_total": "counter",
    "sglang:time_to_first_token_seconds": "histogram",
    "sglang:inter_token_latency_seconds": "histogram",
}


async def test_metrics_are_prometheus_text_and_grow(http: aiohttp.ClientSession) -> None:
    async with running(fast_cfg(enable_metrics=True)) as server:  # SGLang --enable-metrics
        await _metrics_grow(server, http)


async def _metrics_grow(server: EngineServer, http: aiohttp.ClientSession) -> None:
    before = await get_metrics(http, server.url)
    for name, kind in REQUIRED_METRICS.items():
        assert before.types[name] == kind
    names = {s.name for s in before.samples}
    assert "sglang:time_to_first_token_seconds_bucket" in names
    assert "sglang:inter_token_latency_seconds_bucket" in names
    assert before.value("sglang:num_running_reqs") == 0
    assert before.value("sglang:num_queue_reqs") == 0
    assert before.value("sglang:num_used_tokens") == 0
    assert before.value("sglang:cache_hit_rate") == 0
    assert before.value("sglang:time_to_first_token_seconds_count") == 0

    n_tokens, prompt_tokens = 6, 700
    body = {"prompt": filler(prompt_tokens, "metrics"), "max_tokens": n_tokens}
    for _ in range(2):
        async with http.post(f"{server.url}{COMPLETIONS}", json=body) as resp:
            assert resp.status == 200
            await resp.read()
    after = await get_metrics(http, server.url)

    def grew(name: str) -> float:
        return after.value(name) - before.value(name)

    assert grew("sglang:num_requests_total") == 2
    assert grew("sglang:prompt_tokens_total") == 2 * prompt_tokens
    assert grew("sglang:generation_tokens_total") == 2 * n_tokens
    assert grew("sglang:time_to_first_token_seconds_count") == 2
    assert grew("sglang:inter_token_latency_seconds_count") == 2 * (n_tokens - 1)
    assert after.value("sglang:time_to_first_token_seconds_sum") > 0
    assert after.value("sglang:inter_token_latency_seconds_sum") > 0
    assert after.value("sglang:num_running_reqs") == 0
    # The prompt's blocks stay cached, evictable: not "used" to SGLang.
    assert server.engine.runner.model.cache.tokens == prompt_tokens // BLOCK * BLOCK
    assert after.value("sglang:num_used_tokens") == 0
    cached = (prompt_tokens - 1) // BLOCK * BLOCK
    hit_rate = after.value("sglang:cache_hit_rate")
    assert hit_rate == pytest.approx(cached / (2 * prompt_tokens), abs=1e-5)
    assert after.value("sglang:max_total_num_tokens") == FAST.kv_capacity_tokens


# SGLang's GetLoadsReqOutput core fields (managers/io_struct.py, v1_loads.py).
LOAD_FIELDS = {
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "max_total_num_tokens",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "max_running_requests",
}


async def test_loads_and_server_info(server: EngineServer, http: aiohttp.ClientSession) -> None:
    loads = await get_json(http, f"{server.url}/v1/loads")
    assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    (load,) = loads["loads"]
    assert set(load) == LOAD_FIELDS | {"queues", "disaggregation"}  # include: all by default
    assert load["dp_rank"] == 0
    assert load["max_total_num_tokens"] == FAST.kv_capacity_tokens
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0
    assert load["token_usage"] == load["cache_hit_rate"] == 0

    info = await get_json(http, f"{server.url}/server_info")
    assert info["name"] == NAME
    assert info["model_path"] == "emulated"
    assert info["engine_profile"] == "fast-test"
    assert info["tokenizer"] == "approx-4-bytes"
    assert info["max_total_num_tokens"] == FAST.kv_capacity_tokens
    assert info["max_running_requests"] == FAST.max_running_requests
    assert info["chunked_prefill_size"] == FAST.chunk_tokens
    assert info["page_size"] == FAST.block_tokens
    assert info["faults"] == NO_FAULTS
    # SGLang's server_info carries the schedulers' state, one per DP rank.
    (state,) = info["internal_states"]
    assert set(state["load"]) == LOAD_FIELDS
    timing = info["timing"]
    assert timing["tokens_written"] == 0
    assert timing["lag_ms_p50"] is None and timing["lag_ms_max"] is None
    assert timing["cpu_us_per_token"] is None

    n_tokens = 20
    body = {"messages": long_chat(300, "info"), "max_tokens": n_tokens}
    s = await stream(http, server.url, CHAT, body)
    assert len(s.content_chunks) == n_tokens

    for path in ("/server_info", "/get_server_info"):
        info = await get_json(http, f"{server.url}{path}")
        timing = info["timing"]
        assert timing["tokens_written"] == n_tokens
        lags = [timing[k] for k in ("lag_ms_p50", "lag_ms_p95", "lag_ms_p99", "lag_ms_max")]
        assert all(lag >= 0 for lag in lags)  # never early
        assert lags == sorted(lags)
        assert timing["cpu_s"] >= 0
        assert timing["cpu_us_per_token"] > 0
        load = info["internal_states"][0]["load"]
        assert load["num_running_reqs"] == 0
        # The prompt's blocks stay cached but evictable: not used (SGLang's count).
        assert server.engine.runner.model.cache.tokens > 0
        assert load["num_used_tokens"] == load["token_usage"] == 0


# -- faults ----------------------------------------------------------------------------

NO_FAULTS = {
    "error_rate": 0.0,
    "stall_rate": 0.0,
    "stall_ms": 0.0,
    "stream_error_rate": 0.0,
    "stream_error_after": 0,
    "kv_events_down": False,
}


async def test_injected_errors_are_500_json(http: aiohttp.ClientSession) -> None:
    async with running(fast_cfg(faults=Faults(error_rate=1.0))) as srv:
        for path, body in (
            (CHAT, {"messages": MESSAGES, "stream": True}),
            (COMPLETIONS, {"prompt": "hi"}),
            (GENERATE, {"text": "hi"}),
        ):
            async with http.post(f"{srv.url}{path}", json=body) as resp:
                assert resp.status == 500
                assert resp.headers[ENGINE_ID_HEADER] == NAME
                assert resp.content_type == "application/json"
                data = await resp.json()
            if path == GENERATE:  # http_server.py: {"error": {"message"}}
                assert set(data["error"]) == {"message"}
            else:  # serving_base.py handle_request: an exception is a 500 ErrorResponse
                assert (data["object"], data["code"]) == ("error", 500)
                assert data["type"] == "InternalServerError"
                assert data["message"].startswith("Internal server error: ")
            assert "fault" in error_message(data)
        stats = await get_json(http, f"{srv.url}/stats")
        assert stats["injected_errors_total"] == 3
        assert stats["completed_total"] == 0
        # Bad input is still a 400: validation comes first.
        async with http.post(f"{srv.url}{GENERATE}", json={"text": 1}) as resp:
            assert resp.status == 400


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"error_rate": 1.5}', "error_rate"),
        (b'{"error_rate": "0.5"}', "error_rate"),
        (b'{"stall_rate": true}', "stall_rate"),
        (b'{"stall_ms": -5}', "stall_ms"),
        (b'{"latency": 1}', "latency"),
        (b'{"error_rate": 0, "bogus": 1}', "bogus"),
        (b"[0.5]", "JSON object"),
        (b"{nope", "JSON object"),
    ],
)
async def test_set_faults_rejects_bad_input(
    server: EngineServer, http: aiohttp.ClientSession, raw: bytes, needle: str
) -> None:
    async with http.post(f"{server.url}/faults", data=raw) as resp:
        assert resp.status == 400
        data = await resp.json()
    assert needle in error_message(data)
    assert server.cfg.faults == Faults()  # nothing applied


async def test_set_faults_applies_and_clears(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2}
    async with http.post(f"{server.url}/faults", json={"error_rate": 1.0}) as resp:
        assert resp.status == 200
        assert await resp.json() == {**NO_FAULTS, "error_rate": 1.0}
    assert (await get_json(http, f"{server.url}/server_info"))["faults"]["error_rate"] == 1.0
    async with http.post(f"{server.url}{CHAT}", json=body) as resp:
        assert resp.status == 500

    # A partial update keeps the other fields.
    async with http.post(f"{server.url}/faults", json={"stall_rate": 1, "stall_ms": 300}) as resp:
        assert await resp.json() == {
            **NO_FAULTS,
            "error_rate": 1.0,
            "stall_rate": 1,
            "stall_ms": 300,
        }
    async with http.post(f"{server.url}/faults", json={"error_rate": 0}) as resp:
        assert resp.status == 200
    start = time.perf_counter()
    async with http.post(f"{server.url}{CHAT}", json=body) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == 2
    assert time.perf_counter() - start >= 0.3  # stalled before scheduling

    async with http.post(f"{server.url}/faults", json={"stall_rate": 0}) as resp:
        assert resp.status == 200
    async with http.post(f"{server.url}{CHAT}", json=body) as resp:
        assert resp.status == 200
    stats = await get_json(http, f"{server.url}/stats")
    assert stats["injected_errors_total"] == 1
    assert stats["completed_total"] == 2


# -- concurrency -----------------------------------------------------------------------


async def test_many_concurrent_streams_all_complete(http: aiohttp.ClientSession) -> None:
    """Default profile, 32 streams at once: continuous batching runs them together; each
    gets all its tokens, and the engine is idle afterwards."""
    n_streams, n_tokens = 32, 12
    async with running(EngineConfig(name=NAME)) as srv:
        peak = 0
        done = asyncio.Event()

        async def poll_loads() -> None:
            nonlocal peak
            while not done.is_set():
                load = (await get_json(http, f"{srv.url}/v1/loads"))["loads"][0]
                peak = max(peak, load["num_running_reqs"] + load["num_waiting_reqs"])
                await asyncio.sleep(0.01)

        async def one(i: int) -> Streamed:
            body = {
                "messages": long_chat(40, f"c{i}-"),
                "max_tokens": n_tokens,
                "stream_options": {"include_usage": True},
            }
            return await stream(http, srv.url, CHAT, body)

        poller = asyncio.create_task(poll_loads())
        try:
            results = await asyncio.gather(*(one(i) for i in range(n_streams)))
        finally:
            done.set()
            await poller
        for s in results:
            assert len(s.content_chunks) == n_tokens
            assert s.usage["completion_tokens"] == n_tokens
            assert len({c["id"] for c in s.chunks}) == 1
        assert len({s.chunks[0]["id"] for s in results}) == n_streams
        assert peak >= 2  # requests overlapped in the scheduler
        stats = await get_json(http, f"{srv.url}/stats")
        assert stats["in_flight"] == 0
        assert stats["completed_total"] == n_streams
        info = await get_json(http, f"{srv.url}/server_info")
        assert info["timing"]["tokens_written"] == n_streams * n_tokens
        assert info["timing"]["lag_ms_p50"] >= 0
        assert info["internal_states"][0]["load"]["num_running_reqs"] == 0


def test_fast_profile_is_a_valid_profile() -> None:
    assert isinstance(FAST, EngineProfile)
    assert FAST.lone_ttft_ms(1000) < 3.0
    assert FAST.decode_ms(256, 1_000_000) == 1.0
