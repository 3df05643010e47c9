"""The answers of P/D requests: a normal body or stream once the tokens come (a `gate`
may hold the last token until the KV has left, as SGLang's prefill answers only once its
transfer succeeded), or the engine's error when the transfer failed.

An error before any token (SGLang, disaggregation/decode.py and prefill.py: prepare_abort
with a status, then stream_output): a body request gets the error with that status
(tokenizer_manager.py raises an HTTPException for 500s, a ValueError for 400s; the OpenAI
routes answer them with their ErrorResponse, serving_base.py handle_request: type "500"
for the former); a stream gets HTTP 200 and the error as its first event, then [DONE]
(wire.py StreamEncoder.error_event). vLLM (entrypoints/openai/engine/serving.py
GenerationError: a request finished with finish_reason "error", as a failed KV load does
under kv_load_failure_policy fail): 500 "Internal server error" for a body, the same as
an error event in a stream, whose headers vLLM sent at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from emulator.engine.config import VLLM, EngineConfig
from emulator.engine.disagg.config import DisaggConfig
from emulator.engine.disagg.held import HeldKv
from emulator.engine.disagg.prebuilt import DisaggRunner, PrebuiltModel
from emulator.engine.model.queues import Emission
from emulator.engine.parse import GenRequest, Kind
from emulator.engine.runner import EngineStats, ModelRunner, TokenChannel
from emulator.engine.wire import StreamEncoder, dumps, response_body

log = logging.getLogger(__name__)

# Both engines' streams (server.py: Starlette's StreamingResponse adds the charset).
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}


class EngineParts(Protocol):
    """What the P/D paths use of the engine (emulator/engine/server.py Engine)."""

    cfg: EngineConfig
    stats: EngineStats
    runner: ModelRunner

    def error_response(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: Kind = "chat",
        err_type: str | None = None,
    ) -> web.Response: ...


class TwinParts(Protocol):
    """What the protocols use of the twin (emulator/engine/disagg/twin.py DisaggTwin)."""

    engine: EngineParts
    disagg: DisaggConfig
    model: PrebuiltModel
    runner: DisaggRunner
    held: HeldKv

    @property
    def session(self) -> aiohttp.ClientSession: ...

    async def preallocate(self, rid: str, tokens: int) -> None: ...


class TransferFailed(Exception):
    """A P/D request ends in the engine's error: `status`, `message`, and the error type
    its body names (None: the flavor's default for the status)."""

    def __init__(self, status: int, message: str, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


Gate = Callable[[Emission], Awaitable[None]]


def open_stream(engine: EngineParts) -> web.StreamResponse:
    return web.StreamResponse(headers=SSE_HEADERS)


async def fail(
    engine: EngineParts,
    request: web.Request,
    req: GenRequest,
    rid: str,
    exc: TransferFailed,
    resp: web.StreamResponse | None = None,
) -> web.StreamResponse:
    """The engine's error for a request that produced no token (module docstring)."""
    log.warning("%s: request %s failed: %s", engine.cfg.name, rid, exc.message)
    if not req.stream:
        return engine.error_response(exc.status, exc.message, kind=req.kind, err_type=exc.err_type)
    resp = resp or open_stream(engine)
    if not resp.prepared:
        await resp.prepare(request)
    encoder = StreamEncoder(req, rid, engine.cfg)
    await resp.write(encoder.error_event(exc.status, exc.message))
    await resp.write_eof()
    return resp


async def answer(
    engine: EngineParts,
    request: web.Request,
    req: GenRequest,
    rid: str,
    channel: TokenChannel,
    arrival_s: float,
    *,
    gate: Gate | None = None,
    patch: Callable[[dict[str, Any]], None] | None = None,
    resp: web.StreamResponse | None = None,
) -> web.StreamResponse:
    """The request's tokens as a body (`patch` may add to it) or a stream (`resp`: one
    already open). `gate` is awaited before the last token is written; a TransferFailed
    from it becomes the engine's error."""
    if not req.stream:
        return await _whole(engine, req, rid, channel, arrival_s, gate, patch)
    resp = resp or open_stream(engine)
    if engine.cfg.flavor == VLLM and not resp.prepared:
        await resp.prepare(request)  # vLLM's StreamingResponse sends its headers at once
    encoder = StreamEncoder(req, rid, engine.cfg)
    last_s, finished, written = arrival_s, False, 0
    try:
        while not finished:
            batch = await channel.take()
            if gate is not None and batch[-1].finished:
                await gate(batch[-1])
            last_s = engine.stats.record(batch, arrival_s, last_s)
            out, finished = encoder.encode(batch)
            written += len(batch)
            if not resp.prepared:
                await resp.prepare(request)
            await resp.write(out)
        await resp.write_eof()
    except TransferFailed as exc:
        log.warning("%s: request %s failed: %s", engine.cfg.name, rid, exc.message)
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write(encoder.error_event(exc.status, exc.message, written))
        await resp.write_eof()
        return resp
    except ConnectionResetError:
        log.debug("%s: client went away during %s", engine.cfg.name, request.path)
        return resp
    engine.stats.completed_total += 1
    return resp


async def _whole(
    engine: EngineParts,
    req: GenRequest,
    rid: str,
    channel: TokenChannel,
    arrival_s: float,
    gate: Gate | None,
    patch: Callable[[dict[str, Any]], None] | None,
) -> web.Response:
    last_s = arrival_s
    while True:
        batch = await channel.take()
        if gate is not None and batch[-1].finished:
            try:
                await gate(batch[-1])
            except TransferFailed as exc:
                log.warning("%s: request %s failed: %s", engine.cfg.name, rid, exc.message)
                return engine.error_response(
                    exc.status, exc.message, kind=req.kind, err_type=exc.err_type
                )
        last_s = engine.stats.record(batch, arrival_s, last_s)
        if batch[-1].finished:
            break
    body = response_body(req, rid, batch[-1].cached_tokens, engine.cfg)
    if patch is not None:
        patch(body)
    engine.stats.completed_total += 1
    return web.json_response(body, dumps=dumps)
