"""A first emulated SGLang engine: SGLang's HTTP wire format with simple, configurable timing.

Three layers, kept apart so a later faithful continuous-batching model can replace only the
timing:
- `SimpleTiming`: pure, clock-free arithmetic (how long prefill and each decode step take);
- `parse_*`: pure validation of request bodies into a `GenRequest` (bad input -> `BadRequest`,
  always answered with HTTP 400 naming the bad field);
- `Engine` / `make_app` / `serve_engine`: the aiohttp shell that sleeps and writes chunks.

Every request is served independently (no batching, no queueing): request r's first token
leaves at prefill_s(input tokens) after arrival and each further token decode_s_per_token()
later. The engine always emits exactly max_tokens tokens (as with ignore_eos); each token is
the 4-byte piece "tok ", so `count_tokens(output_text) == output_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from aiohttp import web

from ext_proc.tokens import count_tokens, render_chat

log = logging.getLogger(__name__)

ENGINE_ID_HEADER = "x-engine-id"
TOKEN_PIECE = "tok "  # 4 UTF-8 bytes: exactly one token under count_tokens
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
# Long-context prompts (128k tokens ~ 512 KiB of text, more as JSON) exceed aiohttp's 1 MiB
# default body limit; a real engine accepts them.
MAX_BODY_BYTES = 64 * 1024 * 1024

Kind = Literal["chat", "completion", "generate"]


@dataclass
class EngineConfig:
    """One emulated backend. Defaults follow DESIGN.md section 7 at light load."""

    name: str  # backend id, e.g. "us-ashburn"; echoed in x-engine-id
    prefill_base_ms: float = 20.0  # fixed cost of a prefill batch
    prefill_tokens_per_s: float = 12000.0  # prefill throughput (P in DESIGN.md)
    decode_ms_per_token: float = 10.0  # ITL at light load (paper: median 9-10 ms)
    default_max_tokens: int = 16  # when the request names no limit
    max_tokens_cap: int = 4096  # requested limits above this are clamped
    model: str = "emulated"  # served model name (/v1/models, responses)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EngineConfig.name must be a non-empty backend id")
        for f in ("prefill_base_ms", "decode_ms_per_token"):
            value = getattr(self, f)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"EngineConfig.{f} must be finite and >= 0, got {value!r}")
        if not self.prefill_tokens_per_s > 0:  # inf is allowed: instant prefill
            raise ValueError(
                f"EngineConfig.prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s!r}"
            )
        if self.max_tokens_cap < 1:
            raise ValueError(f"EngineConfig.max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.default_max_tokens < 1:  # clamped to max_tokens_cap like any request
            raise ValueError(
                f"EngineConfig.default_max_tokens must be >= 1, got {self.default_max_tokens}"
            )

    @classmethod
    def zero_delay(cls, name: str, **overrides: Any) -> EngineConfig:
        """No prefill or decode delay at all: isolates proxy overhead in benchmarks."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown EngineConfig field(s): {', '.join(unknown)}")
        params: dict[str, Any] = {
            "prefill_base_ms": 0.0,
            "prefill_tokens_per_s": math.inf,
            "decode_ms_per_token": 0.0,
        }
        params.update(overrides)
        return cls(name=name, **params)


class SimpleTiming:
    """Per-request timing with no batching: prefill = base + tokens / throughput, then a
    constant time per decoded token. Pure and clock-free, so the faithful model can replace
    it behind the same two methods."""

    def __init__(
        self, prefill_base_ms: float, prefill_tokens_per_s: float, decode_ms_per_token: float
    ) -> None:
        self._prefill_base_s = prefill_base_ms / 1000.0
        self._prefill_tokens_per_s = prefill_tokens_per_s
        self._decode_s = decode_ms_per_token / 1000.0

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> SimpleTiming:
        return cls(cfg.prefill_base_ms, cfg.prefill_tokens_per_s, cfg.decode_ms_per_token)

    def prefill_s(self, input_tokens: int) -> float:
        """Time from arrival to the first output token."""
        return self._prefill_base_s + input_tokens / self._prefill_tokens_per_s

    def decode_s_per_token(self) -> float:
        """Time between consecutive output tokens."""
        return self._decode_s

    def token_offset_s(self, input_tokens: int, token_index: int) -> float:
        """When output token `token_index` (0-based) is ready, relative to arrival. The first
        token comes out of prefill; each later one costs one decode step."""
        return self.prefill_s(input_tokens) + token_index * self._decode_s


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


