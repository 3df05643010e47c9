"""gorgo as the endpoint picker behind an Envoy configured as the Gateway API Inference
Extension's standalone chart configures its own (emulator/stack/gateway_envoy.py): both bodies
FULL_DUPLEX_STREAMED, an ORIGINAL_DST cluster on `x-gateway-destination-endpoint`, TLS to
the picker, its gRPC health check. Bodies reach the engine byte for byte, responses
stream, the subset hint is obeyed, no endpoint is a 503, a served endpoint another than the
chosen one is credited, and the chart's health check finds the picker healthy."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from emulator.engine.runner import body_digest
from emulator.stack.gateway_envoy import (
    SERVED_ROUTE_HEADER,
    SUBSET_ROUTE_HEADER,
    gateway_envoy_config,
)
from emulator.stack.ports import free_ports
from emulator.stack.stack import Stack
from ext_proc.config.transport import ClientTls, ServerTls
from loadgen.client.stream import CHAT_PATH, Result, chat_body, send_chat
from tests.certs import Ca
from tests.e2e.conftest import FAST_ENGINE, FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import engine_counts, get_json, router_state, wait_for

pytestmark = pytest.mark.e2e

ASHBURN, FRANKFURT, SEOUL = (r.id for r in FAST_REGIONS)
# A decode step of 10 ms: a 40-token answer streams for ~0.4 s.
ENGINE = (*FAST_ENGINE, "--set", "decode_base_ms=10")
MIB = 1024 * 1024


@dataclass
class Gateway:
    stack: Stack
    url: str
    admin_url: str
    # each backend's address, as the pool's endpoints are named
    address: dict[str, str]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    ca = Ca(tmp_path_factory.mktemp("certs"))
    server = ca.issue("gorgo-picker")
    stack = Stack(
        fast_settings(
            "round_robin", envoy_mode="endpoint_picker", wan_links=False, engine_args=ENGINE
        )
    )
    cfg = stack.config
    stack.config = dataclasses.replace(
        cfg,
        # the chart's Envoy speaks TLS to the picker and accepts any certificate
        listen=dataclasses.replace(cfg.listen, tls=ServerTls(str(server.cert), str(server.key))),
        envoy=dataclasses.replace(
            cfg.envoy,
            ext_proc_tls=ClientTls(str(ca.pem.cert)),  # the stack's own front door
            # an ORIGINAL_DST cluster takes one address: no fallback endpoints
            connect_retries=0,
        ),
    )
    stack.start()
    try:
        address = {b.id: b.address for b in stack.config.backends}
        listen, admin = free_ports(2)
        picker_port = int(stack.config.listen.grpc.rsplit(":", 1)[1])
        config = gateway_envoy_config(
            listen,
            admin,
            picker_port,
            subsets={"seoul": [address[SEOUL], "10.255.255.1:8000"], "none": ["10.255.255.1:8000"]},
            served={"seoul": address[SEOUL]},
        )
        stack.start_envoy("gateway", config)
        admin_url = f"http://127.0.0.1:{admin}"
        wait_for(lambda: _ok(f"{admin_url}/ready"), timeout_s=15)
        yield Gateway(stack, f"http://127.0.0.1:{listen}", admin_url, address)
    finally:
        stack.stop()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


async def _post(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{url}{CHAT_PATH}",
            data=data,
            headers={"content-type": "application/json", **(headers or {})},
        ) as r,
    ):
        await r.read()
        return r.status, r.headers.get("x-gorgo-backend", "")


def chats(url: str, n: int, headers: dict[str, str] | None = None, tokens: int = 2) -> list[Result]:
    async def run() -> list[Result]:
        async with aiohttp.ClientSession() as s:
            return [
                await send_chat(s, url, chat_body(f"turn {i}", tokens), f"g{i}", headers)
                for i in range(n)
            ]

    return asyncio.run(run())


def recent_bodies(stack: Stack) -> set[tuple[int, str]]:
    return {
        (n, digest)
        for i in range(len(FAST_REGIONS))
        for n, digest in get_json(f"{stack.engine_url(i)}/stats")["recent_bodies"]
    }


def test_the_charts_health_check_finds_the_picker_serving(gateway: Gateway) -> None:
    """Envoy checks grpc.health.v1 on the ext_proc service's name, over TLS."""
    with urllib.request.urlopen(f"{gateway.admin_url}/clusters?format=json", timeout=5) as r:
        clusters = json.load(r)["cluster_statuses"]
    (picker,) = [c for c in clusters if c["name"] == "ext_proc"]
    (host,) = picker["host_statuses"]
    assert host["health_status"]["eds_health_status"] == "HEALTHY"
    assert "failed_active_health_check" not in host["health_status"]


