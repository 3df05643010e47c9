"""vLLM's twin serving a base model and LoRA adapters over real HTTP (emulator/engine/lora.py,
docs/engines.md "Models and LoRA adapters"): adapters loaded at start and at run time are
listed and served, an unknown model is 404 in vLLM's words, each adapter hits only its own
cached blocks, and /metrics carries vllm:lora_requests_info."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from emulator.engine.config import VLLM, EngineConfig
from emulator.engine.lora import LoraModule
from tests.component.engine_harness import COMPLETIONS, FAST, NAME, filler, running

PROFILE = replace(FAST, block_tokens=16)


def cfg(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "name": NAME,
        "profile": PROFILE,
        "flavor": VLLM,
        "model": "alpha",
        "model_aliases": ("alpha-v1",),
        "cache_report": True,
        "enable_lora": True,
        "lora_modules": (LoraModule("sql", "/lora/sql"),),
    }
    return EngineConfig(**{**base, **kw})


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def complete(http: aiohttp.ClientSession, url: str, model: str, prompt: str) -> Any:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{url}{COMPLETIONS}", json=body) as resp:
        return resp.status, await resp.json()


async def test_adapters_are_listed_loaded_served_and_unloaded(http: aiohttp.ClientSession) -> None:
    async with running(cfg()) as srv:
        url = srv.url
        async with http.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/c"}
        ) as resp:
            assert resp.status == 200
            assert await resp.text() == "Success: LoRA adapter 'chat' added successfully."
        async with http.get(f"{url}/v1/models") as resp:
            cards = (await resp.json())["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [
            ("alpha", None),
            ("alpha-v1", None),
            ("sql", "alpha"),
            ("chat", "alpha"),
        ]
        status, body = await complete(http, url, "chat", "hello there")
        assert status == 200 and body["model"] == "chat"
        status, body = await complete(http, url, "alpha-v1", "hello there")
        assert status == 200 and body["model"] == "alpha"  # the first served name
        async with http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}) as resp:
            assert resp.status == 200
        async with http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}) as resp:
            assert resp.status == 404
            assert await resp.json() == {
                "error": {
                    "message": "The lora adapter 'chat' cannot be found.",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            }
        status, body = await complete(http, url, "chat", "hello there")
        assert status == 404
        assert body == {
            "error": {
                "message": "The model `chat` does not exist. Valid aliases: alpha, alpha-v1.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }


async def test_each_adapter_hits_only_its_own_cache(http: aiohttp.ClientSession) -> None:
    prompt = filler(64, "lora-cache")

    async def cached(url: str, model: str) -> int:
        status, body = await complete(http, url, model, prompt)
        assert status == 200
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with running(cfg()) as srv:
        assert await cached(srv.url, "alpha") == 0
        assert await cached(srv.url, "alpha") == 48  # vLLM: all full blocks but the last
        assert await cached(srv.url, "sql") == 0  # the base model's blocks are not its own
        assert await cached(srv.url, "sql") == 48
        assert await cached(srv.url, "alpha-v1") == 48  # an alias is the base model


async def test_metrics_carry_lora_requests_info_and_routes_need_lora(
    http: aiohttp.ClientSession,
) -> None:
    async with running(cfg(max_loras=2)) as srv:
        await complete(http, srv.url, "sql", "hello there")
        async with http.get(f"{srv.url}/metrics") as resp:
            text = await resp.text()
        line = re.search(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", text, re.M)
        assert line is not None, text
        assert line.group(1).startswith('max_lora="2",waiting_lora_adapters="",')
        assert re.fullmatch(r"1\.\d+e\+09", line.group(2))
    async with running(cfg(enable_lora=False, lora_modules=())) as srv:
        async with http.get(f"{srv.url}/metrics") as resp:
            assert "lora_requests_info" not in await resp.text()
        body = {"lora_name": "x", "lora_path": "/x"}
        async with http.post(f"{srv.url}/v1/load_lora_adapter", json=body) as resp:
            assert resp.status == 404  # not mounted (VLLM_ALLOW_RUNTIME_LORA_UPDATING unset)
