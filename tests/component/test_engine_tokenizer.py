"""The router finds the engine's tokenizer with no `tokenizer:` key and checks it against
the engine's own tokenize endpoint: a match makes a backend's KV events usable, a
mismatch or a missing tokenizer keeps it approximate with the reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
from aiohttp import web
from tokenizers import Tokenizer

from emulator.engine.tokenizer import tiny_tokenizer_dir
from ext_proc.envoy.encoders import decision_encoder
from ext_proc.envoy.server import ExtProcService
from ext_proc.prompt.engine_tokens import PromptTokenizer, load_engine_tokenizer
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.service import engine_tokenizer
from ext_proc.service.engine_tokenizer import PENDING, EngineTokenizers
from tests.builders import make_router


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    """The tiny model's tokenizer files (built once into the cache, ~4 s)."""
    return tiny_tokenizer_dir()


class FakeVllm:
    """An engine's discovery and tokenize endpoints, as vLLM answers them
    (vllm/entrypoints/serve/tokenize/protocol.py), tokenizing with `tokenizers` and
    jinja2 directly, not with the router's code."""

    def __init__(self, model_dir: Path, template: str | None = None) -> None:
        self.root = str(model_dir)
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        self.template = jinja2.Environment().from_string(template or config["chat_template"])
        self.tokenize_calls = 0
        self.has_tokenize = True

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "root": self.root, "parent": None}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        if not self.has_tokenize:
            return web.json_response({"detail": "Not Found"}, status=404)
        self.tokenize_calls += 1
        body = await request.json()
        if "messages" in body:
            text = self.template.render(
                messages=body["messages"], add_generation_prompt=body["add_generation_prompt"]
            )
            ids = self.tok.encode(text, add_special_tokens=body.get("add_special_tokens", False))
        else:
            ids = self.tok.encode(body["prompt"], add_special_tokens=True)
        return web.json_response({"count": len(ids.ids), "tokens": ids.ids})


Started = Callable[..., Any]


@pytest.fixture
async def started(unused_tcp_port_factory: Callable[[], int]) -> AsyncIterator[Started]:
    stops: list[Callable[[], Any]] = []

    async def start(engine: FakeVllm, tokenizer: TokenizerConfig | None = None) -> Any:
        app = web.Application()
        app.router.add_get("/v1/models", engine.models)
        app.router.add_post("/tokenize", engine.tokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        port = unused_tcp_port_factory()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        stops.append(runner.cleanup)
        backend = {
            "id": "a",
            "address": f"127.0.0.1:{port}",
            "engine": "vllm",
            "kv_events": {"endpoint": "tcp://*:1"},
        }
        router, _ = make_router("gorgo", backends=[backend])
        router.inputs.set_event_stream("a", True)
        configured = load_engine_tokenizer(tokenizer) if tokenizer else None
        ext_proc = ExtProcService(
            router,
            decision_encoder(router.cfg),
            PromptTokenizer(configured) if configured else None,
        )
        checker = EngineTokenizers(router.cfg, router, ext_proc)
        await checker.start()
        stops.append(checker.stop)
        return router, ext_proc, checker

    yield start
    for stop in reversed(stops):
        await stop()


async def settled(router: Any, backend: str = "a", timeout_s: float = 10.0) -> Any:
    """The backend's token check once it is no longer pending."""
    async with asyncio.timeout(timeout_s):
        while router.backends[backend].engine.tokens.reason == PENDING:
            await asyncio.sleep(0.02)
    return router.backends[backend].engine.tokens


async def test_no_tokenizer_key_finds_and_verifies_the_engines(
    started: Started, tiny_dir: Path
) -> None:
    engine = FakeVllm(tiny_dir)
    router, ext_proc, checker = await started(engine)
    assert not router.backends["a"].precise  # not before the check
    tokens = await settled(router)
    assert tokens.ok and tokens.reason == "verified against tiny"
    assert router.backends["a"].precise and engine.tokenize_calls == 2  # a chat, a text
    assert ext_proc.tokens is not None and ext_proc.tokens.engine.tokenizer.path == (
        tiny_dir / "tokenizer.json"
    )
    snap = checker.snapshot()
    assert snap["source"].startswith("discovered from a") and snap["models"] == {"a": "tiny"}
    # requests now get the engine's ids
    body = {"messages": [{"role": "user", "content": "hi"}]}
    llm = ext_proc.tokens.apply(parse_body(CHAT, json.dumps(body).encode()))
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert llm.prompts == (tuple(engine.tok.encode(text, add_special_tokens=False).ids),)


async def test_an_engine_with_another_template_keeps_the_backend_approximate(
    started: Started, tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    router, _, checker = await started(FakeVllm(tiny_dir, template=other))
    tokens = await settled(router)
    assert not tokens.ok and not router.backends["a"].precise
    assert tokens.reason.startswith("the engine tokenizes the probe chat differently: token 0")
    assert checker.snapshot()["mismatches"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "approximate" in r.getMessage()]
    assert "Fix: set tokenizer.path" in line and "backend a" in line


async def test_no_tokenizer_to_be_had_says_where_it_looked(
    started: Started, tiny_dir: Path, tmp_path: Path
) -> None:
    engine = FakeVllm(tiny_dir)
    engine.root = str(tmp_path / "elsewhere")
    router, ext_proc, _ = await started(engine)
    tokens = await settled(router)
    assert not tokens.ok and ext_proc.tokens is None
    assert "engine serves 'tiny'" in tokens.reason and "elsewhere" in tokens.reason


async def test_a_configured_tokenizer_is_checked_too_and_trusted_without_an_endpoint(
    started: Started, tiny_dir: Path
) -> None:
    engine = FakeVllm(tiny_dir)
    engine.has_tokenize = False
    router, _, checker = await started(engine, TokenizerConfig(str(tiny_dir / "tokenizer.json")))
    tokens = await settled(router)
    assert tokens.ok and "no tokenize endpoint" in tokens.reason
    assert checker.snapshot()["source"] == "config"


async def test_a_stream_that_comes_back_is_checked_again_and_spot_checks_use_live_requests(
    started: Started, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FakeVllm(tiny_dir)
    router, ext_proc, checker = await started(engine)
    assert (await settled(router)).ok
    calls = engine.tokenize_calls
    router.inputs.set_event_stream("a", False)
    await checker.check_due()
    router.inputs.set_event_stream("a", True)  # back: maybe a restarted engine
    await checker.check_due()
    assert engine.tokenize_calls == calls + 2
    # a spot check: the last live request, tokenized by the engine, with the probe's
    body = {"messages": [{"role": "user", "content": "a live 42 turn\n\n ü"}]}
    ext_proc.tokens.apply(parse_body(CHAT, json.dumps(body).encode()))
    monkeypatch.setattr(engine_tokenizer, "SPOT_CHECK_S", 0.0)
    await checker.check_due()
    assert engine.tokenize_calls == calls + 2 + 3 and router.backends["a"].engine.tokens.ok
    # the engine changes its template (a restart with another one): the spot check sees it
    engine.template = jinja2.Environment().from_string("{{ messages[0]['content'] }}")
    await checker.check_due()
    assert not router.backends["a"].engine.tokens.ok
