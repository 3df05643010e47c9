"""The emulated engine's two flavors side by side, over real HTTP and ZMQ on 127.0.0.1:
`sglang` as its source reads (python/sglang/srt/entrypoints/..., research notes cited per
test) and `vllm` as the real vLLM 0.32 answered on this machine (tests/fixtures/vllm/,
captured by emulator/vllm/capture.py; the tests that compare against a capture skip when
it is missing). One behaviour per test, each with the numbers it must show."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from emulator.engine.config import FLAVORS, SGLANG, VLLM, EngineConfig, Faults
from emulator.engine.kv_publisher import ARRAY, KvEventsConfig
from ext_proc.feeds.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_message
from ext_proc.prompt.tokens import APPROX, count_tokens, render_chat
from tests.component.engine_harness import (
    CHAT,
    COMPLETIONS,
    FAST,
    GENERATE,
    MESSAGES,
    NAME,
    filler,
    read_sse,
    running,
)

BLOCK = FAST.block_tokens  # 64
MODEL = "emulated"  # the served name; vLLM refuses any other
FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "vllm"
# 4,000 prompt tokens take ~0.53 s to prefill (one chunk): a queue a probe can wait behind.
SLOW = replace(FAST, name="slow-prefill", prefill_tokens_per_s=8000.0)
SLOW_PREFILL_S = SLOW.lone_ttft_ms(4000) / 1e3
# 5 ms per decode step: a 200-token stream runs for ~1 s.
SLOW_DECODE = replace(FAST, name="slow-decode", decode_base_ms=5.0)
HEX16, HEX32 = re.compile(r"^[0-9a-f]{16}$"), re.compile(r"^[0-9a-f]{32}$")

flavors = pytest.mark.parametrize("flavor", FLAVORS)


def cfg_of(flavor: str, **overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = {
        "name": NAME,
        "profile": FAST,
        "flavor": flavor,
        "default_max_tokens": 5,
        "max_tokens_cap": 1000,
    }
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


def fixture(name: str) -> Path:
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"no capture of the real vLLM: {path}")
    return path


def fixture_json(name: str) -> Any:
    return json.loads(fixture(name).read_text())


def fixture_sse(name: str) -> list[dict[str, Any]]:
    events = [e for e in fixture(name).read_text().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    payloads = [e[len("data: ") :] for e in events]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def shape(obj: Any) -> Any:
    """The structure of a JSON value: keys kept, leaves replaced by their type (None kept)."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(v) for v in obj[:1]]
    return None if obj is None else type(obj).__name__


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def sse_chunks(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, list[Any]]:
    """Status and every event of a streamed response: JSON objects, then "[DONE]"."""
    async with http.post(url, json={**body, "stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
        status = resp.status
    return status, [p if p == "[DONE]" else json.loads(p) for _, p in events]


async def post_json(
    http: aiohttp.ClientSession, url: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    data = raw if raw is not None else json.dumps(body).encode()
    async with http.post(url, data=data, headers=headers) as resp:
        return resp.status, await resp.json()


# -- OpenAI streams ----------------------------------------------------------------------


@flavors
async def test_chat_stream_chunk_sequence(flavor: str, http: aiohttp.ClientSession) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 3,
        "stream_options": {"include_usage": True},
    }
    async with running(cfg_of(flavor)) as srv:
        status, events = await sse_chunks(http, f"{srv.url}{CHAT}", body)
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks: list[dict[str, Any]] = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {MODEL}
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    envelope = {"id", "object", "created", "model", "choices"}
    if flavor == SGLANG:
        # serving_chat.py: role chunk with the first output, content chunks, a separate
        # finish chunk, the usage chunk; reasoning_content and matched_stop always there.
        assert HEX32.match(chunks[0]["id"])  # the request id, no chatcmpl- prefix
        assert len(chunks) == 1 + 3 + 1 + 1
        assert all(set(c) == envelope for c in chunks[:-1])
        role = {"reasoning_content": None, "role": "assistant", "content": ""}
        token = {"reasoning_content": None, "content": "tok "}
        assert [c["delta"] for c in choices] == [
            role,
            token,
            token,
            token,
            {"reasoning_content": None},
        ]
        assert [c["finish_reason"] for c in choices] == [None, None, None, None, "length"]
        assert all(
            set(c) == {"index", "delta", "logprobs", "finish_reason", "matched_stop"}
            for c in choices
        )
        assert all(c["matched_stop"] is None and c["logprobs"] is None for c in choices)
        assert set(chunks[-1]) == envelope | {"usage"}
    else:
        # The real one (tests/fixtures/vllm/sse-chat.txt): the role chunk carries
        # prompt_token_ids and prompt_text, token chunks token_ids; finish_reason and
        # stop_reason ride on the last token's chunk; fingerprint on the usage chunk.
        assert chunks[0]["id"].startswith("chatcmpl-")
        assert HEX16.match(chunks[0]["id"].removeprefix("chatcmpl-"))
        assert len(chunks) == 1 + 3 + 1
        assert set(chunks[0]) == envelope | {"prompt_token_ids", "prompt_text"}
        assert chunks[0]["prompt_token_ids"] is chunks[0]["prompt_text"] is None
        assert all(set(c) == envelope for c in chunks[1:-1])
        assert [c["delta"] for c in choices] == [
            {"role": "assistant", "content": ""},
            *[{"content": "tok "}] * 3,
        ]
        assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
        assert set(choices[0]) == {"index", "delta", "logprobs", "finish_reason"}
        assert [set(c) for c in choices[1:]] == [
            {"index", "delta", "logprobs", "finish_reason", "token_ids"},
            {"index", "delta", "logprobs", "finish_reason", "token_ids"},
            {"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"},
        ]
        assert choices[-1]["stop_reason"] is None
        assert set(chunks[-1]) == envelope | {"usage", "system_fingerprint"}
        assert chunks[-1]["system_fingerprint"].startswith("vllm-0.32.0-")
    assert chunks[-1]["choices"] == []
    prompt_tokens = count_tokens(render_chat(MESSAGES))
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["total_tokens"] == prompt_tokens + 3


@flavors
async def test_completion_stream_chunk_sequence(flavor: str, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "abcd" * 10, "max_tokens": 3}
    async with running(cfg_of(flavor)) as srv:
        status, events = await sse_chunks(http, f"{srv.url}{COMPLETIONS}", body)
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks: list[dict[str, Any]] = events[:-1]
    assert len(chunks) == 3  # one per token: no role chunk, no finish chunk, no usage asked
    choices = [c["choices"][0] for c in chunks]
    assert [c["text"] for c in choices] == ["tok "] * 3
    # Both put finish_reason on the last token's chunk (serving_completions.py;
    # completion/serving.py).
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    assert {c["object"] for c in chunks} == {"text_completion"}
    if flavor == SGLANG:
        assert HEX32.match(chunks[0]["id"])
        assert all(
            set(c) == {"index", "text", "logprobs", "finish_reason", "matched_stop"}
            for c in choices
        )
        assert all("system_fingerprint" not in c for c in chunks)
    else:
        assert chunks[0]["id"].startswith("cmpl-")
        # completion/serving.py sets stop_reason, token_ids and prompt_token_ids on
        # every chunk; with no usage chunk to follow, the last one has the fingerprint.
        keys = {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids"}
        assert all(set(c) == keys | {"prompt_token_ids"} for c in choices)
        assert ["system_fingerprint" in c for c in chunks] == [False, False, True]


@pytest.mark.parametrize(
    ("flavor", "default_include", "stream_options", "expect_usage"),
    [
        (SGLANG, False, None, False),
        (SGLANG, False, {}, False),  # StreamOptions.include_usage defaults to false
        (SGLANG, False, {"include_usage": False}, False),
        (SGLANG, False, {"include_usage": True}, True),
        (SGLANG, True, None, True),  # --stream-response-default-include-usage
        (SGLANG, True, {"include_usage": False}, True),  # or-ed (openai/utils.py)
        (VLLM, False, None, False),
        (VLLM, False, {}, True),  # vLLM's StreamOptions.include_usage defaults to true
        (VLLM, False, {"include_usage": False}, False),
        (VLLM, False, {"include_usage": True}, True),
        (VLLM, True, None, True),  # --enable-force-include-usage
    ],
)
async def test_usage_chunk_gating(
    flavor: str,
    default_include: bool,
    stream_options: dict[str, Any] | None,
    expect_usage: bool,
    http: aiohttp.ClientSession,
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    if stream_options is not None:
        body["stream_options"] = stream_options
    async with running(cfg_of(flavor, default_include_usage=default_include)) as srv:
        _, events = await sse_chunks(http, f"{srv.url}{CHAT}", body)
    usage_chunks = [c for c in events[:-1] if "usage" in c]
    assert len(usage_chunks) == (1 if expect_usage else 0)
    if expect_usage:
        assert usage_chunks[0] is events[-2]  # the last before [DONE]
        assert usage_chunks[0]["choices"] == []
        assert usage_chunks[0]["usage"]["completion_tokens"] == 2


@flavors
@pytest.mark.parametrize("cache_report", [False, True])
async def test_cache_report_gating(
    flavor: str, cache_report: bool, http: aiohttp.ClientSession
) -> None:
    msgs = [{"role": "user", "content": filler(300, "cache")}]
    n = count_tokens(render_chat(msgs))
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 1,
        "stream_options": {"include_usage": True},
    }
    async with running(cfg_of(flavor, cache_report=cache_report)) as srv:
        cold = (await sse_chunks(http, f"{srv.url}{CHAT}", body))[1][-2]["usage"]
        warm = (await sse_chunks(http, f"{srv.url}{CHAT}", body))[1][-2]["usage"]
        status, whole = await post_json(http, f"{srv.url}{CHAT}", body)
        assert status == 200
        status, cmpl = await post_json(
            http, f"{srv.url}{COMPLETIONS}", {"model": MODEL, "prompt": "x" * 1200, "max_tokens": 1}
        )
        assert status == 200
    # ~300 tokens: 4 full blocks of 64, all of them hit on a repeat.
    hit, full = (n - 1) // BLOCK * BLOCK, n // BLOCK * BLOCK
    assert hit == full == 256
    if flavor == SGLANG:
        # usage_processor.py: {"cached_tokens": N} only with --enable-cache-report and N > 0.
        assert cold["prompt_tokens_details"] is None
        expect = {"cached_tokens": hit} if cache_report else None
        assert warm["prompt_tokens_details"] == expect
        assert whole["usage"]["prompt_tokens_details"] == expect
        assert cmpl["usage"]["prompt_tokens_details"] is None  # 300 tokens, first time
        assert warm["reasoning_tokens"] == 0
    elif cache_report:
        # --enable-prompt-tokens-details: 0 reported too; created_cache_tokens is the
        # prompt's full blocks newly written (sse-chat-cached.json: 0/1664, then 1664/0);
        # the stream's usage chunk drops nulls, the whole response keeps them.
        assert cold["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": full}
        assert warm["prompt_tokens_details"] == {
            "cached_tokens": hit,
            "created_cache_tokens": full - hit,
        }
        assert whole["usage"]["prompt_tokens_details"] == {
            "cached_tokens": hit,
            "created_cache_tokens": 0,
            "multimodal_tokens": None,
        }
        assert whole["usage"]["completion_tokens_details"] is None
        # /v1/completions has no created_cache_tokens (routes.json: null).
        assert cmpl["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
    else:
        assert "prompt_tokens_details" not in cold and "prompt_tokens_details" not in warm
        assert whole["usage"]["prompt_tokens_details"] is None
        assert cmpl["usage"]["prompt_tokens_details"] is None
    assert cold["prompt_tokens"] == warm["prompt_tokens"] == n


async def test_vllm_shapes_match_the_capture(http: aiohttp.ClientSession) -> None:
    """Key by key (types, not values), the emulated vLLM's chat stream and whole responses
    against the real vLLM's, both with --enable-prompt-tokens-details."""
    real = fixture_sse("sse-chat.txt")
    routes = fixture_json("routes.json")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 8,
        "stream_options": {"include_usage": True},
    }
    async with running(cfg_of(VLLM, cache_report=True, context_length=4096)) as srv:
        _, events = await sse_chunks(http, f"{srv.url}{CHAT}", body)
        _, chat = await post_json(http, f"{srv.url}{CHAT}", {**body, "max_tokens": 4})
        _, cmpl = await post_json(
            http, f"{srv.url}{COMPLETIONS}", {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        )
        async with http.get(f"{srv.url}/v1/models") as resp:
            models = await resp.json()
    ours = events[:-1]
    # One chunk per token here; the real one coalesces the tokens that pile up while its
    # API server is behind (6 chunks for 8 tokens), in the same shapes.
    assert len(ours) == 1 + 8 + 1
    assert 1 + 1 + 1 <= len(real) <= len(ours)
    assert real[-1]["usage"]["completion_tokens"] == ours[-1]["usage"]["completion_tokens"] == 8
    for i in (0, 1, -2, -1):  # role, a token, the last token, usage
        assert shape(ours[i]) == shape(real[i]), i
    real_id = re.compile(r"^chatcmpl-[0-9a-f]{16}$")
    assert real_id.match(real[0]["id"]) and real_id.match(ours[0]["id"])
    assert shape(chat) == shape(
        routes["POST /v1/chat/completions (stream false, max_tokens 4)"]["body"]
    )
    assert shape(cmpl) == shape(routes["POST /v1/completions (max_tokens 4)"]["body"])
    assert shape(models) == shape(routes["GET /v1/models"]["body"])


@flavors
async def test_stream_headers_timing(flavor: str, http: aiohttp.ClientSession) -> None:
    """SGLang runs the stream's generator to its first output before it answers
    (serving_chat.py "kick-start"): headers leave with the first token. vLLM's
    StreamingResponse answers at once."""
    body = {"model": MODEL, "prompt": filler(4000, "hdr"), "max_tokens": 2, "stream": True}
    async with running(cfg_of(flavor, profile=SLOW)) as srv:
        start = time.perf_counter()
        async with http.post(f"{srv.url}{COMPLETIONS}", json=body) as resp:
            headers_s = time.perf_counter() - start
            headers = resp.headers
            events = await read_sse(resp)
        first_s = events[0][0] - start
    # Starlette's StreamingResponse in both: charset added, no cache header.
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert "Cache-Control" not in headers
    if flavor == VLLM and (FIXTURES / "routes.json").exists():
        real = fixture_json("routes.json")["POST /v1/chat/completions (stream)"]
        assert real["response_headers"]["content-type"] == headers["Content-Type"]
    assert first_s >= 0.9 * SLOW_PREFILL_S
    if flavor == SGLANG:
        assert headers_s >= 0.9 * SLOW_PREFILL_S
    else:
        assert headers_s < 0.5 * SLOW_PREFILL_S


# -- errors ------------------------------------------------------------------------------


def sglang_error(data: Any, err_type: str, code: int = 400) -> str:
    """SGLang's flat ErrorResponse (serving_base.py create_error_response); its message."""
    assert set(data) == {"object", "message", "type", "param", "code"}
    assert (data["object"], data["type"], data["param"], data["code"]) == (
        "error",
        err_type,
        None,
        code,
    )
    return str(data["message"])


def vllm_error(data: Any, err_type: str, param: str | None, code: int = 400) -> str:
    """vLLM's {"error": {...}} (engine/protocol.py ErrorResponse); its message."""
    assert set(data) == {"error"}
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (err_type, param, code)
    return str(err["message"])


@flavors
async def test_bad_json_and_schema_errors(flavor: str, http: aiohttp.ClientSession) -> None:
    # The real capture's own malformed body: 47 characters, cut inside a message.
    raw = b'{"model": "tiny", "messages": [{"role": "user",'
    async with running(cfg_of(flavor)) as srv:
        bad_json = await post_json(http, f"{srv.url}{CHAT}", raw=raw)
        missing = await post_json(http, f"{srv.url}{CHAT}", {"model": MODEL, "max_tokens": 4})
        wrong = await post_json(http, f"{srv.url}{COMPLETIONS}", {"model": MODEL, "prompt": 42})
    assert [s for s, _ in (bad_json, missing, wrong)] == [400, 400, 400]
    if flavor == SGLANG:
        # RequestValidationError handler: a flat ErrorResponse, type "Bad Request".
        assert "JSON" in sglang_error(bad_json[1], "Bad Request")
        assert "messages" in sglang_error(missing[1], "Bad Request")
        assert "prompt" in sglang_error(wrong[1], "Bad Request")
    else:
        # validation.py: type "Bad Request", param the cleaned pydantic loc.
        assert "JSON" in vllm_error(bad_json[1], "Bad Request", "body.47")
        assert "messages" in vllm_error(missing[1], "Bad Request", "body.messages")
        assert "prompt" in vllm_error(wrong[1], "Bad Request", "body.prompt")
        cases = fixture_json("errors.json") if (FIXTURES / "errors.json").exists() else {}
        for case, ours in (("malformed JSON body", bad_json), ("missing messages", missing)):
            if case in cases:
                real = cases[case]
                assert real["status"] == ours[0]
                assert {k: v for k, v in real["body"]["error"].items() if k != "message"} == {
                    k: v for k, v in ours[1]["error"].items() if k != "message"
                }
        if "malformed JSON body" in cases:  # word for word
            assert cases["malformed JSON body"]["body"] == bad_json[1]


@flavors
async def test_unknown_model(flavor: str, http: aiohttp.ClientSession) -> None:
    body = {
        "model": "no-such-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    async with running(cfg_of(flavor)) as srv:
        status, data = await post_json(http, f"{srv.url}{CHAT}", body)
        async with http.post(f"{srv.url}{CHAT}", json={**body, "stream": True}) as resp:
            stream_status = resp.status
            stream_type = resp.content_type
            await resp.read()
    if flavor == SGLANG:
        # handle_request does not check the model: served, and the name echoed.
        assert (status, stream_status) == (200, 200)
        assert data["model"] == "no-such-model"
        assert stream_type == "text/event-stream"
    else:
        # _check_model: 404 before any stream, in the real one's words.
        assert (status, stream_status) == (404, 404)
        assert stream_type == "application/json"
        message = vllm_error(data, "NotFoundError", "model", 404)
        assert message == f"The model `no-such-model` does not exist. Valid aliases: {MODEL}."
        cases = fixture_json("errors.json") if (FIXTURES / "errors.json").exists() else {}
        if "unknown model" in cases:
            real = cases["unknown model"]["body"]["error"]
            assert real["message"].replace("tiny", MODEL) == message


async def test_context_length_sglang(http: aiohttp.ClientSession) -> None:
    """tokenizer_manager.py _validate_one_request: a prompt as long as the context, or a
    prompt plus max_tokens over it, is a 400 BadRequestError."""
    ctx = 300
    async with running(cfg_of(SGLANG, context_length=ctx)) as srv:
        long_prompt = await post_json(http, f"{srv.url}{COMPLETIONS}", {"prompt": "x" * 4 * 300})
        too_many = await post_json(
            http, f"{srv.url}{COMPLETIONS}", {"prompt": "x" * 400, "max_tokens": 201}
        )
        fits = await post_json(
            http, f"{srv.url}{COMPLETIONS}", {"prompt": "x" * 400, "max_tokens": 200}
        )
        streamed = await post_json(
            http, f"{srv.url}{CHAT}", {"messages": MESSAGES, "max_tokens": 300, "stream": True}
        )
    assert long_prompt[0] == too_many[0] == streamed[0] == 400
    assert sglang_error(long_prompt[1], "BadRequestError") == (
        "The input (300 tokens) is longer than the model's context length (300 tokens)."
    )
    message = sglang_error(too_many[1], "BadRequestError")
    assert message.startswith(
        "Requested token count exceeds the model's maximum context length of 300"
    )
    assert (
        "You requested a total of 301 tokens: 100 tokens from the input messages and 201" in message
    )
    # A stream's validation error is an HTTP 400, not an event (the kick-start).
    assert "context length" in sglang_error(streamed[1], "BadRequestError")
    assert fits[0] == 200
    assert fits[1]["usage"]["completion_tokens"] == 200


async def test_context_length_vllm(http: aiohttp.ClientSession) -> None:
    """vLLM 0.32 as measured (errors.json): max_tokens over max_model_len, or a prompt
    that leaves no room, is a 400 naming the parameter; a max_tokens that does not fit
    with the prompt is shortened to what fits (200, finish_reason length)."""
    ctx = 4096
    async with running(cfg_of(VLLM, context_length=ctx, max_tokens_cap=32768)) as srv:
        long_prompt = await post_json(
            http,
            f"{srv.url}{CHAT}",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x" * 4 * 5000}],
                "max_tokens": 4,
            },
        )
        too_large = await post_json(
            http,
            f"{srv.url}{CHAT}",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10000},
        )
    async with running(cfg_of(VLLM, context_length=300)) as srv:
        clamped = await post_json(
            http,
            f"{srv.url}{COMPLETIONS}",
            {"model": MODEL, "prompt": "x" * 400, "max_tokens": 300},
        )
    assert long_prompt[0] == too_large[0] == 400
    message = vllm_error(long_prompt[1], "BadRequestError", "input_tokens")
    assert "at least 4097 input tokens" in message
    assert vllm_error(too_large[1], "BadRequestError", "max_tokens") == (
        "max_tokens=10000 cannot be greater than max_model_len=4096. Please request fewer "
        "output tokens. (parameter=max_tokens, value=10000)"
    )
    cases = fixture_json("errors.json") if (FIXTURES / "errors.json").exists() else {}
    if cases:
        assert cases["prompt longer than the context"]["body"]["error"]["message"] == message
        real_too_large = cases["max_tokens 10000"]["body"]["error"]["message"]
        assert real_too_large == too_large[1]["error"]["message"]
        real_clamped = cases["max_tokens 4096 (too large for the 4096 context)"]
        assert real_clamped["status"] == 200
        assert real_clamped["body"]["usage"]["total_tokens"] == 4096
    assert clamped[0] == 200
    assert clamped[1]["choices"][0]["finish_reason"] == "length"
    assert clamped[1]["usage"]["completion_tokens"] == 300 - 100
    assert clamped[1]["usage"]["total_tokens"] == 300


@flavors
async def test_injected_500(flavor: str, http: aiohttp.ClientSession) -> None:
    async with running(cfg_of(flavor, faults=Faults(error_rate=1.0))) as srv:
        chat = await post_json(
            http, f"{srv.url}{CHAT}", {"model": MODEL, "messages": MESSAGES, "stream": True}
        )
        generate = None
        if flavor == SGLANG:
            generate = await post_json(http, f"{srv.url}{GENERATE}", {"text": "hi"})
    assert chat[0] == 500
    if flavor == SGLANG:
        # handle_request: any exception is a 500 InternalServerError ErrorResponse.
        assert sglang_error(chat[1], "InternalServerError", 500).startswith(
            "Internal server error: "
        )
        assert generate is not None and generate[0] == 500
        assert set(generate[1]) == {"error"} and set(generate[1]["error"]) == {"message"}
    else:
        assert "fault" in vllm_error(chat[1], "InternalServerError", None, 500)


@flavors
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("after", [0, 3])
async def test_mid_stream_error_event(
    flavor: str, path: str, after: int, http: aiohttp.ClientSession
) -> None:
    """The stream fails after `after` tokens: HTTP 200, an error event, then [DONE].
    SGLang: an abort with a status (serving_chat.py) names it (INTERNAL_SERVER_ERROR)
    and, as the code after its loop still runs, sends the usage chunk of what was sent.
    vLLM: create_streaming_error_response, then [DONE]."""
    faults = Faults(stream_error_rate=1.0, stream_error_after=after)
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 6,
        "stream_options": {"include_usage": True},
    }
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": "abcd" * 10})
    async with running(cfg_of(flavor, faults=faults)) as srv:
        status, events = await sse_chunks(http, f"{srv.url}{path}", body)
        assert srv.engine.stats.injected_errors_total == 1
    assert status == 200
    assert events[-1] == "[DONE]"
    (error_at,) = [i for i, e in enumerate(events) if isinstance(e, dict) and "error" in e]
    before = events[:error_at]
    role = 1 if path == CHAT and after > 0 else 0
    assert len(before) == role + after
    text = "".join(
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "")
        for c in before
    )
    assert text == "tok " * after
    assert all(c["choices"][0]["finish_reason"] is None for c in before)
    err = events[error_at]
    if flavor == SGLANG:
        assert err == {
            "error": {
                "object": "error",
                "message": "injected fault: stream",
                "type": "INTERNAL_SERVER_ERROR",
                "param": None,
                "code": 500,
            }
        }
        (usage,) = events[error_at + 1 : -1]
        assert usage["choices"] == []
        assert usage["usage"]["completion_tokens"] == after
    else:
        assert err == {
            "error": {
                "message": "injected fault: stream",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        assert error_at == len(events) - 2


# -- health ------------------------------------------------------------------------------


async def timed_get(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes, float]:
    start = time.perf_counter()
    async with http.get(url) as resp:
        body = await resp.read()
        return resp.status, body, time.perf_counter() - start


async def test_sglang_health_during_warmup(http: aiohttp.ClientSession) -> None:
    """503 while starting (ServerStatus.Starting), empty body; the HTTP-process routes
    already answer; after the warmup a generation is served and /health is 200."""
    async with running(cfg_of(SGLANG, warmup_s=0.4)) as srv:
        started = time.perf_counter()
        for path in ("/health", "/health_generate"):
            status, body, _ = await timed_get(http, f"{srv.url}{path}")
            assert (status, body) == (503, b"")
        for path in ("/v1/models", "/get_model_info", "/ping"):
            assert (await timed_get(http, f"{srv.url}{path}"))[0] == 200
        assert srv.engine.runner.model.stats.requests_admitted == 0  # no probe ran
        await asyncio.sleep(max(0.0, 0.45 - (time.perf_counter() - started)))
        status, body, _ = await timed_get(http, f"{srv.url}/health")
        assert (status, body) == (200, b"")
        assert srv.engine.runner.model.stats.requests_admitted == 1  # the one-token probe


POLL_S = 0.1  # SGLang's health poll is 1 s; scaled down here


@pytest.mark.parametrize("health_generation", [True, False])
async def test_sglang_health_polls_for_any_output(
    health_generation: bool, http: aiohttp.ClientSession
) -> None:
    """/health submits a one-token generation (max_new_tokens 1) and then, sleeping a
    poll interval (1 s) before each look, answers 200 once the engine produced any output
    since it began (http_server.py health_generate: last_receive_tstamp > tic). So it
    takes at least one poll, and as many as a long prefill holds every output back. With
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false /health answers at once;
    /health_generate generates regardless."""
    cfg = cfg_of(SGLANG, profile=SLOW, health_generation=health_generation, health_poll_s=POLL_S)
    async with running(cfg) as srv:
        status, _, idle_s = await timed_get(http, f"{srv.url}/health")
        assert status == 200
        if health_generation:
            assert POLL_S <= idle_s < 2 * POLL_S  # idle: its own token, seen at the first look
        else:
            assert idle_s < POLL_S
        for path in ("/health", "/health_generate"):
            body = {"prompt": filler(4000, path), "max_tokens": 1}  # no prefix hit
            long = asyncio.create_task(post_json(http, f"{srv.url}{COMPLETIONS}", body))
            await asyncio.sleep(0.05)  # the long prefill is running
            assert srv.engine.runner.model.num_running == 1
            status, _, took_s = await timed_get(http, f"{srv.url}{path}")
            assert status == 200
            done_at_answer = long.done()
            assert (await long)[0] == 200
            if path == "/health" and not health_generation:
                assert took_s < 0.25 * SLOW_PREFILL_S
                assert not done_at_answer
            else:
                # No output until the prefill (~0.48 s more) ends: the looks before find
                # nothing; the first look after it answers.
                assert SLOW_PREFILL_S - 0.05 <= took_s < SLOW_PREFILL_S + POLL_S + 0.1


async def test_sglang_health_is_happy_with_anyones_output(http: aiohttp.ClientSession) -> None:
    """Any output counts, not only the probe's: while a long decode streams, /health
    answers at its first look even though its own token waits in the queue."""
    cfg = cfg_of(SGLANG, health_poll_s=POLL_S)
    async with running(cfg) as srv:
        body = {"prompt": "abcd" * 10, "max_tokens": 400, "stream": False}
        long = asyncio.create_task(post_json(http, f"{srv.url}{COMPLETIONS}", body))
        await asyncio.sleep(0.05)
        status, _, took_s = await timed_get(http, f"{srv.url}/health")
        assert status == 200 and POLL_S <= took_s < 2 * POLL_S
        assert (await long)[0] == 200


async def test_vllm_health_is_immediate(http: aiohttp.ClientSession) -> None:
    """vLLM's /health checks the engine process only (serve/instrumentator/health.py);
    /ping is the same; no warmup 503."""
    body = {"model": MODEL, "prompt": filler(4000, "vq"), "max_tokens": 1}
    async with running(cfg_of(VLLM, profile=SLOW, warmup_s=5.0)) as srv:
        long = asyncio.create_task(post_json(http, f"{srv.url}{COMPLETIONS}", body))
        await asyncio.sleep(0.05)
        for path in ("/health", "/ping"):
            status, content, took_s = await timed_get(http, f"{srv.url}{path}")
            assert (status, content) == (200, b"")
            assert took_s < 0.25 * SLOW_PREFILL_S
        assert not long.done()
        assert (await long)[0] == 200
        assert srv.engine.runner.model.stats.requests_admitted == 1  # no probe generation


# -- routes ------------------------------------------------------------------------------

SGLANG_ONLY = [
    ("POST", GENERATE),
    ("GET", "/health_generate"),
    ("GET", "/get_model_info"),
    ("GET", "/model_info"),
    ("GET", "/v1/loads"),
    ("GET", "/get_load"),
    ("GET", "/get_server_info"),
    ("POST", "/flush_cache"),
    ("POST", "/v1/tokenize"),
]
VLLM_ONLY = [
    ("GET", "/load"),
    ("GET", "/version"),
    ("GET", "/kv_event_sources"),
    ("POST", "/reset_prefix_cache"),  # dev mode (VLLM_SERVER_DEV_MODE) in the real one
]
COMMON = [
    ("GET", "/health"),
    ("GET", "/ping"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),  # vLLM's own; SGLang's alias of /v1/tokenize
]
EMULATOR_OWN = {"/faults", "/stats", "/server_info"}


@flavors
async def test_route_sets(flavor: str, http: aiohttp.ClientSession) -> None:
    own = SGLANG_ONLY if flavor == SGLANG else VLLM_ONLY
    other = VLLM_ONLY if flavor == SGLANG else SGLANG_ONLY
    async with running(cfg_of(flavor, enable_metrics=True)) as srv:
        for method, path in COMMON + own:
            body = {"text": "hi"} if path == GENERATE else None
            if path.endswith("/tokenize"):
                body = {"prompt": "hi"}
            async with http.request(method, f"{srv.url}{path}", json=body) as resp:
                assert resp.status == 200, (method, path)
        for method, path in other:
            async with http.request(method, f"{srv.url}{path}") as resp:
                assert resp.status == 404, (method, path)
        routes = {r.resource.canonical for r in srv.app.router.routes() if r.resource}
    if flavor == VLLM and (FIXTURES / "routes.json").exists():
        real = fixture_json("routes.json")
        real_paths = set(real["GET /openapi.json"]["paths"])
        ours = routes - EMULATOR_OWN - {"/reset_prefix_cache"}
        assert ours <= real_paths, ours - real_paths


@flavors
async def test_metrics_names_and_labels(flavor: str, http: aiohttp.ClientSession) -> None:
    prompt = filler(700, "metrics")
    async with running(cfg_of(flavor, enable_metrics=True, profile=SLOW_DECODE)) as srv:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "stream": True}
        resp = await http.post(f"{srv.url}{COMPLETIONS}", json=body)
        await resp.content.readuntil(b"\n\n")  # decoding
        async with http.get(f"{srv.url}/metrics") as r:
            assert r.status == 200
            assert r.content_type == "text/plain"
            busy = {f.name: f for f in text_string_to_metric_families(await r.text())}
        resp.close()
        async with asyncio.timeout(2):
            while srv.engine.stats.in_flight:
                await asyncio.sleep(0.005)
        if flavor == SGLANG:
            async with http.get(f"{srv.url}/health") as r:  # log_metrics=False: not counted
                assert r.status == 200
        async with http.get(f"{srv.url}/metrics") as r:
            text = await r.text()
            idle = {f.name: f for f in text_string_to_metric_families(text)}

    def value(families: dict[str, Any], family: str, sample: str | None = None) -> float:
        (only,) = [s.value for s in families[family].samples if s.name == (sample or family)]
        return float(only)

    if flavor == SGLANG:
        labels = {"model_name": MODEL, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        running_, waiting, usage = (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
        )
        prompt_counter = "sglang:prompt_tokens"
        expect = {
            "sglang:num_used_tokens": "gauge",
            "sglang:cache_hit_rate": "gauge",
            "sglang:generation_tokens": "counter",
            "sglang:time_to_first_token_seconds": "histogram",
            "sglang:inter_token_latency_seconds": "histogram",
        }
    else:
        labels = {"engine": "0", "model_name": MODEL}
        running_, waiting, usage = (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        )
        prompt_counter = "vllm:prompt_tokens"
        expect = {
            "vllm:prefix_cache_queries": "counter",
            "vllm:prefix_cache_hits": "counter",
            "vllm:generation_tokens": "counter",
            "vllm:time_to_first_token_seconds": "histogram",
            "vllm:inter_token_latency_seconds": "histogram",
        }
    expect.update({running_: "gauge", waiting: "gauge", usage: "gauge", prompt_counter: "counter"})
    for name, kind in expect.items():
        assert idle[name].type == kind, name
    # vLLM's cache config is an info gauge: its labels are the config (checked below)
    info = idle.pop("vllm:cache_config_info", None)
    assert (info is not None) == (flavor == VLLM)
    for family in idle.values():
        for s in family.samples:
            assert {k: v for k, v in s.labels.items() if k != "le"} == labels, s
    assert value(busy, running_) == 1 and value(idle, running_) == 0
    assert value(busy, waiting) == value(idle, waiting) == 0
    assert 0 < value(busy, usage) < 1  # the running request's KV
    assert value(idle, usage) == 0  # cached blocks nobody holds are free
    assert value(idle, prompt_counter, prompt_counter + "_total") == 700
    if flavor == VLLM and (FIXTURES / "metrics.txt").exists():
        real = {
            f.name: f for f in text_string_to_metric_families(fixture("metrics.txt").read_text())
        }
        for name, family in idle.items():
            assert name in real, name
            assert real[name].type == family.type, name
            real_labels = {k for s in real[name].samples for k in s.labels if k != "le"}
            assert real_labels == set(labels), name
        assert info is not None
        (pool,) = info.samples
        (real_pool,) = real["vllm:cache_config_info"].samples
        assert set(pool.labels) <= set(real_pool.labels) and pool.value == real_pool.value


async def test_sglang_metrics_need_enable_metrics(http: aiohttp.ClientSession) -> None:
    async with running(cfg_of(SGLANG)) as srv, http.get(f"{srv.url}/metrics") as resp:
        assert resp.status == 404  # add_prometheus_middleware only with --enable-metrics
    async with running(cfg_of(VLLM)) as srv, http.get(f"{srv.url}/metrics") as resp:
        assert resp.status == 200  # vLLM always serves it


@flavors
async def test_load_endpoints(flavor: str, http: aiohttp.ClientSession) -> None:
    async with running(cfg_of(flavor, profile=SLOW_DECODE)) as srv:
        body = {"model": MODEL, "prompt": filler(300, "load"), "max_tokens": 200, "stream": True}
        resp = await http.post(f"{srv.url}{COMPLETIONS}", json=body)
        await resp.content.readuntil(b"\n\n")
        if flavor == SGLANG:
            async with http.get(f"{srv.url}/v1/loads") as r:
                loads = await r.json()
            async with http.get(f"{srv.url}/get_load") as r:
                get_load = await r.json()
            async with http.post(f"{srv.url}/flush_cache") as r:
                flush_busy = (r.status, await r.text())
        else:
            async with http.get(f"{srv.url}/load") as r:
                load = await r.json()
        resp.close()
        async with asyncio.timeout(2):
            while srv.engine.stats.in_flight:
                await asyncio.sleep(0.005)
        if flavor == VLLM:
            async with http.get(f"{srv.url}/load") as r:
                idle_load = await r.json()
    if flavor == SGLANG:
        # v1_loads.py: {"timestamp", "version", "accelerator", "num_accelerators", "loads"}.
        assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        (one,) = loads["loads"]
        assert (one["dp_rank"], one["num_running_reqs"], one["num_waiting_reqs"]) == (0, 1, 0)
        # The request's prompt (4 blocks pinned + its tail) and its 200 reserved tokens.
        assert one["num_used_tokens"] == 300 + 200
        # rounded to 4 places, as SGLang's get_loads does
        assert one["token_usage"] == round(500 / FAST.kv_capacity_tokens, 4)
        assert one["max_total_num_tokens"] == FAST.kv_capacity_tokens
        assert get_load == [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 500}]
        # The scheduler refuses a flush while requests run.
        assert flush_busy[0] == 400 and "Cache flushed" in flush_busy[1]
    else:
        # serve/instrumentator/basic.py; routes.json: {"server_load": 0} idle.
        assert load == {"server_load": 1}
        assert idle_load == {"server_load": 0}
        if (FIXTURES / "routes.json").exists():
            assert fixture_json("routes.json")["GET /load"]["body"] == idle_load


# -- KV events ---------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def kv_cfg(flavor: str, port: int, replay_port: int = 0, **overrides: Any) -> EngineConfig:
    encoding = overrides.pop("encoding", "map")
    kv = KvEventsConfig(
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}" if replay_port else "",
        encoding=encoding,
    )
    return cfg_of(flavor, kv_events=kv, **overrides)


@contextlib.contextmanager
def subscriber(port: int) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield sock
    finally:
        sock.close()


async def joined(sock: zmq.Socket[bytes]) -> None:
    await asyncio.sleep(0.2)  # ZMQ's slow joiner: what is published earlier is lost


async def drain(sock: zmq.Socket[bytes], quiet_s: float = 0.15) -> list[list[bytes]]:
    """Every message that arrives until none has for quiet_s."""
    out: list[list[bytes]] = []
    loop = asyncio.get_running_loop()
    last = loop.time()
    while loop.time() - last < quiet_s:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
            last = loop.time()
        except zmq.Again:
            await asyncio.sleep(0.005)
    return out


def raw_events(frames: list[bytes]) -> list[Any]:
    return list(msgpack.unpackb(frames[2], raw=False, strict_map_key=False)[1])


SGLANG_STORED_KEYS = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
}
# The real vLLM's (tests/fixtures/vllm/kv_events.jsonl).
VLLM_STORED_KEYS = SGLANG_STORED_KEYS | {
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
}
VLLM_REMOVED_KEYS = {"type", "block_hashes", "medium", "group_idx"}


