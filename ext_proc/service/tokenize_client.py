"""The router's tokens against one engine's: what the engine serves (`GET /v1/models`), and a
probe chat and a plain text tokenized by the engine (vLLM: `POST /tokenize` with `messages`
or `prompt`, vllm/entrypoints/serve/tokenize; SGLang: `POST /v1/tokenize` with `prompt`,
python/sglang/srt/entrypoints/openai/serving_tokenize.py, so the rendered chat is sent as
text) and by the router, the ids compared. The running router's check
(engine_tokenizer.py) and `gorgo check` (ext_proc/service/check/) both call these.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from ext_proc.prompt.engine_tokens import EngineTokenizer
from ext_proc.vocab.backend import Backend, EngineKind
from ext_proc.vocab.request import Chat

# What the probe checks: a chat with the template's usual turns (system, user,
# assistant, user), digits, spacing and non-ASCII text, and a plain text.
PROBE_CHAT = Chat(
    messages=(
        {"role": "system", "content": "You are a careful assistant. Answer in one line."},
        {"role": "user", "content": "What is 12 + 30?\n\nShow  the steps: é, 日本."},
        {"role": "assistant", "content": "12 + 30 = 42."},
        {"role": "user", "content": "  And 42 * 2?"},
    )
)
PROBE_TEXT = "The quick brown fox: 1234 jumps over\n\n the lazy dog. ünïcödé"


class TokenizeUnsupported(Exception):
    """The engine has no tokenize endpoint."""


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> str:
    """Where two tokenizations part, in words for a log line."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if at is None:
        return f"{len(ours)} tokens here, {len(theirs)} from the engine"
    return f"token {at} differs ({len(ours)} tokens here, {len(theirs)} from the engine)"


# A live request to check besides the probes: (its chat, or its one text prompt; the ids
# the router gave it), as `PromptTokenizer.last` keeps it.
Sample = tuple[Chat | None, str | None, tuple[int, ...]]


async def served_model(session: aiohttp.ClientSession, address: str) -> tuple[str, str]:
    """The engine's base model: its served name (`id`) and the model path it was started
    with (`root`, "" when not said)."""
    async with session.get(f"http://{address}/v1/models") as resp:
        resp.raise_for_status()
        doc = await resp.json(content_type=None)
    data = doc.get("data") if isinstance(doc, Mapping) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], Mapping):
        raise ValueError("/v1/models lists no model")
    # The base model, not an adapter (vLLM lists LoRA adapters with a parent).
    first = next((m for m in data if isinstance(m, Mapping) and not m.get("parent")), data[0])
    return str(first.get("id") or ""), str(first.get("root") or "")


async def verify_tokens(
    session: aiohttp.ClientSession,
    b: Backend,
    model: str,
    engine: EngineTokenizer,
    sample: Sample | None = None,
) -> str:
    """ "" when the engine tokenizes as the router does, else what differs. Raises
    TokenizeUnsupported (no tokenize endpoint), ValueError (an answer without ids) and
    aiohttp's errors."""
    chat, text, ours_sample = sample if sample is not None else (None, None, ())
    chats = [(PROBE_CHAT, tuple(await asyncio.to_thread(engine.chat_ids, PROBE_CHAT)))]
    texts = [(PROBE_TEXT, tuple(engine.text_ids(PROBE_TEXT, special=True)))]
    if chat is not None:
        chats.append((chat, ours_sample))
    elif text is not None:
        texts.append((text, ours_sample))
    for c, ours in chats:
        theirs = await _tokenize_chat(session, b, model, c, engine)
        if theirs != ours:
            what = "a live request" if c is not PROBE_CHAT else "the probe chat"
            return f"the engine tokenizes {what} differently: {first_difference(ours, theirs)}"
    for t, ours in texts:
        theirs = await _tokenize(session, b, {"model": model, "prompt": t})
        if theirs != ours:
            return f"the engine tokenizes text differently: {first_difference(ours, theirs)}"
    return ""


async def _tokenize_chat(
    session: aiohttp.ClientSession, b: Backend, model: str, chat: Chat, engine: EngineTokenizer
) -> tuple[int, ...]:
    if b.engine == EngineKind.VLLM:
        body: dict[str, Any] = {
            "model": model,
            "messages": list(chat.messages),
            "add_generation_prompt": chat.add_generation_prompt,
            "continue_final_message": chat.continue_final_message,
        }
        if chat.tools is not None:
            body["tools"] = list(chat.tools)
        if chat.template_kwargs:
            body["chat_template_kwargs"] = dict(chat.template_kwargs)
        if chat.template is not None:
            body["chat_template"] = chat.template
        return await _tokenize(session, b, body)
    # SGLang tokenizes text only: the router's rendering, without special tokens.
    rendered = await asyncio.to_thread(engine.render, chat)
    return await _tokenize(
        session, b, {"model": model, "prompt": rendered, "add_special_tokens": False}
    )


async def _tokenize(
    session: aiohttp.ClientSession, b: Backend, body: dict[str, Any]
) -> tuple[int, ...]:
    path = "/tokenize" if b.engine == EngineKind.VLLM else "/v1/tokenize"
    if b.engine != EngineKind.VLLM and "add_special_tokens" not in body:
        body = {**body, "add_special_tokens": True}  # as vLLM's completions default
    async with session.post(f"http://{b.address}{path}", json=body) as resp:
        if resp.status in (404, 405):
            raise TokenizeUnsupported(path)
        resp.raise_for_status()
        doc = await resp.json(content_type=None)
    tokens = doc.get("tokens") if isinstance(doc, Mapping) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError(f"{path}: no token ids in the answer")
    return tuple(tokens)
