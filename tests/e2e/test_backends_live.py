"""Backends change while requests flow, through real Envoy and one `gorgo serve`: a fourth
backend added by the admin API gets decisions, a drained one gets none after the call and
ends removed, a deleted one goes, a config reload (SIGHUP) adds one, and no request fails.
Neither Envoy nor the router restarts: Envoy follows the xDS files the router rewrites
(envoy.xds_dir, docs/envoy.md)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import yaml

from emulator.stack.settings import Region
from emulator.stack.stack import Stack
from loadgen.client.stream import Result, chat_body, send_chat
from tests.e2e.conftest import FAST_ENGINE, FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import admin_call

pytestmark = pytest.mark.e2e

ASHBURN, FRANKFURT, SEOUL = (r.id for r in FAST_REGIONS)
# Streams long enough that every change below finds requests in flight on the backend it
# touches: 40 tokens at 15 ms each.
SLOW_DECODE = (*FAST_ENGINE, "--set", "decode_base_ms=15")
CLIENTS = 16
TOKENS = 40


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings("round_robin", engine_args=SLOW_DECODE, probe_interval_s=0.5))
    s.start()
    yield s
    s.stop()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def envoy_clusters(stack: Stack) -> set[str]:
    with urllib.request.urlopen(f"{stack.envoy_admin_url}/clusters", timeout=5) as r:
        return {line.split("::", 1)[0] for line in r.read().decode().splitlines()}


def lifecycle(stack: Stack) -> dict[str, str]:
    """Backend id -> lifecycle (pending, active, draining; removed ones are not listed)."""
    rows = get_json(f"{stack.admin_url}/backends")["backends"]
    return {row["id"]: row["lifecycle"] for row in rows}


@dataclass
class Load:
    """CLIENTS closed-loop clients streaming through the front door, in a thread of their
    own until stopped (the test's thread starts the stack's children: they die with the
    thread that started them); each result with the moment it was sent."""

    url: str
    sent: list[tuple[float, Result]] = field(default_factory=list)
    stopping: bool = False
    thread: threading.Thread | None = None

    async def client(self, http: aiohttp.ClientSession, c: int) -> None:
        i = 0
        while not self.stopping:
            t = time.monotonic()
            r = await send_chat(http, self.url, chat_body(f"c{c} r{i} " * 8, TOKENS), f"{c}-{i}")
            self.sent.append((t, r))
            i += 1

    async def clients(self) -> None:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(self.client(http, c) for c in range(CLIENTS)))

    def __enter__(self) -> Load:
        self.thread = threading.Thread(target=asyncio.run, args=(self.clients(),))
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping = True
        assert self.thread is not None
        self.thread.join(timeout=30)

    def served_by(self, backend: str, after: float = 0.0) -> list[Result]:
        return [r for t, r in list(self.sent) if r.backend == backend and t >= after]

    def across(self, backend: str, moment: float) -> list[Result]:
        """Its requests sent before `moment` that finished after it: in flight then."""
        return [
            r
            for t, r in list(self.sent)
            if r.backend == backend and t < moment < t + (r.e2e_ms or 0) / 1e3
        ]

    @property
    def failed(self) -> list[Result]:
        return [r for _, r in self.sent if not r.ok or r.output_tokens != TOKENS]


def until(predicate: Any, timeout_s: float, what: str) -> float:
    """Poll until true; returns the moment it became true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.02)
    return time.monotonic()


