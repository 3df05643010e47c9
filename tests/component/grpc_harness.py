"""The router's gRPC service as Envoy talks to it, for the component tests: a running
service and a channel to it, the routing filter's stream for one chat, and access-log
entries."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp
import grpc
from google.protobuf.duration_pb2 import Duration

from ext_proc.common.names import (
    ACCESS_LOG_NAME,
    ACCESS_LOG_SERVICE,
    EXT_PROC_SERVICE,
    METADATA_ENVOY_NODE,
)
from ext_proc.envoy.proto import envoy_wire_pb2 as pb
from ext_proc.service.app import Running
from tests.messages import body, headers

CHAT = json.dumps({"messages": [{"role": "user", "content": "hello"}], "stream": True}).encode()


# The Envoy node id the harness's access-log streams carry.
NODE = "harness-envoy"


def log_message(
    *entries: pb.HTTPAccessLogEntry, node: str = NODE, log_name: str = ACCESS_LOG_NAME
) -> pb.StreamAccessLogsMessage:
    msg = pb.StreamAccessLogsMessage()
    msg.identifier.log_name = log_name
    msg.identifier.node.id = node
    msg.http_logs.log_entry.extend(entries)
    return msg


@dataclass
class Harness:
    svc: Running
    channel: grpc.aio.Channel
    # An access-log stream held open for the harness's life, as a running Envoy holds one
    # per worker: the short streams `access_log` opens end without the Envoy going away.
    keeper: grpc.aio.StreamUnaryCall | None = None  # type: ignore[type-arg]
    _keeper_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def process(self, envoy: str = "") -> grpc.aio.StreamStreamCall:  # type: ignore[type-arg]
        """An ext_proc stream; `envoy`: the node id its metadata names (as the generated
        Envoy config's initial_metadata does)."""
        return self.channel.stream_stream(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString,
        )(metadata=((METADATA_ENVOY_NODE, envoy),) if envoy else None)

    def log_stream(self) -> grpc.aio.StreamUnaryCall:  # type: ignore[type-arg]
        return self.channel.stream_unary(
            f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs",
            request_serializer=pb.StreamAccessLogsMessage.SerializeToString,
            response_deserializer=pb.StreamAccessLogsResponse.FromString,
        )()

    async def access_log(self, *entries: pb.HTTPAccessLogEntry) -> None:
        # Concurrent callers wait for the keeper's first message: a short stream that ends
        # before the router has heard the keeper is this Envoy's last, and its requests
        # are lost (a flake under load: 59 of 60 requests lost in one make test).
        async with self._keeper_lock:
            if self.keeper is None:
                self.keeper = self.log_stream()
                await self.keeper.write(log_message())
        call = self.log_stream()
        await call.write(log_message(*entries))
        await call.done_writing()
        await call

    async def close(self) -> None:
        """The harness's Envoy goes away: its access-log streams end."""
        if self.keeper is not None:
            await self.keeper.done_writing()
            await self.keeper
        await self.channel.close()

    async def state(self) -> dict:  # type: ignore[type-arg]
        url = f"http://127.0.0.1:{self.svc.admin_port}/state"
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return await r.json()  # type: ignore[no-any-return]


def log_entry(
    rid: str, code: int, e2e_ms: int, route: str = "gorgo", backend: str = ""
) -> pb.HTTPAccessLogEntry:
    e = pb.HTTPAccessLogEntry()
    e.request.request_id = rid
    e.response.response_code.value = code
    e.common_properties.route_name = route
    e.common_properties.time_to_last_downstream_tx_byte.CopyFrom(Duration(nanos=e2e_ms * 1_000_000))
    if backend:
        e.response.response_headers["x-gorgo-backend"] = backend
    return e


async def route(h: Harness, rid: str, envoy: str = "") -> str:
    """The routing filter's stream: headers, then the body; returns the chosen backend."""
    call = h.process(envoy)
    await call.write(headers("/v1/chat/completions", rid))
    assert (await call.read()).WhichOneof("response") == "request_headers"
    await call.write(body(CHAT))
    r = await call.read()
    common = r.request_body.response
    assert common.clear_route_cache
    opt, deadline = common.header_mutation.set_headers
    assert opt.header.key == "x-gorgo-backend"
    # the first-byte deadline: Envoy's per-try timeout, in ms
    assert deadline.header.key == "x-envoy-upstream-rq-per-try-timeout-ms"
    assert int(deadline.header.raw_value) >= 5000
    # routing done and the filter sends no response phases: the server closed the stream
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    return opt.header.raw_value.decode()
