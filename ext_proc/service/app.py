"""Composition root: config -> router -> gRPC server + admin HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExporter

from ext_proc.config.schema import Config, TunerMode
from ext_proc.core.build import build_router, tuner_settings
from ext_proc.core.router import Router
from ext_proc.envoy.server import ExtProcService, add_services, grpc_options
from ext_proc.envoy_config.xds import write_xds
from ext_proc.policy.catalog import policy_info
from ext_proc.prompt.engine_tokens import PromptTokenizer, load_engine_tokenizer
from ext_proc.service.admin.api import make_admin_app
from ext_proc.service.collector import Collector
from ext_proc.service.engine_tokenizer import EngineTokenizers
from ext_proc.service.fleet_shell import FleetShell
from ext_proc.service.health import (
    HealthService,
    Readiness,
    add_health_service,
    router_readiness,
)
from ext_proc.service.last_good import ConfigSource
from ext_proc.service.loops.catalog import FEEDS
from ext_proc.service.loops.fleet_bus import FleetBus
from ext_proc.service.loops.kv_client import KvEventClients
from ext_proc.service.loops.leader import LeaderLease
from ext_proc.service.loops.pool_watch import PoolWatch
from ext_proc.service.loops.probe import Prober
from ext_proc.service.reloader import ConfigReloader
from ext_proc.service.telemetry.gauges import BusGauges, FlowGauges
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.service.tuner_file import TunerStateFile
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.params import split_host_port

log = logging.getLogger("gorgo")

# How often requests are checked against their deadlines: a first byte missed makes its
# backend suspect within this, a lost completion closes them.
EXPIRE_INTERVAL_S = 0.5
# Objects allocated between young-generation collections (Python's default: 700). A
# request leaves some 45 tracked objects behind it until a collection (measured in the
# soak): 20k is one collection per ~450 requests; service/collector.py bounds the rest.
GC_GEN0_THRESHOLD = 20_000
# SIGTERM: requests in flight get this long to complete (their completions recorded),
# then open streams get STOP_GRACE_S before they are cancelled.
DRAIN_GRACE_S = 5.0
STOP_GRACE_S = 0.5


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


@dataclass
class Running:
    """What `running_service` started, for the CLI and tests while it runs: the router, the
    gRPC service and the ports bound (a port 0 in the config becomes the real one),
    telemetry, the fleet bus and shell, and the config reloader."""

    router: Router
    ext_proc: ExtProcService
    grpc_port: int
    admin_port: int
    telemetry: Telemetry
    fleet: FleetBus
    fleet_shell: FleetShell
    # None: started without a config file to reload.
    reloader: ConfigReloader | None = None
    # The gRPC health service on the gRPC port (attach it to another server with `attach`).
    health: HealthService | None = None


async def _expire_loop(router: Router, prober: Prober) -> None:
    while True:
        await asyncio.sleep(EXPIRE_INTERVAL_S)
        for backend in router.inputs.late_backends():  # a late first byte: is the link still there?
            prober.poke(backend)
        for c in router.expire():
            log.warning("request %s on %s: no completion seen, expired", c.request_id, c.backend)


@contextlib.asynccontextmanager
async def running_service(
    cfg: Config,
    exporter: SpanExporter | None = None,
    config_path: str | Path | None = None,
    source: ConfigSource | None = None,
    grpc_credentials: grpc.ServerCredentials | None = None,
) -> AsyncIterator[Running]:
    """Start the ext_proc gRPC server and admin HTTP; stop them on exit. `config_path`:
    the file `cfg` came from, reloaded on SIGHUP (`Running.reloader.request`) and when it
    changes; `source`: where `cfg` came from (that file, or its last good copy) and where
    an accepted reload keeps its copy (service/last_good.py); `grpc_credentials`: TLS for
    the gRPC port made elsewhere (gorgo epp's), instead of listen.tls. Each piece registers its own
    stop as it starts (an AsyncExitStack), so the teardown is the start-up in reverse,
    whatever step failed."""
    async with contextlib.AsyncExitStack() as stack:
        tuned = cfg.tuner.state_file and cfg.tuner.mode != TunerMode.OFF
        state_file = TunerStateFile(cfg.tuner.state_file) if tuned else None
        if state_file is not None:
            stack.callback(state_file.close)
        router = make_router(cfg, state_file)
        # New backends wait for Envoy to have their clusters (FleetShell) before decisions.
        router.fleet.confirm_new_backends = True
        try:  # Envoy's backend clusters, before anything can ask for them
            write_xds(router.cfg, router.fleet.draining)
        except OSError as e:
            raise OSError(f"envoy.xds_dir: cannot write {cfg.envoy.xds_dir}: {e}") from e
        telemetry = Telemetry(cfg.telemetry, router, exporter)
        stack.callback(telemetry.shutdown)
        router.subscribe(telemetry)
        engine_tokens = load_engine_tokenizer(cfg.tokenizer)
        tokens = PromptTokenizer(engine_tokens) if engine_tokens is not None else None
        fleet = FleetBus(cfg, router)
        server = grpc.aio.server(options=grpc_options(cfg.envoy.max_body_bytes))
        ext_proc, access_log = add_services(
            server, router, telemetry.fallback, tokens, fleet.forward
        )
        fleet.on_forwarded = access_log.apply_forwarded
        # flow control with several routers: the bus confirms our releases, brings the
        # peers' claims and events, and carries ours (ext_proc/flow/shared.py)
        holding = ext_proc.holding
        fleet.on_confirmed = holding.confirm
        fleet.on_peer = holding.hear
        holding.tell = fleet.tell_claims
        # Backends from Kubernetes (an InferencePool's pods), with the configured ones.
        discovery = PoolWatch(cfg, router) if cfg.discovery.enabled else None
        discovered: Callable[[], Sequence[Backend]] = (
            discovery.discovered if discovery is not None else tuple
        )

        # Active-passive replicas: only the Lease's holder is ready (loops/leader.py).
        leader = LeaderLease(cfg)

        def ready() -> Readiness:
            if discovery is not None and not discovery.synced:  # its backends not known yet
                why = discovery.error or "listing the pods"
                return Readiness(False, f"kubernetes discovery has not listed the pods: {why}")
            if not leader.leading:
                return Readiness(
                    False, f"a standby replica: another holds {leader.snapshot()['lease']}"
                )
            return router_readiness(router, ext_proc.draining)

        # grpc.health.v1 on the same port: SERVING while the router can route
        health = add_health_service(server, ready)
        router.subscribe(health)
        leader.on_change = health.poke
        telemetry.metrics.registry.register(FlowGauges(ext_proc.director))
        telemetry.metrics.registry.register(BusGauges(fleet.snapshot))
        # The engine's tokenizer, found when none is configured, and checked against the
        # engines: until then a backend with KV events stays approximate.
        tokenizers = EngineTokenizers(cfg, router, ext_proc)
        prober = Prober(cfg, router)
        kv_events = KvEventClients(cfg, router)
        # Feeds registered beyond the built-in loops (service/loops/catalog.py).
        extra_feeds = [make(cfg, router) for make in FEEDS.values()]
        fleet_shell = FleetShell(router, [prober, kv_events, fleet, *extra_feeds], ext_proc)
        router.subscribe(fleet_shell)
        if config_path and source is None:
            source = ConfigSource(str(config_path))
        reloader = (
            ConfigReloader(config_path, router, telemetry, source, discovered)
            if config_path
            else None
        )
        host, port = split_host_port(cfg.listen.grpc, "listen.grpc")
        credentials = grpc_credentials or server_credentials(cfg)
        if credentials is None:
            grpc_port = server.add_insecure_port(f"{host}:{port}")
        else:
            grpc_port = server.add_secure_port(f"{host}:{port}", credentials)
        if port and grpc_port != port:
            raise OSError(f"listen.grpc: cannot bind {cfg.listen.grpc} (port in use?)")
        await server.start()
        stack.push_async_callback(server.stop, STOP_GRACE_S)
        await health.start()
        stack.push_async_callback(health.stop)
        # Before the admin answers /healthz: the probes' start reads what each engine
        # serves (a request routed before would go to any backend, whatever its model).
        await prober.start()
        stack.push_async_callback(prober.stop)

        admin_app = make_admin_app(
            router,
            telemetry,
            lambda: {
                "active_ext_proc_streams": ext_proc.active_streams,
                # The gateway queue (flow control): what waits, what it did.
                "flow": ext_proc.director.admission.snapshot(),
                # How prompts are tokenized: the engine's tokenizer and its cache, or the
                # approximation (None); where it came from and its checks.
                "tokenizer": ext_proc.tokens.snapshot() if ext_proc.tokens else None,
                "tokenizer_checks": tokenizers.snapshot(),
                # Per backend with KV events: its subscribers' ranks up, errors, restarts.
                "kv_event_subscribers": {b: kv_events.snapshot(b) for b in kv_events.backends},
                # The other routers' dispatches over NATS (None: a single router).
                "fleet": fleet.snapshot(),
                # The backends' shell tasks and Envoy's xDS files.
                "fleet_shell": fleet_shell.snapshot(),
                # The pods found in Kubernetes (None: no discovery).
                "discovery": discovery.snapshot() if discovery is not None else None,
                # Active-passive replicas: the Lease and whether this one holds it.
                "leader_election": leader.snapshot() if leader.le.enabled else None,
                # Config reloads (None: no config file to reload).
                "reload": reloader.snapshot() if reloader is not None else None,
                # Where the running config came from: its file, or the last good copy
                # when the file did not load at start (with the file's error).
                "config": source.snapshot() if source is not None else None,
            },
            cfg.listen.admin_token or os.environ.get("GORGO_ADMIN_TOKEN", ""),
            fleet_shell.settle,
            cfg.listen.admin,
            cfg.listen.admin_hosts,
            ext_proc.director.admission.snapshot,
            ready,
        )
        runner = web.AppRunner(admin_app, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        admin_host, admin_port = split_host_port(cfg.listen.admin, "listen.admin")
        site = web.TCPSite(runner, admin_host, admin_port)
        try:
            await site.start()
        except OSError as e:
            raise OSError(f"listen.admin: cannot bind {cfg.listen.admin}: {e.strerror}") from e
        bound_admin = int(runner.addresses[0][1])
        # Stopping: the routed requests drain while the admin API still answers; then
        # the prefill legs the router sent itself end.
        stack.push_async_callback(ext_proc.prefill_legs.close)
        stack.push_async_callback(_drain, router, ext_proc, health)
        for part in (tokenizers, kv_events):
            await part.start()
            stack.push_async_callback(part.stop)
        fleet_shell.start()
        stack.push_async_callback(fleet_shell.stop)
        if discovery is not None:
            await discovery.start()
            stack.push_async_callback(discovery.stop)
        await leader.start()
        stack.push_async_callback(leader.stop)
        for feed in (fleet, *extra_feeds):
            await feed.start()
            stack.push_async_callback(feed.stop)
        if reloader is not None:
            reloader.start()
            stack.push_async_callback(reloader.stop)
        expirer = asyncio.create_task(_expire_loop(router, prober))
        stack.callback(expirer.cancel)
        # Start-up objects never die: keep them out of the collector's scans, and collect
        # the young generation less often, so GC pauses do not land on requests' tails;
        # and a full pass on a clock, so the streams' cycles do not hold their native
        # memory for hours (service/collector.py).
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_GEN0_THRESHOLD)
        collector = asyncio.create_task(Collector().run())
        stack.callback(collector.cancel)
        yield Running(
            router,
            ext_proc,
            grpc_port,
            bound_admin,
            telemetry,
            fleet,
            fleet_shell,
            reloader,
            health,
        )


async def _drain(router: Router, ext_proc: ExtProcService, health: HealthService) -> None:
    """New requests fail open to Envoy's fallback route (and readiness says NOT_SERVING);
    the access log stays open so the requests already routed can report their completion,
    for up to DRAIN_GRACE_S."""
    closed_before = _closed(router)
    log.info(
        "stopping: %d ext_proc streams open, %d requests in flight; draining for up to %.0f s",
        ext_proc.active_streams,
        len(router.in_flight),
        DRAIN_GRACE_S,
    )
    ext_proc.draining = True
    await health.refresh()
    deadline = time.monotonic() + DRAIN_GRACE_S
    while router.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.info(
        "stopped: %d requests completed while draining, %d still in flight",
        _closed(router) - closed_before,
        len(router.in_flight),
    )


def _closed(router: Router) -> int:
    return sum(
        b.stats.completed + b.stats.errors + b.stats.failovers for b in router.backends.values()
    )
