"""Composition root: config -> router -> gRPC server + admin HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExporter

from ext_proc.admin import make_admin_app
from ext_proc.config import Config, split_host_port
from ext_proc.policy import make_policy
from ext_proc.probe import Prober
from ext_proc.router import Router, make_tuner
from ext_proc.server import ExtProcService, add_services, grpc_options
from ext_proc.telemetry import Telemetry

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


def build_router(cfg: Config) -> Router:
    rng = random.Random(cfg.seed)
    policy = make_policy(cfg.policy, rng, cfg)
    tuner = make_tuner(cfg, random.Random(rng.random()), policy)
    return Router(cfg, clock=time.monotonic, rng=rng, policy=policy, tuner=tuner)


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
    router: Router
    ext_proc: ExtProcService
    grpc_port: int
    admin_port: int
    telemetry: Telemetry


async def _expire_loop(router: Router, telemetry: Telemetry) -> None:
    while True:
        await asyncio.sleep(EXPIRE_INTERVAL_S)
        for c in router.expire():
            telemetry.completed(c)
            log.warning("request %s on %s: no completion seen, expired", c.request_id, c.backend)


@contextlib.asynccontextmanager
async def running_service(
    cfg: Config, exporter: SpanExporter | None = None
) -> AsyncIterator[Running]:
    """Start the ext_proc gRPC server and admin HTTP; stop them on exit."""
    router = build_router(cfg)
    telemetry = Telemetry(cfg.telemetry, router, exporter)
    server = grpc.aio.server(options=grpc_options(cfg.envoy.max_body_bytes))
    ext_proc = add_services(server, router, telemetry)
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
        lambda: {"active_ext_proc_streams": ext_proc.active_streams},
        cfg.listen.admin_token or os.environ.get("GORGO_ADMIN_TOKEN", ""),
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
    expirer = asyncio.create_task(_expire_loop(router, telemetry))
    prober = Prober(cfg, router)
    await prober.start()
    # Start-up objects never die: keep them out of the collector's scans, and collect the
    # young generation less often, so GC pauses do not land on requests' tails.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD)
    try:
        yield Running(router, ext_proc, grpc_port, bound_admin, telemetry)
    finally:
        expirer.cancel()
        await prober.stop()
        closed_before = _closed(router)
        log.info(
            "stopping: %d ext_proc streams open, %d requests in flight; draining for up to %.0f s",
            ext_proc.active_streams,
            len(router.state.in_flight),
            DRAIN_GRACE_S,
        )
        # New requests fail open to Envoy's fallback route; the access log stays open so
        # the requests already routed can report their completion.
        ext_proc.draining = True
        deadline = time.monotonic() + DRAIN_GRACE_S
        while router.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await server.stop(STOP_GRACE_S)
        log.info(
            "stopped: %d requests completed while draining, %d still in flight",
            _closed(router) - closed_before,
            len(router.state.in_flight),
        )
        await runner.cleanup()
        telemetry.shutdown()


def _closed(router: Router) -> int:
    return sum(b.completed + b.errors + b.failovers for b in router.state.backends.values())
