"""The engine's responses, pure (no HTTP server): the JSON / SSE bodies of OpenAI and
SGLang responses and errors, in each flavor's shapes, for a `GenRequest`
(emulator/engine/parse.py parses the requests).

The engine always emits exactly max_tokens tokens (as with `ignore_eos`); each token is the
4-byte piece "tok ", so `count_tokens(output_text) == output_tokens`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from http import HTTPStatus
from typing import Any

from emulator.engine.config import SGLANG, VLLM_VERSION, EngineConfig
from emulator.engine.model.scheduler import Emission

# parse_chat and parse_request stay importable from here (the module was one before).
from emulator.engine.parse import GenRequest, InvalidBody, Kind, parse_chat, parse_request  # noqa: F401

TOKEN_PIECE = "tok "  # 4 UTF-8 bytes: exactly one token under the approximate tokenizer


def dumps(obj: Any) -> str:
    """Compact JSON, as the engine writes response bodies."""
    return json.dumps(obj, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    """One server-sent event carrying obj."""
    return f"data: {dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def _without_none(obj: Any) -> Any:
    """What pydantic's exclude_none leaves of a JSON object."""
    if isinstance(obj, dict):
        return {k: _without_none(v) for k, v in obj.items() if v is not None}
    return obj


def system_fingerprint(cfg: EngineConfig) -> str:
    """vLLM's system_fingerprint, vllm-<version>-<8 hex> (the real one here writes
    vllm-0.32.0-81df5d86); the hex part is a stand-in, stable per served model."""
    return f"vllm-{VLLM_VERSION}-{hashlib.sha256(cfg.model.encode()).hexdigest()[:8]}"


