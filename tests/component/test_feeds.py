"""A feed is one class registered by name: a toy one is started with the service, told of
each backend as it is added or removed at run time (the fleet shell drives every feed
alike), shown in /state, and stopped with the service."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from ext_proc.config.load import backend_from_dict, config_from_dict
from ext_proc.config.schema import Config
from ext_proc.core.router import Router
from ext_proc.service.app import running_service
from ext_proc.service.loops.catalog import register_feed, unregister_feed
from ext_proc.vocab.backend import Backend

pytestmark = pytest.mark.component


class Heard:
    """What the toy feed was told, by all its instances."""

    calls: list[str] = []


@pytest.fixture
def toy() -> Iterator[str]:
    @register_feed("toy")
    class ToyFeed:
        """Reads nothing: it only says what it was told."""

        name = "toy"

        def __init__(self, cfg: Config, router: Router) -> None:
            self.router = router
            self.read: list[str] = []

        async def start(self) -> None:
            Heard.calls.append("start")
            for b in self.router.cfg.backends:
                self.add(b)

        def add(self, backend: Backend) -> None:
            Heard.calls.append(f"add {backend.id}")
            self.read.append(backend.id)

        def cancel(self, backend: str) -> list[asyncio.Task[None]]:
            Heard.calls.append(f"cancel {backend}")
            if backend in self.read:
                self.read.remove(backend)
            return []

        @property
        def backends(self) -> list[str]:
            return list(self.read)

        async def stop(self) -> None:
            Heard.calls.append("stop")

    Heard.calls = []
    yield "toy"
    unregister_feed("toy")


async def test_a_registered_feed_follows_the_fleet(toy: str) -> None:
    cfg = config_from_dict(
        {
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "backends": [{"id": "a", "address": "127.0.0.1:1"}],
            "probes": {"models_interval_s": 0, "metrics_interval_s": 0},
        }
    )
    async with running_service(cfg) as svc, aiohttp.ClientSession() as http:
        assert Heard.calls[:2] == ["start", "add a"]
        svc.router.fleet.add(backend_from_dict({"id": "b", "address": "127.0.0.1:2"}), "test")
        await svc.fleet_shell.settle()
        svc.router.fleet.drain("a", "test")  # nothing in flight: removed at once
        await svc.fleet_shell.settle()
        async with http.get(f"http://127.0.0.1:{svc.admin_port}/state") as r:
            shown = (await r.json())["fleet_shell"][toy]
        assert shown == ["b"]
        assert "add b" in Heard.calls and "cancel a" in Heard.calls
    assert Heard.calls[-1] == "stop"
