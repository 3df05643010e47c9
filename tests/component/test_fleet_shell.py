"""Backends changed at run time through the real service: the admin API (tokens, error
bodies naming the key), the shell's per-backend tasks (probes, metrics scrapes, KV-event
subscribers) started and stopped, Envoy's xDS files and the wait for Envoy, and config
reloads (file change, invalid file, SIGHUP to a real `gorgo serve`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web

from ext_proc.config.load import config_from_dict
from ext_proc.service import fleet_shell
from ext_proc.service.admin import api as admin
from ext_proc.service.app import Running, running_service
from ext_proc.vocab.types import Status
from tests.component.grpc_harness import Harness, log_entry, route

pytestmark = pytest.mark.component

TOKEN = {"Authorization": "Bearer s3cret"}


class FakeEngine:
    """An engine's HTTP surface the router touches: probe path and /metrics, counted."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        async def handle(request: web.Request) -> web.Response:
            self.hits[request.path] += 1
            if request.path == "/metrics":
                return web.Response(text="sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\n")
            return web.json_response({"data": []})

        a = web.Application()
        a.router.add_get("/{tail:.*}", handle)
        self.runner = web.AppRunner(a, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    out = [FakeEngine() for _ in range(4)]
    for e in out:
        await e.start()
    yield out
    for e in out:
        await e.stop()


def raw_config(engines: list[FakeEngine], ids: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    return {
        "policy": "round_robin",
        "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0", "admin_token": "s3cret"},
        "probes": {"interval_s": 0.05, "metrics_interval_s": 0.1},
        "backends": [
            {"id": bid, "address": e.address, "kv_events": {"endpoint": "tcp://*:1"}}
            for bid, e in zip(ids, engines, strict=False)
        ],
        **extra,
    }


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def quiet(engine: FakeEngine, for_s: float = 0.4) -> bool:
    """No probe or scrape reached the engine for a while."""
    before = sum(engine.hits.values())
    await asyncio.sleep(for_s)
    return sum(engine.hits.values()) == before


async def test_admin_add_drain_delete_with_tokens_and_the_shell_follows(
    engines: list[FakeEngine],
) -> None:
    cfg = config_from_dict(raw_config(engines, ("a", "b")))
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{svc.admin_port}"
        shell = svc.fleet_shell
        d_item = {"id": "d", "address": engines[3].address, "kv_events": {"endpoint": "tcp://*:2"}}
        # Reads are open; every change needs the token.
        async with s.get(f"{url}/backends") as r:
            listed = await r.json()
        assert [(b["id"], b["lifecycle"], b["in_flight"]) for b in listed["backends"]] == [
            ("a", "active", 0),
            ("b", "active", 0),
        ]
        assert listed["backends"][0]["config"]["address"] == engines[0].address
        for method, path in (
            ("POST", "/backends"),
            ("POST", "/backends/a/drain"),
            ("DELETE", "/backends/a"),
        ):
            async with s.request(method, f"{url}{path}", json=d_item) as r:
                assert r.status == 401
        # Bad bodies: 400 naming the key.
        for bad, key in (
            ({"id": "d"}, "address: required key is missing"),
            ({**d_item, "colour": "red"}, "colour: unknown key"),
            ({**d_item, "rtt_prior_ms": -3}, "rtt_prior_ms: must be >= 0"),
            ({**d_item, "kv_events": {"endpoint": "x"}}, "kv_events.endpoint: expected"),
        ):
            async with s.post(f"{url}/backends", json=bad, headers=TOKEN) as r:
                assert r.status == 400
                assert (await r.json())["error"].startswith(key)
        async with s.post(f"{url}/backends", data=b"[", headers=TOKEN) as r:
            assert r.status == 400
        # Add: 201 once it is a candidate; its probes, scrape and subscriber run.
        async with s.post(f"{url}/backends", json=d_item, headers=TOKEN) as r:
            assert r.status == 201
            added = await r.json()
        assert (added["id"], added["lifecycle"]) == ("d", "active")
        async with s.post(f"{url}/backends", json=d_item, headers=TOKEN) as r:
            assert r.status == 409 and "'d' exists" in (await r.json())["error"]
        await eventually(
            lambda: engines[3].hits["/v1/models"] >= 2 and engines[3].hits["/metrics"] >= 1
        )
        fed = shell.snapshot()
        assert "d" in fed["probed"] and "d" in fed["kv_event_subscribers"]
        # Decisions reach it over the real ext_proc stream.
        h = Harness(svc, grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}"))
        chosen = [await route(h, f"r{i}") for i in range(6)]
        assert Counter(chosen) == {"a": 2, "b": 2, "d": 2}
        for i in range(6):
            await h.access_log(log_entry(f"r{i}", 200, 5))
        # (a completion that may overtake its first chunk is closed a moment later)
        await eventually(lambda: not svc.router.in_flight)
        # Drain with a request in flight: 202, no decision reaches it, removed when it
        # completes; its tasks stop.
        on_b = [rid for rid in ("s0", "s1", "s2") if await route(h, rid) == "b"]
        assert len(on_b) == 1
        async with s.post(f"{url}/backends/b/drain", headers=TOKEN) as r:
            assert r.status == 202
            assert (await r.json())["lifecycle"] == "draining"
        async with s.get(f"{url}/backends") as r:
            b_row = next(b for b in (await r.json())["backends"] if b["id"] == "b")
        assert (b_row["lifecycle"], b_row["in_flight"]) == ("draining", 1)
        assert "b" not in {await route(h, f"t{i}") for i in range(8)}
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
        assert 'gorgo_backend_lifecycle{backend="b",state="draining"} 1.0' in text
        await h.access_log(
            *(log_entry(rid, 200, 5) for rid in ("s0", "s1", "s2") if rid not in on_b)
        )
        await h.access_log(*(log_entry(f"t{i}", 200, 5) for i in range(8)))
        assert svc.router.fleet.lifecycle("b").value == "draining"
        await h.access_log(log_entry(on_b[0], 200, 5))
        await eventually(lambda: "b" not in svc.router.backends)
        await shell.settle()
        assert "b" not in svc.router.backends
        fed = shell.snapshot()
        assert "b" not in fed["probed"] and "b" not in fed["kv_event_subscribers"]
        assert await quiet(engines[1])
        async with s.get(f"{url}/state") as r:
            state = await r.json()
        assert "b" not in state["backends"] and [x["id"] for x in state["removed_backends"]] == [
            "b"
        ]
        assert state["backends"]["d"]["lifecycle"] == "active"
        # DELETE: unknown 404; the last active one 409; an idle one gone at once.
        async with s.delete(f"{url}/backends/b", headers=TOKEN) as r:
            assert r.status == 404 and "'b'" in (await r.json())["error"]
        async with s.delete(f"{url}/backends/d", headers=TOKEN) as r:
            assert r.status == 202 and (await r.json())["lifecycle"] == "removed"
        async with s.post(f"{url}/backends/a/drain", headers=TOKEN) as r:
            assert r.status == 409 and "last active" in (await r.json())["error"]
        await shell.settle()
        assert await quiet(engines[3])
        await h.channel.close()
        # nothing leaked: no request in flight, no task of a removed backend
        await eventually(lambda: not svc.router.in_flight)
        fed = shell.snapshot()
        assert fed["probed"] == ["a"] and fed["kv_event_subscribers"] == ["a"]


async def test_a_new_backend_waits_for_envoy_then_the_files_follow_the_fleet(
    engines: list[FakeEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With envoy.xds_dir: the files are written at start and at each change, and a new
    backend is no candidate until Envoy's admin /clusters shows it (a fake Envoy here)."""
    monkeypatch.setattr(fleet_shell, "ENVOY_WAIT_S", 0.3)
    monkeypatch.setattr(fleet_shell, "PENDING_RETRY_S", 0.2)
    monkeypatch.setattr(admin, "SETTLE_S", 0.5)
    shown: set[str] = set()

    async def clusters(_: web.Request) -> web.Response:
        return web.Response(
            text="".join(
                f"{b}::{e.address}::health_flags::healthy\n"
                for b, e in zip("abcd", engines, strict=False)
                if b in shown
            )
        )

    fake = web.Application()
    fake.router.add_get("/clusters", clusters)
    runner = web.AppRunner(fake, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    envoy_admin = f"127.0.0.1:{runner.addresses[0][1]}"
    xds = tmp_path / "xds"
    cfg = config_from_dict(
        raw_config(engines, ("a", "b"), envoy={"xds_dir": str(xds), "admin": envoy_admin})
    )
    shown.update("ab")
    try:
        async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{svc.admin_port}"

            def clusters_in_files() -> set[str]:
                doc = yaml.safe_load((xds / "cds.yaml").read_text())
                return {r["name"] for r in doc["resources"]}

            assert {"a", "b"} <= clusters_in_files()
            item = {"id": "c", "address": engines[2].address}
            async with s.post(f"{url}/backends", json=item, headers=TOKEN) as r:
                assert r.status == 201 and (await r.json())["lifecycle"] == "pending"
            assert "c" in clusters_in_files()  # Envoy is told first
            assert svc.router.fleet.lifecycle("c").value == "pending"
            assert all(svc.router.decide(_req(f"p{i}")).backend != "c" for i in range(6))
            for i in range(6):
                svc.router.close(f"p{i}", Status.OK)
            shown.add("c")  # Envoy has it now: active at the next look
            await eventually(lambda: svc.router.fleet.lifecycle("c").value == "active")
            writes = svc.fleet_shell.xds_writes
            # Drain: Envoy keeps its cluster while requests finish; removal rewrites.
            svc.router.decide(_req("q"))
            busy = svc.router.in_flight["q"].backend
            svc.router.fleet.drain(busy)
            await svc.fleet_shell.settle()
            assert busy in clusters_in_files() and svc.fleet_shell.xds_writes > writes
            fallback = (xds / "eds-gorgo_fallback.yaml").read_text()
            assert svc.router.backends[busy].config.address.split(":")[1] not in fallback
            svc.router.close("q", Status.OK)
            await svc.fleet_shell.settle()
            assert busy not in clusters_in_files()
            assert not (xds / f"eds-{busy}.yaml").exists()
    finally:
        await runner.cleanup()


def _req(rid: str) -> Any:
    from tests.builders import chat

    return chat(rid=rid)


# -- reloads ---------------------------------------------------------------------------


async def _state(s: aiohttp.ClientSession, svc: Running) -> dict[str, Any]:
    async with s.get(f"http://127.0.0.1:{svc.admin_port}/state") as r:
        out: dict[str, Any] = await r.json()
        return out


async def test_a_changed_file_is_applied_and_an_invalid_one_refused(
    engines: list[FakeEngine], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gorgo.yaml"
    raw = raw_config(engines, ("a", "b", "c"))
    path.write_text(yaml.safe_dump(raw))
    cfg = config_from_dict(raw)
    async with running_service(cfg, config_path=path) as svc, aiohttp.ClientSession() as s:
        reloader = svc.reloader
        assert reloader is not None
        svc.router.decide(_req("busy"))
        busy = svc.router.in_flight["busy"].backend
        # c is gone, d is new, the busy one stays; a live key and a restart-only key change.
        new = raw_config(
            engines, ("a", "b", "c", "d"), routing={"shed_queue_ms": 900, "block_tokens": 128}
        )
        new["backends"] = [b for b in new["backends"] if b["id"] != "c"]
        path.write_text(yaml.safe_dump(new))
        await eventually(lambda: reloader.reloads == 1, 4.0)
        await svc.fleet_shell.settle()
        assert svc.router.fleet.lifecycle("d").value == "active"
        if busy == "c":  # a request in flight there: draining until it completes
            assert svc.router.fleet.lifecycle("c").value == "draining"
        else:
            assert "c" not in svc.router.backends
        assert svc.router.cfg.routing.shed_queue_ms == 900  # live
        assert svc.router.cfg.routing.block_tokens == 256  # needs a restart
        state = await _state(s, svc)
        assert state["reload"]["restart_required"] == ["routing.block_tokens"]
        assert state["reload"]["last_trigger"] == "file changed"
        assert "restart to apply" in caplog.text and "routing.block_tokens" in caplog.text
        # Invalid: refused with the key named, the running config stays.
        before = svc.router.cfg
        bad = json.loads(json.dumps(new))
        bad["backends"][0]["address"] = "no-port"
        bad["backends"].append({"id": "e", "address": engines[2].address})
        path.write_text(yaml.safe_dump(bad))
        await eventually(lambda: reloader.failures == 1, 4.0)
        assert svc.router.cfg == before and "e" not in svc.router.backends
        state = await _state(s, svc)
        assert "backends[0].address: expected host:port" in state["reload"]["last_error"]
        assert "refused, the running config stays" in caplog.text
        async with s.get(f"http://127.0.0.1:{svc.admin_port}/metrics") as r:
            text = await r.text()
        assert 'gorgo_config_reloads_total{result="error"} 1.0' in text
        assert 'gorgo_config_reloads_total{result="ok"} 1.0' in text
        # Not re-read every second while it stays the same.
        await asyncio.sleep(1.5)
        assert reloader.failures == 1
        # SIGHUP's path (request) reloads even an unchanged file.
        path.write_text(yaml.safe_dump(new))
        await eventually(lambda: reloader.reloads == 2, 4.0)
        reloader.request("SIGHUP")
        await eventually(lambda: reloader.reloads == 3, 4.0)
        assert reloader.last_trigger == "SIGHUP"
        svc.router.close("busy", Status.OK)


def test_sighup_reloads_a_running_gorgo_serve(engines_sync: list[str], tmp_path: Path) -> None:
    """A real `gorgo serve`: SIGHUP applies the file (here a change the file watcher
    cannot see: same size, same mtime), and the process keeps serving."""
    path = tmp_path / "gorgo.yaml"

    def doc(ids: str) -> str:
        return yaml.safe_dump(
            {
                "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                "backends": [
                    {"id": b, "address": a} for b, a in zip(ids, engines_sync, strict=False)
                ],
            }
        )

    path.write_text(doc("abc"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ext_proc.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 30
        while "ready" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        port = re.search(r"admin http://[\d.]+:(\d+)/state", line)
        assert port, line
        state_url = f"http://127.0.0.1:{port.group(1)}/state"
        st = os.stat(path)
        new = doc("abd")  # the same length: only the third id differs
        assert len(new) == len(doc("abc"))
        with open(path, "r+") as f:
            f.write(new)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        time.sleep(1.5)  # the watcher has looked and seen nothing
        assert set(_get(state_url)["backends"]) == {"a", "b", "c"}
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = _get(state_url)
            if "d" in state["backends"] and "c" not in state["backends"]:
                break
            time.sleep(0.1)
        assert set(state["backends"]) == {"a", "b", "d"}
        assert state["reload"]["last_trigger"] == "SIGHUP" and state["reload"]["reloads"] == 1
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "config reload (SIGHUP): backends added ['d']" in out


def _get(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@pytest.fixture
def engines_sync() -> list[str]:
    """Addresses nothing listens on: the serve process's probes simply fail."""
    return ["127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"]
