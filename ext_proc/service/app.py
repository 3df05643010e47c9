"""Composition root: config -> router -> gRPC server + admin HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExporter

from ext_proc.common.aio import cancel_and_wait
from ext_proc.common.files import write_atomic
from ext_proc.config.dump import changed_keys
from ext_proc.config.load import load_config
from ext_proc.config.schema import Config, ConfigError, TunerMode, split_host_port
from ext_proc.core.build import build_router, tuner_settings
from ext_proc.core.events import BackendChanged, Listener
from ext_proc.core.fleet import FleetConflict
from ext_proc.core.router import Router
from ext_proc.core.types import BackendChange, BackendLifecycle
from ext_proc.envoy.server import ExtProcService, add_services, grpc_options
from ext_proc.envoy.xds import wait_envoy, write_xds
from ext_proc.feeds.fleet_bus import FleetBus
from ext_proc.feeds.kv_client import KvEventClients
from ext_proc.feeds.probe import Prober
from ext_proc.learn.tuner import TunerSettings, TunerState, state_from_doc
from ext_proc.policy.catalog import policy_info
from ext_proc.prompt.engine_tokens import PromptTokenizer, load_engine_tokenizer
from ext_proc.service.admin import make_admin_app
from ext_proc.service.telemetry import Telemetry

log = logging.getLogger("gorgo")

# How often lost completions are looked for; cheap (stops at the first young record).
EXPIRE_INTERVAL_S = 5.0
# Objects allocated between young-generation collections (Python's default: 700). Each
# request allocates a few hundred; 20k keeps collections to about one per 50 requests.
GC_GEN0_THRESHOLD = 20_000
# SIGTERM: requests in flight get this long to complete (their completions recorded),
# then open streams get STOP_GRACE_S before they are cancelled.
DRAIN_GRACE_S = 5.0
STOP_GRACE_S = 0.5
# A backend added at run time is a candidate once Envoy can route to it (with
# envoy.xds_dir): Envoy applies a rewritten file within ~10-50 ms (measured here), so 5 s
# means it is not reading the files; the backend then stays pending, retried this often.
ENVOY_WAIT_S = 5.0
PENDING_RETRY_S = 5.0
# The config file is looked at this often (its size, mtime and inode; its hash only when
# they change): a change is applied within about a second, for one stat() a second.
RELOAD_POLL_S = 1.0


class TunerStateFile:
    """Persists the tuner's state (tuner.state_file): restored at start; each new state
    written atomically by one worker thread, in order, off the event loop."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuner-state")

    def load(self, settings: TunerSettings) -> TunerState | None:
        if not self.path.exists():
            return None
        try:
            state = state_from_doc(json.loads(self.path.read_text()), settings)
        except (ValueError, OSError) as e:
            log.error(
                "tuner state %s is corrupt (%s): starting from the configured weights",
                self.path,
                e,
            )
            return None
        if state is None:
            log.warning("tuner state %s is for another mode: starting from config", self.path)
        return state

    def save(self, doc: dict[str, Any]) -> None:
        self._writer.submit(write_atomic, self.path, json.dumps(doc))

    def close(self) -> None:
        self._writer.shutdown(wait=True)


def make_router(cfg: Config, state_file: TunerStateFile | None = None) -> Router:
    """The service's router: the shared factory on the monotonic clock, seeded by the
    config, with the tuner's state restored from and saved to its file."""
    info = policy_info(cfg.policy)
    restored = None
    if state_file is not None and info.weighted:
        restored = state_file.load(tuner_settings(cfg, info))
    sink = state_file.save if state_file is not None else None
    return build_router(cfg, time.monotonic, random.Random(cfg.seed), restored, sink)


def _read_pem(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"{key}: cannot read {path}: {e.strerror}") from e


def server_credentials(cfg: Config) -> grpc.ServerCredentials | None:
    """TLS for the gRPC port when listen.tls names a certificate (mTLS with a client CA)."""
    tls = cfg.listen.tls
    if not tls.cert_file:
        return None
    key = _read_pem(tls.key_file, "listen.tls.key_file")
    cert = _read_pem(tls.cert_file, "listen.tls.cert_file")
    client_ca = (
        _read_pem(tls.client_ca_file, "listen.tls.client_ca_file") if tls.client_ca_file else None
    )
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


