"""The standard gRPC health service on `gorgo serve`'s gRPC port, over a real channel with
grpc_health's own client stub, and /readyz on the admin port: SERVING / 200 while the router
can route, NOT_SERVING / 503 while it cannot, as its state changes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ext_proc.common.names import EXT_PROC_SERVICE
from ext_proc.config.load import config_from_dict
from ext_proc.service.app import Running, running_service

pytestmark = pytest.mark.component

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE, "inference-extension")
BACKENDS = ("a", "b")


@pytest.fixture
async def svc() -> AsyncIterator[Running]:
    cfg = config_from_dict(
        {
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            # nothing answers there: the test says when probes fail, not the prober
            "probes": {"interval_s": 3600},
            "backends": [
                {"id": b, "address": f"127.0.0.1:{i + 1}"} for i, b in enumerate(BACKENDS)
            ],
        }
    )
    async with running_service(cfg) as running:
        yield running


async def readyz(svc: Running) -> tuple[int, dict]:  # type: ignore[type-arg]
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{svc.admin_port}/readyz", headers={"Host": "10.1.2.3:9180"}) as r,
    ):
        return r.status, await r.json()


async def statuses(stub: health_pb2_grpc.HealthStub) -> dict[str, int]:
    out = {}
    for service in SERVICES:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        out[service] = reply.status
    return out


async def test_the_health_service_follows_the_router(svc: Running) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert await statuses(stub) == dict.fromkeys(SERVICES, SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # kubelet probes by the pod's IP: /readyz answers whatever the Host
        assert await readyz(svc) == (
            200,
            {"ready": True, "reason": "2 of 2 active backends available"},
        )

        watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
        assert (await watch.read()).status == SERVING
        # every backend's probes fail: nothing can take a request
        for b in BACKENDS:
            for _ in range(svc.router.cfg.probes.suspect_after):
                svc.router.inputs.record_probe(b, None)
        assert (await asyncio.wait_for(watch.read(), 2.0)).status == NOT_SERVING
        assert await statuses(stub) == {**dict.fromkeys(SERVICES, NOT_SERVING), "liveness": SERVING}
        status, body = await readyz(svc)
        assert status == 503 and not body["ready"] and "suspect" in body["reason"]

        svc.router.inputs.record_probe("b", 3.0)  # b answers again
        assert (await asyncio.wait_for(watch.read(), 2.0)).status == SERVING
        assert (await readyz(svc))[0] == 200

        svc.ext_proc.draining = True  # shutting down (what SIGTERM's drain sets first)
        assert svc.health is not None
        svc.health.poke()
        assert (await asyncio.wait_for(watch.read(), 2.0)).status == NOT_SERVING
        assert (await readyz(svc))[1]["reason"].startswith("shutting down")
        assert (
            await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
        ).status == SERVING
        watch.cancel()
        svc.ext_proc.draining = False
