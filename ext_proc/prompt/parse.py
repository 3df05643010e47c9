"""Request bodies -> what routing needs to know. Pure; never logs the prompt.

Understands OpenAI `/v1/chat/completions` and `/v1/completions` and SGLang's native
`/generate`. Anything else is not an LLM request (`None`); a body that claims to be one
but cannot be read raises `ParseError` with a reason that names the bad field.

A prompt is text or token ids (`prompt: [ints]`, `/generate` `input_ids`: their length is
exact). A list of prompts (`prompt: [str, ...]` or `[[ints], ...]`, `text: [...]`,
`input_ids: [[...], ...]`) is a batch the engine runs as separate sequences, each with its
own prefix: it is kept as several prompts, never joined into one.
"""

from __future__ import annotations

from typing import Any

import orjson

from ext_proc.prompt.tokens import count_tokens, render_chat
from ext_proc.vocab.request import Chat, LlmRequest, Prompt

CHAT = "chat"
COMPLETIONS = "completions"
GENERATE = "generate"

_API_BY_PATH = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/generate": GENERATE,
}


class ParseError(ValueError):
    """The body of an LLM request cannot be understood."""


def prompt_tokens(prompt: Prompt) -> int:
    return len(prompt) if isinstance(prompt, tuple) else count_tokens(prompt)


def api_for_path(path: str) -> str | None:
    """The API a request path addresses, or None when it is not an LLM call."""
    return _API_BY_PATH.get(route_path(path))


def route_path(path: str) -> str:
    """A request path as routes compare it: no query, no trailing slash."""
    return path.split("?", 1)[0].rstrip("/") or "/"


