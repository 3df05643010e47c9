"""The router tokenizes as a real vLLM does: one vLLM engine (the tiny model) behind Envoy and
`gorgo serve` configured with the model's own tokenizer.json and chat template and
subscribed to the engine's KV events. A two-turn chat: the router counts the prompt's tokens
as the engine does, and its prediction of turn 2's cached prefix (from the engine's events,
keyed by the router's own token ids) agrees with what vLLM reports serving from its cache."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from emulator.stack import Region, Stack, StackPorts, StackSettings
from emulator.vllm.tiny import ensure_tiny_model
from ext_proc.config.dump import config_as_dict
from ext_proc.config.load import config_from_dict
from tests.e2e.stack_harness import router_state, wait_for

pytestmark = pytest.mark.real

REGION = Region("us-ashburn", 1.0)
BLOCK = 128  # vLLM's block size on this CPU build


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    settings = StackSettings(
        policy="round_robin",
        regions=(REGION,),
        ports=StackPorts.ephemeral(1),
        real_engine=True,
        vllm_small_pool=(),
        probe_interval_s=0.5,
        tuner_mode="off",
    )
    model = ensure_tiny_model(settings.vllm_venv)
    s = Stack(settings)
    raw = config_as_dict(s.config)
    # the model's tokenizer.json; its template from the tokenizer_config.json beside it
    raw["tokenizer"] = {"path": str(model / "tokenizer.json")}
    # the engine connects to this loopback port (emulator/vllm/serve.py); the router binds it
    raw["backends"][0]["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{s.kv_ports[0]}"}
    s.config = config_from_dict(raw)
    t0 = time.monotonic()
    s.start()
    print(f"one vLLM engine, Envoy and gorgo serve (tokenizer configured) in "
          f"{time.monotonic() - t0:.1f} s")  # fmt: skip
    wait_for(lambda: router_state(s)["backends"][REGION.id]["prefix_state"] == "precise", 30)
    yield s
    s.stop()


def chat(stack: Stack, messages: list[dict[str, str]], request_id: str) -> dict[str, Any]:
    """A non-streamed chat through the front door, with our own request id."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 16, "ignore_eos": True}
    req = urllib.request.Request(
        f"{stack.front_door_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-request-id": request_id},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def decision(stack: Stack, request_id: str) -> dict[str, Any]:
    recent = router_state(stack)["recent_decisions"]
    found: dict[str, Any] = next(d for d in recent if d["request_id"] == request_id)
    return found


def test_a_second_turn_is_predicted_cached_as_vllm_serves_it(stack: Stack) -> None:
    document = " ".join(f"doc{i % 89} alpha beta gamma delta" for i in range(120))
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": f"Read this:\n{document}"},
    ]
    first = chat(stack, messages, f"turn1-{time.monotonic_ns()}")
    answer = first["choices"][0]["message"]["content"]
    # the engine's events of turn 1 reach the router (it then holds turn 1's blocks)
    wait_for(lambda: router_state(stack)["backends"][REGION.id]["kv_events"]["blocks"] > 0, 10)
    time.sleep(0.5)  # the stored blocks of the generated tokens follow within a step
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And in one word?"},
    ]
    rid = f"turn2-{time.monotonic_ns()}"
    second = chat(stack, messages, rid)
    usage = second["usage"]
    reported = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    d = decision(stack, rid)
    predicted = next(c["cached_tokens"] for c in d["candidates"] if c["backend"] == REGION.id)
    tokenizer = router_state(stack)["tokenizer"]
    print(
        f"turn 2: {usage['prompt_tokens']} prompt tokens (router: {d['input_tokens']}); cached: "
        f"vLLM {reported}, router predicted {predicted}; tokenizer {tokenizer}"
    )
    # the router counts the prompt exactly as vLLM does: same template, same tokenizer
    assert d["input_tokens"] == usage["prompt_tokens"]
    assert usage["prompt_tokens"] > 8 * BLOCK and reported >= 6 * BLOCK
    assert abs(predicted - reported) <= BLOCK
    # turn 2 reused turn 1's tokenization (only the new messages were tokenized)
    assert tokenizer["hits"] >= 1 and tokenizer["failures"] == 0 and tokenizer["mismatches"] == 0