async def complete(http: aiohttp.ClientSession, url: str, prompt: str) -> None:
    status, _ = await post_json(
        http, f"{url}{COMPLETIONS}", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert status == 200


@flavors
async def test_kv_events_of_requests(flavor: str, http: aiohttp.ClientSession) -> None:
    (port,) = free_ports(1)
    first = filler(200, "kv")  # 3 full blocks of 64 (192 tokens)
    second = first + filler(130, "more")  # 330 tokens: 5 full blocks, the first 3 shared
    async with running(kv_cfg(flavor, port)) as srv:
        with subscriber(port) as sub:
            await joined(sub)
            await complete(http, srv.url, first)
            await complete(http, srv.url, second)
            messages = await drain(sub)
    assert all(len(m) == 3 for m in messages)
    batches = [decode_message(m) for m in messages]
    # seq counts from 0 per publisher, +1 per message (kv_events.py itertools.count()).
    assert [b.seq for b in batches] == [0, 1]
    assert {b.topic for b in batches} == {""}
    assert {b.dp_rank for b in batches} == {0}
    events = [e for b in batches for e in b.events]
    if flavor == SGLANG:
        # The radix cache's reset at construction rides on the first batch.
        assert events[0] == AllBlocksCleared()
        assert batches[0].events[0] == AllBlocksCleared()
        events = events[1:]
    assert all(isinstance(e, BlockStored) for e in events)
    a, b = events  # one BlockStored per request: the new blocks of one chain
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    ids = APPROX.ids(second)
    assert (len(a.block_hashes), a.parent_block_hash, a.token_ids) == (3, None, tuple(ids[:192]))
    assert (len(b.block_hashes), b.parent_block_hash) == (2, a.block_hashes[-1])
    assert b.token_ids == tuple(ids[192:320])
    for e in (a, b):
        assert e.block_size == BLOCK
        assert len(e.token_ids) == len(e.block_hashes) * e.block_size
        assert e.medium == "GPU"
        if flavor == SGLANG:  # hash_str_to_int64: signed
            assert all(-(2**63) <= h < 2**63 for h in e.block_hashes)
        else:  # maybe_convert_block_hash: unsigned
            assert all(0 <= h < 2**64 for h in e.block_hashes)
    assert len(set(a.block_hashes + b.block_hashes)) == 5
    raw = [e for m in messages for e in raw_events(m) if e["type"] == "BlockStored"]
    assert len(raw) == 2
    keys = SGLANG_STORED_KEYS if flavor == SGLANG else VLLM_STORED_KEYS
    assert all(set(e) == keys for e in raw)  # maps
    if flavor == VLLM:
        assert all(e["extra_keys"] == [None] * len(e["block_hashes"]) for e in raw)
        assert {(e["group_idx"], e["kv_cache_spec_kind"]) for e in raw} == {(0, "full_attention")}


@flavors
async def test_kv_events_of_eviction_and_flush(flavor: str, http: aiohttp.ClientSession) -> None:
    """A pool of 4 blocks: a second prompt evicts the first one's 3 blocks (one
    BlockRemoved each, leaf first, as the real vLLM sends them). Two flushes of an idle
    engine clear everything twice; the two AllBlocksCleared go out with the next step's
    BlockStored, as the real vLLM sends them (kv_events-reset.jsonl)."""
    (port,) = free_ports(1)
    small = replace(FAST, kv_capacity_tokens=4 * BLOCK)
    flush = "/flush_cache" if flavor == SGLANG else "/reset_prefix_cache"
    async with running(kv_cfg(flavor, port, profile=small)) as srv:
        with subscriber(port) as sub:
            await joined(sub)
            await complete(http, srv.url, filler(200, "evict-a"))
            await complete(http, srv.url, filler(200, "evict-b"))
            evicting = await drain(sub)
            for _ in range(2):
                async with http.post(f"{srv.url}{flush}") as resp:
                    assert resp.status == 200
                    if flavor == VLLM:
                        assert await resp.json() == {"success": True}  # timings-reset.json
            flushed = await drain(sub)
            await complete(http, srv.url, filler(200, "evict-c"))
            after = await drain(sub)
    events = [e for m in evicting for e in decode_message(m).events]
    if flavor == SGLANG:
        assert events.pop(0) == AllBlocksCleared()  # the reset at construction
    stored_a, *removed, stored_b = events
    assert isinstance(stored_a, BlockStored) and isinstance(stored_b, BlockStored)
    assert all(isinstance(e, BlockRemoved) and len(e.block_hashes) == 1 for e in removed)
    assert [e.block_hashes[0] for e in removed] == list(reversed(stored_a.block_hashes))
    assert stored_b.parent_block_hash is None
    assert not set(stored_b.block_hashes) & set(stored_a.block_hashes)
    if flavor == VLLM:
        removed_raw = [e for m in evicting for e in raw_events(m) if e["type"] == "BlockRemoved"]
        assert all(set(e) == VLLM_REMOVED_KEYS for e in removed_raw)
    assert flushed == []  # nothing until the engine steps again
    (message,) = after
    batch = decode_message(message)
    assert batch.seq == decode_message(evicting[-1]).seq + 1
    assert [type(e) for e in batch.events] == [AllBlocksCleared, AllBlocksCleared, BlockStored]
    if flavor == VLLM and (FIXTURES / "kv_events-reset.jsonl").exists():
        rows = fixture("kv_events-reset.jsonl").read_text().splitlines()
        real = [[e["type"] for e in json.loads(row)["payload"][1]] for row in rows]
        assert ["AllBlocksCleared", "AllBlocksCleared", "BlockStored"] in real
        assert [e["type"] for e in raw_events(message)] == real[-1]


async def test_kv_events_array_encoding(http: aiohttp.ClientSession) -> None:
    """SGLang before 2026: tagged arrays, [type, *fields in declaration order]."""
    (port,) = free_ports(1)
    prompt = filler(130, "array")
    async with running(kv_cfg(SGLANG, port, encoding=ARRAY)) as srv:
        with subscriber(port) as sub:
            await joined(sub)
            await complete(http, srv.url, prompt)
            messages = await drain(sub)
    (message,) = messages
    cleared, stored = raw_events(message)
    assert cleared == ["AllBlocksCleared"]
    tag, hashes, parent, tokens, size, lora_id, medium = stored
    assert (tag, len(hashes), parent, size, lora_id, medium) == (
        "BlockStored",
        2,
        None,
        BLOCK,
        None,
        "GPU",
    )
    assert tokens == APPROX.ids(prompt)[:128]
    assert decode_message(message).events == (
        AllBlocksCleared(),
        BlockStored(tuple(hashes), None, tuple(tokens), BLOCK, "GPU", None),
    )


@flavors
async def test_kv_events_replay(flavor: str, http: aiohttp.ClientSession) -> None:
    """The ROUTER replay endpoint (kv_events.py ZmqEventPublisher): a DEALER sends
    [b"", start_seq] and gets [b"", seq, payload] for every buffered batch from
    start_seq on, then [b"", -1, b""]. A late joiner recovers everything."""
    port, replay_port = free_ports(2)
    end = (-1).to_bytes(8, "big", signed=True)
    async with running(kv_cfg(flavor, port, replay_port)) as srv:
        await complete(http, srv.url, filler(200, "replay-a"))  # nobody subscribed
        await complete(http, srv.url, filler(200, "replay-b"))
        dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        try:
            replies: dict[int, list[list[bytes]]] = {}
            for start in (0, 1, 2):
                dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
                got: list[list[bytes]] = []
                async with asyncio.timeout(3):
                    while not got or got[-1][1] != end:
                        try:
                            got.append(dealer.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            await asyncio.sleep(0.01)
                replies[start] = got
        finally:
            dealer.close()
    for got in replies.values():
        assert all(len(f) == 3 and f[0] == b"" for f in got)
        assert got[-1] == [b"", end, b""]
    batches = [decode_message(f) for f in replies[0][:-1]]
    assert [b.seq for b in batches] == [0, 1]
    first = list(batches[0].events)
    if flavor == SGLANG:
        assert first.pop(0) == AllBlocksCleared()  # the radix cache's reset at start
    for events in (first, batches[1].events):
        (event,) = events
        assert isinstance(event, BlockStored) and len(event.block_hashes) == 3
    assert [decode_message(f).seq for f in replies[1][:-1]] == [1]
    assert replies[2] == [[b"", end, b""]]


def test_router_decoder_reads_the_real_vllm_capture() -> None:
    """The router's decoder on every message the real vLLM published (both captures)."""
    rows = [json.loads(line) for line in fixture("kv_events.jsonl").read_text().splitlines()]
    small = FIXTURES / "kv_events-small-pool.jsonl"
    if small.exists():
        rows += [json.loads(line) for line in small.read_text().splitlines()]
    kinds: set[type] = set()
    for row in rows:
        frames = [
            row["topic"].encode(),
            row["seq"].to_bytes(8, "big", signed=True),
            base64.b64decode(row["payload_b64"]),
        ]
        batch = decode_message(frames)
        assert batch.seq == row["seq"] and batch.dp_rank == 0
        assert len(batch.events) == len(row["payload"][1])
        for event, raw in zip(batch.events, row["payload"][1], strict=True):
            kinds.add(type(event))
            if isinstance(event, BlockStored):
                assert set(raw) == VLLM_STORED_KEYS  # what the emulated vLLM sends too
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            if isinstance(event, BlockRemoved):
                assert set(raw) == VLLM_REMOVED_KEYS
    assert BlockStored in kinds


@pytest.mark.parametrize("flavor", [SGLANG, VLLM])
async def test_absurd_max_tokens_and_a_lone_surrogate_are_400s(
    http: aiohttp.ClientSession, flavor: str
) -> None:
    """A max_tokens beyond any context (past int64) is checked against the context before
    the twin caps what it generates: the engines' 400, not a 32k-token answer. A lone
    surrogate is valid JSON the tokenizer cannot take: the engines' 400, not a 500."""
    async with running(cfg_of(flavor, context_length=262_144)) as srv:
        huge = (
            b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], ' % (MODEL.encode())
            + b'"max_tokens": 99999999999999999999}'
        )
        async with http.post(f"{srv.url}{CHAT}", data=huge) as r:
            too_many = (r.status, await r.json())
        lone = b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800"}]}' % (
            MODEL.encode()
        )
        async with http.post(f"{srv.url}{CHAT}", data=lone) as r:
            surrogate = (r.status, await r.json())
    assert too_many[0] == surrogate[0] == 400
    error = too_many[1] if flavor == SGLANG else too_many[1]["error"]
    assert error["type"] == "BadRequestError" and "99999999999999999999" in error["message"]
    error = surrogate[1] if flavor == SGLANG else surrogate[1]["error"]
    assert error["type"] == "BadRequestError"
