"""The engine's wire format, pure (no HTTP server): OpenAI /v1/chat/completions and
/v1/completions and SGLang /generate request bodies parsed into a `GenRequest` (bad input ->
`BadRequest`, always answered with HTTP 400 naming the bad field), and the JSON / SSE
bodies of responses and errors.

The engine always emits exactly max_tokens tokens (as with `ignore_eos`); each token is the
4-byte piece "tok ", so `count_tokens(output_text) == output_tokens`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from emulator.engine_config import EngineConfig
from emulator.model import Emission
from ext_proc.tokens import block_hashes_of_ids, render_chat

TOKEN_PIECE = "tok "  # 4 UTF-8 bytes: exactly one token under the approximate tokenizer

Kind = Literal["chat", "completion", "generate"]


class BadRequest(Exception):
    """Invalid request body; `message` names what is wrong. Answered with HTTP 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class GenRequest:
    """A validated generation request, independent of the wire format it came in."""

    kind: Kind
    input_tokens: int
    output_tokens: int
    stream: bool
    include_usage: bool
    model: str
    # Chained hashes of the prompt's full cache blocks (what the prefix cache matches).
    blocks: tuple[int, ...] = ()


def _text_prompt(text: str, cfg: EngineConfig, field: str) -> tuple[int, tuple[int, ...]]:
    tok = cfg.tokenizer
    n = tok.count(text)
    if n == 0:
        raise BadRequest(f"'{field}' is empty: a prompt needs at least one token")
    return n, tuple(tok.block_hashes(text, cfg.profile.block_tokens))


def _ids_prompt(ids: list[int], cfg: EngineConfig) -> tuple[int, tuple[int, ...]]:
    return len(ids), tuple(block_hashes_of_ids(ids, cfg.profile.block_tokens))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_bool(body: Mapping[str, Any], key: str, where: str = "") -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{where}{key}' must be a boolean, got {type(value).__name__}")
    return value


def _opt_int(body: Mapping[str, Any], key: str, minimum: int, where: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise BadRequest(f"'{where}{key}' must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise BadRequest(f"'{where}{key}' must be >= {minimum}, got {value}")
    return int(value)


def _model(body: Mapping[str, Any], cfg: EngineConfig) -> str:
    value = body.get("model")
    if value is None:
        return cfg.model
    if not isinstance(value, str):
        raise BadRequest(f"'model' must be a string, got {type(value).__name__}")
    return value or cfg.model


def _openai_common(body: Mapping[str, Any], cfg: EngineConfig) -> tuple[int, bool, bool, str]:
    """max tokens, stream, include_usage and model of an OpenAI-style body."""
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping):
            raise BadRequest(f"'stream_options' must be an object, got {type(options).__name__}")
        include_usage = _opt_bool(options, "include_usage", "stream_options.")
    return min(max_tokens, cfg.max_tokens_cap), stream, include_usage, _model(body, cfg)


def _token_ids(value: list[Any], field: str) -> list[int]:
    """A list of token ids counts one token per id."""
    if not all(_is_int(t) for t in value):
        raise BadRequest(f"'{field}' must be a list of integer token ids")
    return value


def parse_chat(body: Any, cfg: EngineConfig) -> GenRequest:
    """Validate a /v1/chat/completions body; input tokens = tokens of the rendered chat."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("missing required field 'messages'")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise BadRequest(f"'messages[{i}]' must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}].role' must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"'messages[{i}].content' must be a string, a list of parts or null, "
                f"got {type(content).__name__}"
            )
    max_tokens, stream, include_usage, model = _openai_common(body, cfg)
    input_tokens, blocks = _text_prompt(render_chat(messages), cfg, "messages")
    return GenRequest("chat", input_tokens, max_tokens, stream, include_usage, model, blocks)


def parse_completion(body: Any, cfg: EngineConfig) -> GenRequest:
    """Validate a /v1/completions body. `prompt` is a string, a list of strings (counted as
    their concatenation: the emulator answers one choice), or a list of token ids."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("missing required field 'prompt'")
    if isinstance(prompt, str):
        input_tokens, blocks = _text_prompt(prompt, cfg, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        input_tokens, blocks = _text_prompt("".join(prompt), cfg, "prompt")
    elif isinstance(prompt, list) and prompt:
        input_tokens, blocks = _ids_prompt(_token_ids(prompt, "prompt"), cfg)
    else:
        raise BadRequest(
            "'prompt' must be a string, a non-empty list of strings or a list of token ids"
        )
    max_tokens, stream, include_usage, model = _openai_common(body, cfg)
    return GenRequest("completion", input_tokens, max_tokens, stream, include_usage, model, blocks)


def parse_generate(body: Any, cfg: EngineConfig) -> GenRequest:
    """Validate a native SGLang /generate body: `text` (or `input_ids`), `sampling_params`,
    `stream`. max_new_tokens may be 0 (prefill only, as SGLang allows)."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    text = body.get("text")
    input_ids = body.get("input_ids")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest(f"'text' must be a string, got {type(text).__name__}")
        input_tokens, blocks = _text_prompt(text, cfg, "text")
    elif input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("'input_ids' must be a non-empty list of integer token ids")
        input_tokens, blocks = _ids_prompt(_token_ids(input_ids, "input_ids"), cfg)
    else:
        raise BadRequest("missing required field 'text'")
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise BadRequest(f"'sampling_params' must be an object, got {type(params).__name__}")
    max_new_tokens = _opt_int(params, "max_new_tokens", 0, "sampling_params.")
    if max_new_tokens is None:
        max_new_tokens = cfg.default_max_tokens
    return GenRequest(
        kind="generate",
        input_tokens=input_tokens,
        output_tokens=min(max_new_tokens, cfg.max_tokens_cap),
        stream=_opt_bool(body, "stream"),
        include_usage=False,
        model=cfg.model,
        blocks=blocks,
    )


def decode_json(raw: bytes) -> Any:
    """A request body's JSON value; not JSON at all -> BadRequest."""
    try:
        return json.loads(raw)
    except ValueError as exc:  # includes bad UTF-8
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None


def parse_request(kind: Kind, raw: bytes, cfg: EngineConfig) -> GenRequest:
    """Validate the raw body of a request for endpoint `kind`."""
    body = decode_json(raw)
    if kind == "chat":
        return parse_chat(body, cfg)
    if kind == "completion":
        return parse_completion(body, cfg)
    return parse_generate(body, cfg)


def dumps(obj: Any) -> str:
    """Compact JSON, as the engine writes response bodies."""
    return json.dumps(obj, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    """One server-sent event carrying obj."""
    return f"data: {dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def _usage(req: GenRequest, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": req.input_tokens,
        "completion_tokens": req.output_tokens,
        "total_tokens": req.input_tokens + req.output_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class OpenAIFormatter:
    """Builds the JSON objects of one OpenAI-style response (all chunks share one id)."""

    def __init__(self, req: GenRequest) -> None:
        self.req = req
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }

    def token_chunk(self, index: int) -> dict[str, Any]:
        """Chunk carrying output token `index`; the first chat chunk also carries the role."""
        if self.chat:
            delta: dict[str, Any] = {"content": TOKEN_PIECE}
            if index == 0:
                delta = {"role": "assistant", "content": TOKEN_PIECE}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": TOKEN_PIECE}
        choice.update(logprobs=None, finish_reason=None)
        return self._envelope([choice], chunk=True)

    def final_chunk(self) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}}
        else:
            choice = {"index": 0, "text": ""}
        choice.update(logprobs=None, finish_reason="length")
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, cached_tokens: int) -> dict[str, Any]:
        out = self._envelope([], chunk=True)
        out["usage"] = _usage(self.req, cached_tokens)
        return out

    def full(self, cached_tokens: int) -> dict[str, Any]:
        text = TOKEN_PIECE * self.req.output_tokens
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
            }
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason="length")
        out = self._envelope([choice], chunk=False)
        out["usage"] = _usage(self.req, cached_tokens)
        return out


