"""The twin's discovery and tokenize endpoints over HTTP (emulator/engine/model_api.py), with the
tiny model's real tokenizer: /v1/models names the tokenizer directory (vLLM's root, SGLang's
served name by default), SGLang's /get_model_info, vLLM's /tokenize and SGLang's
/v1/tokenize and /tokenize, each only on its own flavor."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from emulator.engine.config import SGLANG, VLLM, EngineConfig
from emulator.engine.tokenizer import TOKENIZER_JSON, load_twin_tokenizer
from ext_proc.prompt.chat_template import TOKENIZER_CONFIG
from ext_proc.prompt.tokens import APPROX
from tests.component.engine_harness import CHAT, COMPLETIONS, FAST, NAME, running

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "vllm"
TOKENS = load_twin_tokenizer()
HI = [{"role": "user", "content": "hi"}]
HI_IDS = [1, 503, 535, 201, 74, 75, 2, 201, 1, 518, 85, 387, 408, 86, 201]
HELLO_IDS = TOKENS.tokenizer.ids("hello world")


def cfg_of(flavor: str, **overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = {
        "name": NAME,
        "profile": FAST,
        "flavor": flavor,
        # the CLI's defaults: vLLM's twin serves "tiny", SGLang's its model path
        "model": "tiny" if flavor == VLLM else TOKENS.model_dir,
        "model_path": TOKENS.model_dir,
        "tokenizer": TOKENS.tokenizer,
        "chat_template": TOKENS.template,
    }
    return EngineConfig(**{**kwargs, **overrides})


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, data=json.dumps(body)) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_models_name_the_tokenizer_directory(http: aiohttp.ClientSession) -> None:
    """vLLM: root is the model path (openai/models/serving.py); SGLang: root is the served
    name, by default the model path (http_server.py, server_args.py); the directory holds
    the files a router loads."""
    root = Path(TOKENS.model_dir)
    assert root.is_absolute() and (root / TOKENIZER_JSON).is_file()
    assert "chat_template" in json.loads((root / TOKENIZER_CONFIG).read_text())
    for flavor, name in ((VLLM, "tiny"), (SGLANG, TOKENS.model_dir)):
        srv_cfg = cfg_of(flavor, context_length=4096)
        async with running(srv_cfg) as srv, http.get(f"{srv.url}/v1/models") as resp:
            (card,) = (await resp.json())["data"]
        assert (card["id"], card["root"], card["owned_by"]) == (name, str(root), flavor)
        assert (card["parent"], card["max_model_len"], card["object"]) == (None, 4096, "model")
        assert ("permission" in card) == (flavor == VLLM)
    routes = FIXTURES / "routes.json"
    if routes.exists():  # the real vLLM's card: every key, root its model path
        (real,) = json.loads(routes.read_text())["GET /v1/models"]["body"]["data"]
        async with running(cfg_of(VLLM)) as srv, http.get(f"{srv.url}/v1/models") as resp:
            (card,) = (await resp.json())["data"]
        assert list(card) == list(real) and real["root"].startswith("/")
    # a served name of its own: SGLang's root is that name, vLLM's still the path
    async with running(cfg_of(SGLANG, model="qwen")) as srv:
        async with http.get(f"{srv.url}/v1/models") as resp:
            (card,) = (await resp.json())["data"]
        async with http.get(f"{srv.url}/get_model_info") as resp:
            info = await resp.json()
    assert card["root"] == "qwen"
    assert info == {
        "model_path": str(root),
        "tokenizer_path": str(root),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
    }


async def test_without_a_model_directory_the_served_name_stands_in(
    http: aiohttp.ClientSession,
) -> None:
    approx = {"model": "m", "model_path": "", "tokenizer": APPROX, "chat_template": None}
    async with running(cfg_of(VLLM, **approx)) as srv:
        async with http.get(f"{srv.url}/v1/models") as resp:
            (card,) = (await resp.json())["data"]
        # 4 bytes per token: "hello world" is 3 tokens, the 4-byte pieces as ids
        status, out = await post(http, f"{srv.url}/tokenize", {"prompt": "hello world"})
    assert card["root"] == "m"
    assert status == 200 and out["count"] == 3 and out["tokens"] == APPROX.ids("hello world")


async def test_vllm_tokenize_takes_a_prompt_or_a_chat(http: aiohttp.ClientSession) -> None:
    """serve/tokenize/protocol.py: count, max_model_len, tokens, token_strs (only when
    asked); a chat is rendered as the chat endpoint renders it, and counts what a chat
    request's usage reports."""
    async with running(cfg_of(VLLM, context_length=4096)) as srv:
        url = f"{srv.url}/tokenize"
        assert await post(http, url, {"model": "tiny", "prompt": "hello world"}) == (
            200,
            {"count": 7, "max_model_len": 4096, "tokens": HELLO_IDS, "token_strs": None},
        )
        status, out = await post(http, url, {"messages": HI, "return_token_strs": True})
        assert status == 200 and out["tokens"] == HI_IDS and out["count"] == 15
        assert out["token_strs"][:4] == ["<|im_start|>", "us", "er", "\u010a"]
        _, usage = await post(
            http, f"{srv.url}{CHAT}", {"model": "tiny", "messages": HI, "max_tokens": 1}
        )
        assert usage["usage"]["prompt_tokens"] == 15
        _, no_gen = await post(http, url, {"messages": HI, "add_generation_prompt": False})
        assert no_gen["tokens"] == HI_IDS[:8]
        cont = {
            "messages": [*HI, {"role": "assistant", "content": "hello world"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        }
        _, prefill = await post(http, url, cont)
        assert prefill["tokens"] == HI_IDS + HELLO_IDS and prefill["count"] == 15 + 7
        assert await post(http, url, {"prompt": ""}) == (
            200,
            {"count": 0, "max_model_len": 4096, "tokens": [], "token_strs": None},
        )


async def test_vllm_tokenize_refuses_what_the_engine_refuses(http: aiohttp.ClientSession) -> None:
    async with running(cfg_of(VLLM)) as srv:
        url = f"{srv.url}/tokenize"
        status, out = await post(http, url, {"model": "other", "prompt": "x"})
        assert status == 404 and out["error"]["type"] == "NotFoundError"
        both = {"messages": HI, "continue_final_message": True}
        status, out = await post(http, url, both)
        assert status == 400 and "Cannot set both" in out["error"]["message"]
        status, out = await post(http, url, {"messages": HI, "chat_template": "{{ 1 }}"})
        assert status == 400 and "--trust-request-chat-template" in out["error"]["message"]
        status, out = await post(http, url, {"prompt": ["a", "b"]})
        assert status == 400 and out["error"]["param"] == "body.prompt"
    async with running(cfg_of(VLLM, trust_request_chat_template=True)) as srv:
        body = {"messages": HI, "chat_template": "{{ messages[0].content }} world"}
        _, out = await post(http, f"{srv.url}/tokenize", body)
    assert out["tokens"] == [74, 75, 3551, 78, 70]  # "hi world"


@pytest.mark.parametrize("path", ["/v1/tokenize", "/tokenize"])
async def test_sglang_tokenize_takes_a_string_or_a_list(
    http: aiohttp.ClientSession, path: str
) -> None:
    """openai/serving_tokenize.py: per string when given a list; max_model_len is the
    tokenizer's model_max_length (4096 in the tiny model's tokenizer_config.json)."""
    async with running(cfg_of(SGLANG)) as srv:
        url = f"{srv.url}{path}"
        assert await post(http, url, {"prompt": "hello world"}) == (
            200,
            {"tokens": HELLO_IDS, "count": 7, "max_model_len": 4096},
        )
        assert await post(http, url, {"prompt": ["hello world", "hi"]}) == (
            200,
            {"tokens": [HELLO_IDS, [74, 75]], "count": [7, 2], "max_model_len": 4096},
        )
        status, out = await post(http, url, {"text": "hi"})
        assert status == 400 and out["type"] == "Bad Request" and out["object"] == "error"


async def test_each_flavor_has_only_its_own_tokenize_paths(http: aiohttp.ClientSession) -> None:
    async with running(cfg_of(VLLM)) as srv:
        for path in ("/v1/tokenize", "/get_model_info"):
            async with http.post(f"{srv.url}{path}", json={"prompt": "x"}) as resp:
                assert resp.status == 404, path
    async with running(cfg_of(SGLANG)) as srv:
        for path in ("/v1/tokenize", "/tokenize"):
            async with http.post(f"{srv.url}{path}", json={"prompt": "x"}) as resp:
                assert resp.status == 200, path


async def test_a_long_prompt_is_tokenized_off_the_loop(http: aiohttp.ClientSession) -> None:
    """A long body is parsed in the engine's tokenizing thread: the counts are the same, and
    the engine answers other requests meanwhile (the library lets go of the GIL)."""
    text = "hello world " * 20_000
    n = len(TOKENS.tokenizer.ids(text))
    huge = "ab cd " * 100_000  # 600 KB: tokenizing it takes ~0.3 s
    async with running(cfg_of(VLLM)) as srv:
        _, out = await post(http, f"{srv.url}/tokenize", {"prompt": text})
        body = {"model": "tiny", "prompt": text, "max_tokens": 1}
        _, done = await post(http, f"{srv.url}{COMPLETIONS}", body)
        t0 = time.perf_counter()
        long = asyncio.create_task(post(http, f"{srv.url}/tokenize", {"prompt": huge}))
        await asyncio.sleep(0.05)
        async with http.get(f"{srv.url}/health") as resp:
            assert resp.status == 200
        health_s = time.perf_counter() - t0
        status, big = await long
        long_s = time.perf_counter() - t0
    assert out["count"] == done["usage"]["prompt_tokens"] == n > 20_000
    print(f"/health answered after {health_s:.3f} s, the long /tokenize after {long_s:.3f} s")
    assert status == 200 and big["count"] > 200_000
    assert health_s < long_s / 2