def _optional_int(body: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            # Name the type, not the value: a misplaced prompt must not reach the logs.
            got = value if isinstance(value, int) else type(value).__name__
            raise ParseError(f"{key}: expected a non-negative integer, got {got}")
        return value
    return None


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ParseError(f"{key}: expected a string, got {type(value).__name__}")
    return value


def _chat(body: dict[str, Any]) -> Chat:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ParseError("messages: expected a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ParseError(f"messages[{i}]: expected an object")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ParseError(f"messages[{i}].content: expected a string or a list of parts")
    # The template's other inputs: only well-formed ones (the engine judges the rest).
    tools = body.get("tools")
    generation = body.get("add_generation_prompt")
    kwargs = body.get("chat_template_kwargs")
    template = body.get("chat_template")
    continued = body.get("continue_final_message")
    return Chat(
        messages=tuple(messages),
        tools=tuple(tools)
        if isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        else None,
        add_generation_prompt=generation if isinstance(generation, bool) else True,
        template_kwargs=kwargs if isinstance(kwargs, dict) else {},
        template=template if isinstance(template, str) and template else None,
        continue_final_message=continued is True,
    )


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    return value if isinstance(value, bool) else default


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def _prompts(value: Any, key: str, text: bool = True) -> tuple[Prompt, ...]:
    """A prompt field: a string, token ids, or a batch of either (ids only: text=False)."""
    if _is_ids(value):
        return (tuple(value),)
    if isinstance(value, list) and value and all(_is_ids(p) for p in value):
        return tuple(tuple(p) for p in value)
    if text and isinstance(value, str):
        return (value,)
    if text and isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return tuple(value)
    what = (
        "a string, a list of token ids, or a non-empty list of either"
        if text
        else ("a list of token ids, or a non-empty list of them")
    )
    raise ParseError(f"{key}: expected {what}")


def _generate_prompts(body: dict[str, Any]) -> tuple[Prompt, ...]:
    if body.get("input_ids") is not None:
        return _prompts(body["input_ids"], "input_ids", text=False)
    return _prompts(body.get("text"), "text")


def rewritten(body: bytes, model: str | None = None, priority: int | None = None) -> bytes:
    """The body with its `model` (an alias resolved to a served name) and its `priority`
    (the value the engine's scheduler reads) set, those given; everything else as it was,
    re-serialized (one parse, one dump)."""
    decoded = orjson.loads(body)
    if model is not None:
        decoded["model"] = model
    if priority is not None:
        decoded["priority"] = priority
    return orjson.dumps(decoded)


def parse_body(api: str, body: bytes) -> LlmRequest:
    """Parse the body of a request to `api` (see `api_for_path`)."""
    try:
        # orjson: 2-3x faster than json on long prompts; rejects non-UTF-8 and nesting
        # deeper than 1024 with JSONDecodeError.
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ParseError(f"body: invalid JSON: {e}") from e
    if not isinstance(decoded, dict):
        raise ParseError(f"body: expected a JSON object, got {type(decoded).__name__}")
    prompts: tuple[Prompt, ...]
    chat = None
    if api == CHAT:
        chat = _chat(decoded)
        prompts = (render_chat(chat.messages),)
        max_out = _optional_int(decoded, "max_completion_tokens", "max_tokens")
    elif api == COMPLETIONS:
        prompts = _prompts(decoded.get("prompt"), "prompt")
        max_out = _optional_int(decoded, "max_tokens")
    elif api == GENERATE:
        prompts = _generate_prompts(decoded)
        params = decoded.get("sampling_params")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise ParseError("sampling_params: expected an object")
        max_out = _optional_int(params, "max_new_tokens")
    else:
        raise ParseError(f"unknown api {api!r}")
    stream = decoded.get("stream", False)
    if not isinstance(stream, bool):
        raise ParseError(f"stream: expected true or false, got {type(stream).__name__}")
    return LlmRequest(
        api=api,
        # vLLM's defaults (vllm/entrypoints/openai/completion/protocol.py: true;
        # chat_completion/protocol.py: false); SGLang's /generate tokenizes as completions.
        add_special_tokens=_flag(decoded, "add_special_tokens", api != CHAT),
        cache_salt=_optional_str(decoded, "cache_salt"),
        prompts=prompts,
        prompt_tokens=tuple(prompt_tokens(p) for p in prompts),
        max_output_tokens=max_out,
        stream=stream,
        model=_optional_str(decoded, "model"),
        user=_optional_str(decoded, "user"),
        chat=chat,
        priority=_client_priority(decoded),
    )


def _client_priority(decoded: dict[str, Any]) -> int | None:
    """The body's own `priority` (vLLM's and SGLang's field), when an integer."""
    value = decoded.get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# A server-sent event stream's last event (vLLM's and SGLang's OpenAI servers).
SSE_DONE = b"data: [DONE]\n\n"


def event_bytes(chunk: bytes) -> float | None:
    """The mean size of the server-sent events in a response chunk (None: not an event
    stream). Measured on a stream's second chunk, it is the size of one token's event as
    this engine writes it for this request (its id, model name and fields): the first
    chunk carries the role event too. A closing `data: [DONE]` is not counted."""
    if not chunk.startswith(b"data:"):
        return None
    events = chunk.removesuffix(SSE_DONE)
    n = events.count(b"data:")
    return len(events) / n if n else None


def streamed_tokens(body_bytes: int, token_event_bytes: float) -> int:
    """The tokens a streamed chat or completion response generated, counted from its size:
    vLLM and SGLang send one event per token (stream_interval 1, their default), and
    around them a role event, a finish or usage event and `[DONE]`, about one token's
    event more (chat_completion/serving.py, openai/serving_chat.py)."""
    return max(1, round(body_bytes / token_event_bytes) - 1)


def ends_event_stream(chunk: bytes) -> bool:
    """Whether a response body chunk ends with the stream's last event, `data: [DONE]`
    (vLLM's and SGLang's OpenAI servers end every stream with it): the response is
    complete, whatever the client does after."""
    return chunk.rstrip().endswith(SSE_DONE.rstrip())


def is_error_event(chunk: bytes) -> bool:
    """Whether a response's first body chunk is an error event inside an HTTP 200 stream
    (SGLang sends `data: {"error": {...}}` then `data: [DONE]` when a request fails after
    its stream began, python/sglang/srt/entrypoints/openai/serving_chat.py)."""
    if not chunk.startswith(b"data:"):
        return False
    event = chunk[5:].split(b"\n", 1)[0].strip()
    if not event.startswith(b'{"error"') and b'"error"' not in event[:64]:
        return False  # cheap test first: the first chunk of a normal stream is a delta
    try:
        decoded = orjson.loads(event)
    except orjson.JSONDecodeError:
        return False
    return isinstance(decoded, dict) and "error" in decoded and "choices" not in decoded
