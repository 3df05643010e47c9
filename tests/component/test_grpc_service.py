"""The real grpc.aio service over a real channel, driven with scripted ext_proc messages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest

from ext_proc.common.names import ACCESS_LOG_STARTS, EXT_PROC_SERVICE
from ext_proc.config.load import config_from_dict
from ext_proc.envoy.proto import envoy_wire_pb2 as pb
from ext_proc.service.app import running_service
from tests.component.grpc_harness import CHAT, Harness, log_entry, log_message, route
from tests.messages import body, headers

pytestmark = pytest.mark.component

BACKENDS = ["us-ashburn", "eu-frankfurt", "ap-seoul"]


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    cfg = config_from_dict(
        {
            "policy": "round_robin",
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "backends": [
                {"id": b, "address": f"127.0.0.1:{i + 1}"} for i, b in enumerate(BACKENDS)
            ],
        }
    )
    async with running_service(cfg) as svc:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}")
        h = Harness(svc, channel)
        yield h
        # nothing leaked: every stream ended and nothing is left in flight (checked before
        # the harness's Envoy goes away, which would close what is left as lost)
        await asyncio.sleep(0.05)
        assert svc.ext_proc.active_streams == 0
        assert not svc.router.in_flight
        for b in svc.router.backends.values():
            assert (b.load.in_flight, b.load.waiting_first_byte) == (0, 0)
        await h.close()


async def observe_first_chunk(h: Harness, rid: str) -> None:
    """The observer's stream, as Envoy opens it: the first response chunk, the request id
    as an attribute, no request headers. Envoy does not wait, and we never reply."""
    call = h.process()
    first = body(b"data: {}\n\n", response=True)
    first.observability_mode = True
    first.protocol_config.response_body_mode = pb.ProcessingMode.STREAMED
    first.attributes["envoy.filters.http.ext_proc"].update({"request.id": rid})
    await call.write(first)
    # the second chunk: one token's event (its size counts the output at the end)
    await call.write(body(b'data: {"token": 1}\n\n', response=True))
    # no replies; the server closed after the second chunk, so later chunks skip Python
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


async def test_route_observe_complete(harness: Harness) -> None:
    assert await route(harness, "r1") == "us-ashburn"
    ashburn = (await harness.state())["backends"]["us-ashburn"]
    assert (ashburn["in_flight"], ashburn["waiting_first_byte"]) == (1, 1)

    await observe_first_chunk(harness, "r1")
    ashburn = (await harness.state())["backends"]["us-ashburn"]
    assert (ashburn["in_flight"], ashburn["waiting_first_byte"], len(ashburn["last_ttft_ms"])) == (
        1,
        0,
        1,
    )

    await harness.access_log(log_entry("r1", 200, 750))
    state = await harness.state()
    assert state["backends"]["us-ashburn"]["completed"] == 1
    assert state["backends"]["us-ashburn"]["last_e2e_ms"] == [750.0]
    assert state["in_flight"] == 0


async def test_one_filter_doing_both_keeps_the_stream_until_the_second_chunk(
    harness: Harness,
) -> None:
    """The first chunk is the TTFT, the second one token's event (its size counts the
    output tokens at the end); then the stream ends."""
    call = harness.process()
    await call.write(headers("/v1/chat/completions", "r5", watch=True))
    await call.read()
    await call.write(body(CHAT))
    assert (await call.read()).request_body.response.header_mutation.set_headers
    await call.write(body(b"data: {}\n\n", response=True, eos=False))
    assert (await call.read()).WhichOneof("response") == "response_body"
    await call.write(body(b'data: {"a": 1}\n\n', response=True, eos=False))
    assert (await call.read()).WhichOneof("response") == "response_body"
    assert await call.read() == grpc.aio.EOF
    assert harness.svc.router.in_flight["r5"].token_event_bytes == len(b'data: {"a": 1}\n\n')
    assert len(harness.svc.router.backends["us-ashburn"].stats.recent_ttft_ms) == 1
    await harness.access_log(log_entry("r5", 200, 9))


async def test_cancel_before_first_byte_closes_the_loop(harness: Harness) -> None:
    await route(harness, "r2")
    call = harness.process()
    await call.write(headers("/v1/chat/completions", "r2", observe=True))
    await asyncio.sleep(0.05)
    call.cancel()  # the client went away before the first token
    for _ in range(100):
        if not harness.svc.router.in_flight:
            break
        await asyncio.sleep(0.01)
    ashburn = harness.svc.router.backends["us-ashburn"]
    assert (ashburn.stats.cancelled, ashburn.stats.errors) == (1, 0)  # not the backend's failure


async def test_the_requests_of_an_envoy_that_went_away_are_lost_at_once(
    harness: Harness,
) -> None:
    """Each Envoy holds its access-log streams open while it runs; when the last one of an
    Envoy ends (killed, restarted), nothing it carried will ever be reported."""
    router = harness.svc.router
    for rid, envoy in (("a1", "edge-a"), ("a2", "edge-a"), ("b1", "edge-b")):
        await route(harness, rid, envoy)
    streams = {}
    for node in ("edge-a", "edge-a", "edge-b"):  # edge-a has two workers
        call = harness.log_stream()
        await call.write(log_message(node=node))
        streams.setdefault(node, []).append(call)
    await asyncio.sleep(0.05)
    first, second = streams["edge-a"]
    await first.done_writing()
    await first
    await asyncio.sleep(0.05)
    assert set(router.in_flight) == {"a1", "a2", "b1"}  # edge-a still has a stream: alive
    await second.done_writing()
    await second
    await asyncio.sleep(0.05)
    assert set(router.in_flight) == {"b1"}  # edge-a is gone: its requests were lost
    assert sum(b.stats.lost for b in router.backends.values()) == 2
    assert sum(b.stats.errors for b in router.backends.values()) == 0  # not the backends' doing
    (b_stream,) = streams["edge-b"]
    await b_stream.done_writing()
    await b_stream
    await asyncio.sleep(0.05)
    assert not router.in_flight


async def test_an_envoy_that_only_logged_starts_is_seen_going_and_its_starts_close_nothing(
    harness: Harness,
) -> None:
    """An Envoy none of whose requests has ended has only its stream of requests' starts
    open (issue 51: before it had none, and a kill -9 left its requests in flight until
    they expired). Start entries close nothing, however they look."""
    router = harness.svc.router
    for rid in ("s1", "s2"):
        await route(harness, rid, "edge-s")
    starts = harness.log_stream()
    # a start entry as Envoy sends it carries no response code yet (read as 0)
    await starts.write(
        log_message(
            log_entry("s1", 0, 0),
            log_entry("s2", 200, 5),
            node="edge-s",
            log_name=ACCESS_LOG_STARTS,
        )
    )
    await asyncio.sleep(0.05)
    assert set(router.in_flight) == {"s1", "s2"}
    assert all(b.stats.completed == b.stats.lost == 0 for b in router.backends.values())
    await starts.done_writing()  # the Envoy is killed: its only stream ends
    await starts
    await asyncio.sleep(0.05)
    assert not router.in_flight
    assert sum(b.stats.lost for b in router.backends.values()) == 2
    assert sum(b.stats.errors for b in router.backends.values()) == 0


async def test_a_client_gone_before_any_response_is_a_cancellation(harness: Harness) -> None:
    for rid in ("g1", "g2", "g3"):  # Envoy logs status 0: nothing was sent to the client
        await route(harness, rid)
        await harness.access_log(log_entry(rid, 0, 30))
    ashburn = harness.svc.router.backends["us-ashburn"]
    assert not harness.svc.router.in_flight
    assert (ashburn.health.request_failures, ashburn.health.ejected_until_s) == (0, None)


async def test_upstream_error_status_is_recorded_from_the_access_log(harness: Harness) -> None:
    await route(harness, "r3")
    await observe_first_chunk(harness, "r3")
    await harness.access_log(log_entry("r3", 503, 20))
    assert harness.svc.router.backends["us-ashburn"].stats.errors == 1


@pytest.mark.parametrize(
    "script",
    [
        [headers("/v1/models")],  # not an LLM call
        [headers("/v1/chat/completions", eos=True)],  # no body
        [headers("/v1/chat/completions"), body(b"{broken")],  # unreadable body
        [headers("/v1/chat/completions"), body(b'{"messages": 3}')],
    ],
)
async def test_unroutable_requests_go_to_the_fallback_route(
    harness: Harness, script: list[pb.ProcessingRequest]
) -> None:
    call = harness.process()
    for msg in script:
        await call.write(msg)
        r = await call.read()
        which = r.WhichOneof("response")
        assert not getattr(r, which).response.HasField("header_mutation")
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert harness.svc.router.decisions == 0


async def test_fallback_completions_are_counted_per_backend(harness: Harness) -> None:
    await harness.access_log(log_entry("x", 200, 5, route="fallback", backend="ap-seoul"))
    assert harness.svc.router.backends["ap-seoul"].stats.fallback_completed == 1


async def test_many_concurrent_streams(harness: Harness) -> None:
    async def one(i: int) -> str:
        backend = await route(harness, f"c{i}")
        await observe_first_chunk(harness, f"c{i}")
        await harness.access_log(log_entry(f"c{i}", 200, 1))
        return backend

    chosen = await asyncio.gather(*(one(i) for i in range(60)))
    assert sorted(set(chosen)) == sorted(BACKENDS)
    backends = harness.svc.router.backends.values()
    assert sum(b.stats.completed for b in backends) == 60
    assert sum(len(b.stats.recent_ttft_ms) for b in backends) == min(60, 3 * 16)


async def test_admin_tuner_freeze_set_and_errors(harness: Harness) -> None:
    url = f"http://127.0.0.1:{harness.svc.admin_port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/state") as r:
            state = await r.json()
        assert state["tuner"] is None  # round_robin has no weights to tune
        async with s.post(f"{url}/tuner", json={"action": "freeze"}) as r:
            assert r.status == 409
    # the same admin API on a gorgo router that tunes
    cfg = config_from_dict(
        {
            "policy": "gorgo",
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "backends": [{"id": "a", "address": "127.0.0.1:1"}],
            "tuner": {"mode": "paired"},
        }
    )
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{svc.admin_port}"
        async with s.post(
            f"{url}/tuner", json={"action": "set", "weights": {"rtt": 0.7, "queue": 2}}
        ) as r:
            assert r.status == 200 and (await r.json())["weights"] == {"rtt": 0.7, "queue": 2.0}
        async with s.post(f"{url}/tuner", json={"action": "freeze"}) as r:
            assert (await r.json())["frozen"] is True
        async with s.get(f"{url}/state") as r:
            state = await r.json()
        assert state["weights"] == {"rtt": 0.7, "queue": 2.0}
        assert state["tuner"]["mode"] == "paired" and state["tuner"]["frozen"]
        for bad in ({"action": "jump"}, {"action": "set", "weights": {"rtt": -1, "queue": 1}}, []):
            async with s.post(f"{url}/tuner", json=bad) as r:
                assert r.status == 400 and "error" in await r.json()


async def test_admin_token_guards_state_changes_only() -> None:
    cfg = config_from_dict(
        {
            "policy": "gorgo",
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0", "admin_token": "s3cret"},
            "backends": [{"id": "a", "address": "127.0.0.1:1"}],
            "tuner": {"mode": "paired"},
        }
    )
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{svc.admin_port}"
        async with s.get(f"{url}/state") as r:
            assert r.status == 200  # reads stay open (loopback)
        async with s.post(f"{url}/tuner", json={"action": "freeze"}) as r:
            assert r.status == 401
        bad = {"Authorization": "Bearer wrong"}
        async with s.post(f"{url}/tuner", json={"action": "freeze"}, headers=bad) as r:
            assert r.status == 401
        good = {"Authorization": "Bearer s3cret"}
        async with s.post(f"{url}/tuner", json={"action": "freeze"}, headers=good) as r:
            assert r.status == 200 and (await r.json())["frozen"]


async def test_a_paced_decision_is_sent_after_its_pace() -> None:
    """Dispatch pacing in the shell: the reply that carries a paced decision leaves the
    service no earlier than its pace (Envoy sends the request on when it reads it)."""
    cfg = config_from_dict(
        {
            "policy": "gorgo",
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "backends": [{"id": "a", "address": "127.0.0.1:1", "rtt_prior_ms": 100}],
        }
    )
    long_chat = json.dumps(
        {"messages": [{"role": "user", "content": "word " * 4000}], "stream": True}
    ).encode()
    async with running_service(cfg) as svc:
        for s in (100, 300, 20, 300, 20, 300):  # a jitter of ~100 ms: 2 sigma ~200 ms
            svc.router.inputs.record_probe("a", s)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}")
        waited_s = []
        for rid in ("p1", "p2"):
            call = channel.stream_stream(
                f"/{EXT_PROC_SERVICE}/Process",
                request_serializer=pb.ProcessingRequest.SerializeToString,
                response_deserializer=pb.ProcessingResponse.FromString,
            )()
            await call.write(headers("/v1/chat/completions", rid))
            await call.read()
            t0 = asyncio.get_running_loop().time()
            await call.write(body(long_chat))
            assert (await call.read()).request_body.response.header_mutation.set_headers
            waited_s.append(asyncio.get_running_loop().time() - t0)
        await channel.close()
        first, second = svc.router.recent.decisions[-2:]
        assert first.pace_ms == 0.0
        assert 100 < second.pace_ms <= 250
        assert waited_s[1] >= second.pace_ms / 1000
