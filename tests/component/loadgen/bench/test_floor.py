"""The floor of `gorgo bench path` answers a routing stream as the router would (CONTINUE
for the headers, the first backend's routing header for the body), ends an observing
stream without a reply, and counts access-log entries."""

import asyncio
from collections.abc import AsyncIterator

import pytest

from ext_proc.common.names import HEADER_BACKEND
from ext_proc.envoy import codec
from ext_proc.envoy.proto import envoy_wire_pb2 as pb
from loadgen.bench.live.floor import Floor
from tests.messages import body, headers

pytestmark = pytest.mark.component


async def _replies(floor: Floor, messages: list[pb.ProcessingRequest]) -> list[str]:
    async def stream() -> AsyncIterator[pb.ProcessingRequest]:
        for m in messages:
            yield m

    out = []
    async for reply in floor.process(stream(), None):
        phase = reply.WhichOneof("response") or ""
        mutation = getattr(reply, phase).response.header_mutation
        routed = [h.header.raw_value.decode() for h in mutation.set_headers]
        out.append(f"{phase}:{','.join(routed)}")
    return out


def test_the_floor_routes_to_the_first_backend_and_observes_nothing() -> None:
    floor = Floor("us-ashburn")
    routed = asyncio.run(_replies(floor, [headers("/v1/chat/completions"), body(b"{}")]))
    assert routed == ["request_headers:", "request_body:us-ashburn"]
    assert floor.body.request_body.response.clear_route_cache
    key = floor.body.request_body.response.header_mutation.set_headers[0].header.key
    assert key == HEADER_BACKEND
    observed = asyncio.run(_replies(floor, [body(b"data: x", response=True)]))
    assert observed == []

    async def logs() -> AsyncIterator[codec.StreamAccessLogsMessage]:
        msg = codec.StreamAccessLogsMessage()
        for rid in ("a", "b", "c"):
            msg.http_logs.log_entry.add().request.request_id = rid
        yield msg

    asyncio.run(floor.access_logs(logs(), None))
    assert floor.entries == 3
