"""The emulated engine against an independent, real client: the official `openai` package
(AsyncOpenAI over real HTTP on 127.0.0.1; no mocks), in both flavors, each started with
its cache-report flag (SGLang --enable-cache-report, vLLM --enable-prompt-tokens-details)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from openai import AsyncOpenAI
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

from emulator.engine.config import FLAVORS, SGLANG, VLLM, EngineConfig, Faults
from emulator.engine.server import ENGINE_ID_HEADER, EngineServer
from ext_proc.prompt.tokens import count_tokens, render_chat
from tests.component.engine_harness import FAST

BLOCK = FAST.block_tokens
NAME = "eu-frankfurt"
MODEL = "emulated"


def filler(n_tokens: int, salt: str) -> str:
    """ASCII text of exactly n_tokens tokens (4 bytes each), distinct per salt."""
    return "".join(f"{salt}{i:07d}|" for i in range(n_tokens))[: 4 * n_tokens]


@pytest.fixture(params=FLAVORS)
async def server(request: pytest.FixtureRequest) -> AsyncIterator[EngineServer]:
    cfg = EngineConfig(name=NAME, profile=FAST, flavor=request.param, cache_report=True)
    srv = EngineServer(cfg, "127.0.0.1", 0)
    await srv.start()
    try:
        yield srv
        assert srv.engine.stats.in_flight == 0
    finally:
        await srv.stop()


@pytest.fixture
async def client(server: EngineServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=10.0
    ) as c:
        yield c


async def stream_chat(
    client: AsyncOpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int
) -> list[ChatCompletionChunk]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    return [chunk async for chunk in stream]


def cached_of(usage: CompletionUsage | None, flavor: str) -> int:
    """cached_tokens as the flavor reports it: SGLang leaves prompt_tokens_details null
    unless there was a hit (usage_processor.py), vLLM reports 0 too (the real one:
    tests/fixtures/vllm/sse-chat.txt)."""
    assert usage is not None
    if usage.prompt_tokens_details is None:
        assert flavor == SGLANG
        return 0
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert cached > 0 or flavor == VLLM
    return cached


async def test_chat_stream_with_usage(server: EngineServer, client: AsyncOpenAI) -> None:
    flavor = server.cfg.flavor
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": filler(400, "chat")},
    ]
    prompt_tokens = count_tokens(render_chat(messages))
    chunks = await stream_chat(client, messages, 6)

    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(content) == 6
    assert count_tokens("".join(content)) == 6
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["length"]

    *_, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == prompt_tokens
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == prompt_tokens + 6
    assert cached_of(last.usage, flavor) == 0
    assert all(c.usage is None for c in chunks[:-1])
    if flavor == VLLM:  # vLLM's own field: the prompt's full blocks it wrote
        assert last.usage.prompt_tokens_details is not None
        created = (last.usage.prompt_tokens_details.model_extra or {})["created_cache_tokens"]
        assert created == prompt_tokens // BLOCK * BLOCK

    # The same chat again: its prompt blocks come from the prefix cache.
    *_, again = await stream_chat(client, messages, 2)
    cached = cached_of(again.usage, flavor)
    assert prompt_tokens - BLOCK <= cached < prompt_tokens
    assert again.usage is not None and again.usage.completion_tokens == 2


async def test_completion_stream_with_usage(server: EngineServer, client: AsyncOpenAI) -> None:
    flavor = server.cfg.flavor
    prompt = filler(500, "cmpl")

    async def once(max_tokens: int) -> tuple[str, CompletionUsage | None]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks: list[Completion] = [c async for c in stream]
        assert len({c.id for c in chunks}) == 1
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert [f for f in finishes if f] == ["length"]
        return text, chunks[-1].usage

    text, usage = await once(4)
    assert text == "tok " * 4
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (500, 4)
    assert cached_of(usage, flavor) == 0

    text, usage = await once(3)
    assert text == "tok " * 3
    assert cached_of(usage, flavor) == (500 - 1) // BLOCK * BLOCK


async def test_non_streaming_chat_and_completion(server: EngineServer, client: AsyncOpenAI) -> None:
    # SGLang answers (and echoes) any model name; vLLM only its served one.
    model = "my-model" if server.cfg.flavor == SGLANG else MODEL
    chat = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello there."}],
        max_completion_tokens=5,
    )
    assert isinstance(chat, ChatCompletion)
    assert chat.object == "chat.completion"
    assert chat.model == model
    assert chat.id.startswith("chatcmpl-") == (server.cfg.flavor == VLLM)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "tok " * 5
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == count_tokens(render_chat([{"content": "Hello there."}]))
    assert chat.usage.completion_tokens == 5

    cmpl = await client.completions.create(model=MODEL, prompt="abcd" * 10, max_tokens=3)
    assert cmpl.object == "text_completion"
    assert cmpl.choices[0].text == "tok " * 3
    assert cmpl.choices[0].finish_reason == "length"
    assert cmpl.usage is not None
    assert (cmpl.usage.prompt_tokens, cmpl.usage.completion_tokens) == (10, 3)
    assert cmpl.usage.total_tokens == 13
    assert cmpl.id.startswith("cmpl-") == (server.cfg.flavor == VLLM)


async def test_raw_response_headers_and_models(client: AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert raw.headers[ENGINE_ID_HEADER] == NAME
    parsed = raw.parse()
    assert parsed.choices[0].message.content == "tok "
    models = [m.id async for m in client.models.list()]
    assert models == [MODEL]


async def test_errors_surface_as_openai_exceptions(
    server: EngineServer, client: AsyncOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )
    assert bad.value.status_code == 400
    assert "max_tokens" in bad.value.message

    if server.cfg.flavor == VLLM:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert missing.value.status_code == 404
        assert "no-such-model" in missing.value.message

    server.cfg.faults = Faults(error_rate=1.0)
    with pytest.raises(openai.InternalServerError) as err:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert err.value.status_code == 500
    assert "fault" in err.value.message