class FleetShell(Listener):
    """The shell's side of a fleet change (`BackendChanged`): a removed backend's probes,
    metrics scrape and KV-event subscriber stop at once (cancelled before the router's
    next step, so none of them touches a backend that is gone); one worker task then, in
    order, awaits them, starts a new backend's tasks, and tells Envoy: `write_xds` with
    the pending, active and draining backends (once per burst of changes), and for a
    pending backend `wait_envoy` before the router may name it."""

    def __init__(
        self, router: Router, prober: Prober, kv_events: KvEventClients, ext_proc: ExtProcService
    ) -> None:
        self.router = router
        self.prober = prober
        self.kv_events = kv_events
        self.ext_proc = ext_proc
        # (the change, tasks to await); None: look at the pending backends again.
        self._queue: asyncio.Queue[tuple[BackendChanged | None, list[asyncio.Task[None]]]] = (
            asyncio.Queue()
        )
        self._worker: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None
        self.xds_writes = 0
        self.xds_error = ""

    def on_backend(self, e: BackendChanged) -> None:
        tasks: list[asyncio.Task[None]] = []
        if e.change == BackendChange.REMOVED or (e.change == BackendChange.UPDATED and e.reset):
            tasks = [*self.prober.cancel(e.backend), *self.kv_events.cancel(e.backend)]
        log.info(
            "backend %s %s (%s)%s",
            e.backend,
            e.change,
            e.reason,
            ": the router forgets what it knew of its engine" if e.reset else "",
        )
        self._queue.put_nowait((e, tasks))

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._worker is not None:
            await cancel_and_wait([self._worker])

    async def settle(self) -> None:
        """Until every change so far has been applied (and Envoy told)."""
        await self._queue.join()

    def snapshot(self) -> dict[str, Any]:
        return {
            "xds_writes": self.xds_writes,
            "xds_error": self.xds_error or None,
            "probed": self.prober.backends,
            "kv_event_subscribers": self.kv_events.backends,
        }

    async def _run(self) -> None:
        while True:
            e, tasks = await self._queue.get()
            try:
                try:
                    await cancel_and_wait(tasks)
                except Exception:  # a task that had crashed: its error is old news
                    log.exception("a stopped backend task had failed")
                if e is not None:
                    await self._apply(e)
                if self._queue.empty():
                    await self._tell_envoy()
            except Exception:  # never let one change stop the ones after it
                log.exception("applying a fleet change failed")
            finally:
                self._queue.task_done()

    async def _apply(self, e: BackendChanged) -> None:
        record = self.router.backends.get(e.backend)
        config = None if record is None else record.config
        starts = e.change == BackendChange.ADDED or (e.change == BackendChange.UPDATED and e.reset)
        if starts and config is not None:  # (not removed again meanwhile)
            await cancel_and_wait(
                [*self.prober.cancel(e.backend), *self.kv_events.cancel(e.backend)]
            )
            self.prober.add(config)
            self.kv_events.add(config)
        self.ext_proc.encoder.set_backends(self.router.cfg.backends)

    async def _tell_envoy(self) -> None:
        try:  # off the loop: the files grow with the fleet (snapshots: cfg, draining)
            await asyncio.to_thread(write_xds, self.router.cfg, self.router.draining)
            self.xds_writes += 1
            self.xds_error = ""
        except OSError as err:
            self.xds_error = f"envoy.xds_dir: {err}"
            log.error("cannot write Envoy's xDS files (%s): retrying", self.xds_error)
            self._retry_later()
            return
        pending = [b for b, st in self.router.backends.items() if st.lifecycle is _PENDING]
        if not pending:
            return
        missing = await wait_envoy(self.router.cfg, self.router.draining, ENVOY_WAIT_S)
        for b in pending:
            if b not in missing:
                self.router.activate_backend(b)
        still = [b for b in pending if b in missing and b in self.router.backends]
        if still:
            log.error(
                "Envoy shows no route to %s %.0f s after its xDS files were written: "
                "pending (no decisions) and retried every %.0f s",
                ", ".join(still),
                ENVOY_WAIT_S,
                PENDING_RETRY_S,
            )
            self._retry_later()

    def _retry_later(self) -> None:
        if self._retry is None or self._retry.cancelled() or self._retry.when() < time.monotonic():
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(PENDING_RETRY_S, self._queue.put_nowait, (None, []))


_PENDING = BackendLifecycle.PENDING