def usage(
    req: GenRequest, cached_tokens: int, cfg: EngineConfig, stream: bool = False
) -> dict[str, Any]:
    """The usage object. prompt_tokens_details is there only when the engine was started
    with its cache-report flag. SGLang (--enable-cache-report, openai/usage_processor.py)
    reports {"cached_tokens": N} for N > 0 and null otherwise. vLLM
    (--enable-prompt-tokens-details; chat_completion/serving.py, completion/serving.py and
    the real one, tests/fixtures/vllm/) reports the count, 0 included, with
    created_cache_tokens (the prompt's full blocks it wrote to the cache; null on
    /v1/completions) and multimodal_tokens; its stream's usage chunk leaves nulls out."""
    out: dict[str, Any] = {
        "prompt_tokens": req.input_tokens,
        "total_tokens": req.input_tokens + req.output_tokens,
        "completion_tokens": req.output_tokens,
    }
    details: dict[str, Any] | None = None
    if cfg.flavor == SGLANG:
        if cfg.cache_report and cached_tokens:
            details = {"cached_tokens": cached_tokens}
        out["prompt_tokens_details"] = details
        out["reasoning_tokens"] = 0
        return out
    if cfg.cache_report:
        bt = cfg.profile.block_tokens
        created = (
            max(0, req.input_tokens // bt * bt - cached_tokens) if req.kind == "chat" else None
        )
        details = {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": created,
            "multimodal_tokens": None,
        }
    out["prompt_tokens_details"] = details
    out["completion_tokens_details"] = None
    return _without_none(out) if stream else out


class OpenAIFormatter:
    """Builds the JSON objects of one OpenAI-style response, in the flavor's shapes.

    SGLang (openai/serving_chat.py, serving_completions.py): the id is the request id;
    chat deltas always carry reasoning_content; every choice carries matched_stop; chat
    ends with a separate chunk holding finish_reason, completions put it on the last
    token's chunk. vLLM (chat_completion/serving.py, completion/serving.py, and the real
    one: tests/fixtures/vllm/sse-chat.txt, routes.json): ids are chatcmpl-/cmpl-
    prefixed; chunks hold only the fields the server set (token_ids: null on token
    chunks, prompt_token_ids and prompt_text: null on the role chunk); finish_reason
    (with stop_reason) rides on the last token's chunk; system_fingerprint is on the last
    message (the usage chunk when there is one).
    """

    def __init__(self, req: GenRequest, cfg: EngineConfig, rid: str) -> None:
        self.req = req
        self.cfg = cfg
        self.sglang = cfg.flavor == SGLANG
        self.chat = req.kind == "chat"
        prefix = "" if self.sglang else ("chatcmpl-" if self.chat else "cmpl-")
        self.id = prefix + rid
        self.created = int(time.time())
        self.fingerprint = None if self.sglang else system_fingerprint(cfg)

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

    def _choice(self, body: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}
        if self.sglang:
            choice["matched_stop"] = None  # max_tokens reached: no stop matched
        elif finish_reason is not None:
            choice["stop_reason"] = None
        return choice

    def _delta(self, **fields: Any) -> dict[str, Any]:
        return {"reasoning_content": None, **fields} if self.sglang else fields

    def role_chunk(self) -> dict[str, Any]:
        """The chat stream's first chunk: the role and empty content."""
        delta = self._delta(role="assistant", content="")
        out = self._envelope([self._choice({"delta": delta}, None)], chunk=True)
        if not self.sglang:
            out.update(prompt_token_ids=None, prompt_text=None)
        return out

    def token_chunk(self, last: bool) -> dict[str, Any]:
        """A chunk carrying one output token; on the last one the finish reason, where
        the flavor puts it there."""
        finish = "length" if last and not (self.sglang and self.chat) else None
        if self.chat:
            body: dict[str, Any] = {"delta": self._delta(content=TOKEN_PIECE)}
        else:
            body = {"text": TOKEN_PIECE}
        choice = self._choice(body, finish)
        if not self.sglang:
            if not self.chat:
                choice["stop_reason"] = None  # completions set it on every chunk
            choice["token_ids"] = None
            if not self.chat:
                choice["prompt_token_ids"] = None
        out = self._envelope([choice], chunk=True)
        if self.fingerprint is not None and last and not self.req.include_usage:
            out["system_fingerprint"] = self.fingerprint
        return out

    def finish_chunk(self) -> dict[str, Any] | None:
        """SGLang chat's separate last chunk: no content, the finish reason."""
        if not (self.sglang and self.chat):
            return None
        return self._envelope([self._choice({"delta": self._delta()}, "length")], chunk=True)

    def usage_chunk(self, cached_tokens: int, req: GenRequest | None = None) -> dict[str, Any]:
        """The last chunk, choices [] and the usage of `req` (default: the whole
        response)."""
        out = self._envelope([], chunk=True)
        u = usage(req or self.req, cached_tokens, self.cfg, stream=not self.sglang)
        # SGLang's completions usage chunk is written without null fields.
        if self.sglang and not self.chat and u.get("prompt_tokens_details") is None:
            u.pop("prompt_tokens_details", None)
        out["usage"] = u
        if self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out

    def full(self, cached_tokens: int) -> dict[str, Any]:
        text = TOKEN_PIECE * self.req.output_tokens
        u = usage(self.req, cached_tokens, self.cfg)
        if self.sglang:
            if self.chat:
                message = {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": None,
                }
                body: dict[str, Any] = {"message": message}
            else:
                body = {"text": text}
            out = self._envelope([self._choice(body, "length")], chunk=False)
            out["usage"] = u
            out["metadata"] = {"weight_version": "default"}
            return out
        # vLLM: every field of the response model, nulls included (routes.json).
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        out = self._envelope([choice], chunk=False)
        out.update(service_tier=None, system_fingerprint=self.fingerprint, usage=u)
        if self.chat:
            out.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        out.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
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


def response_body(req: GenRequest, rid: str, cached_tokens: int, cfg: EngineConfig) -> Any:
    """The whole (non-streamed) response once all of req's tokens are out."""
    if req.kind == "generate":
        return generate_body(req, rid, req.output_tokens, cached_tokens)
    return OpenAIFormatter(req, cfg, rid).full(cached_tokens)


class StreamEncoder:
    """The SSE bytes of one streamed response, written a batch of emissions at a time."""

    def __init__(self, req: GenRequest, rid: str, cfg: EngineConfig) -> None:
        self.req = req
        self.rid = rid
        self.fmt = OpenAIFormatter(req, cfg, rid)
        # Every token chunk but the last is the same bytes: encode it once per response.
        self._chunk = sse(self.fmt.token_chunk(last=False))
        self._role = sse(self.fmt.role_chunk()) if req.kind == "chat" else b""

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
                if e.index == 0:
                    out += self._role
                out += sse(self.fmt.token_chunk(last=True)) if e.finished else self._chunk
            finished = e.finished
        if finished:
            if req.kind != "generate":
                finish = self.fmt.finish_chunk()
                if finish is not None:
                    out += sse(finish)
                if req.include_usage:
                    out += sse(self.fmt.usage_chunk(batch[-1].cached_tokens))
            out += SSE_DONE
        return bytes(out), finished

    def error_event(
        self, status: int, message: str, tokens_sent: int = 0, cached_tokens: int = 0
    ) -> bytes:
        """An error inside the stream (HTTP stays 200), then the end. SGLang's abort
        with a status breaks out of its loop, and what follows the loop still runs: the
        usage chunk (of the tokens sent) when asked for (serving_chat.py,
        serving_completions.py); vLLM goes straight to [DONE] (chat_completion/serving.py)."""
        out = sse(stream_error_body(self.fmt.cfg, status, message))
        if self.fmt.sglang and self.req.kind != "generate" and self.req.include_usage:
            sent = replace(self.req, output_tokens=tokens_sent)
            out += sse(self.fmt.usage_chunk(cached_tokens, sent))
        return out + SSE_DONE


def _error_type(status: int) -> str:
    if status == 404:
        return "NotFoundError"
    return "BadRequestError" if status < 500 else "InternalServerError"


def error_body(
    cfg: EngineConfig,
    status: int,
    message: str,
    param: str | None = None,
    kind: Kind = "chat",
    err_type: str | None = None,
) -> dict[str, Any]:
    """An error answered before any stream. SGLang: a flat ErrorResponse (OpenAI routes,
    serving_base.py create_error_response, and any route's schema errors, http_server.py
    validation_exception_handler), with no param; /generate's own errors
    {"error": {"message"}} (http_server.py). vLLM: {"error": {...}} naming the param
    (engine/protocol.py ErrorResponse; tests/fixtures/vllm/errors.json)."""
    err_type = err_type or _error_type(status)
    if cfg.flavor == SGLANG:
        if kind == "generate" and err_type != InvalidBody.err_type:
            return {"error": {"message": message}}
        return {
            "object": "error",
            "message": message,
            "type": err_type,
            "param": None,
            "code": status,
        }
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def stream_error_body(cfg: EngineConfig, status: int, message: str) -> dict[str, Any]:
    """The error event of a stream that already began: {"error": <the error object>}.
    SGLang's abort with a status names the status (type HTTPStatus.name, e.g.
    INTERNAL_SERVER_ERROR; serving_chat.py); vLLM dumps its ErrorResponse
    (create_streaming_error_response)."""
    if cfg.flavor == SGLANG:
        return {
            "error": {
                "object": "error",
                "message": message,
                "type": HTTPStatus(status).name,
                "param": None,
                "code": status,
            }
        }
    return error_body(cfg, status, message)
