"""Two `gorgo serve` shells share their dispatches through a real NATS server, and a
router whose NATS is gone keeps deciding (fail open) and catches up when it is back."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterator

import aiohttp
import pytest

from emulator.stack.ports import free_ports
from emulator.stack.processes import nats_binary
from emulator.stack.supervision import wait_port
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config
from ext_proc.core.router import Router
from ext_proc.director.outcomes import Queued, Routed
from ext_proc.prompt.parse import COMPLETIONS
from ext_proc.service.app import Running, running_service
from ext_proc.vocab.request import LlmRequest
from ext_proc.vocab.types import RouteRequest, Status


class Nats:
    """A real NATS server on a loopback port, stoppable and restartable."""

    def __init__(self) -> None:
        (self.port,) = free_ports(1)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [nats_binary(), "-a", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, time.monotonic() + 10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def nats_server() -> Iterator[Nats]:
    server = Nats()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def config(name: str, nats_port: int) -> Config:
    grpc, admin = free_ports(2)
    return config_from_dict(
        {
            "listen": {"grpc": f"127.0.0.1:{grpc}", "admin": f"127.0.0.1:{admin}"},
            "tuner": {"mode": "off"},
            "probes": {"interval_s": 60, "metrics_interval_s": 0},
            "bus": {"nats_url": f"nats://127.0.0.1:{nats_port}", "router_id": name},
            "backends": [{"id": "a", "address": "127.0.0.1:1"}],
        }
    )


def request(rid: str) -> RouteRequest:
    llm = LlmRequest(COMPLETIONS, (f"{rid} " * 400,), (800,), 16, True, None, None)
    return RouteRequest(rid, llm, None)


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_dispatches_reach_the_other_router_and_nats_loss_fails_open(
    nats_server: Nats,
) -> None:
    async with (
        running_service(config("east", nats_server.port)) as east,
        running_service(config("west", nats_server.port)) as west,
        aiohttp.ClientSession() as http,
    ):

        async def fleet(admin_port: int) -> dict[str, object]:
            async with http.get(f"http://127.0.0.1:{admin_port}/state") as r:
                return dict((await r.json())["fleet"])

        peer = west.router
        await reach(east, peer)

        east.router.decide(request("r-1"))
        await until(lambda: "r-1" in peer.peer_in_flight)
        assert peer.backends["a"].load.in_flight == 1 and west.router.decisions == 0
        east.router.close("r-1", Status.OK, 10.0)
        await until(lambda: peer.backends["a"].load.in_flight == 0)
        state = await fleet(west.admin_port)
        assert state["connected"] is True and state["router_id"] == "west"
        assert state["received"] >= 3 and state["malformed"] == 0  # type: ignore[operator]

        # NATS goes away: both keep deciding from their own view, and nothing piles up.
        nats_server.stop()
        await until(lambda: not east.fleet.connected)
        east.router.decide(request("r-2"))
        west.router.decide(request("r-3"))
        east.router.close("r-2", Status.OK, 10.0)
        west.router.close("r-3", Status.OK, 10.0)
        assert east.router.decisions >= 3 and west.router.decisions == 1
        # It comes back: the routers reconnect by themselves and share again.
        nats_server.start()
        await until(lambda: east.fleet.connected and west.fleet.connected, 15.0)
        await reach(east, peer)


async def reach(sender: Running, peer: Router) -> None:
    """Dispatch on `sender` until one reaches `peer` (a subscription is asynchronous),
    then close them all."""
    deadline = time.monotonic() + 10
    while not peer.peer_in_flight:
        sender.router.decide(request(f"probe-{time.monotonic()}"))
        await asyncio.sleep(0.2)
        assert time.monotonic() < deadline, "no dispatch reached the other router"
    for rid in list(sender.router.in_flight):
        sender.router.close(rid, Status.OK, 10.0)
    await until(lambda: not peer.peer_in_flight)


def flow_config(name: str, nats_port: int) -> Config:
    raw = config(name, nats_port)
    return config_from_dict(
        {
            "listen": {"grpc": raw.listen.grpc, "admin": raw.listen.admin},
            "tuner": {"mode": "off"},
            "probes": {"interval_s": 60, "metrics_interval_s": 0},
            "bus": {"nats_url": f"nats://127.0.0.1:{nats_port}", "router_id": name},
            "flow_control": {"enabled": True, "max_waiting_requests": 1},
            "backends": [{"id": "a", "address": "127.0.0.1:1"}],
        }
    )


async def test_flow_control_releases_are_confirmed_and_claims_heard_over_real_nats(
    nats_server: Nats,
) -> None:
    """A release blocks its backend for this router until NATS has the dispatch (a flush
    later); what a router's queue waits for reaches the other; with NATS gone a release
    is confirmed at once (fail open)."""
    async with (
        running_service(flow_config("east", nats_server.port)) as east,
        running_service(flow_config("west", nats_server.port)) as west,
    ):
        await reach(east, west.router)
        flow = east.ext_proc.director.admission
        assert flow.releases is not None and west.ext_proc.director.admission.claims is not None
        out = east.ext_proc.director.handle(request("r-1"))
        assert isinstance(out, Routed)
        assert flow.releases.blocked("a")  # not yet confirmed by the bus
        await until(lambda: flow.releases is not None and not flow.releases.blocked("a"))
        assert flow.releases.confirmed >= 1 and flow.releases.timed_out == 0
        await until(lambda: "r-1" in west.router.peer_in_flight)

        # west's queue waits for a (east's request has no first byte): east hears it
        queued = west.ext_proc.director.handle(request("w-1"))
        assert isinstance(queued, Queued)
        with west.ext_proc.holding.hold(queued.ticket) as waiting:
            await until(lambda: "west" in flow.snapshot()["peer_claims"])
            claims = flow.snapshot()["peer_claims"]["west"]
            assert claims == {"backends": {"a": 0}, "heads": {"0": 1}}
            east.router.close("r-1", Status.OK, 10.0)  # room: west's request goes
            assert isinstance(await asyncio.wait_for(waiting, 5), Routed)
        await until(lambda: "west" not in flow.snapshot()["peer_claims"])
        west.router.close("w-1", Status.OK, 10.0)
        await until(lambda: not east.router.peer_in_flight)  # room for r-2

        nats_server.stop()
        await until(lambda: not east.fleet.connected)
        before = flow.releases.confirmed
        assert isinstance(east.ext_proc.director.handle(request("r-2")), Routed)
        await until(lambda: flow.releases is not None and flow.releases.confirmed > before)
        assert flow.releases.timed_out == 0
        east.router.close("r-2", Status.OK, 10.0)


async def test_a_router_back_on_the_bus_forgets_the_peer_requests_whose_close_it_missed(
    nats_server: Nats,
) -> None:
    """Core NATS keeps nothing for a subscriber that was away: a close published while
    west was cut off never reaches it. After a reconnect each router says what it has in
    flight (SYNC), and west forgets east's request it still counted."""
    from types import SimpleNamespace

    from ext_proc.feeds.peers import PeerEvent, PeerKind

    async with (
        running_service(config("east", nats_server.port)) as east,
        running_service(config("west", nats_server.port)) as west,
    ):
        peer = west.router
        await reach(east, peer)
        east.router.decide(request("r-live"))
        await until(lambda: "r-live" in peer.peer_in_flight)
        nats_server.stop()
        await until(lambda: not west.fleet.connected and not east.fleet.connected)
        # east's request that closed while west was away: west heard its dispatch only
        ghost = PeerEvent(PeerKind.DISPATCHED, "east", "r-ghost", "a", input_tokens=800)
        await west.fleet._on_message(
            SimpleNamespace(subject="gorgo.fleet.east", data=ghost.encode())
        )
        assert {"r-live", "r-ghost"} <= set(peer.peer_in_flight)
        assert peer.backends["a"].load.in_flight == 2
        nats_server.start()
        await until(lambda: "r-ghost" not in peer.peer_in_flight, 15.0)
        assert "r-live" in peer.peer_in_flight  # still in flight at east: still counted
        assert peer.backends["a"].load.in_flight == 1
        assert west.fleet.snapshot()["forgotten"] == 1  # type: ignore[index]
        east.router.close("r-live", Status.OK, 10.0)
        await until(lambda: not peer.peer_in_flight)