def _token_ids(value: list[Any], field: str) -> int:
    """A list of token ids counts one token per id."""
    if not all(_is_int(t) for t in value):
        raise BadRequest(f"'{field}' must be a list of integer token ids")
    return len(value)


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
    return GenRequest(
        kind="chat",
        input_tokens=count_tokens(render_chat(messages)),
        output_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        model=model,
    )


def parse_completion(body: Any, cfg: EngineConfig) -> GenRequest:
    """Validate a /v1/completions body. `prompt` is a string, a list of strings (counted as
    their concatenation: the emulator answers one choice), or a list of token ids."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("missing required field 'prompt'")
    if isinstance(prompt, str):
        input_tokens = count_tokens(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        input_tokens = count_tokens("".join(prompt))
    elif isinstance(prompt, list) and prompt:
        input_tokens = _token_ids(prompt, "prompt")
    else:
        raise BadRequest(
            "'prompt' must be a string, a non-empty list of strings or a list of token ids"
        )
    max_tokens, stream, include_usage, model = _openai_common(body, cfg)
    return GenRequest(
        kind="completion",
        input_tokens=input_tokens,
        output_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        model=model,
    )


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
        input_tokens = count_tokens(text)
    elif input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("'input_ids' must be a non-empty list of integer token ids")
        input_tokens = _token_ids(input_ids, "input_ids")
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
    )


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _sse(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def _usage(req: GenRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": req.input_tokens,
        "completion_tokens": req.output_tokens,
        "total_tokens": req.input_tokens + req.output_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


class _OpenAIFormatter:
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

    def usage_chunk(self) -> dict[str, Any]:
        out = self._envelope([], chunk=True)
        out["usage"] = _usage(self.req)
        return out

    def full(self) -> dict[str, Any]:
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
        out["usage"] = _usage(self.req)
        return out


def _generate_body(req: GenRequest, rid: str, tokens_done: int) -> dict[str, Any]:
    """SGLang native response after `tokens_done` tokens (text is cumulative, as SGLang's)."""
    finished = tokens_done >= req.output_tokens
    return {
        "text": TOKEN_PIECE * tokens_done,
        "meta_info": {
            "id": rid,
            "prompt_tokens": req.input_tokens,
            "completion_tokens": tokens_done,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": req.output_tokens} if finished else None,
        },
    }


def error_response(status: int, message: str) -> web.Response:
    """OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


@dataclass
class EngineStats:
    """Counters behind GET /stats. Only generation requests count: health checks and RTT
    probes must not look like served traffic."""

    requests_total: int = 0  # generation requests received, valid or not
    bad_requests_total: int = 0
    completed_total: int = 0  # responses fully written
    in_flight: int = 0  # valid requests being prefilled or decoded
    requests_by_path: Counter[str] = field(default_factory=Counter)


class Engine:
    """HTTP shell around SimpleTiming; one instance per emulated backend."""

    def __init__(self, cfg: EngineConfig, timing: SimpleTiming | None = None) -> None:
        self.cfg = cfg
        self.timing = timing or SimpleTiming.from_config(cfg)
        self.stats = EngineStats()

    # -- plumbing ---------------------------------------------------------------------

    async def add_engine_header(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[ENGINE_ID_HEADER] = self.cfg.name

    async def _sleep_until(self, deadline: float) -> None:
        delay_s = deadline - asyncio.get_running_loop().time()
        if delay_s > 0:  # zero-delay engines must not yield per token
            await asyncio.sleep(delay_s)

    async def _serve(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        self.stats.requests_total += 1
        self.stats.requests_by_path[request.path] += 1
        arrival = asyncio.get_running_loop().time()
        try:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except ValueError as exc:  # includes bad UTF-8
                raise BadRequest(f"request body is not valid JSON: {exc}") from None
            except RecursionError:
                raise BadRequest("request body is not valid JSON: nested too deeply") from None
            if kind == "chat":
                req = parse_chat(body, self.cfg)
            elif kind == "completion":
                req = parse_completion(body, self.cfg)
            else:
                req = parse_generate(body, self.cfg)
        except BadRequest as exc:
            self.stats.bad_requests_total += 1
            return error_response(400, exc.message)

        self.stats.in_flight += 1
        # finally: a client that disconnects mid-stream (handler cancelled, or a write that
        # fails) must not stay counted in flight.
        try:
            if not req.stream:
                return await self._respond_whole(req, arrival)
            if kind == "generate":
                return await self._stream_generate(request, req, arrival)
            return await self._stream_openai(request, req, arrival)
        finally:
            self.stats.in_flight -= 1

    async def _respond_whole(self, req: GenRequest, arrival: float) -> web.Response:
        last = max(req.output_tokens - 1, 0)
        await self._sleep_until(arrival + self.timing.token_offset_s(req.input_tokens, last))
        if req.kind == "generate":
            body = _generate_body(req, secrets.token_hex(16), req.output_tokens)
        else:
            body = _OpenAIFormatter(req).full()
        self.stats.completed_total += 1
        return web.json_response(body, dumps=_dumps)

    def _client_gone(self, request: web.Request) -> None:
        # Only reached under a runner without handler_cancellation: the write failed.
        # Returning the prepared response lets aiohttp close quietly, without a 500.
        log.debug("%s: client went away during %s", self.cfg.name, request.path)

    async def _open_sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)  # headers leave now, before prefill
        return resp

    async def _stream_openai(
        self, request: web.Request, req: GenRequest, arrival: float
    ) -> web.StreamResponse:
        fmt = _OpenAIFormatter(req)
        resp = await self._open_sse(request)
        try:
            for i in range(req.output_tokens):
                await self._sleep_until(arrival + self.timing.token_offset_s(req.input_tokens, i))
                await resp.write(_sse(fmt.token_chunk(i)))
            tail = _sse(fmt.final_chunk())
            if req.include_usage:
                tail += _sse(fmt.usage_chunk())
            await resp.write(tail + SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            self._client_gone(request)
            return resp
        self.stats.completed_total += 1
        return resp

    async def _stream_generate(
        self, request: web.Request, req: GenRequest, arrival: float
    ) -> web.StreamResponse:
        rid = secrets.token_hex(16)
        resp = await self._open_sse(request)
        try:
            if req.output_tokens == 0:  # prefill only: one chunk when prefill ends
                await self._sleep_until(arrival + self.timing.prefill_s(req.input_tokens))
                await resp.write(_sse(_generate_body(req, rid, 0)))
            for i in range(req.output_tokens):
                await self._sleep_until(arrival + self.timing.token_offset_s(req.input_tokens, i))
                await resp.write(_sse(_generate_body(req, rid, i + 1)))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            self._client_gone(request)
            return resp
        self.stats.completed_total += 1
        return resp

    # -- handlers ---------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "generate")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.cfg.model,
            "object": "model",
            "created": 0,
            "owned_by": "sglang",
            "root": self.cfg.model,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def stats_handler(self, request: web.Request) -> web.Response:
        s = self.stats
        return web.json_response(
            {
                "name": self.cfg.name,
                "requests_total": s.requests_total,
                "bad_requests_total": s.bad_requests_total,
                "completed_total": s.completed_total,
                "in_flight": s.in_flight,
                "requests_by_path": dict(s.requests_by_path),
            }
        )


ENGINE_KEY: web.AppKey[Engine] = web.AppKey("gorgo_engine", Engine)


def make_app(cfg: EngineConfig) -> web.Application:
    """The engine's aiohttp application; `app[ENGINE_KEY]` is its Engine (stats, config)."""
    engine = Engine(cfg)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app.on_response_prepare.append(engine.add_engine_header)
    app.router.add_post(CHAT_PATH, engine.chat)
    app.router.add_post(COMPLETIONS_PATH, engine.completions)
    app.router.add_post(GENERATE_PATH, engine.generate)
    app.router.add_get("/health", engine.health)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/stats", engine.stats_handler)
    return app


class EngineServer:
    """An engine listening on host:port (port 0 picks a free one); start() / stop()."""

    def __init__(self, cfg: EngineConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg = cfg
        self.app = make_app(cfg)
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE_KEY]

    @property
    def port(self) -> int:
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("EngineServer is not started")
        return int(self._runner.addresses[0][1])

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        # handler_cancellation: a client disconnect aborts the request at once, as SGLang
        # aborts a request whose client went away.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self._host, self._port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


async def serve_engine(
    cfg: EngineConfig, host: str, port: int, ready: asyncio.Event | None = None
) -> None:
    """Serve one emulated engine until cancelled; `ready` is set once it accepts."""
    server = EngineServer(cfg, host, port)
    await server.start()
    try:
        log.info("engine %s listening on %s", cfg.name, server.url)
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()  # until cancelled
    finally:
        await server.stop()
