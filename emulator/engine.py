"""The emulated SGLang engine: SGLang's HTTP wire format, timed by the engine model.

Three layers:
- `emulator.model.EngineModel`: pure scheduler (continuous batching, chunked prefill,
  radix prefix cache), shared with the offline simulator;
- `parse_*`: pure validation of request bodies into a `GenRequest` (bad input ->
  `BadRequest`, always answered with HTTP 400 naming the bad field);
- `ModelRunner` / `Engine` / `make_app` / `serve_engine`: the aiohttp shell. One task
  advances the model on the event loop's clock and hands each emitted token to the
  request's handler, which writes it.

The engine always emits exactly max_tokens tokens (as with `ignore_eos`); each token is the
4-byte piece "tok ", so `count_tokens(output_text) == output_tokens`. The prefix cache
holds prompt blocks only (not generated text).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import math
import random
import secrets
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from aiohttp import web

from emulator.model import Emission, EngineModel
from ext_proc.profile import DEFAULT_PROFILE, EngineProfile, load_profile
from ext_proc.tokens import APPROX, Tokenizer, block_hashes_of_ids, render_chat

log = logging.getLogger(__name__)

ENGINE_ID_HEADER = "x-engine-id"
TOKEN_PIECE = "tok "  # 4 UTF-8 bytes: exactly one token under the approximate tokenizer
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
# Long-context prompts (128k tokens ~ 512 KiB of text, more as JSON) exceed aiohttp's 1 MiB
# default body limit; a real engine accepts them.
MAX_BODY_BYTES = 64 * 1024 * 1024
# The event loop's timers wake up to 1 ms late (epoll's millisecond timeout is rounded up):
# sleep until this long before a step ends, then yield until it is due.
WAKE_EARLY_S = 0.0015
# Emission lag samples kept for /server_info (a ring: the recent past).
LAG_SAMPLES = 100_000

Kind = Literal["chat", "completion", "generate"]


def zero_delay_profile(base: EngineProfile) -> EngineProfile:
    """Every step takes no time: isolates proxy overhead in benchmarks."""
    return replace(
        base,
        name=f"{base.name}+zero-delay",
        prefill_base_ms=0.0,
        prefill_tokens_per_s=float("inf"),
        decode_base_ms=0.0,
        decode_batch_ms=0.0,
        decode_per_request_ms=0.0,
        decode_per_1k_context_ms=0.0,
        no_cuda_graph_ms=0.0,
        jitter_sigma=0.0,
    )


@dataclass
class Faults:
    """Fault injection, for reliability tests; all off by default."""

    # Share of generation requests answered with HTTP 500 at once.
    error_rate: float = 0.0
    # Share of generation requests held for stall_ms before they reach the scheduler.
    stall_rate: float = 0.0
    stall_ms: float = 0.0

    def validate(self) -> None:
        for key in ("error_rate", "stall_rate"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                raise ValueError(f"{key} must be a number in [0, 1], got {v!r}")
        v = self.stall_ms
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
            raise ValueError(f"stall_ms must be a finite number >= 0, got {v!r}")


@dataclass
class EngineConfig:
    """One emulated backend."""

    name: str  # backend id, e.g. "us-ashburn"; echoed in x-engine-id
    profile: EngineProfile = field(default_factory=lambda: load_profile(DEFAULT_PROFILE))
    default_max_tokens: int = 16  # when the request names no limit
    max_tokens_cap: int = 32768  # requested limits above this are clamped
    model: str = "emulated"  # served model name (/v1/models, responses)
    seed: int = 0  # step-time jitter and fault draws
    tokenizer: Tokenizer = APPROX
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EngineConfig.name must be a non-empty backend id")
        if self.max_tokens_cap < 1:
            raise ValueError(f"EngineConfig.max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.default_max_tokens < 1:
            raise ValueError(
                f"EngineConfig.default_max_tokens must be >= 1, got {self.default_max_tokens}"
            )
        self.faults.validate()

    @classmethod
    def zero_delay(cls, name: str, **overrides: Any) -> EngineConfig:
        """No prefill or decode time at all: isolates proxy overhead in benchmarks."""
        return cls(
            name=name, profile=zero_delay_profile(load_profile(DEFAULT_PROFILE)), **overrides
        )


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


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _sse(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def _usage(req: GenRequest, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": req.input_tokens,
        "completion_tokens": req.output_tokens,
        "total_tokens": req.input_tokens + req.output_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
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


def _generate_body(
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


def error_response(status: int, message: str) -> web.Response:
    """OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


