"""Admin HTTP on loopback: /healthz (alive), /readyz (can route), /state, POST /tuner, the
fleet (GET/POST /backends, POST /backends/{id}/drain, DELETE /backends/{id}), the
operator's page (/ui) and its OpenAPI document (/openapi.json, openapi.py); who may
use it is guard.py's."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ext_proc.config.load import backend_from_dict
from ext_proc.core.fleet import FleetConflict, UnknownBackend
from ext_proc.core.router import Router
from ext_proc.service.admin.guard import AdminGuard, Peer
from ext_proc.service.admin.openapi import admin_openapi
from ext_proc.service.admin.operator_page import add_page_routes
from ext_proc.service.health import Readiness, router_readiness
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.vocab.params import ConfigError
from ext_proc.vocab.types import Weights

TUNER_ACTIONS = ("freeze", "unfreeze", "set")
# POST /backends answers once the new backend is a candidate (Envoy has its cluster:
# ~10-50 ms with envoy.xds_dir), or after this long with it still pending.
SETTLE_S = 6.0


def _peer(request: web.Request) -> Peer:
    """The client's IP (None for a Unix socket) and the local address it reached."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return Peer(request.remote, str(sockname[0]), int(sockname[1]))
    return Peer(request.remote)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _weights_ok(w: Any) -> bool:
    """{"rtt": x, "queue": y}, both finite numbers > 0 (JSON's NaN and Infinity, which
    Python's parser takes, are not weights)."""
    return (
        isinstance(w, dict)
        and set(w) == {"rtt", "queue"}
        and all(
            isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf
            for v in w.values()
        )
    )


# The largest request body the admin reads (aiohttp's default): a backend or a tuner
# change is a few hundred bytes.
MAX_BODY_BYTES = 1024**2


def _unrouted(request: web.Request, e: web.HTTPException) -> web.Response:
    """aiohttp's 404 or 405 (with its Allow header) as the admin's JSON error."""
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        response = _error(405, f"{request.method} is not served on {request.path}: {allowed}")
        response.headers["Allow"] = e.headers["Allow"]
        return response
    if e.status == 404:
        return _error(
            404, f"no {request.path} on the admin port (GET /openapi.json lists its paths)"
        )
    return _error(e.status, e.reason)


def make_admin_app(
    router: Router,
    telemetry: Telemetry,
    extra_state: Callable[[], dict[str, Any]],
    token: str = "",
    settle: Callable[[], Awaitable[None]] | None = None,
    listen: str = "127.0.0.1:0",
    hosts: tuple[str, ...] = (),
    flow: Callable[[], dict[str, Any]] | None = None,
    readiness: Callable[[], Readiness] | None = None,
) -> web.Application:
    """`settle`: waits until the shell has applied the fleet's changes (FleetShell);
    `listen`, `hosts`, `token`: listen.admin, listen.admin_hosts and the admin token, which
    decide who may use it (guard.py); `flow`: the gateway queue's snapshot, for the
    operator's page; `readiness`: whether the router can route (/readyz; None: the
    router's backends alone)."""
    ready = readiness if readiness is not None else (lambda: router_readiness(router))

    guard = AdminGuard(listen, token, hosts)

    @web.middleware
    async def guarded(request: web.Request, handler: Any) -> web.StreamResponse:
        # guard.py: the Host on every request; a token, or JSON with no foreign
        # Origin from loopback, on every change. A path or method the admin does not
        # serve changes nothing: once the Host is this admin's, it is answered 404, or
        # 405 with Allow, whatever the token (as the document at /openapi.json says).
        peer = _peer(request)
        unrouted = request.match_info.http_exception
        if unrouted is not None and guard.refuse_host(request.path, request.headers, peer) is None:
            return _unrouted(request, unrouted)
        refusal = guard.refuse(request.method, request.path, request.headers, peer)
        if refusal is not None:
            return _error(*refusal)
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPRequestEntityTooLarge as e:  # a body over client_max_size
            return _error(413, f"body too large: {e.text}")
        return response

    async def healthz(_: web.Request) -> web.Response:
        """Liveness: the process answers."""
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        """Readiness: 200 while the router can route, else 503; the reason either way."""
        now = ready()
        return web.json_response(
            {"ready": now.ready, "reason": now.reason}, status=200 if now.ready else 503
        )

    async def state(_: web.Request) -> web.Response:
        return web.json_response({**router.snapshot(), **extra_state()})

    async def tuner(request: web.Request) -> web.Response:
        """{"action": "freeze"|"unfreeze"} or {"action": "set", "weights": {"rtt", "queue"}};
        any other key is refused (a freeze sent with weights sets none: say so)."""
        t = router.tuner
        if t is None:
            return _error(409, f"no tuner: policy {router.policy.name!r} or tuner.mode off")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body must be a JSON object")
        action = body.get("action") if isinstance(body, dict) else None
        if action not in TUNER_ACTIONS:
            return _error(400, f"action: expected one of {', '.join(TUNER_ACTIONS)}")
        allowed = {"action", "weights"} if action == "set" else {"action"}
        if extra := sorted(set(body) - allowed):
            return _error(400, f"{', '.join(extra)}: not a key of action {action!r}")
        if action == "freeze":
            t.freeze()
        elif action == "unfreeze":
            t.unfreeze()
        else:
            w = body.get("weights")
            if not _weights_ok(w):
                return _error(400, 'weights: expected {"rtt": number > 0, "queue": number > 0}')
            t.set_weights(Weights(float(w["rtt"]), float(w["queue"])))
        return web.json_response(t.snapshot())

    def backend_json(backend: str) -> dict[str, Any]:
        for b in router.fleet.backends_json():
            if b["id"] == backend:
                return b
        return {"id": backend, "lifecycle": "removed"}

    async def settled() -> None:
        if settle is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(settle(), SETTLE_S)

    async def list_backends(_: web.Request) -> web.Response:
        now_s = router.clock()
        return web.json_response(
            {"backends": router.fleet.backends_json(), "removed": router.fleet.removed_json(now_s)}
        )

    async def add_backend(request: web.Request) -> web.Response:
        """One backend object, exactly as an item of the config's `backends:` list."""
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body must be a JSON object (one item of backends:)")
        try:
            b = backend_from_dict(body)
        except ConfigError as e:
            return _error(400, str(e))
        try:
            router.fleet.add(b, "admin")
        except FleetConflict as e:
            return _error(409, str(e))
        await settled()
        return web.json_response(backend_json(b.id), status=201)

    async def drain_backend(request: web.Request) -> web.Response:
        """No new decisions; removed once its requests in flight have closed."""
        backend = request.match_info["id"]
        try:
            router.fleet.drain(backend, "admin")
        except UnknownBackend:
            return _error(404, f"no backend {backend!r}")
        except FleetConflict as e:
            return _error(409, str(e))
        return web.json_response(backend_json(backend), status=202)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=telemetry.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    document = admin_openapi(bool(token))

    async def openapi(_: web.Request) -> web.Response:
        """This admin's OpenAPI document (with or without its token's rules)."""
        return web.json_response(document)

    app = web.Application(middlewares=[guarded], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/state", state)
    app.router.add_post("/tuner", tuner)
    app.router.add_get("/backends", list_backends)
    app.router.add_post("/backends", add_backend)
    app.router.add_post("/backends/{id}/drain", drain_backend)
    # The REST spelling of a drain: no new decisions at once, gone once its requests in
    # flight have closed (so none of them fails).
    app.router.add_delete("/backends/{id}", drain_backend)
    app.router.add_get("/openapi.json", openapi)
    add_page_routes(app, router, router.cfg.telemetry.trace_url, flow)
    return app