class ConfigReloader:
    """Reloads the config file on SIGHUP (`request`) and when it changes (`watch`: its
    stat about once a second, its hash when that moved). The whole file is loaded and
    validated by `load_config`; invalid, it is refused with the loader's message (naming
    the key), logged, shown in /state and counted, and the running config stays. Valid,
    the router's fleet becomes the file's (`Router.reconcile`), the keys read live are
    applied (`Router.apply_live_keys`), and a warning names any other key that changed:
    those need a restart."""

    def __init__(self, path: str | Path, router: Router, telemetry: Telemetry) -> None:
        self.path = Path(path)
        self.router = router
        self.telemetry = telemetry
        self._seen = self._stat()
        self._digest = self._hash()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[bool]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self.reloads = self.failures = 0
        self.last_trigger = ""
        self.last_ok_at_s: float | None = None
        self.last_error = ""
        self.last_error_at_s: float | None = None
        self.restart_required: list[str] = []

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _hash(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        await cancel_and_wait([t for t in (self._watcher,) if t is not None])
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def request(self, trigger: str = "SIGHUP") -> None:
        """Reload soon (from a signal handler: the reload runs as a task)."""
        task = asyncio.get_running_loop().create_task(self.reload(trigger))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_POLL_S)
            seen = self._stat()
            if seen == self._seen:
                continue
            self._seen = seen
            digest = self._hash()
            if digest is None or digest == self._digest:
                continue  # touched, or being replaced: nothing new to read yet
            await self.reload("file changed")

    async def reload(self, trigger: str) -> bool:
        """Load, validate and apply the file; False if it was refused."""
        async with self._lock:
            self._seen, self._digest = self._stat(), self._hash()
            self.last_trigger = trigger
            try:
                # Off the event loop: a configured tokenizer is loaded to validate it.
                new = await asyncio.to_thread(load_config, self.path)
                changes = self.router.reconcile(new.backends, "reload")
            except Exception as e:  # ConfigError names the key; anything else: still refused
                if not isinstance(e, ConfigError | FleetConflict):
                    log.exception("config reload (%s) failed", trigger)
                self.failures += 1
                self.last_error, self.last_error_at_s = str(e), time.time()
                self.telemetry.metrics.reloads.labels("error").inc()
                log.error("config reload (%s) refused, the running config stays: %s", trigger, e)
                return False
            live = self.router.apply_live_keys(new)
            self.restart_required = changed_keys(self.router.cfg, new)
            self.reloads += 1
            self.last_ok_at_s = time.time()
            self.telemetry.metrics.reloads.labels("ok").inc()
            log.info(
                "config reload (%s): backends added %s, back %s, updated %s, draining %s; "
                "applied live: %s",
                trigger,
                list(changes.added),
                list(changes.reactivated),
                list(changes.updated),
                list(changes.draining),
                live or "nothing else",
            )
            if self.restart_required:
                log.warning(
                    "config reload (%s): %s changed: restart to apply",
                    trigger,
                    ", ".join(self.restart_required),
                )
            return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "reloads": self.reloads,
            "failures": self.failures,
            "last_trigger": self.last_trigger or None,
            "last_ok_at_s": self.last_ok_at_s,
            # The last refusal (the loader's message, naming the key) and when (Unix s).
            "last_error": self.last_error or None,
            "last_error_at_s": self.last_error_at_s,
            # Keys the file changed that only a restart applies.
            "restart_required": self.restart_required,
        }


@dataclass
class Running:
    router: Router
    ext_proc: ExtProcService
    grpc_port: int
    admin_port: int
    telemetry: Telemetry
    fleet: FleetBus
    fleet_shell: FleetShell
    # None: started without a config file to reload.
    reloader: ConfigReloader | None = None


async def _expire_loop(router: Router) -> None:
    while True:
        await asyncio.sleep(EXPIRE_INTERVAL_S)
        for c in router.expire():
            log.warning("request %s on %s: no completion seen, expired", c.request_id, c.backend)