def generate_body(
    req: GenRequest, rid: str, tokens_done: int, cached_tokens: int
) -> dict[str, Any]:
    """SGLang native response after `tokens_done` tokens (text is cumulative, as SGLang's)."""
    finished = tokens_done >= req.output_tokens
    return {
        "text": TOKEN_PIECE * tokens_done,
        "meta_info": {
            "id": rid,
            "prompt_tokens": req.input_tokens,
            "completion_tokens": tokens_done,
            "cached_tokens": cached_tokens,
            "finish_reason": {"type": "length", "length": req.output_tokens} if finished else None,
        },
    }


def response_body(req: GenRequest, rid: str, cached_tokens: int) -> dict[str, Any]:
    """The whole (non-streamed) response once all of req's tokens are out."""
    if req.kind == "generate":
        return generate_body(req, rid, req.output_tokens, cached_tokens)
    return OpenAIFormatter(req).full(cached_tokens)


class StreamEncoder:
    """The SSE bytes of one streamed response, written a batch of emissions at a time."""

    def __init__(self, req: GenRequest, rid: str) -> None:
        self.req = req
        self.rid = rid
        self.fmt = OpenAIFormatter(req)
        # Every chunk after the first is the same bytes: encode it once per response.
        self._first_chunk = sse(self.fmt.token_chunk(0))
        self._next_chunk = sse(self.fmt.token_chunk(1))

    def encode(self, batch: list[Emission]) -> tuple[bytes, bool]:
        """The bytes carrying `batch`, and whether they end the response."""
        req = self.req
        out = bytearray()
        finished = False
        for e in batch:
            if req.kind == "generate":
                done = min(e.index + 1, req.output_tokens)
                out += sse(generate_body(req, self.rid, done, e.cached_tokens))
            else:
                out += self._first_chunk if e.index == 0 else self._next_chunk
            finished = e.finished
        if finished:
            if req.kind != "generate":
                out += sse(self.fmt.final_chunk())
                if req.include_usage:
                    out += sse(self.fmt.usage_chunk(batch[-1].cached_tokens))
            out += SSE_DONE
        return bytes(out), finished


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return {"error": {"message": message, "type": kind, "code": status}}
