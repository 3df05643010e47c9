"""What the e2e tests ask of a running Stack: its router's /state and its engines'
counts, changes through its admin (with the stack's token), chats through its front door,
waiting for a condition, and its regions spread apart (1 / 60 / 120 ms)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp

from emulator.stack.stack import Stack
from loadgen.client.stream import Result, chat_body, send_chat
from tests.e2e.conftest import FAST_REGIONS

ASHBURN, FRANKFURT, SEOUL = (r.id for r in FAST_REGIONS)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def admin_call(stack: Stack, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """A change through the router's admin, as the stack's own tools make it: JSON, with
    the stack's token (gorgo up generates one). (status, JSON body), errors included."""
    req = urllib.request.Request(
        f"{stack.admin_url}{path}",
        method=method,
        data=json.dumps({} if body is None else body).encode(),
        headers=stack.admin_headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def engine_counts(stack: Stack) -> dict[str, int]:
    return {
        r.id: get_json(f"{stack.engine_url(i)}/stats")["requests_total"]
        for i, r in enumerate(FAST_REGIONS)
    }


def router_state(stack: Stack) -> Any:
    return get_json(f"{stack.admin_url}/state")


async def chats(
    url: str, bodies: list[dict[str, Any]], headers: dict[str, str] | None = None
) -> list[Result]:
    async with aiohttp.ClientSession() as s:
        return [await send_chat(s, url, b, f"t{i}", headers) for i, b in enumerate(bodies)]


def wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def rtt(stack: Stack, backend: str) -> float:
    return float(router_state(stack)["backends"][backend]["rtt_ms"])


def spread_regions(stack: Stack) -> None:
    """Regions 1 / 60 / 120 ms away: costs differ beyond gorgo's 20 % tie band and any
    probe noise on a busy machine, so the nearest region wins an idle fleet."""
    stack.set_rtt_ms(1, 60)
    stack.set_rtt_ms(2, 120)
    wait_for(lambda: rtt(stack, FRANKFURT) > 40 and rtt(stack, SEOUL) > 80, timeout_s=10)


@dataclass
class Timed:
    result: Result
    start_s: float  # monotonic
    end_s: float


class ClosedLoop:
    """`clients` closed-loop streaming clients in a thread of their own until the `with`
    block ends; each request's result with when it was sent and when it ended."""

    def __init__(self, url: str, clients: int, output_tokens: int, timeout_s: float = 30) -> None:
        self.url = url
        self.clients = clients
        self.output_tokens = output_tokens
        self.timeout_s = timeout_s
        self.done: list[Timed] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.clients)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client(i: int) -> None:
                n = 0
                while not self._stop.is_set():
                    start_s = time.monotonic()
                    body = chat_body(f"client {i} turn {n} " * 20, self.output_tokens)
                    r = await send_chat(session, self.url, body, f"c{i}-{n}", None, self.timeout_s)
                    self.done.append(Timed(r, start_s, time.monotonic()))
                    n += 1

            await asyncio.gather(*(client(i) for i in range(self.clients)))

    def __enter__(self) -> ClosedLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def failed(self) -> list[Timed]:
        return [d for d in self.done if not d.result.ok]

    def after(self, t_s: float) -> list[Timed]:
        """The requests that ended after t_s (monotonic)."""
        return [d for d in self.done if d.end_s > t_s]


def decisions_by_backend(stack: Stack) -> dict[str, float]:
    """The router's gorgo_decisions_total, summed per backend."""
    with urllib.request.urlopen(f"{stack.admin_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gorgo_decisions_total{"):
            backend = line.split('backend="', 1)[1].split('"', 1)[0]
            out[backend] = out.get(backend, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
