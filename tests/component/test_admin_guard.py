"""The admin port against what a web page in the operator's browser can send (issue 39,
point 3), through the real aiohttp admin app of a running service: without a token a
change must be JSON from no foreign Origin, every read names this admin in Host (DNS
rebinding), and a configured token is still required. The rules themselves:
ext_proc/service/admin/guard.py (unit tests: tests/unit/service/admin/test_api.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from ext_proc.config.load import config_from_dict
from ext_proc.service.app import Running, running_service

EVIL = {"id": "evil", "address": "127.0.0.1:9"}


def config(**listen: Any) -> Any:
    return config_from_dict(
        {
            "policy": "gorgo",
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0", **listen},
            "backends": [
                {"id": "a", "address": "127.0.0.1:1"},
                {"id": "b", "address": "127.0.0.1:2"},
            ],
            "tuner": {"mode": "paired"},
        }
    )


@pytest.fixture
async def svc() -> AsyncIterator[Running]:
    async with running_service(config()) as running:
        yield running


async def fleet(s: aiohttp.ClientSession, url: str) -> list[str]:
    async with s.get(f"{url}/backends") as r:
        assert r.status == 200
        return [b["id"] for b in (await r.json())["backends"]]


async def test_a_cross_origin_text_plain_post_adds_no_backend(svc: Running) -> None:
    url = f"http://127.0.0.1:{svc.admin_port}"
    # What a page on another site sends with fetch(..., {mode: "no-cors"}): no preflight.
    page = {"Origin": "http://attacker.example", "Content-Type": "text/plain;charset=UTF-8"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/backends", data=json.dumps(EVIL), headers=page) as r:
            assert r.status == 403
            assert "attacker.example" in (await r.json())["error"]
        # the same body from this host's own tool, but as text/plain: refused too
        plain = {"Content-Type": "text/plain"}
        async with s.post(f"{url}/backends", data=json.dumps(EVIL), headers=plain) as r:
            assert r.status == 403 and "application/json" in (await r.json())["error"]
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        async with s.post(f"{url}/tuner", data="action=freeze", headers=form) as r:
            assert r.status == 403
        assert await fleet(s, url) == ["a", "b"]
        assert svc.router.tuner is not None and not svc.router.tuner.snapshot()["frozen"]


async def test_a_json_post_with_a_foreign_origin_is_refused_its_own_origin_works(
    svc: Running,
) -> None:
    url = f"http://127.0.0.1:{svc.admin_port}"
    async with aiohttp.ClientSession() as s:
        for origin in ("http://attacker.example", "null", f"http://localhost:{svc.admin_port}0"):
            headers = {"Origin": origin}
            async with s.post(f"{url}/backends", json=EVIL, headers=headers) as r:
                assert r.status == 403, origin
                body = await r.json()
                assert origin in body["error"] and "Origin" in body["error"]
            async with s.delete(f"{url}/backends/a", json={}, headers=headers) as r:
                assert r.status == 403
        assert await fleet(s, url) == ["a", "b"]
        # The admin's own origin (its page /ui, were it to post), and no Origin (curl,
        # this host's tools): taken.
        own = {"Origin": url}
        async with s.post(f"{url}/tuner", json={"action": "freeze"}, headers=own) as r:
            assert r.status == 200 and (await r.json())["frozen"]
        async with s.post(f"{url}/tuner", json={"action": "unfreeze"}) as r:
            assert r.status == 200 and not (await r.json())["frozen"]
        async with s.post(f"{url}/backends", json=EVIL, headers=own) as r:
            assert r.status == 201
        async with s.post(f"{url}/backends/a/drain", json={}, headers=own) as r:
            assert r.status == 202  # nothing in flight: removed at once
        assert "evil" in await fleet(s, url)


async def test_a_foreign_host_reads_nothing_but_healthz(svc: Running) -> None:
    port = svc.admin_port
    url = f"http://127.0.0.1:{port}"
    rebound = {"Host": f"attacker.example:{port}"}
    async with aiohttp.ClientSession() as s:
        for path in ("/state", "/metrics", "/backends", "/ui", "/ui/feed"):
            async with s.get(f"{url}{path}", headers=rebound) as r:
                assert r.status == 421, path
                error = (await r.json())["error"]
                assert "attacker.example" in error and "listen.admin_hosts" in error
        async with s.post(f"{url}/tuner", json={"action": "freeze"}, headers=rebound) as r:
            assert r.status == 421
        async with s.get(f"{url}/healthz", headers=rebound) as r:
            assert r.status == 200  # says only "ok"; kubelet probes it by the pod's IP
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
            async with s.get(f"{url}/state", headers={"Host": host}) as r:
                assert r.status == 200, host
        async with s.get(f"{url}/state", headers={"Host": "localhost:1"}) as r:
            assert r.status == 421  # another port: another service's page


async def test_configured_admin_hosts_are_accepted() -> None:
    cfg = config(admin_hosts=["gorgo", "gorgo.gorgo.svc:9180"])
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{svc.admin_port}"
        for host, status in (
            ("gorgo:9180", 200),  # a bare name: any port (Prometheus' target gorgo:9180)
            ("gorgo", 200),
            ("GORGO:1234", 200),
            ("gorgo.gorgo.svc:9180", 200),
            ("gorgo.gorgo.svc:80", 421),  # name:port: that port only
            ("gorgo.attacker.example:9180", 421),
        ):
            async with s.get(f"{url}/metrics", headers={"Host": host}) as r:
                assert r.status == status, host


async def test_with_a_token_the_token_is_still_required() -> None:
    async with running_service(config(admin_token="s3cret")) as svc:
        url = f"http://127.0.0.1:{svc.admin_port}"
        own = {"Origin": url}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/backends", json=EVIL, headers=own) as r:
                assert r.status == 401  # JSON from its own origin: still the token
            page = {"Content-Type": "text/plain", "Authorization": "Bearer wrong"}
            async with s.post(f"{url}/backends", data=json.dumps(EVIL), headers=page) as r:
                assert r.status == 401
            rebound = {"Host": "attacker.example", "Authorization": "Bearer s3cret"}
            async with s.get(f"{url}/state", headers=rebound) as r:
                assert r.status == 421  # the Host rule holds with a token too
            good = {"Authorization": "Bearer s3cret"}
            async with s.post(f"{url}/tuner", json={"action": "freeze"}, headers=good) as r:
                assert r.status == 200
            assert await fleet(s, url) == ["a", "b"]
