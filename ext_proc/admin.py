"""Admin HTTP on loopback: /healthz, /state, and POST /tuner."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ext_proc.cost import Weights
from ext_proc.router import Router
from ext_proc.telemetry import Telemetry

TUNER_ACTIONS = ("freeze", "unfreeze", "set")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def make_admin_app(
    router: Router,
    telemetry: Telemetry,
    extra_state: Callable[[], dict[str, Any]],
    token: str = "",
) -> web.Application:
    @web.middleware
    async def require_token(request: web.Request, handler: Any) -> web.StreamResponse:
        # Reads stay open on loopback; anything that changes state needs the token.
        if (
            token
            and request.method != "GET"
            and not hmac.compare_digest(request.headers.get("Authorization", ""), f"Bearer {token}")
        ):
            return _error(401, "admin token required: Authorization: Bearer <token>")
        response: web.StreamResponse = await handler(request)
        return response

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def state(_: web.Request) -> web.Response:
        return web.json_response({**router.snapshot(), **extra_state()})

    async def tuner(request: web.Request) -> web.Response:
        """{"action": "freeze"|"unfreeze"} or {"action": "set", "weights": {"rtt", "queue"}}."""
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
        if action == "freeze":
            t.freeze()
        elif action == "unfreeze":
            t.unfreeze()
        else:
            w = body.get("weights")
            ok = isinstance(w, dict) and all(
                isinstance(w.get(k), int | float) and not isinstance(w.get(k), bool) and w[k] > 0
                for k in ("rtt", "queue")
            )
            if not ok:
                return _error(400, 'weights: expected {"rtt": number > 0, "queue": number > 0}')
            t.set_weights(Weights(float(w["rtt"]), float(w["queue"])))
        return web.json_response(t.snapshot())

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=telemetry.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    app = web.Application(middlewares=[require_token])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/state", state)
    app.router.add_post("/tuner", tuner)
    return app
