"""The emulated engine's HTTP layer: the aiohttp routes of one backend, `Engine`,
`make_app`, `EngineServer` and `serve_engine`. One flavor per engine it twins: `sglang`
(the default) or `vllm`; docs/engine-model.md lists every behaviour with the engine's
source file (or the measurement on the real vLLM) it comes from.

Three layers under it:
- `emulator.engine.model.scheduler.EngineModel`: pure scheduler (continuous batching, chunked
  prefill, radix prefix cache), shared with the offline simulator;
- `emulator.engine.parse` and `emulator.engine.wire`: pure request parsing and response
  formatting (OpenAI and SGLang);
- `emulator.engine.runner.ModelRunner`: one task advances the model on the event loop's
  clock and hands each emitted token to the request's handler here, which writes it.
Beside them, `emulator.engine.status` writes what the status endpoints answer (/v1/loads,
/get_load, /server_info, /kv_event_sources, /metrics, /stats) and
`emulator.engine.model_api` the model and tokenize endpoints' bodies.

The prefix cache holds prompt blocks only (not generated text).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web

from emulator.engine.config import SGLANG, VLLM, VLLM_VERSION, EngineConfig
from emulator.engine.disagg.prebuilt import DisaggRunner, PrebuiltModel
from emulator.engine.disagg.twin import DisaggTwin
from emulator.engine.kv_publisher import KvEventEmitter, KvEventPublisher
from emulator.engine.lora import LoraError, LoraInfoGauge
from emulator.engine.model.scheduler import EngineModel
from emulator.engine.model_api import (
    TOKENIZE_PATHS,
    load_lora,
    model_info_body,
    models_body,
    sglang_tokenize,
    unload_lora,
    vllm_tokenize,
)
from emulator.engine.parse import BadRequest, GenRequest, Kind, decode_json, parse_request
from emulator.engine.priority import priority_label
from emulator.engine.runner import EngineStats, ModelRunner, TokenChannel
from emulator.engine.status import (
    get_load_body,
    kv_event_sources_body,
    loads_body,
    metrics_text,
    server_info_body,
    stats_body,
)
from emulator.engine.wire import StreamEncoder, dumps, error_body, response_body

log = logging.getLogger(__name__)

ENGINE_ID_HEADER = "x-engine-id"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
# Long-context prompts (128k tokens ~ 512 KiB of text, more as JSON) exceed aiohttp's 1 MiB
# default body limit; a real engine accepts them.
MAX_BODY_BYTES = 64 * 1024 * 1024


# SGLang's /health generation must see output within this long (SGLANG_HEALTH_CHECK_TIMEOUT,
# python/sglang/srt/entrypoints/http_server.py), else 503.
HEALTH_CHECK_TIMEOUT_S = 20.0
# Bodies this long are parsed (tokenized) in a thread: ~8k tokens, ~10 ms of tokenizing;
# shorter ones cost less than the hop to a thread.
OFF_LOOP_BYTES = 32 * 1024
# One thread for them, as the engines' one tokenizer (SGLang's TokenizerManager): long
# prompts are tokenized in arrival order, and a conversation's turns meet the same prompt
# cache (emulator/engine/tokenizer.py keeps one per thread).
TOKENIZE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
T = TypeVar("T")

# vLLM reads a request's priority from this header before the body's field
# (entrypoints/generate/base/serving.py PRIORITY_HEADER, _get_priority: an integer
# header wins, anything else falls back to the body).
VLLM_PRIORITY_HEADER = "X-Vllm-Priority"


def with_priority_header(req: GenRequest, header: str | None) -> GenRequest:
    if header is None:
        return req
    try:
        return replace(req, priority=int(header))
    except ValueError:
        return req


class Engine:
    """HTTP shell around the model runner; one instance per emulated backend."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.publisher = KvEventPublisher(cfg.kv_events) if cfg.kv_events else None
        emitter = (
            KvEventEmitter(self.publisher, cfg.profile.block_tokens, cfg.flavor)
            if self.publisher
            else None
        )
        max_loras = cfg.max_loras if cfg.enable_lora else None
        # The twin schedules as the engine it stands in for (model.py: SCHEDULERS); a P/D
        # twin's model also takes KV in transit (emulator/engine/disagg/).
        model = (PrebuiltModel if cfg.disagg else EngineModel)(
            cfg.profile, random.Random(cfg.seed), max_loras, cfg.flavor, cfg.priority
        )
        self.runner = (DisaggRunner if cfg.disagg else ModelRunner)(model, emitter)
        self.disagg = DisaggTwin(self) if cfg.disagg else None
        # vLLM exports vllm:lora_requests_info only with a LoRA config (--enable-lora).
        self.lora_info = (
            LoraInfoGauge(cfg.max_loras or 1) if cfg.enable_lora and cfg.flavor == VLLM else None
        )
        self.stats = EngineStats()
        self.started_s = 0.0
        self._health_seq = 0

    def error_response(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: Kind = "chat",
        err_type: str | None = None,
    ) -> web.Response:
        """An error before any stream, in the flavor's shape."""
        body = error_body(self.cfg, status, message, param, kind, err_type)
        return web.json_response(body, status=status, dumps=dumps)

    # -- plumbing ---------------------------------------------------------------------

    async def add_engine_header(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[ENGINE_ID_HEADER] = self.cfg.name
        if request.method == "GET":
            # What routers ask of the engine (/stats `gets`): path and query, answered or not.
            self.stats.gets[request.path_qs] += 1

    async def on_startup(self, app: web.Application) -> None:
        self.started_s = asyncio.get_running_loop().time()
        self.runner.start()
        if self.publisher is not None:
            if self.cfg.flavor == SGLANG and self.runner.model.cache.events is not None:
                # SGLang's radix cache resets at construction, and the scheduler
                # publishes what the cache recorded with its first batch
                # (scheduler_metrics_mixin.py _publish_kv_events): seq 0 opens with
                # AllBlocksCleared, followed by the first request's blocks.
                self.runner.model.cache.events.append(("cleared",))
            if self.publisher.cfg.replay_endpoint:
                # Both engines' ZmqEventPublisher answers replays on a ROUTER socket.
                app[REPLAY_TASK] = asyncio.create_task(self._serve_replays())

    async def on_cleanup(self, app: web.Application) -> None:
        await self.runner.stop()
        task = app.get(REPLAY_TASK)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.publisher is not None:
            self.publisher.close()

    async def _serve_replays(self) -> None:
        assert self.publisher is not None
        while True:
            self.publisher.serve_replays()
            await asyncio.sleep(0.05)

    async def _serve(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        self.stats.requests_total += 1
        self.stats.requests_by_path[request.path] += 1
        try:
            raw = await request.read()
            self.stats.received(raw)
            req = await self._off_loop(lambda r, cfg: parse_request(kind, r, cfg), raw, raw)
        except BadRequest as exc:
            self.stats.bad_requests_total += 1
            return self.error_response(exc.status, exc.message, exc.param, kind, exc.err_type)
        if self.cfg.flavor == VLLM:
            req = with_priority_header(req, request.headers.get(VLLM_PRIORITY_HEADER))
        faults = self.cfg.faults
        if faults.error_rate and self.rng.random() < faults.error_rate:
            self.stats.injected_errors_total += 1
            return self.error_response(500, "Internal server error: injected fault", kind=kind)
        if faults.stall_rate and self.rng.random() < faults.stall_rate:
            await asyncio.sleep(faults.stall_ms / 1000)

        # SGLang's rid is a uuid4 hex; vLLM's ids carry 16 hex digits (chatcmpl-<16>,
        # tests/fixtures/vllm/sse-chat.txt).
        rid = secrets.token_hex(16 if self.cfg.flavor == SGLANG else 8)
        self.stats.requests_by_priority[priority_label(req.priority)] += 1
        if req.priority is not None:
            # what priority the request arrived with, in the engine's own log
            log.info("%s: request %s priority %d", self.cfg.name, rid, req.priority)
        self.stats.in_flight += 1
        self.stats.prompt_tokens += req.input_tokens
        arrival_s = asyncio.get_running_loop().time()
        # finally: a client that disconnects (handler cancelled, or a write that fails)
        # leaves the scheduler at once and is not counted in flight.
        try:
            if self.disagg is not None:  # a P/D transfer's request: the twin answers
                answer = await self.disagg.serve(request, req, raw, rid, arrival_s)
                if answer is not None:
                    return answer
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
        body = response_body(req, rid, batch[-1].cached_tokens, self.cfg)
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
        # Both engines answer with Starlette's StreamingResponse(media_type=
        # "text/event-stream"), which adds the charset and no cache header (the real
        # vLLM's headers: tests/fixtures/vllm/routes.json).
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        # vLLM's StreamingResponse sends its headers at once; SGLang runs the generator to
        # its first output before it answers (serving_chat.py), so they leave with the
        # first token.
        if self.cfg.flavor == VLLM:
            await resp.prepare(request)
        encoder = StreamEncoder(req, rid, self.cfg)
        faults = self.cfg.faults
        fail_after = (
            faults.stream_error_after
            if faults.stream_error_rate and self.rng.random() < faults.stream_error_rate
            else None
        )
        try:
            last_s, finished, written = arrival_s, False, 0
            while not finished:
                batch = await channel.take()
                if fail_after is not None and written + len(batch) > fail_after:
                    batch = batch[: fail_after - written]
                    out = encoder.encode(batch)[0] if batch else b""
                    self.stats.injected_errors_total += 1
                    if not resp.prepared:
                        await resp.prepare(request)
                    cached = batch[-1].cached_tokens if batch else 0
                    error = encoder.error_event(500, "injected fault: stream", fail_after, cached)
                    await resp.write(out + error)
                    await resp.write_eof()
                    return resp
                last_s = self.stats.record(batch, arrival_s, last_s)
                out, finished = encoder.encode(batch)
                written += len(batch)
                if not resp.prepared:
                    await resp.prepare(request)
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
        """SGLang (/health and /health_generate share one handler, http_server.py): 503
        while starting; then it submits a one-token generation and, every second (it
        sleeps first), checks whether the engine produced any output since it began: 200
        then, 503 after HEALTH_CHECK_TIMEOUT_S. So it takes at least a second, longer while
        a long prefill holds the engine. With SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=
        false, /health answers at once. vLLM: 200 while the engine process lives
        (serve/instrumentator/health.py)."""
        if self.cfg.flavor == VLLM:
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        if loop.time() - self.started_s < self.cfg.warmup_s:
            return web.Response(status=503)
        if request.path == "/health" and not self.cfg.health_generation:
            return web.Response(status=200)
        self._health_seq += 1
        rid = f"HEALTH_CHECK_{self._health_seq}"
        probe = GenRequest("generate", 1, 1, False, False, self.cfg.model)
        tic = loop.time()
        self.runner.submit(rid, probe)
        try:
            while loop.time() < tic + HEALTH_CHECK_TIMEOUT_S:
                await asyncio.sleep(self.cfg.health_poll_s)
                if self.runner.last_output_s > tic:
                    return web.Response(status=200)
            return web.Response(status=503)
        finally:
            self.runner.release(rid)

    async def ping(self, request: web.Request) -> web.Response:
        """SGLang's /ping answers 200 from the HTTP process; vLLM's is its /health."""
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        """Answered without the scheduler in both engines (a probe path that does no work)."""
        return web.json_response(models_body(self.cfg))

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM POST /v1/load_lora_adapter: 200 with a text body, else its ErrorResponse
        with its code (serve/lora/api_router.py). Mounted as vLLM mounts it with
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, which the twin takes as set whenever LoRA
        is enabled (EngineConfig.runtime_lora_updating)."""
        return await self._lora_change(request, load_lora)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM POST /v1/unload_lora_adapter, as load_lora_adapter."""
        return await self._lora_change(request, unload_lora)

    async def _lora_change(
        self, request: web.Request, change: Callable[[Any, EngineConfig], str]
    ) -> web.Response:
        try:
            text = change(decode_json(await request.read()), self.cfg)
        except BadRequest as exc:
            return self.error_response(exc.status, exc.message, exc.param, err_type=exc.err_type)
        except LoraError as exc:
            return self.error_response(exc.status, exc.message, err_type=exc.err_type)
        return web.Response(text=text)

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang /get_model_info (/model_info): from the HTTP process."""
        return web.json_response(model_info_body(self.cfg))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM POST /tokenize, SGLang POST /v1/tokenize and /tokenize
        (emulator/engine/model_api.py): answered by the API server's tokenizer, without the
        scheduler."""
        tokenize = vllm_tokenize if self.cfg.flavor == VLLM else sglang_tokenize
        try:
            body = await self._off_loop(tokenize, decode_json(raw := await request.read()), raw)
        except BadRequest as exc:
            return self.error_response(exc.status, exc.message, exc.param, err_type=exc.err_type)
        return web.json_response(body, dumps=dumps)

    async def _off_loop(self, fn: Callable[[Any, EngineConfig], T], arg: Any, raw: bytes) -> T:
        """fn(arg, cfg), in a thread when the body is long: tokenizing a long prompt takes
        ~1 ms per 2 KB here, and the engine's steps run on this loop (a real engine
        tokenizes in its API server while the scheduler runs on)."""
        if len(raw) < OFF_LOOP_BYTES:
            return fn(arg, self.cfg)
        return await asyncio.get_running_loop().run_in_executor(TOKENIZE_THREAD, fn, arg, self.cfg)

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang /v1/loads?include=...&dp_rank=... (entrypoints/v1_loads.py): a bad
        section is 400 {"detail"} (its HTTPException), a dp_rank that is not an integer
        422 (FastAPI's query validation)."""
        dp_rank: int | None = None
        raw_rank = request.query.get("dp_rank")
        if raw_rank is not None:
            try:
                dp_rank = int(raw_rank)
            except ValueError:
                detail = [{"type": "int_parsing", "loc": ["query", "dp_rank"], "input": raw_rank}]
                return web.json_response({"detail": detail}, status=422)
        try:
            body = loads_body(self.cfg, self.runner.model, request.query.get("include"), dp_rank)
        except ValueError as e:
            return web.json_response({"detail": str(e)}, status=400)
        return web.json_response(body)

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang /get_load: per DP rank, requests and tokens."""
        return web.json_response(get_load_body(self.cfg, self.runner.model))

    async def vllm_load(self, request: web.Request) -> web.Response:
        """vLLM /load: {"server_load": requests in flight} (serve/instrumentator/basic.py)."""
        return web.json_response({"server_load": self.stats.in_flight})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM /kv_event_sources (emulator/engine/status.py)."""
        return web.json_response(kv_event_sources_body(self.cfg))

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang /server_info and /get_server_info (emulator/engine/status.py); on the vLLM
        twin /server_info is the emulator's own (vLLM serves none outside dev mode)."""
        return web.json_response(server_info_body(self.cfg, self.runner.model, self.stats))

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang /flush_cache: refused (400) while requests run, as the scheduler does;
        vLLM's dev-mode /reset_prefix_cache answers {"success": true}
        (tests/fixtures/vllm/timings-reset.json). The KV events of the reset are not
        published now: both engines publish cache events with their next scheduled step
        (the real vLLM sends AllBlocksCleared in one message with the next BlockStored,
        kv_events-reset.jsonl)."""
        m = self.runner.model
        if self.cfg.flavor == SGLANG and (m.num_running or m.num_waiting):
            return web.Response(status=400, text=FLUSH_TEXT)
        freed = m.flush_cache()
        if self.cfg.flavor == VLLM:
            return web.json_response({"success": True})
        return web.Response(text=f"{FLUSH_TEXT}({freed} tokens freed.)\n")

    async def set_faults(self, request: web.Request) -> web.Response:
        """POST /faults {"error_rate": .., "stall_rate": .., "stall_ms": .., ...}."""
        try:
            raw = await request.json()
        except ValueError:
            return self.error_response(400, "body must be a JSON object")
        if not isinstance(raw, dict):
            return self.error_response(400, "body must be a JSON object")
        known = set(vars(self.cfg.faults))
        unknown = sorted(set(raw) - known)
        if unknown:
            return self.error_response(
                400, f"unknown fault {unknown[0]!r} (known: {sorted(known)})"
            )
        faults = replace(self.cfg.faults, **raw)
        try:
            faults.validate()
        except ValueError as e:
            return self.error_response(400, str(e))
        self.cfg.faults = faults
        if self.publisher is not None:
            self.publisher.set_down(faults.kv_events_down)
        return web.json_response(vars(faults))

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text in each engine's names and labels (emulator/engine/status.py)."""
        if self.cfg.flavor == SGLANG and not self.cfg.enable_metrics:
            raise web.HTTPNotFound()  # SGLang mounts /metrics only with --enable-metrics
        text = metrics_text(self.cfg, self.runner.model, self.stats, self.lora_info)
        return web.Response(text=text, content_type="text/plain")

    async def stats_handler(self, request: web.Request) -> web.Response:
        return web.json_response(stats_body(self.cfg, self.stats, self.runner.model))


FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
REPLAY_TASK: web.AppKey[asyncio.Task[None]] = web.AppKey("gorgo_kv_replay", asyncio.Task)


ENGINE_KEY: web.AppKey[Engine] = web.AppKey("gorgo_engine", Engine)


def make_app(cfg: EngineConfig) -> web.Application:
    """The engine's aiohttp application; `app[ENGINE_KEY]` is its Engine (stats, config)."""
    engine = Engine(cfg)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app.on_response_prepare.append(engine.add_engine_header)
    app.on_startup.append(engine.on_startup)
    app.on_cleanup.append(engine.on_cleanup)
    if engine.disagg is not None:
        app.on_startup.append(engine.disagg.on_startup)
        app.on_shutdown.append(engine.disagg.on_shutdown)
    app.router.add_post(CHAT_PATH, engine.chat)
    app.router.add_post(COMPLETIONS_PATH, engine.completions)
    app.router.add_get("/health", engine.health)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/server_info", engine.server_info)
    for path in TOKENIZE_PATHS[cfg.flavor]:
        app.router.add_post(path, engine.tokenize)
    if cfg.flavor == SGLANG:
        app.router.add_post(GENERATE_PATH, engine.generate)
        app.router.add_get("/health_generate", engine.health)
        app.router.add_get("/ping", engine.ping)
        app.router.add_get("/get_model_info", engine.model_info)
        app.router.add_get("/model_info", engine.model_info)
        app.router.add_get("/v1/loads", engine.loads)
        app.router.add_get("/get_load", engine.get_load)
        app.router.add_get("/get_server_info", engine.server_info)
        app.router.add_route("*", "/flush_cache", engine.flush_cache)
    else:
        app.router.add_get("/ping", engine.health)
        app.router.add_get("/load", engine.vllm_load)
        app.router.add_get("/version", engine.version)
        app.router.add_get("/kv_event_sources", engine.kv_event_sources)
        app.router.add_post("/reset_prefix_cache", engine.flush_cache)
        if cfg.runtime_lora_updating:
            app.router.add_post("/v1/load_lora_adapter", engine.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", engine.unload_lora_adapter)
    # The emulator's own: fault injection and counters (no engine has them).
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
