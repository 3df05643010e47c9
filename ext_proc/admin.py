"""Admin HTTP on loopback: /healthz and /state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from ext_proc.router import Router


def make_admin_app(router: Router, extra_state: Callable[[], dict[str, Any]]) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def state(_: web.Request) -> web.Response:
        return web.json_response({**router.snapshot(), **extra_state()})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/state", state)
    return app
