"""Active-passive `gorgo epp` replicas (service/loops/leader.py) against the fake API
server's Leases: exactly one replica leads and is ready; when it dies, another takes the
Lease once it runs out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from emulator.stack.ports import free_ports
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config
from ext_proc.service.loops.leader import LeaderLease
from tests.kube_api import FakeKubeApi, inference_pool, pod

pytestmark = pytest.mark.component

APP = {"app": "vllm"}
# The shortest timings the library takes (lease > renew > 1.2 x retry, retry >= 1 s).
FAST = {"enabled": True, "lease_duration_s": 3, "renew_deadline_s": 2.5, "retry_period_s": 1}


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    fake = FakeKubeApi()
    await fake.start()
    fake.put_pool(inference_pool("llama", APP, [8000]))
    fake.put_pod(pod("vllm-0", "10.0.0.1", APP))
    yield fake
    await fake.stop()


def config(kubeconfig: Path, leader: bool = True, nats_url: str = "", name: str = "") -> Config:
    grpc, admin = free_ports(2)
    # (replicas are pods with host names of their own; here one process holds both)
    bus = {"bus": {"nats_url": nats_url, "router_id": name}} if nats_url else {}
    return config_from_dict(
        {
            "listen": {"grpc": f"127.0.0.1:{grpc}", "admin": f"127.0.0.1:{admin}"},
            "envoy": {"mode": "endpoint_picker"},
            "tuner": {"mode": "off"},
            "probes": {"interval_s": 60, "metrics_interval_s": 0},
            "discovery": {
                "kubernetes": {
                    "pool_name": "llama",
                    "kubeconfig": str(kubeconfig),
                    "leader_election": FAST if leader else {},
                }
            },
            **bus,
        }
    )


def leader_cfg(api: FakeKubeApi, tmp_path: Path) -> Config:
    return config(api.kubeconfig(tmp_path / "kubeconfig"))


async def until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.long  # waits out a Lease (7 s): `make test-long`, which CI runs
async def test_one_replica_leads_and_another_takes_over_when_it_dies(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    cfg = leader_cfg(api, tmp_path)
    replicas = [LeaderLease(cfg, identity=name) for name in ("epp-a", "epp-b")]
    for r in replicas:
        await r.start()
    try:
        await until(lambda: any(r.leading for r in replicas), 5)
        await asyncio.sleep(2.5)  # a few renewals: still exactly one
        (leader,) = [r for r in replicas if r.leading]
        (standby,) = [r for r in replicas if not r.leading]
        assert api.holder("gorgo-epp-llama") == leader.identity
        for task in leader._tasks:  # killed: it neither renews nor releases the Lease
            task.cancel()
        died = time.monotonic()
        await until(lambda: standby.leading, 3 + 1 + 2)  # the lease, a retry, slack
        assert api.holder("gorgo-epp-llama") == standby.identity
        assert time.monotonic() - died >= 1.0  # not before the dead one's Lease ran out
        assert standby.elected == 1
        # a clean stop hands the Lease back: the other takes it at its next try
        leader.leading = False
        await leader.stop()
        await until(lambda: not leader._tasks or all(t.done() for t in leader._tasks), 2)
        back = LeaderLease(leader_cfg(api, tmp_path), identity="epp-c")
        await back.start()
        await standby.stop()
        stopped = time.monotonic()
        await until(lambda: back.leading, 3)
        assert time.monotonic() - stopped < 1.8  # its next try (1 s), not the 3 s Lease
        await back.stop()
    finally:
        for r in replicas:
            await r.stop()


async def test_only_the_leader_is_ready(api: FakeKubeApi, tmp_path: Path) -> None:
    """Through the service: /readyz (and the gRPC readiness) pass on the Lease's holder
    alone; /state says which replica holds it."""
    from ext_proc.service.app import running_service

    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    async with (
        running_service(config(kubeconfig)) as a,
        running_service(config(kubeconfig)) as b,
        aiohttp.ClientSession() as http,
    ):

        async def ready(port: int) -> bool:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
                return r.status == 200

        async def both() -> list[bool]:
            return [await ready(a.admin_port), await ready(b.admin_port)]

        deadline = time.monotonic() + 8
        while sorted(await both()) != [False, True]:
            assert time.monotonic() < deadline, await both()
            await asyncio.sleep(0.1)
        async with http.get(f"http://127.0.0.1:{a.admin_port}/state") as r:
            state = (await r.json())["leader_election"]
        assert state["lease"] == "default/gorgo-epp-llama"
        assert state["leading"] == (await ready(a.admin_port))


def active(router: object) -> bool:
    from ext_proc.vocab.types import BackendLifecycle

    b = getattr(router, "backends", {}).get("vllm-0-rank-0")
    return b is not None and b.lifecycle is BackendLifecycle.ACTIVE


@pytest.mark.long  # two services and NATS (10 s)
async def test_active_active_replicas_each_count_the_others_dispatches(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    """Without leader election both endpoint-picker replicas serve; over the bus each
    counts the other's requests on the pool's backends (the same ids, from the same pods)."""
    from ext_proc.service.app import running_service
    from tests.component.test_fleet_bus import Nats, request, until

    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    nats = Nats()
    nats.start()
    url = f"nats://127.0.0.1:{nats.port}"
    try:
        async with (
            running_service(config(kubeconfig, False, url, "epp-a")) as a,
            running_service(config(kubeconfig, False, url, "epp-b")) as b,
        ):
            for r in (a, b):  # the pool's pod, found and in rotation
                await until(lambda r=r: active(r.router), 8.0)
            await until(lambda: a.fleet.connected and b.fleet.connected, 8.0)
            deadline = time.monotonic() + 8
            k = 0
            while not b.router.peer_in_flight:  # a subscription is asynchronous
                a.router.decide(request(f"a-{k}"))
                k += 1
                await asyncio.sleep(0.2)
                assert time.monotonic() < deadline, "a's dispatches never reached b"
            b.router.decide(request("b-1"))
            await until(lambda: "b-1" in a.router.peer_in_flight)
            assert b.router.backends["vllm-0-rank-0"].load.in_flight >= 2
    finally:
        nats.stop()
