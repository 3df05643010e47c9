"""Whether the router can route (the health service's and /readyz's predicate), and the
health service's statuses following it."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2

from ext_proc.common.names import EXT_PROC_SERVICE
from ext_proc.config.load import backend_from_dict
from ext_proc.service.health import (
    NOT_SERVING,
    READINESS_SERVICES,
    SERVING,
    HealthService,
    Readiness,
    router_readiness,
)
from tests.builders import make_router


def test_ready_while_some_active_backend_is_available() -> None:
    r, clock = make_router(backends=("a", "b"))
    assert router_readiness(r) == Readiness(True, "2 of 2 active backends available")
    for _ in range(r.cfg.probes.suspect_after):  # a's probes fail: suspect
        r.inputs.record_probe("a", None)
    assert router_readiness(r) == Readiness(True, "1 of 2 active backends available")
    r.fleet.state.eject_failing("b", clock(), 0, 5.0)  # b's requests failed: ejected 5 s
    now = router_readiness(r)
    assert not now.ready and "suspect" in now.reason and "ejected" in now.reason
    clock.advance(5.1)  # the ejection ends by itself
    assert router_readiness(r).ready
    assert router_readiness(r, draining=True) == Readiness(
        False, "shutting down: new requests are not routed"
    )


def test_not_ready_without_an_active_backend() -> None:
    r, _ = make_router(backends=("a",))
    r.fleet.confirm_new_backends = True
    r.fleet.add(backend_from_dict({"id": "b", "address": "127.0.0.1:9"}), "reload")
    r.fleet.drain("a", "reload")
    assert router_readiness(r) == Readiness(
        False, "no active backend (1 waiting for Envoy to have their clusters)"
    )
    r.fleet.activate("b")
    assert router_readiness(r).ready


class Context:
    """What the servicer asks of a gRPC context: an abort on an unknown service."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code = code


async def check(h: HealthService, service: str) -> int | grpc.StatusCode:
    context = Context()
    reply = await h.servicer.Check(health_pb2.HealthCheckRequest(service=service), context)
    return context.code if reply is None else reply.status


async def test_statuses_follow_readiness_and_liveness_stays() -> None:
    state = {"ready": True}
    h = HealthService(lambda: Readiness(state["ready"], "test"))
    await h.start()
    try:
        for service in (*READINESS_SERVICES, "liveness"):
            assert await check(h, service) == SERVING, service
        assert await check(h, "no.such.Service") == grpc.StatusCode.NOT_FOUND
        state["ready"] = False
        h.poke()
        await asyncio.sleep(0.05)  # the loop checks at once when poked
        assert [await check(h, s) for s in READINESS_SERVICES] == [NOT_SERVING] * 4
        assert await check(h, "liveness") == SERVING
        assert await check(h, EXT_PROC_SERVICE) == NOT_SERVING
        state["ready"] = True
        await asyncio.sleep(0.7)  # unpoked: the periodic check finds it
        assert await check(h, "readiness") == SERVING
    finally:
        await h.stop()
    assert await check(h, "liveness") == NOT_SERVING  # stopped: nothing serves
