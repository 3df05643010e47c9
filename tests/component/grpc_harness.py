"""The router's gRPC service as Envoy talks to it, for the component tests: a running
service and a channel to it, the routing filter's stream for one chat, and access-log
entries."""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp
import grpc
from google.protobuf.duration_pb2 import Duration

from ext_proc.common.names import ACCESS_LOG_SERVICE, EXT_PROC_SERVICE
from ext_proc.envoy.proto import envoy_wire_pb2 as pb
from ext_proc.service.app import Running
from tests.messages import body, headers

CHAT = json.dumps({"messages": [{"role": "user", "content": "hello"}], "stream": True}).encode()


@dataclass
class Harness:
    svc: Running
    channel: grpc.aio.Channel

    def process(self) -> grpc.aio.StreamStreamCall:  # type: ignore[type-arg]
        return self.channel.stream_stream(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString,
        )()

    async def access_log(self, *entries: pb.HTTPAccessLogEntry) -> None:
        msg = pb.StreamAccessLogsMessage()
        msg.identifier.log_name = "gorgo"
        msg.http_logs.log_entry.extend(entries)
        call = self.channel.stream_unary(
            f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs",
            request_serializer=pb.StreamAccessLogsMessage.SerializeToString,
            response_deserializer=pb.StreamAccessLogsResponse.FromString,
        )
        await call(iter([msg]))

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


async def route(h: Harness, rid: str) -> str:
    """The routing filter's stream: headers, then the body; returns the chosen backend."""
    call = h.process()
    await call.write(headers("/v1/chat/completions", rid))
    assert (await call.read()).WhichOneof("response") == "request_headers"
    await call.write(body(CHAT))
    r = await call.read()
    common = r.request_body.response
    assert common.clear_route_cache
    (opt,) = common.header_mutation.set_headers
    assert opt.header.key == "x-gorgo-backend"
    # routing done and the filter sends no response phases: the server closed the stream
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    return opt.header.raw_value.decode()
