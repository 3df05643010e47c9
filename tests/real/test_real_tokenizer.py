"""Precise prefix state on a real vLLM with the config a new user writes: no `tokenizer`
key. One vLLM engine (the tiny model) behind Envoy and `gorgo serve`, subscribed to the
engine's KV events; the router finds the model's tokenizer from the engine's
`/v1/models` and checks it against the engine's `/tokenize`.

A 4-turn conversation, turns 15 s apart (past `routing.optimistic_ttl_s`, so the
router's memory of its own dispatches no longer counts): the cached tokens the router
predicts for each turn, from the engine's events keyed by its own token ids, are within
one block of what vLLM reports serving from its cache. The same with
`optimistic_ttl_s: 0` (no optimism at all, turns back to back). With a deliberately wrong
tokenizer configured, the backend shows approximate with the reason, and its prediction
error is no worse than a router's without KV events (approximate mode)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from emulator.stack.settings import Region, StackPorts, StackSettings
from emulator.stack.stack import Stack
from emulator.vllm.tiny import ensure_tiny_model
from ext_proc.config.dump import config_as_dict
from ext_proc.config.load import config_from_dict
from tests.e2e.stack_harness import router_state, wait_for

pytestmark = pytest.mark.real

REGION = Region("us-ashburn", 1.0)
BLOCK = 128  # vLLM's block size on this CPU build
TURNS = 4


@contextmanager
def vllm_stack(edit: Callable[[dict[str, Any], Stack], None]) -> Iterator[Stack]:
    """One vLLM engine, Envoy and gorgo serve, the router's config edited by `edit`."""
    settings = StackSettings(
        policy="round_robin",
        regions=(REGION,),
        ports=StackPorts.ephemeral(1),
        real_engine=True,
        vllm_small_pool=(),
        probe_interval_s=0.5,
        tuner_mode="off",
    )
    ensure_tiny_model(settings.vllm_venv)
    s = Stack(settings)
    raw = config_as_dict(s.config)
    raw.pop("tokenizer", None)  # what a new user writes: no tokenizer key
    edit(raw, s)
    s.config = config_from_dict(raw)
    t0 = time.monotonic()
    s.start()
    print(f"one vLLM engine, Envoy and gorgo serve in {time.monotonic() - t0:.1f} s")
    try:
        yield s
    finally:
        s.stop()


def with_events(ttl_s: float | None = None) -> Callable[[dict[str, Any], Stack], None]:
    def edit(raw: dict[str, Any], s: Stack) -> None:
        # the engine connects to this loopback port (emulator/vllm/serve.py); the router binds
        raw["backends"][0]["kv_events"] = {
            "endpoint": f"tcp://127.0.0.1:{s.kv_ports[0]}",
            "mode": "bind",
        }
        if ttl_s is not None:
            raw.setdefault("routing", {})["optimistic_ttl_s"] = ttl_s

    return edit


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


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    router_tokens: int
    reported: int
    predicted: int
    prefix_state: str


def backend_state(stack: Stack) -> dict[str, Any]:
    state: dict[str, Any] = router_state(stack)["backends"][REGION.id]
    return state


def conversation(stack: Stack, gap_s: float, tag: str) -> list[Turn]:
    """TURNS turns, each adding a ~750-token document part; gap_s between turns."""
    messages = [{"role": "system", "content": "You answer briefly."}]
    turns = []
    for n in range(TURNS):
        if n:
            time.sleep(gap_s)
        part = " ".join(f"{tag}{n}x{i % 89} alpha beta gamma delta" for i in range(40))
        messages.append({"role": "user", "content": f"Part {n}:\n{part}"})
        rid = f"{tag}-turn{n}-{time.monotonic_ns()}"
        out = chat(stack, messages, rid)
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        usage = out["usage"]
        recent = router_state(stack)["recent_decisions"]
        d = next(d for d in recent if d["request_id"] == rid)
        turns.append(
            Turn(
                prompt_tokens=usage["prompt_tokens"],
                router_tokens=d["input_tokens"],
                reported=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                predicted=next(
                    c["cached_tokens"] for c in d["candidates"] if c["backend"] == REGION.id
                ),
                prefix_state=d.get("prefix_state") or backend_state(stack)["prefix_state"],
            )
        )
        print(f"{tag} turn {n}: {turns[-1]}")
    return turns


def mean_error(turns: list[Turn]) -> float:
    return sum(abs(t.predicted - t.reported) / t.prompt_tokens for t in turns) / len(turns)


def assert_precise(turns: list[Turn]) -> None:
    for t in turns:
        assert t.router_tokens == t.prompt_tokens  # counted exactly as vLLM counts
        assert abs(t.predicted - t.reported) <= BLOCK, t
    assert all(t.reported >= 4 * BLOCK for t in turns[1:])  # the turns did hit the cache


def test_no_tokenizer_key_predicts_every_turn_from_the_engines_events() -> None:
    with vllm_stack(with_events()) as s:
        wait_for(lambda: backend_state(s)["prefix_state"] == "precise", 30)
        tokens = backend_state(s)["tokens"]
        print(f"tokens: {tokens}; tokenizer: {router_state(s)['tokenizer_checks']}")
        assert tokens == {"ok": True, "reason": "verified against tiny"}
        ttl_s = s.config.routing.optimistic_ttl_s
        turns = conversation(s, gap_s=ttl_s + 5.0, tag="gap")  # 15 s apart by default
        assert_precise(turns)


def test_without_optimism_too() -> None:
    with vllm_stack(with_events(ttl_s=0.0)) as s:
        wait_for(lambda: backend_state(s)["prefix_state"] == "precise", 30)
        assert_precise(conversation(s, gap_s=1.0, tag="ttl0"))


def wrong_tokenizer(out: Path) -> Path:
    """A tokenizer trained on another seed (another vocabulary) with the same template."""
    from emulator.vllm.tiny_model import CHAT_TEMPLATE, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(1, 4096).save(str(out / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out / "tokenizer.json"


def test_a_wrong_tokenizer_shows_approximate_and_predicts_no_worse(tmp_path: Path) -> None:
    def wrong(raw: dict[str, Any], s: Stack) -> None:
        with_events()(raw, s)
        raw["tokenizer"] = {"path": str(wrong_tokenizer(tmp_path / "wrong"))}

    with vllm_stack(wrong) as s:
        wait_for(lambda: "differently" in backend_state(s)["tokens"]["reason"], 30)
        state = backend_state(s)
        print(f"wrong tokenizer: {state['tokens']}")
        assert state["prefix_state"] == "approximate" and not state["tokens"]["ok"]
        wrong_turns = conversation(s, gap_s=1.0, tag="wrong")
    with vllm_stack(lambda raw, s: None) as s:  # approximate mode: no KV events
        approx_turns = conversation(s, gap_s=1.0, tag="approx")
    print(f"mean error: wrong tokenizer {mean_error(wrong_turns):.4f}, "
          f"approximate mode {mean_error(approx_turns):.4f}")  # fmt: skip
    assert all(t.prefix_state == "approximate" for t in wrong_turns)
    assert mean_error(wrong_turns) <= mean_error(approx_turns) + 0.02
