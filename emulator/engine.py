"""The emulated SGLang engine's HTTP layer: the aiohttp routes of one backend, `Engine`,
`make_app`, `EngineServer` and `serve_engine`.

Three layers under it:
- `emulator.model.EngineModel`: pure scheduler (continuous batching, chunked prefill,
  radix prefix cache), shared with the offline simulator;
- `emulator.wire`: pure request parsing and response formatting (OpenAI and SGLang);
- `emulator.runner.ModelRunner`: one task advances the model on the event loop's clock and
  hands each emitted token to the request's handler here, which writes it.

The prefix cache holds prompt blocks only (not generated text).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from dataclasses import replace
from typing import Any

from aiohttp import web

from emulator.engine_config import EngineConfig
from emulator.model import EngineModel
from emulator.runner import EngineStats, ModelRunner, TokenChannel
from emulator.wire import (
    BadRequest,
    GenRequest,
    Kind,
    StreamEncoder,
    dumps,
    error_body,
    parse_request,
    response_body,
)

log = logging.getLogger(__name__)

ENGINE_ID_HEADER = "x-engine-id"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
# Long-context prompts (128k tokens ~ 512 KiB of text, more as JSON) exceed aiohttp's 1 MiB
# default body limit; a real engine accepts them.
MAX_BODY_BYTES = 64 * 1024 * 1024


def error_response(status: int, message: str) -> web.Response:
    """OpenAI-style error response."""
    return web.json_response(error_body(status, message), status=status)


class Engine:
    """HTTP shell around the model runner; one instance per emulated backend."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.runner = ModelRunner(EngineModel(cfg.profile, random.Random(cfg.seed)))
        self.stats = EngineStats()

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
            req = parse_request(kind, await request.read(), self.cfg)
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

    async def _respond_whole(
        self, req: GenRequest, rid: str, channel: TokenChannel, arrival_s: float
    ) -> web.Response:
        last_s = arrival_s
        while True:
            batch = await channel.take()
            last_s = self.stats.record(batch, arrival_s, last_s)
            if batch[-1].finished:
                break
        body = response_body(req, rid, batch[-1].cached_tokens)
        self.stats.completed_total += 1
        return web.json_response(body, dumps=dumps)

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
        encoder = StreamEncoder(req, rid)
        try:
            last_s, finished = arrival_s, False
            while not finished:
                batch = await channel.take()
                last_s = self.stats.record(batch, arrival_s, last_s)
                out, finished = encoder.encode(batch)
                await resp.write(out)
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
                "timing": self.stats.timing(),
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
