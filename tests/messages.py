"""Envoy's ext_proc messages as the tests send them."""

from __future__ import annotations

from ext_proc.envoy.proto import envoy_wire_pb2 as pb


def headers(
    path: str, rid: str = "rid-1", eos: bool = False, observe: bool = False, watch: bool = False
) -> pb.ProcessingRequest:
    """A stream's first message, as the routing filter (or the observer) sends it."""
    req = pb.ProcessingRequest(observability_mode=observe)
    req.protocol_config.request_body_mode = (
        pb.ProcessingMode.NONE if observe else pb.ProcessingMode.BUFFERED
    )
    if observe or watch:
        req.protocol_config.response_body_mode = pb.ProcessingMode.STREAMED
    h = req.request_headers
    h.end_of_stream = eos
    for k, v in {":path": path, ":method": "POST", "x-request-id": rid}.items():
        h.headers.headers.add(key=k, raw_value=v.encode())
    return req


def body(data: bytes, response: bool = False, eos: bool | None = None) -> pb.ProcessingRequest:
    """A body chunk; a request body ends its stream unless eos says otherwise."""
    req = pb.ProcessingRequest()
    b = req.response_body if response else req.request_body
    b.body = data
    b.end_of_stream = (not response) if eos is None else eos
    return req
