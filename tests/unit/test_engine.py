"""The emulated SGLang engine over real HTTP on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from emulator.engine import (
    ENGINE_ID_HEADER,
    ENGINE_KEY,
    EngineConfig,
    EngineServer,
    SimpleTiming,
    make_app,
    serve_engine,
)
from ext_proc.tokens import count_tokens, render_chat

PREFILL_BASE_MS = 60.0
DECODE_MS = 3.0
CAP = 64
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the weather in Ashburn, please."},
]


@pytest.fixture
async def server() -> AsyncIterator[EngineServer]:
    cfg = EngineConfig(
        name="us-ashburn",
        prefill_base_ms=PREFILL_BASE_MS,
        decode_ms_per_token=DECODE_MS,
        default_max_tokens=5,
        max_tokens_cap=CAP,
    )
    srv = EngineServer(cfg, "127.0.0.1", 0)
    await srv.start()
    yield srv
    # Nothing may stay counted in flight after a test.
    assert srv.engine.stats.in_flight == 0
    await srv.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=4)) as session:
        yield session


async def read_sse(resp: aiohttp.ClientResponse) -> list[tuple[float, str]]:
    """(arrival time, payload) of every `data:` event of an SSE response."""
    events: list[tuple[float, str]] = []
    buf = b""
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            events.append((now, event[len(b"data: ") :].decode()))
    assert buf == b"", f"trailing bytes after last event: {buf!r}"
    return events


def prefill_s(input_tokens: int) -> float:
    return PREFILL_BASE_MS / 1000 + input_tokens / 12000.0


# -- pure parts --------------------------------------------------------------------------


def test_simple_timing() -> None:
    t = SimpleTiming(prefill_base_ms=20.0, prefill_tokens_per_s=12000.0, decode_ms_per_token=10.0)
    assert t.prefill_s(0) == pytest.approx(0.020)
    assert t.prefill_s(12000) == pytest.approx(1.020)
    assert t.decode_s_per_token() == pytest.approx(0.010)
    assert t.token_offset_s(1200, 3) == pytest.approx(0.020 + 0.1 + 0.030)


def test_zero_delay_config() -> None:
    cfg = EngineConfig.zero_delay("bench", max_tokens_cap=8)
    t = SimpleTiming.from_config(cfg)
    assert cfg.max_tokens_cap == 8
    assert t.prefill_s(1_000_000) == 0.0
    assert t.decode_s_per_token() == 0.0
    assert math.isinf(cfg.prefill_tokens_per_s)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prefill_base_ms": -1.0}, "prefill_base_ms"),
        ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s"),
        ({"decode_ms_per_token": math.nan}, "decode_ms_per_token"),
        ({"default_max_tokens": 0}, "default_max_tokens"),
        ({"max_tokens_cap": 0}, "max_tokens_cap"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(name="x", **kwargs)


# -- OpenAI chat -----------------------------------------------------------------------


async def test_stream_chat_with_usage(server: EngineServer, http: aiohttp.ClientSession) -> None:
    n_tokens = 7
    body = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": n_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        headers_s = time.perf_counter() - start
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers[ENGINE_ID_HEADER] == "us-ashburn"
        events = await read_sse(resp)
    end_s = time.perf_counter() - start

    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(payload) for _, payload in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"

    content_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content_chunks) == n_tokens
    text = "".join(c["choices"][0]["delta"]["content"] for c in content_chunks)
    assert count_tokens(text) == n_tokens

    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    prompt_tokens = count_tokens(render_chat(MESSAGES))
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n_tokens,
        "total_tokens": prompt_tokens + n_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    # Headers leave at once; the first token only after prefill; then one per decode step.
    ttft_s = events[0][0] - start
    assert headers_s < prefill_s(prompt_tokens)
    assert ttft_s >= prefill_s(prompt_tokens)
    assert end_s >= prefill_s(prompt_tokens) + (n_tokens - 1) * DECODE_MS / 1000
    assert end_s < prefill_s(prompt_tokens) + (n_tokens - 1) * DECODE_MS / 1000 + 0.25


async def test_stream_chat_without_usage(server: EngineServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": MESSAGES, "max_completion_tokens": 3, "stream": True}
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        events = await read_sse(resp)
    chunks = [json.loads(p) for _, p in events[:-1]]
    assert events[-1][1] == "[DONE]"
    assert all(c["choices"] for c in chunks)  # no usage chunk
    assert "usage" not in chunks[-1]
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 3


async def test_chat_whole_response_and_cap(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 10_000}
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers[ENGINE_ID_HEADER] == "us-ashburn"
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["model"] == "m"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert count_tokens(choice["message"]["content"]) == CAP
    assert choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == CAP
    assert data["usage"]["prompt_tokens"] == count_tokens(render_chat(MESSAGES))


async def test_chat_default_max_tokens(server: EngineServer, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES}) as r:
        data = await r.json()
    assert data["usage"]["completion_tokens"] == 5


# -- OpenAI completions ----------------------------------------------------------------


async def test_completions_whole(server: EngineServer, http: aiohttp.ClientSession) -> None:
    prompt = ["The quick brown fox ", "jumps over the lazy dog."]
    body = {"prompt": prompt, "max_tokens": 4}
    async with http.post(f"{server.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == "tok " * 4
    assert data["usage"]["prompt_tokens"] == count_tokens("".join(prompt))
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 4


async def test_completions_stream(server: EngineServer, http: aiohttp.ClientSession) -> None:
    prompt = "x" * 4000  # 1000 tokens: prefill visibly longer than the base
    body = {
        "prompt": prompt,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    async with http.post(f"{server.url}/v1/completions", json=body) as resp:
        events = await read_sse(resp)
    assert events[0][0] - start >= prefill_s(1000)
    chunks = [json.loads(p) for _, p in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert count_tokens(text) == 6
    assert chunks[-1]["usage"]["prompt_tokens"] == 1000
    assert chunks[-1]["usage"]["completion_tokens"] == 6


# -- SGLang native ---------------------------------------------------------------------


async def test_generate_whole(server: EngineServer, http: aiohttp.ClientSession) -> None:
    body = {"text": "Hello there, engine.", "sampling_params": {"max_new_tokens": 9}}
    async with http.post(f"{server.url}/generate", json=body) as resp:
        assert resp.status == 200
        assert resp.headers[ENGINE_ID_HEADER] == "us-ashburn"
        data = await resp.json()
    assert data["text"] == "tok " * 9
    meta = data["meta_info"]
    assert meta["prompt_tokens"] == count_tokens("Hello there, engine.")
    assert meta["completion_tokens"] == 9
    assert meta["cached_tokens"] == 0
    assert isinstance(meta["id"], str) and meta["id"]


async def test_generate_stream(server: EngineServer, http: aiohttp.ClientSession) -> None:
    body = {"text": "abcd" * 10, "sampling_params": {"max_new_tokens": 4}, "stream": True}
    async with http.post(f"{server.url}/generate", json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(p) for _, p in events[:-1]]
    assert [c["text"] for c in chunks] == ["tok " * i for i in range(1, 5)]  # cumulative
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert {c["meta_info"]["id"] for c in chunks} == {chunks[0]["meta_info"]["id"]}
    assert chunks[-1]["meta_info"]["prompt_tokens"] == 10


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "needle"),
    [
        ("/v1/chat/completions", b"{not json", "JSON"),
        ("/v1/chat/completions", b"[1, 2]", "object"),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
        ("/v1/chat/completions", b'{"messages": [1]}', "messages[0]"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "messages[0].role"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user"}], "max_tokens": "5"}',
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user"}], "max_tokens": 0}',
            "max_tokens",
        ),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stream": "yes"}', "stream"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user"}], "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
        ),
        ("/v1/completions", b'{"max_tokens": 3}', "prompt"),
        ("/v1/completions", b'{"prompt": 42}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "model": 7}', "model"),
        ("/generate", b'{"sampling_params": {}}', "text"),
        ("/generate", b'{"text": ["a"]}', "text"),
        ("/generate", b'{"text": "a", "sampling_params": []}', "sampling_params"),
        (
            "/generate",
            b'{"text": "a", "sampling_params": {"max_new_tokens": 1.5}}',
            "max_new_tokens",
        ),
        ("/generate", b"\xff\xfe", "JSON"),
        ("/generate", b"[" * 100_000, "JSON"),
    ],
)
async def test_bad_input_is_400_naming_the_problem(
    server: EngineServer, http: aiohttp.ClientSession, path: str, raw: bytes, needle: str
) -> None:
    headers = {"Content-Type": "application/json"}
    async with http.post(f"{server.url}{path}", data=raw, headers=headers) as resp:
        assert resp.status == 400
        assert resp.headers[ENGINE_ID_HEADER] == "us-ashburn"
        data = await resp.json()
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["code"] == 400
    assert needle in data["error"]["message"]


# -- other endpoints, stats, disconnects -----------------------------------------------


async def test_health_models_and_header(server: EngineServer, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{server.url}/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""
        assert resp.headers[ENGINE_ID_HEADER] == "us-ashburn"
    async with http.get(f"{server.url}/v1/models") as resp:
        data = await resp.json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["emulated"]
    async with http.get(f"{server.url}/no/such/path") as resp:
        assert resp.status == 404
        assert resp.headers[ENGINE_ID_HEADER] == "us-ashburn"


async def test_stats_count_generation_requests(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    for _ in range(2):
        async with http.post(
            f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}
        ) as resp:
            await resp.read()
    async with http.post(f"{server.url}/generate", json={"text": "hi"}) as resp:
        await resp.read()
    async with http.post(f"{server.url}/v1/completions", data=b"nope") as resp:
        assert resp.status == 400
    async with http.get(f"{server.url}/health") as resp:  # probes are not traffic
        await resp.read()

    async with http.get(f"{server.url}/stats") as resp:
        stats = await resp.json()
    assert stats["name"] == "us-ashburn"
    assert stats["requests_total"] == 4
    assert stats["in_flight"] == 0
    assert stats["bad_requests_total"] == 1
    assert stats["completed_total"] == 3
    assert stats["requests_by_path"] == {
        "/v1/chat/completions": 2,
        "/generate": 1,
        "/v1/completions": 1,
    }


async def test_in_flight_during_and_after_client_disconnect(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    body = {"messages": MESSAGES, "max_tokens": CAP, "stream": True}
    resp = await http.post(f"{server.url}/v1/chat/completions", json=body)
    await resp.content.readuntil(b"\n\n")  # first token: the request is mid-stream
    assert server.engine.stats.in_flight == 1
    resp.close()  # drop the connection mid-stream

    async with asyncio.timeout(2):
        while server.engine.stats.in_flight:
            await asyncio.sleep(0.005)
    assert server.engine.stats.completed_total == 0


async def test_disconnect_without_handler_cancellation(http: aiohttp.ClientSession) -> None:
    """Under a plain aiohttp server the handler is not cancelled; the failed write must
    still release the request."""
    cfg = EngineConfig(name="eu-frankfurt", prefill_base_ms=1.0, decode_ms_per_token=2.0)
    app = make_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        body = {"messages": MESSAGES, "max_tokens": 500, "stream": True}
        resp = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        resp.close()
        stats = app[ENGINE_KEY].stats
        async with asyncio.timeout(0.5):  # well before the 1 s the full stream would take
            while stats.in_flight:
                await asyncio.sleep(0.005)
        assert stats.completed_total == 0
    finally:
        await runner.cleanup()


async def test_zero_delay_engine_is_fast(http: aiohttp.ClientSession) -> None:
    srv = EngineServer(EngineConfig.zero_delay("bench"), "127.0.0.1", 0)
    await srv.start()
    try:
        body = {"messages": MESSAGES, "max_tokens": 2000, "stream": True}
        start = time.perf_counter()
        async with http.post(f"{srv.url}/v1/chat/completions", json=body) as resp:
            events = await read_sse(resp)
        assert time.perf_counter() - start < 1.0
        assert len(events) == 2000 + 2  # tokens, final chunk, [DONE]
    finally:
        await srv.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_serve_engine_runs_until_cancelled(http: aiohttp.ClientSession) -> None:
    port = free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(
        serve_engine(EngineConfig(name="ap-seoul"), "127.0.0.1", port, ready)
    )
    async with asyncio.timeout(2):
        await ready.wait()
    async with http.get(f"http://127.0.0.1:{port}/health") as resp:
        assert resp.headers[ENGINE_ID_HEADER] == "ap-seoul"

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(OSError):  # the listener is gone
        await asyncio.open_connection("127.0.0.1", port)