def test_bodies_from_1_kb_to_8_mb_reach_the_engine_byte_for_byte(gateway: Gateway) -> None:
    sent = []
    for size in (1024, 64 * 1024, MIB, 8 * MIB):
        body = chat_body(f"size {size}", 1, stream=False)
        # the bulk in a field the engine ignores: the prompt stays short
        body["padding"] = ""
        pad = size - len(json.dumps(body).encode())
        body["padding"] = "".join(chr(0x61 + (i * 7 + size) % 26) for i in range(pad))
        data = json.dumps(body).encode()
        assert abs(len(data) - size) <= 2
        status, backend = asyncio.run(_post(gateway.url, data))
        assert (status, backend in gateway.address) == (200, True), (size, status)
        sent.append((len(data), body_digest(data)))
    assert set(sent) <= recent_bodies(gateway.stack)


def test_a_streamed_response_streams(gateway: Gateway) -> None:
    (r,) = chats(gateway.url, 1, tokens=40)
    assert r.ok, r.error
    assert r.output_tokens == 40 and len(r.itl_ms) == 39
    assert r.ttft_ms is not None and r.e2e_ms is not None
    # ~10 ms a token: the first arrived long before the last, not all at the end
    assert r.e2e_ms > 300 and r.ttft_ms < r.e2e_ms / 3, (r.ttft_ms, r.e2e_ms)
    assert sum(1 for gap in r.itl_ms if gap > 3) >= 20  # spread, not one burst


def test_the_subset_is_obeyed_and_no_endpoint_is_a_503(gateway: Gateway) -> None:
    before = engine_counts(gateway.stack)
    results = chats(gateway.url, 4, {SUBSET_ROUTE_HEADER: "seoul"})
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.backend for r in results] == [SEOUL] * 4  # round robin would have gone round
    after = engine_counts(gateway.stack)
    assert {b: after[b] - before[b] for b in before} == {ASHBURN: 0, FRANKFURT: 0, SEOUL: 4}
    (refused,) = chats(gateway.url, 1, {SUBSET_ROUTE_HEADER: "none"})
    assert refused.status == 503 and "no endpoint can take the request" in refused.error
    # every routed request was closed by its stream's end (the chart sends no access log)
    wait_for(lambda: router_state(gateway.stack)["in_flight"] == 0)


def test_the_served_endpoint_gets_the_request(gateway: Gateway) -> None:
    """A data plane that reports another endpoint than the one named (it went on after a
    connect failure): seoul is credited with the answer, the chosen one with a failover."""

    def counts() -> dict[str, tuple[int, int]]:
        b = router_state(gateway.stack)["backends"]
        return {k: (v["completed"], v["failovers"]) for k, v in b.items()}

    before = counts()
    results = chats(gateway.url, 3, {SERVED_ROUTE_HEADER: "seoul"})
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.backend for r in results] == [SEOUL] * 3  # the echo names who answered
    wait_for(lambda: router_state(gateway.stack)["in_flight"] == 0)
    decided = [d["backend"] for d in router_state(gateway.stack)["recent_decisions"][-3:]]
    after = counts()
    for b in (ASHBURN, FRANKFURT):
        failed_over = decided.count(b)
        assert after[b] == (before[b][0], before[b][1] + failed_over), (b, decided)
    assert after[SEOUL][0] - before[SEOUL][0] == 3