@pytest.mark.long  # `make test-long`
def test_add_drain_and_delete_while_requests_flow(stack: Stack) -> None:
    pids = (stack.procs["envoy"].pid, stack.procs["gorgo-serve"].pid)
    figures: dict[str, Any] = {}
    decisions = get_json(f"{stack.admin_url}/state")["decisions"]
    with Load(stack.front_door_url) as load:
        time.sleep(1.5)

        # (1) a fourth engine, started now, added through the admin API
        item = stack.add_engine(Region("sa-saopaulo", 3.0))
        t_add = time.monotonic()
        status, row = admin_call(stack, "POST", "/backends", item)
        assert status == 201 and row["lifecycle"] == "active", row
        figures["add_call_s"] = time.monotonic() - t_add
        assert "sa-saopaulo" in envoy_clusters(stack)  # active only once Envoy has it
        first = until(lambda: bool(load.served_by("sa-saopaulo")), 10, "decisions to it")
        figures["add_to_first_done_s"] = first - t_add
        time.sleep(1.0)

        # (2) drain ashburn: no decision after the call, its requests finish, then removed
        status, _ = admin_call(stack, "POST", f"/backends/{ASHBURN}/drain")
        assert status == 202
        t_drain = time.monotonic()
        until(lambda: ASHBURN not in lifecycle(stack), 15, "drained backend removed")
        until(lambda: ASHBURN not in envoy_clusters(stack), 5, "its cluster gone from Envoy")
        figures["drain_to_removed_s"] = time.monotonic() - t_drain

        # (3) delete frankfurt
        status, _ = admin_call(stack, "DELETE", f"/backends/{FRANKFURT}")
        assert status == 202
        t_delete = time.monotonic()
        until(lambda: FRANKFURT not in lifecycle(stack), 15, "deleted backend removed")
        until(lambda: FRANKFURT not in envoy_clusters(stack), 5, "its cluster gone from Envoy")
        figures["delete_to_removed_s"] = time.monotonic() - t_delete
        time.sleep(1.0)
    figures["decided"] = get_json(f"{stack.admin_url}/state")["decisions"] - decisions
    figures["in_flight_across_drain"] = len(load.across(ASHBURN, t_drain))
    figures["in_flight_across_delete"] = len(load.across(FRANKFURT, t_delete))
    by_backend: dict[str, int] = {}
    for _, r in load.sent:
        by_backend[r.backend] = by_backend.get(r.backend, 0) + 1
    shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    print(f"\nrequests {len(load.sent)}, failed {len(load.failed)}, served {by_backend}, {shown}")
    assert load.failed == [], [r.error for r in load.failed][:5]
    # the router decided (nearly) all of them: the changes did not make Envoy fail open
    assert figures["decided"] >= 0.9 * len(load.sent)
    assert len(load.served_by("sa-saopaulo", after=t_add)) >= 5
    # no decision reached them after the call; what was in flight then finished (ok above)
    assert load.served_by(ASHBURN, after=t_drain) == []
    assert load.served_by(FRANKFURT, after=t_delete) == []
    assert figures["in_flight_across_drain"] >= 1 and figures["in_flight_across_delete"] >= 1
    # neither Envoy nor the router restarted
    assert (stack.procs["envoy"].pid, stack.procs["gorgo-serve"].pid) == pids
    assert all(stack.procs[n].poll() is None for n in ("envoy", "gorgo-serve"))


def test_a_config_reload_adds_a_backend(stack: Stack) -> None:
    pid = stack.procs["gorgo-serve"].pid
    item = stack.add_engine(Region("af-capetown", 4.0))
    path = stack.workdir / "gorgo.yaml"
    raw = yaml.safe_load(path.read_text())
    # declarative: the running fleet (as the admin API left it) plus the new backend
    rows = get_json(f"{stack.admin_url}/backends")["backends"]
    raw["backends"] = [row["config"] for row in rows] + [item]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    tmp.replace(path)
    stack.procs["gorgo-serve"].send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while lifecycle(stack).get("af-capetown") != "active":
        assert time.monotonic() < deadline, lifecycle(stack)
        time.sleep(0.05)
    assert "af-capetown" in envoy_clusters(stack)

    async def some() -> list[Result]:
        async with aiohttp.ClientSession() as http:
            return list(
                await asyncio.gather(
                    *(
                        send_chat(http, stack.front_door_url, chat_body(f"r{i}", 4), f"r{i}")
                        for i in range(12)
                    )
                )
            )

    results = asyncio.run(some())
    assert all(r.ok for r in results), [r.error for r in results]
    assert any(r.backend == "af-capetown" for r in results)
    assert stack.procs["gorgo-serve"].pid == pid and stack.procs["gorgo-serve"].poll() is None
