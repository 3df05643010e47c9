"""Who may use the admin (ext_proc/service/admin/guard.py): changes need a token from
another host (an open admin on the network could route prompts anywhere through POST
/backends); without a token they must be JSON with no foreign Origin (a page elsewhere
posts text/plain without a preflight); every request but /healthz names this admin in
Host (DNS rebinding). Through the real app: tests/component/test_admin_guard.py."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from ext_proc.service.admin.api import make_admin_app
from ext_proc.service.admin.guard import AdminGuard, Peer, split_authority

JSON = {"Content-Type": "application/json"}


def request_from(peer: str, method: str = "POST", headers: dict[str, str] | None = None) -> Any:
    transport = MagicMock()
    transport.get_extra_info.side_effect = lambda key, default=None: {
        "peername": (peer, 40000),
        "sockname": ("127.0.0.1", 9180),
    }.get(key, default)
    return make_mocked_request(method, "/backends", headers=headers or {}, transport=transport)


async def through_the_guard(token: str, request: Any) -> int:
    app = make_admin_app(MagicMock(), MagicMock(), dict, token=token, listen="127.0.0.1:9180")
    guard = app.middlewares[0]

    async def handler(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    response = await guard(request, handler)  # type: ignore[call-arg]
    return int(response.status)


@pytest.mark.parametrize(
    ("token", "peer", "method", "headers", "status"),
    [
        ("", "127.0.0.1", "POST", JSON, 200),  # loopback, no token, JSON
        ("", "::1", "DELETE", JSON, 200),
        ("", "127.0.0.1", "POST", None, 403),  # no Content-Type: not JSON
        ("", "127.0.0.1", "POST", {"Content-Type": "text/plain"}, 403),
        ("", "10.1.2.3", "POST", JSON, 403),  # another host, no token: refused
        ("", "10.1.2.3", "GET", None, 200),  # reads stay open
        ("", "127.0.0.1", "HEAD", None, 200),
        ("s3cret", "10.1.2.3", "POST", {"Authorization": "Bearer s3cret"}, 200),
        ("s3cret", "10.1.2.3", "POST", {"Authorization": "Bearer wrong"}, 401),
        ("s3cret", "127.0.0.1", "POST", JSON, 401),
    ],
)
async def test_changes_need_json_from_loopback_or_a_token(
    token: str, peer: str, method: str, headers: dict[str, str] | None, status: int
) -> None:
    assert await through_the_guard(token, request_from(peer, method, headers)) == status


LOOPBACK = Peer("127.0.0.1", "127.0.0.1", 9180)


@pytest.mark.parametrize(
    ("origin", "host", "refused"),
    [
        ("http://127.0.0.1:9180", "127.0.0.1:9180", False),
        ("https://LOCALHOST:9180", "localhost:9180", False),  # behind a TLS proxy
        ("http://localhost:9180", "127.0.0.1:9180", True),  # another origin to a browser
        ("http://attacker.example", "127.0.0.1:9180", True),
        ("null", "127.0.0.1:9180", True),  # a sandboxed frame, a file:// page
        ("http://127.0.0.1:9180", None, True),
    ],
)
def test_an_origin_other_than_the_admins_own_is_refused(
    origin: str, host: str | None, refused: bool
) -> None:
    headers = {**JSON, "Origin": origin, **({"Host": host} if host else {})}
    refusal = AdminGuard("127.0.0.1:9180").refuse("POST", "/tuner", headers, LOOPBACK)
    assert (refusal is not None) == refused
    if refused:
        assert refusal == (403, refusal[1]) and origin in refusal[1]


def test_host_on_loopback_the_address_its_names_and_admin_hosts() -> None:
    guard = AdminGuard("127.0.0.1:9180", extra_hosts=("gorgo", "gorgo.gorgo.svc:9180"))
    assert guard.accepted_hosts(LOOPBACK) == [
        "127.0.0.1:9180",
        "localhost:9180",
        "[::1]:9180",
        "gorgo",
        "gorgo.gorgo.svc:9180",
    ]
    for host in ("127.0.0.1:9180", "LocalHost:9180", "[::1]:9180", "gorgo:1", "gorgo", None):
        assert guard.host_ok(host, LOOPBACK), host
    for host in ("attacker.example:9180", "localhost:9181", "localhost", "gorgo.gorgo.svc"):
        assert not guard.host_ok(host, LOOPBACK), host


def test_host_on_all_interfaces_the_address_the_client_reached_and_admin_hosts() -> None:
    guard = AdminGuard("0.0.0.0:9180", extra_hosts=("gorgo",))
    pod = Peer("10.0.0.7", "10.1.2.3", 9180)  # kubelet or Prometheus by the pod's IP
    assert guard.accepted_hosts(pod) == ["10.1.2.3:9180", "gorgo"]
    assert guard.host_ok("10.1.2.3:9180", pod) and guard.host_ok("gorgo:9180", pod)
    assert not guard.host_ok("localhost:9180", pod)  # not over loopback
    assert not guard.host_ok("10.9.9.9:9180", pod)
    inside = Peer("127.0.0.1", "127.0.0.1", 9180)  # a probe inside the container
    assert guard.host_ok("localhost:9180", inside) and guard.host_ok("127.0.0.1:9180", inside)
    v6 = Peer("::1", "::1", 9180)
    assert guard.accepted_hosts(v6)[0] == "[::1]:9180"
    refusal = guard.refuse("GET", "/state", {"Host": "evil.example:9180"}, pod)
    assert refusal is not None and refusal[0] == 421
    assert "all interfaces" in refusal[1]
    assert "add 'evil.example' to listen.admin_hosts" in refusal[1]
    assert guard.refuse("GET", "/healthz", {"Host": "evil.example"}, pod) is None


def test_split_authority() -> None:
    assert split_authority("Gorgo:9180") == ("gorgo", "9180")
    assert split_authority("[::1]:9180") == ("[::1]", "9180")
    assert split_authority("[::1]") == ("[::1]", "")
    assert split_authority("gorgo") == ("gorgo", "")
