"""Several regions, several routers, under a steady load (`gorgo up --front-doors 3
--routers 2`): a router killed (kill -9), one region's NATS server frozen for 30 s, every
NATS server frozen (the routers run alone), then all back. No request may fail; after
the load the routers' views agree (nothing counted in flight anywhere) within 5 s. Prints
TTFT per phase: the routing quality during each outage against before it.

`pytest -s -m long tests/e2e/test_regions_faults.py` (about 90 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import pytest

from loadgen.client.stream import send_chat
from tests.e2e.stack_harness import wait_for
from tests.e2e.test_front_doors import three_doors_two_routers

pytestmark = [pytest.mark.e2e, pytest.mark.long]

RATE_PER_S = 4.0


@dataclass
class Load:
    """Requests sent round robin over the doors at RATE_PER_S, each tagged with the phase
    it was sent in, until `stop`."""

    urls: list[str]
    phase: str = "before"
    results: list[tuple[str, bool, float | None, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as s:
            tasks, k = [], 0
            while not self.stop.is_set():
                url, phase = self.urls[k % len(self.urls)], self.phase
                tasks.append(asyncio.create_task(self._one(s, url, phase, k)))
                k += 1
                await asyncio.sleep(1 / RATE_PER_S)
            await asyncio.gather(*tasks)

    async def _one(self, s: aiohttp.ClientSession, url: str, phase: str, k: int) -> None:
        body = {
            "model": "default",
            "stream": True,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": f"session {k % 12} says hello " * 40}],
        }
        r = await send_chat(s, url, body, f"load-{k}", {"x-session-id": f"s{k % 12}"})
        self.results.append((phase, r.ok, r.ttft_ms, r.error))

    def thread(self) -> threading.Thread:
        t = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        t.start()
        return t


def state(admin_url: str) -> dict:
    with urllib.request.urlopen(f"{admin_url}/state", timeout=5) as r:
        return dict(json.loads(r.read()))


def test_a_router_killed_and_nats_frozen_fail_no_request_and_the_views_agree_after() -> None:
    stack = three_doors_two_routers()
    stack.start()
    admins = [*stack.admin_urls, *(u for d in stack.doors for u in d.admin_urls)]
    nats = {name: stack.procs[name].pid for name in stack.procs if name.startswith("nats")}
    load = Load([stack.front_door_url, *(d.url for d in stack.doors)])
    try:
        assert len(admins) == 6 and len(nats) == 3
        wait_for(lambda: all(state(a)["fleet"]["connected"] for a in admins), 15)
        worker = load.thread()
        time.sleep(8)
        load.phase = "router killed"  # Frankfurt's second router, kill -9
        os.kill(stack.procs["door-eu-frankfurt-2-gorgo-serve"].pid, signal.SIGKILL)
        dead = stack.doors[0].admin_urls[1]  # not restarted here (`gorgo up` would)
        admins.remove(dead)
        time.sleep(8)
        load.phase = "one NATS frozen"  # Seoul's server, for 30 s
        os.kill(nats["nats-ap-seoul"], signal.SIGSTOP)
        try:
            time.sleep(30)
        finally:
            os.kill(nats["nats-ap-seoul"], signal.SIGCONT)
        load.phase = "every NATS frozen"  # the routers run alone
        for pid in nats.values():
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(6)
            alone = [state(a)["fleet"]["connected"] for a in admins[:2]]
            time.sleep(6)
        finally:
            for pid in nats.values():
                os.kill(pid, signal.SIGCONT)
        load.phase = "after"
        time.sleep(8)
        load.stop.set()
        worker.join(60)
        back = time.monotonic()

        def agree() -> bool:
            views = [state(a) for a in admins]
            return all(
                v["fleet"]["connected"]
                and v["in_flight"] == 0
                and v["fleet"]["peer_requests_in_flight"] == 0
                for v in views
            )

        try:
            wait_for(agree, 5 + 5)  # a request's last bytes may take a few seconds
        except AssertionError:
            views = {a: state(a) for a in admins}
            raise AssertionError(
                {
                    a: (
                        v["in_flight"],
                        v["fleet"]["connected"],
                        v["fleet"]["peer_requests_in_flight"],
                    )
                    for a, v in views.items()
                }
            ) from None
        settled_s = time.monotonic() - back
        phases = ["before", "router killed", "one NATS frozen", "every NATS frozen", "after"]
        print()
        for phase in phases:
            got = [r for r in load.results if r[0] == phase]
            ttft = sorted(t for _, ok, t, _ in got if ok and t is not None)
            p95 = ttft[int(0.95 * (len(ttft) - 1))] if ttft else float("nan")
            print(
                f"{phase:18} {len(got):4d} requests, {sum(not ok for _, ok, _, _ in got)} failed, "
                f"TTFT p50 {statistics.median(ttft) if ttft else float('nan'):.0f} ms, "
                f"p95 {p95:.0f} ms"
            )
        print(f"routers alone while every NATS was frozen: {alone}")
        print(f"views agreed {settled_s:.1f} s after the load ended")
        failed = [r for r in load.results if not r[1]]
        assert not failed, failed[:5]
        assert alone == [False, False]  # they said so
        assert {r[0] for r in load.results} == set(phases)
    finally:
        load.stop.set()
        stack.stop()
