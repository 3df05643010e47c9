"""The request body parser (ext_proc/prompt/parse.py): any bytes to any API path.

Invariant: `parse_body` returns a request whose counts match its prompts, or raises
ParseError naming the field (never another exception); a parsed body takes a new model
name and stays the same JSON otherwise; `is_error_event` answers true or false."""

from __future__ import annotations

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    import json

    import orjson

    from ext_proc.prompt.parse import (
        CHAT,
        COMPLETIONS,
        GENERATE,
        ParseError,
        is_error_event,
        parse_body,
        rewritten,
    )

from tests.fuzz import jsonish
from tests.fuzz.runner import fuzz

NAME = "body"
# The first byte picks the API (an unknown one too: the parser's own refusal) and, with
# its high bit, a body built from the rest (keys from the APIs' fields) over raw bytes.
APIS = (CHAT, COMPLETIONS, GENERATE, "embeddings")
KEYS = (
    *("model", "messages", "role", "content", "name", "type", "text", "image_url", "url"),
    *("tools", "tool_calls", "tool_call_id", "function", "arguments", "parameters"),
    *("prompt", "input_ids", "sampling_params", "max_new_tokens", "max_tokens"),
    *("max_completion_tokens", "stream", "cache_salt", "user", "add_special_tokens"),
    *("chat_template", "chat_template_kwargs", "add_generation_prompt"),
    *("continue_final_message", "priority", "n", "logprobs"),
)


def body_of(data: bytes) -> tuple[str, bytes]:
    """The API and the body an input stands for."""
    if not data:
        return CHAT, b""
    api = APIS[data[0] % len(APIS)]
    if data[0] & 0x80:
        fdp = atheris.FuzzedDataProvider(data[1:])
        return api, json.dumps(jsonish.obj(fdp, KEYS)).encode()
    return api, data[1:]


def one_input(data: bytes) -> None:
    api, body = body_of(data)
    assert is_error_event(body) in (True, False)
    try:
        llm = parse_body(api, body)
    except ParseError as e:
        # "<field>: expected ...", or "unknown api 'x'"
        assert ": " in str(e) or api not in APIS[:3], f"a parse error naming nothing: {e!r}"
        return
    assert llm.api == api
    assert len(llm.prompt_tokens) == len(llm.prompts) >= 1
    assert all(n >= 0 for n in llm.prompt_tokens)
    assert llm.max_output_tokens is None or llm.max_output_tokens >= 0
    assert (llm.chat is not None) == (api == CHAT)
    renamed = orjson.loads(rewritten(body, "served-name", -10))
    original = orjson.loads(body)
    assert renamed == {**original, "model": "served-name", "priority": -10}


def main() -> None:
    fuzz(NAME, one_input)


if __name__ == "__main__":
    main()