@contextlib.asynccontextmanager
async def running_service(
    cfg: Config, exporter: SpanExporter | None = None, config_path: str | Path | None = None
) -> AsyncIterator[Running]:
    """Start the ext_proc gRPC server and admin HTTP; stop them on exit. `config_path`:
    the file `cfg` came from, reloaded on SIGHUP (`Running.reloader.request`) and when it
    changes."""
    tuned = cfg.tuner.state_file and cfg.tuner.mode != TunerMode.OFF
    state_file = TunerStateFile(cfg.tuner.state_file) if tuned else None
    router = make_router(cfg, state_file)
    # New backends wait for Envoy to have their clusters (FleetShell) before decisions.
    router.confirm_new_backends = True
    try:  # Envoy's backend clusters, before anything can ask for them
        write_xds(router.cfg, router.draining)
    except OSError as e:
        raise OSError(f"envoy.xds_dir: cannot write {cfg.envoy.xds_dir}: {e}") from e
    telemetry = Telemetry(cfg.telemetry, router, exporter)
    router.subscribe(telemetry)
    engine_tokens = load_engine_tokenizer(cfg.tokenizer)
    tokens = PromptTokenizer(engine_tokens) if engine_tokens is not None else None
    fleet = FleetBus(cfg, router)
    server = grpc.aio.server(options=grpc_options(cfg.envoy.max_body_bytes))
    ext_proc = add_services(server, router, telemetry, tokens)
    prober = Prober(cfg, router)
    kv_events = KvEventClients(cfg, router)
    fleet_shell = FleetShell(router, prober, kv_events, ext_proc)
    router.subscribe(fleet_shell)
    reloader = ConfigReloader(config_path, router, telemetry) if config_path is not None else None
    host, port = split_host_port(cfg.listen.grpc, "listen.grpc")
    credentials = server_credentials(cfg)
    if credentials is None:
        grpc_port = server.add_insecure_port(f"{host}:{port}")
    else:
        grpc_port = server.add_secure_port(f"{host}:{port}", credentials)
    if port and grpc_port != port:
        raise OSError(f"listen.grpc: cannot bind {cfg.listen.grpc} (port in use?)")
    await server.start()

    admin_app = make_admin_app(
        router,
        telemetry,
        lambda: {
            "active_ext_proc_streams": ext_proc.active_streams,
            # How prompts are tokenized: the engine's tokenizer and its cache, or the
            # approximation (None).
            "tokenizer": tokens.snapshot() if tokens is not None else None,
            # The other routers' dispatches over NATS (None: a single router).
            "fleet": fleet.snapshot(),
            # The backends' shell tasks and Envoy's xDS files.
            "fleet_shell": fleet_shell.snapshot(),
            # Config reloads (None: no config file to reload).
            "reload": reloader.snapshot() if reloader is not None else None,
        },
        cfg.listen.admin_token or os.environ.get("GORGO_ADMIN_TOKEN", ""),
        fleet_shell.settle,
    )
    runner = web.AppRunner(admin_app, access_log=None)
    await runner.setup()
    admin_host, admin_port = split_host_port(cfg.listen.admin, "listen.admin")
    site = web.TCPSite(runner, admin_host, admin_port)
    try:
        await site.start()
    except OSError as e:
        await server.stop(None)
        await runner.cleanup()
        raise OSError(f"listen.admin: cannot bind {cfg.listen.admin}: {e.strerror}") from e
    bound_admin = int(runner.addresses[0][1])
    expirer = asyncio.create_task(_expire_loop(router))
    await prober.start()
    await kv_events.start()
    fleet_shell.start()
    await fleet.start()
    if reloader is not None:
        reloader.start()
    # Start-up objects never die: keep them out of the collector's scans, and collect the
    # young generation less often, so GC pauses do not land on requests' tails.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD)
    try:
        yield Running(
            router, ext_proc, grpc_port, bound_admin, telemetry, fleet, fleet_shell, reloader
        )
    finally:
        expirer.cancel()
        if reloader is not None:
            await reloader.stop()
        await fleet_shell.stop()
        await prober.stop()
        await kv_events.stop()
        await fleet.stop()
        closed_before = _closed(router)
        log.info(
            "stopping: %d ext_proc streams open, %d requests in flight; draining for up to %.0f s",
            ext_proc.active_streams,
            len(router.in_flight),
            DRAIN_GRACE_S,
        )
        # New requests fail open to Envoy's fallback route; the access log stays open so
        # the requests already routed can report their completion.
        ext_proc.draining = True
        deadline = time.monotonic() + DRAIN_GRACE_S
        while router.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await server.stop(STOP_GRACE_S)
        log.info(
            "stopped: %d requests completed while draining, %d still in flight",
            _closed(router) - closed_before,
            len(router.in_flight),
        )
        await runner.cleanup()
        telemetry.shutdown()
        if state_file is not None:
            state_file.close()


def _closed(router: Router) -> int:
    return sum(b.completed + b.errors + b.failovers for b in router.backends.values())