# Histogram buckets (seconds), SGLang-like ranges.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):  # above the last bucket: counted in +Inf only
            self.counts[i] += 1

    def prometheus(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [f"# TYPE {name} histogram"], 0
        for upper, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels},le="{upper}"}} {cumulative}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        lines.append(f"{name}_count{{{labels}}} {self.n}")
        return lines


@dataclass
class EngineStats:
    """Counters behind GET /stats. Only generation requests count: health checks and RTT
    probes must not look like served traffic."""

    requests_total: int = 0  # generation requests received, valid or not
    bad_requests_total: int = 0
    injected_errors_total: int = 0
    completed_total: int = 0  # responses fully written
    in_flight: int = 0  # valid requests being prefilled or decoded
    requests_by_path: Counter[str] = field(default_factory=Counter)
    tokens_written: int = 0
    # How late each token left relative to the model's schedule (ms).
    lag_ms: deque[float] = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl_s: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))


class TokenChannel:
    """One request's emissions: the runner pushes, the handler takes all that are ready.
    Lighter than an asyncio.Queue, and a handler that fell behind writes a batch at once."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Emission] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, e: Emission) -> None:
        self._items.append(e)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Emission]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class ModelRunner:
    """Drives the engine model on the event loop's clock. One task sleeps until the
    running step ends, advances the model, and hands each emission to its request."""

    def __init__(self, model: EngineModel) -> None:
        self.model = model
        self._channels: dict[str, TokenChannel] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, rid: str, req: GenRequest) -> TokenChannel:
        channel = TokenChannel()
        self._channels[rid] = channel
        now = asyncio.get_running_loop().time()
        self.model.submit(rid, req.input_tokens, max(1, req.output_tokens), req.blocks, now)
        self._wake.set()
        return channel

    def release(self, rid: str) -> None:
        """The handler is done with rid (finished, or the client went away)."""
        if self._channels.pop(rid, None) is not None:
            self.model.cancel(rid, asyncio.get_running_loop().time())
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due_s = self.model.next_event_s()
            if due_s is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay_s = due_s - loop.time()
            if delay_s > WAKE_EARLY_S:
                await asyncio.sleep(delay_s - WAKE_EARLY_S)
            while loop.time() < due_s:  # the last stretch: yield to other tasks, not epoll
                await asyncio.sleep(0)
            for e in self.model.advance(loop.time()):
                channel = self._channels.get(e.rid)
                if channel is not None:
                    channel.push(e)


class Engine:
    """HTTP shell around the model runner; one instance per emulated backend."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.runner = ModelRunner(EngineModel(cfg.profile, random.Random(cfg.seed)))
        self.stats = EngineStats()
        self.started_cpu_s = time.process_time()

    # -- plumbing ---------------------------------------------------------------------

    async def add_engine_header(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[ENGINE_ID_HEADER] = self.cfg.name

    async def on_startup(self, app: web.Application) -> None:
        self.runner.start()

    async def on_cleanup(self, app: web.Application) -> None:
        await self.runner.stop()

    async def _serve(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        self.stats.requests_total += 1
        self.stats.requests_by_path[request.path] += 1
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
        faults = self.cfg.faults
        if faults.error_rate and self.rng.random() < faults.error_rate:
            self.stats.injected_errors_total += 1
            return error_response(500, "injected fault: internal error")
        if faults.stall_rate and self.rng.random() < faults.stall_rate:
            await asyncio.sleep(faults.stall_ms / 1000)

        rid = secrets.token_hex(16)
        self.stats.in_flight += 1
        arrival_s = asyncio.get_running_loop().time()
        # finally: a client that disconnects (handler cancelled, or a write that fails)
        # leaves the scheduler at once and is not counted in flight.
        try:
            channel = self.runner.submit(rid, req)
            if not req.stream:
                return await self._respond_whole(req, rid, channel, arrival_s)
            return await self._stream(request, req, rid, channel, arrival_s)
        finally:
            self.runner.release(rid)
            self.stats.in_flight -= 1

    def _record(self, batch: list[Emission], arrival_s: float, last_s: float) -> float:
        """Account tokens about to be written: lag against the schedule, TTFT or ITL.
        Returns the time of the last one."""
        now_s = asyncio.get_running_loop().time()
        stats = self.stats
        for e in batch:
            stats.lag_ms.append((now_s - e.time_s) * 1e3)
            if e.index == 0:
                stats.ttft_s.observe(e.time_s - arrival_s)
            else:
                stats.itl_s.observe(e.time_s - last_s)
            last_s = e.time_s
        stats.tokens_written += len(batch)
        return last_s

    async def _respond_whole(
        self, req: GenRequest, rid: str, channel: TokenChannel, arrival_s: float
    ) -> web.Response:
        last_s = arrival_s
        while True:
            batch = await channel.take()
            last_s = self._record(batch, arrival_s, last_s)
            if batch[-1].finished:
                break
        cached = batch[-1].cached_tokens
        if req.kind == "generate":
            body = _generate_body(req, rid, req.output_tokens, cached)
        else:
            body = _OpenAIFormatter(req).full(cached)
        self.stats.completed_total += 1
        return web.json_response(body, dumps=_dumps)

    async def _stream(
        self,
        request: web.Request,
        req: GenRequest,
        rid: str,
        channel: TokenChannel,
        arrival_s: float,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)  # headers leave now, before prefill
        fmt = _OpenAIFormatter(req)
        # Every chunk after the first is the same bytes: encode it once per response.
        first_chunk, next_chunk = _sse(fmt.token_chunk(0)), _sse(fmt.token_chunk(1))
        try:
            last_s, finished = arrival_s, False
            while not finished:
                batch = await channel.take()
                last_s = self._record(batch, arrival_s, last_s)
                out = bytearray()
                for e in batch:
                    if req.kind == "generate":
                        done = min(e.index + 1, req.output_tokens)
                        out += _sse(_generate_body(req, rid, done, e.cached_tokens))
                    else:
                        out += first_chunk if e.index == 0 else next_chunk
                    finished = e.finished
                if finished:
                    if req.kind != "generate":
                        out += _sse(fmt.final_chunk())
                        if req.include_usage:
                            out += _sse(fmt.usage_chunk(batch[-1].cached_tokens))
                    out += SSE_DONE
                await resp.write(bytes(out))
            await resp.write_eof()
        except ConnectionResetError:
            log.debug("%s: client went away during %s", self.cfg.name, request.path)
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

    def _load(self) -> dict[str, Any]:
        m = self.runner.model
        cap = self.cfg.profile.kv_capacity_tokens
        return {
            "num_running_reqs": m.num_running,
            "num_waiting_reqs": m.num_waiting,
            "num_used_tokens": m.used_tokens,
            "max_total_num_tokens": cap,
            "token_usage": round(m.used_tokens / cap, 6),
            "cache_hit_rate": round(m.cache_hit_rate, 6),
        }

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response({"loads": [{"dp_rank": 0, **self._load()}]})

    def timing(self) -> dict[str, Any]:
        """Emission lag against the model's schedule and CPU per token written."""
        lags = sorted(self.stats.lag_ms)

        def q(p: float) -> float | None:
            return round(lags[min(len(lags) - 1, int(p * len(lags)))], 4) if lags else None

        cpu_s = time.process_time() - self.started_cpu_s
        tokens = self.stats.tokens_written
        return {
            "tokens_written": tokens,
            "lag_ms_p50": q(0.50),
            "lag_ms_p95": q(0.95),
            "lag_ms_p99": q(0.99),
            "lag_ms_max": round(lags[-1], 4) if lags else None,
            "cpu_s": round(cpu_s, 4),
            "cpu_us_per_token": round(cpu_s / tokens * 1e6, 2) if tokens else None,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        p = self.cfg.profile
        return web.json_response(
            {
                "name": self.cfg.name,
                "model_path": self.cfg.model,
                "engine_profile": p.name,
                "tokenizer": self.cfg.tokenizer.name,
                "max_total_num_tokens": p.kv_capacity_tokens,
                "max_running_requests": p.max_running_requests,
                "chunked_prefill_size": p.chunk_tokens,
                "page_size": p.block_tokens,
                "faults": vars(self.cfg.faults),
                "load": self._load(),
                "timing": self.timing(),
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        freed = self.runner.model.flush_cache()
        return web.Response(text=f"Cache flushed ({freed} tokens freed).\n")

    async def set_faults(self, request: web.Request) -> web.Response:
        """POST /faults {"error_rate": .., "stall_rate": .., "stall_ms": ..}."""
        try:
            raw = await request.json()
        except ValueError:
            return error_response(400, "body must be a JSON object")
        if not isinstance(raw, dict):
            return error_response(400, "body must be a JSON object")
        known = set(vars(self.cfg.faults))
        unknown = sorted(set(raw) - known)
        if unknown:
            return error_response(400, f"unknown fault {unknown[0]!r} (known: {sorted(known)})")
        faults = replace(self.cfg.faults, **raw)
        try:
            faults.validate()
        except ValueError as e:
            return error_response(400, str(e))
        self.cfg.faults = faults
        return web.json_response(vars(faults))

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'model_name="{self.cfg.model}",engine_id="{self.cfg.name}"'
        load = self._load()
        lines = []
        for name, value in (
            ("sglang:num_running_reqs", load["num_running_reqs"]),
            ("sglang:num_queue_reqs", load["num_waiting_reqs"]),
            ("sglang:num_used_tokens", load["num_used_tokens"]),
            ("sglang:max_total_num_tokens", load["max_total_num_tokens"]),
            ("sglang:token_usage", load["token_usage"]),
            ("sglang:cache_hit_rate", load["cache_hit_rate"]),
        ):
            lines += [f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
        s = self.stats
        for name, value in (
            ("sglang:prompt_tokens_total", self.runner.model.stats.prompt_tokens),
            ("sglang:generation_tokens_total", s.tokens_written),
            ("sglang:num_requests_total", s.requests_total),
        ):
            lines += [f"# TYPE {name} counter", f"{name}{{{labels}}} {value}"]
        lines += s.ttft_s.prometheus("sglang:time_to_first_token_seconds", labels)
        lines += s.itl_s.prometheus("sglang:inter_token_latency_seconds", labels)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def stats_handler(self, request: web.Request) -> web.Response:
        s = self.stats
        return web.json_response(
            {
                "name": self.cfg.name,
                "requests_total": s.requests_total,
                "bad_requests_total": s.bad_requests_total,
                "injected_errors_total": s.injected_errors_total,
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
    app.on_startup.append(engine.on_startup)
    app.on_cleanup.append(engine.on_cleanup)
    app.router.add_post(CHAT_PATH, engine.chat)
    app.router.add_post(COMPLETIONS_PATH, engine.completions)
    app.router.add_post(GENERATE_PATH, engine.generate)
    app.router.add_get("/health", engine.health)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/v1/loads", engine.loads)
    app.router.add_get("/server_info", engine.server_info)
    app.router.add_get("/get_server_info", engine.server_info)
    app.router.add_post("/flush_cache", engine.flush_cache)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_post("/faults", engine.set_faults)
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
