"""The admin's changes need a token from another host (an open admin on the network could
route prompts anywhere through POST /backends)."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from ext_proc.service.admin import make_admin_app


def request_from(peer: str, method: str = "POST", headers: dict[str, str] | None = None) -> Any:
    transport = MagicMock()
    transport.get_extra_info.side_effect = lambda key, default=None: (
        (peer, 40000) if key == "peername" else default
    )
    return make_mocked_request(method, "/backends", headers=headers or {}, transport=transport)


async def through_the_guard(token: str, request: Any) -> int:
    app = make_admin_app(MagicMock(), MagicMock(), dict, token=token)
    guard = app.middlewares[0]

    async def handler(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    response = await guard(request, handler)  # type: ignore[call-arg]
    return int(response.status)


@pytest.mark.parametrize(
    ("token", "peer", "method", "headers", "status"),
    [
        ("", "127.0.0.1", "POST", None, 200),  # loopback, no token: as before
        ("", "::1", "DELETE", None, 200),
        ("", "10.1.2.3", "POST", None, 403),  # another host, no token: refused
        ("", "10.1.2.3", "GET", None, 200),  # reads stay open
        ("s3cret", "10.1.2.3", "POST", {"Authorization": "Bearer s3cret"}, 200),
        ("s3cret", "10.1.2.3", "POST", {"Authorization": "Bearer wrong"}, 401),
        ("s3cret", "127.0.0.1", "POST", None, 401),
    ],
)
async def test_changes_from_another_host_need_a_token(
    token: str, peer: str, method: str, headers: dict[str, str] | None, status: int
) -> None:
    assert await through_the_guard(token, request_from(peer, method, headers)) == status
