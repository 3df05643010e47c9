"""`gorgo epp` as the inference extension's chart starts its picker: the chart's flags
(its own plugins file included), the backends found from a (fake) Kubernetes API as pods
come and go, the gRPC health service on its own port following them, and requests through
an Envoy configured as the chart's (TLS to the picker, ORIGINAL_DST) reaching the pods."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from emulator.engine.config import EngineConfig
from emulator.engine.server import EngineServer
from emulator.stack.gateway_envoy import gateway_envoy_config
from emulator.stack.ports import free_ports
from loadgen.client.stream import chat_body, send_chat
from tests.component.engine_harness import FAST
from tests.kube_api import FakeKubeApi, inference_pool, pod

pytestmark = pytest.mark.e2e

APP = {"app": "tiny-vllm"}
PODS = {"vllm-a": "127.0.0.2", "vllm-b": "127.0.0.3"}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BIN = Path(sys.executable).parent


def shared_port(hosts: list[str]) -> int:
    """A port free on every one of `hosts` (the pods' engines listen on the same port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = int(s.getsockname()[1])
        try:
            for h in hosts:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every host")


async def until(check: Callable[[], object], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def process(argv: list[str], log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.PIPE, stderr=out, stdin=subprocess.DEVNULL
        )
        try:
            yield proc
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def test_gorgo_epp_follows_the_pools_pods_and_says_so_in_its_health(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi()
    await api.start()
    port = shared_port(list(PODS.values()))
    engines = {
        name: EngineServer(EngineConfig(name=name, profile=FAST, flavor="vllm"), ip, port)
        for name, ip in PODS.items()
    }
    for e in engines.values():
        await e.start()
    api.put_pool(inference_pool("tiny", APP, [port]))
    # the chart mounts its own plugins file at --config-file unless told otherwise
    plugins = tmp_path / "default-plugins.yaml"
    plugins.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\n"
        "kind: EndpointPickerConfig\nplugins: []\n"
    )
    argv = [
        str(BIN / "gorgo"), "epp",
        "--pool-name", "tiny", "--pool-namespace", "default",
        "--pool-group", "inference.networking.k8s.io",
        "--zap-encoder", "json", "--config-file", str(plugins), "--v", "1",
        "--tracing=false", "--metrics-endpoint-auth=false",
        "--kubeconfig", str(api.kubeconfig(tmp_path / "kubeconfig")),
        "--address", "127.0.0.1",
        "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
    ]  # fmt: skip
    try:
        async with process(argv, tmp_path / "epp.log") as epp:
            assert epp.stdout is not None
            line = (await asyncio.wait_for(epp.stdout.readline(), 30)).decode()
            assert "gorgo epp: ready" in line, (tmp_path / "epp.log").read_text()
            grpc_port, health_port, metrics_port = (
                int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", line)
            )
            assert "TLS (self-signed)" in line and "InferencePool tiny" in line
            log = (tmp_path / "epp.log").read_text()
            assert "EndpointPickerConfig" in log and "--metrics-endpoint-auth" in log
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                health = health_pb2_grpc.HealthStub(ch)

                async def status(service: str = "inference-extension") -> int:
                    req = health_pb2.HealthCheckRequest(service=service)
                    return int((await health.Check(req)).status)

                # no pod yet: alive, not ready
                assert await status("liveness") == SERVING
                assert await status() == NOT_SERVING
                api.put_pod(pod("vllm-a", PODS["vllm-a"], APP))
                await until(lambda: _is(status(), SERVING))

                envoy_listen, envoy_admin = free_ports(2)
                config = tmp_path / "envoy.yaml"
                config.write_text(gateway_envoy_config(envoy_listen, envoy_admin, grpc_port))
                envoy_argv = [str(BIN / "envoy"), "-c", str(config), "--log-level", "warn"]
                async with process(envoy_argv, tmp_path / "envoy.log"):
                    url = f"http://127.0.0.1:{envoy_listen}"
                    await until(lambda: _served(url, engines["vllm-a"]))
                    # a second pod joins, the first goes: the requests follow
                    api.put_pod(pod("vllm-b", PODS["vllm-b"], APP))
                    api.delete_pod("vllm-a")
                    before = engines["vllm-a"].engine.stats.requests_total
                    await until(lambda: _served(url, engines["vllm-b"]))
                    assert engines["vllm-a"].engine.stats.requests_total == before
                    # the pool empties: not ready, and the picker answers 503
                    api.delete_pod("vllm-b")
                    await until(lambda: _is(status(), NOT_SERVING))
                    assert await status("liveness") == SERVING
                    async with aiohttp.ClientSession() as s:
                        result = await send_chat(s, url, chat("hi"), "empty")
                    assert result.status == 503, result
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"http://127.0.0.1:{metrics_port}/metrics") as r,
            ):
                assert r.status == 200 and "gorgo_build_info" in await r.text()
    finally:
        for e in engines.values():
            await e.stop()
        await api.stop()


def chat(text: str) -> dict[str, object]:
    return chat_body(text, 2, model="emulated")  # the engines' served name


async def _is(status: object, want: int) -> bool:
    assert asyncio.iscoroutine(status)
    return bool(await status == want)


async def _served(url: str, engine: EngineServer) -> bool:
    """A chat through the gateway came back and `engine` served it."""
    before = engine.engine.stats.requests_total
    async with aiohttp.ClientSession() as s:
        result = await send_chat(s, url, chat("route me"), f"r{time.monotonic_ns()}")
    return result.ok and engine.engine.stats.requests_total == before + 1
