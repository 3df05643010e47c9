"""A disaggregated decision through real Envoy (docs/envoy.md, "Prefill and decode apart"):
the router sends the prefill leg itself, Envoy carries the decode leg, and the client sees
one normal stream naming both engines, in SGLang's protocol (the bootstrap fields in both
bodies) and vLLM's (the one-token prefill's kv_transfer_params in the decode body), with
the generated front door (plain ext_proc) and behind the Gateway API Inference Extension
chart's Envoy (endpoint picker, FULL_DUPLEX_STREAMED). A failed prefill leg is a clear
error naming the prefill engine, the decode engine never gets a body, and nothing stays
in flight.

Until the core's P/D decision lands, a stub stands in for it: a test policy that picks the
decode backend, and the Director's outcome given `prefill` (the prefill backend). Stub
engines speaking the protocols' minimum (tests/pd_engines.py) test every path, failures
included; the P/D twins (emulator/engine/disagg/; the test is skipped, saying so, where
they are missing) show the real protocols end to end, the KV over a link between them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import random
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from emulator.stack.gateway_envoy import gateway_envoy_config
from emulator.stack.ports import free_ports
from emulator.stack.processes import envoy_binary
from ext_proc.config.load import config_from_dict
from ext_proc.core.build import build_router
from ext_proc.core.router import Router
from ext_proc.director.outcomes import Routed
from ext_proc.envoy.server import add_services, grpc_options
from ext_proc.envoy_config.bootstrap import render_envoy_config
from ext_proc.policy.base import POLICIES, NoParams, register
from ext_proc.vocab.policy import Choice
from ext_proc.vocab.types import Candidate, PrefillLeg, RouteRequest, Weights
from tests.pd_engines import TOKENS, StubEngine, stub_engines

pytestmark = pytest.mark.e2e

# The P/D twins (emulator/engine/disagg/, merged from s59-twin2).
TWINS = importlib.util.find_spec("emulator.engine.disagg") is not None
NO_TWINS = "the P/D twins (emulator/engine/disagg/) are not on this branch"

PD_STUB = "pd_stub_decode"
CHAT = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


class PickDecode:
    """Test only: the backend named `dec` (the core's pair choice stands in)."""

    name = PD_STUB

    def __init__(self, rng: random.Random, params: NoParams) -> None:
        pass

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        return Choice("dec", {})


@pytest.fixture(autouse=True)
def _pd_stub_policy() -> Iterator[None]:
    """Registered while this module's tests run, not at import: the tests that run every
    registered policy (tests/unit/core/test_fleet.py) are collected before it runs."""
    register(PD_STUB)(PickDecode)
    try:
        yield
    finally:
        POLICIES.pop(PD_STUB, None)


@dataclass
class Front:
    url: str
    router: Router
    prefill: StubEngine
    decode: StubEngine


@asynccontextmanager
async def pd_front(
    tmp: Path,
    engine: str,
    picker: bool = False,
    prefill_timeout_s: float = 5.0,
    dead_prefill: bool = False,
    decode_role: str = "decode",
) -> AsyncIterator[Front]:
    """The stub engines, the router in this process, and a real Envoy in front: the
    generated front door, or (picker) the inference-gateway chart's Envoy."""
    async with stub_engines(engine) as (pre, dec):
        (dead,) = free_ports(1)
        addresses = (f"127.0.0.1:{dead}" if dead_prefill else pre.address, dec.address)
        async with front(tmp, engine, addresses, 9999, picker, prefill_timeout_s, decode_role) as (
            url,
            r,
        ):
            yield Front(url, r, pre, dec)


@asynccontextmanager
async def front(
    tmp: Path,
    engine: str,
    addresses: tuple[str, str],
    bootstrap_port: int,
    picker: bool = False,
    prefill_timeout_s: float = 5.0,
    decode_role: str = "decode",
) -> AsyncIterator[tuple[str, Router]]:
    """The router in this process (its fleet: `pre`, a prefill engine, and `dec`, a decode
    engine, at `addresses`), and a real Envoy in front; the front door's URL."""
    grpc_port, listen, admin = free_ports(3)
    cfg = config_from_dict(
        {
            "policy": PD_STUB,
            "listen": {"grpc": f"127.0.0.1:{grpc_port}"},
            "envoy": {
                "listen": f"127.0.0.1:{listen}",
                "admin": f"127.0.0.1:{admin}",
                "mode": "endpoint_picker" if picker else "cluster",
                "connect_retries": 0,
            },
            "routing": {"prefill_timeout_s": prefill_timeout_s},
            "backends": [
                # local engines: RTT priors of 1 ms (no probes here), so a leg's engine
                # time (its answer less the trip) is what the engine took
                {
                    "id": "pre",
                    "address": addresses[0],
                    "engine": engine,
                    "role": "prefill",
                    "bootstrap_port": bootstrap_port,
                    "rtt_prior_ms": 1,
                },
                {
                    "id": "dec",
                    "address": addresses[1],
                    "engine": engine,
                    "role": decode_role,
                    "rtt_prior_ms": 1,
                },
            ],
        }
    )
    router = build_router(cfg, time.monotonic, random.Random(0))
    server = grpc.aio.server(options=grpc_options(cfg.envoy.max_body_bytes))
    ext_proc, _ = add_services(server, router)
    handle = ext_proc.director.handle

    def with_prefill(request: RouteRequest, body_bytes: int) -> Any:
        outcome = handle(request, body_bytes)  # the core's pair decision stands in
        if isinstance(outcome, Routed):
            d = dataclasses.replace(outcome.decision, prefill=PrefillLeg("pre", 1024, 5.0))
            return dataclasses.replace(outcome, decision=d)
        return outcome

    ext_proc.director.handle = with_prefill  # type: ignore[method-assign]
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    config = (
        gateway_envoy_config(listen, admin, grpc_port, tls=False)
        if picker
        else render_envoy_config(cfg)
    )
    path = tmp / "envoy.yaml"
    path.write_text(config)
    proc = subprocess.Popen(
        [envoy_binary(), "-c", str(path), "--disable-hot-restart", "-l", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await _ready(f"http://127.0.0.1:{admin}/ready")
        yield f"http://127.0.0.1:{listen}", router
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)
        await server.stop(0.5)
        await ext_proc.prefill_legs.close()


async def _ready(url: str) -> None:
    deadline = time.monotonic() + 15
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "Envoy did not start"
            await asyncio.sleep(0.05)


async def chat(url: str, body: bytes = CHAT) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{url}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json", "x-gorgo-prefill-backend": "forged"},
            timeout=aiohttp.ClientTimeout(total=20),
        ) as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def settled(router: Router, timeout_s: float = 5.0) -> None:
    """Every request closed (the access log's entry, or the stream's end)."""
    deadline = time.monotonic() + timeout_s
    while router.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not router.in_flight, list(router.in_flight)


def assert_one_stream(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 200, body
    assert (headers.get("x-gorgo-backend"), headers.get("x-gorgo-prefill-backend")) == (
        "dec",
        "pre",
    )
    text = body.decode()
    assert "".join(TOKENS) == "".join(
        json.loads(line[6:])["choices"][0]["delta"]["content"]
        for line in text.splitlines()
        if line.startswith("data: {")
    )
    assert text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("picker", [False, True], ids=["ext_proc", "endpoint_picker"])
async def test_sglang_both_legs_carry_the_bootstrap_fields(tmp_path: Path, picker: bool) -> None:
    async with pd_front(tmp_path, "sglang", picker) as f:
        for _ in range(2):
            assert_one_stream(*await chat(f.url))
        rooms = [b["bootstrap_room"] for b in f.decode.bodies]
        assert [b["bootstrap_room"] for b in f.prefill.bodies] == rooms
        assert len(set(rooms)) == 2 and all(0 <= r < 2**63 for r in rooms)
        for leg in (*f.prefill.bodies, *f.decode.bodies):
            assert (leg["bootstrap_host"], leg["bootstrap_port"]) == ("127.0.0.1", 9999)
            assert leg["messages"] == [{"role": "user", "content": "hi"}]
        await settled(f.router)
        assert f.router.backends["dec"].stats.completed == 2


@pytest.mark.parametrize("picker", [False, True], ids=["ext_proc", "endpoint_picker"])
async def test_vllm_decode_leg_carries_the_prefills_kv_transfer_params(
    tmp_path: Path, picker: bool
) -> None:
    async with pd_front(tmp_path, "vllm", picker) as f:
        assert_one_stream(*await chat(f.url))
        (prefill,), (decode,) = f.prefill.bodies, f.decode.bodies
        assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
        assert (prefill["max_tokens"], prefill["stream"]) == (1, False)
        assert decode["kv_transfer_params"]["do_remote_prefill"] is True
        assert decode["kv_transfer_params"]["remote_request_id"].startswith("cmpl-")
        assert decode["stream"] is True and "max_tokens" not in decode
        await settled(f.router)


async def assert_failed(f: Front, status: int, words: str, n: int = 1) -> None:
    code, headers, body = await chat(f.url)
    assert code == status, body
    assert headers.get("x-gorgo-prefill-backend") == "pre"
    message = json.loads(body)["error"]["message"]
    assert "prefill engine pre" in message and words in message, message
    assert f.decode.bodies == []  # never a decode leg with dangling parameters
    await settled(f.router)
    # closed at once, and not against the decode engine (no error, no ejection)
    dec = f.router.backends["dec"]
    assert (dec.stats.errors, dec.stats.gateway_errors) == (0, n)
    assert dec.health.ejected_until_s is None


async def test_a_refused_sglang_prefill_is_a_503_naming_it(tmp_path: Path) -> None:
    """An SGLang decode engine takes only requests with a bootstrap room: nothing to fall
    back on, a clear answer."""
    async with pd_front(tmp_path, "sglang", dead_prefill=True) as f:
        await assert_failed(f, 503, "unreachable")


async def assert_served_whole(f: Any, n: int = 1) -> None:
    """A vLLM decode engine serves the request whole when its prefill leg fails: no
    kv_transfer_params, not counted against the decode engine."""
    status, headers, body = await chat(f.url)
    assert status == 200, body
    assert headers.get("x-gorgo-backend") == "dec"
    assert "x-gorgo-prefill-backend" not in headers
    assert "kv_transfer_params" not in f.decode.bodies[-1]
    await settled(f.router)
    dec = f.router.backends["dec"]
    assert (dec.stats.completed, dec.stats.errors) == (n, 0)
    # nothing left counted on the prefill engine: its leg ended with the failure
    assert f.router.backends["pre"].load.in_flight == 0 and not f.router.fleet.state.leg_of


async def test_a_refused_vllm_prefill_is_served_whole_by_the_decode_engine(
    tmp_path: Path,
) -> None:
    async with pd_front(tmp_path, "vllm", dead_prefill=True) as f:
        await assert_served_whole(f)


async def test_a_vllm_prefill_5xx_is_served_whole_by_the_decode_engine(tmp_path: Path) -> None:
    async with pd_front(tmp_path, "vllm", picker=True) as f:
        f.prefill.fail_status = 500
        await assert_served_whole(f)
        await assert_served_whole(f, n=2)  # the decode engine is not ejected


async def test_a_vllm_prefill_past_its_timeout_is_served_whole_by_the_decode_engine(
    tmp_path: Path,
) -> None:
    """A leg that outlasts routing.prefill_timeout_s (a 120k-token prompt takes 30 s on
    the shipped profile) no longer fails the request: the decode engine prefills it."""
    async with pd_front(tmp_path, "vllm", prefill_timeout_s=0.5) as f:
        f.prefill.stall_s = 3.0
        await assert_served_whole(f)


@pytest.mark.parametrize("picker", [False, True], ids=["ext_proc", "endpoint_picker"])
async def test_a_decode_engine_of_role_both_serves_it_whole_when_the_prefill_fails(
    tmp_path: Path, picker: bool
) -> None:
    async with pd_front(tmp_path, "sglang", picker, dead_prefill=True, decode_role="both") as f:
        status, headers, body = await chat(f.url)
        assert status == 200, body
        assert headers.get("x-gorgo-backend") == "dec"
        assert "x-gorgo-prefill-backend" not in headers  # not prefilled apart (nor forged)
        (whole,) = f.decode.bodies
        assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room"} & set(whole)
        await settled(f.router)
        assert f.router.backends["dec"].stats.completed == 1


@pytest.mark.skipif(not TWINS, reason=NO_TWINS)
@pytest.mark.parametrize(
    ("engine", "picker"),
    [("sglang", False), ("vllm", False), ("sglang", True), ("vllm", True)],
    ids=["sglang-ext_proc", "vllm-ext_proc", "sglang-endpoint_picker", "vllm-endpoint_picker"],
)
async def test_through_the_pd_twins(
    tmp_path: Path, engine: str, picker: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The P/D twins (emulator/engine/disagg/): prefilled on one, the KV over the link
    between them, decoded and streamed by the other; both idle after."""
    from tests.component.emulator.engine.pd_harness import assert_idle, pd_pair

    async with pd_pair(engine) as pair:
        addresses = (_address(pair.prefill.url), _address(pair.decode.url))
        async with front(tmp_path, engine, addresses, pair.side_port, picker) as (url, router):
            answered: list[bool] = []  # each prefill_done's kv_sent
            done = Router.prefill_done

            def spy(self: Router, request_id: str, kv_sent: bool = False) -> None:
                answered.append(kv_sent)
                done(self, request_id, kv_sent)

            monkeypatch.setattr(Router, "prefill_done", spy)
            model = "emulated" if engine == "sglang" else "tiny"
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "tell me about the link " * 20}],
                "max_tokens": 6,
                "stream": True,
            }
            status, headers, answer = await chat(url, json.dumps(body).encode())
            assert status == 200, answer
            assert (headers.get("x-gorgo-backend"), headers.get("x-gorgo-prefill-backend")) == (
                "dec",
                "pre",
            )
            events = [
                line[6:] for line in answer.decode().splitlines() if line.startswith("data: ")
            ]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
            contents = [
                json.loads(e)["choices"][0]["delta"].get("content")
                for e in events[:-1]
                if json.loads(e).get("choices")
            ]
            assert any(contents), events
            await settled(router)
            # the leg's own answer reached the router: vLLM's one-token prefill, SGLang's
            # once its KV went (in the background, after the decode's stream began)
            deadline = time.monotonic() + 5.0
            while not answered and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert answered == [engine == "sglang"]
            assert not router.fleet.state.leg_of
            if engine == "sglang":  # the router's own pair (an idle vLLM decode engine is
                # chosen whole, and the stub adds the leg): its answer taught the speed
                assert router.backends["pre"].learned.speed.samples[0] == 1
        await _idle(pair, assert_idle)


def _address(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


async def _idle(pair: Any, assert_idle: Any, timeout_s: float = 5.0) -> None:
    """Both twins idle again (the prefill's leg ends once its KV went)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            assert_idle(pair.prefill)
            assert_idle(pair.decode)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
