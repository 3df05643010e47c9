"""The official openai client, an independent real client, through the Envoy front door."""

from __future__ import annotations

import openai
import pytest

from emulator.engine.tokenizer import load_twin_tokenizer
from emulator.stack.stack import Stack
from tests.e2e.conftest import FAST_REGIONS

pytestmark = pytest.mark.e2e


async def test_openai_client_streams_chat_and_completions_through_envoy(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.front_door_url}/v1", api_key="unused")
    try:
        # Round robin over 3 backends: the 1st and 4th identical prompts meet on one
        # backend, whose prefix cache then serves most of the prompt.
        prompt = "The same long system prompt, word after word. " * 120
        usages = []
        for _ in range(4):
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage
            assert text == "tok " * 5
            assert usage is not None and usage.completion_tokens == 5
            usages.append(usage)
        # SGLang reports cached tokens only when there are some (usage_processor.py)
        assert usages[0].prompt_tokens_details is None
        assert usages[3].prompt_tokens_details.cached_tokens > usages[0].prompt_tokens / 2

        completion = await client.completions.create(model="m", prompt="hello", max_tokens=3)
        assert completion.choices[0].text == "tok " * 3
        # the engines' tokenizer (the tiny model's BPE) makes 4 tokens of "hello"
        assert len(load_twin_tokenizer().tokenizer.ids("hello")) == 4
        assert completion.usage is not None and completion.usage.prompt_tokens == 4

        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert raw.headers["x-gorgo-backend"] in {r.id for r in FAST_REGIONS}
        assert raw.parse().choices[0].message.content == "tok tok "
    finally:
        await client.close()


async def test_the_router_learns_output_lengths_the_client_did_not_give(stack: Stack) -> None:
    """No max_tokens: the twin, as SGLang and vLLM, generates up to its own default (16
    here); the router counts each answer's tokens from its size (its second chunk's event
    and Envoy's access-log body size) and learns the length: it expects 16, not the 256
    it assumes before it knows anything (estimate/output_length.py)."""
    from tests.e2e.stack_harness import get_json, wait_for

    before = get_json(f"{stack.admin_url}/state")["output_lengths"].get("m", {})
    client = openai.AsyncOpenAI(base_url=f"{stack.front_door_url}/v1", api_key="unused")
    try:
        for i in range(10):
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"question {i}"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == "tok " * 16
    finally:
        await client.close()

    def learned() -> dict:
        return dict(get_json(f"{stack.admin_url}/state")["output_lengths"].get("m", {}))

    wait_for(lambda: learned().get("completions", 0) >= before.get("completions", 0) + 10)
    assert learned()["mean_tokens"] == pytest.approx(16, abs=2)
