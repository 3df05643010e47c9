"""Decision spans over the real OTLP protocol, and Prometheus /metrics."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from ext_proc.common.build import package_version
from ext_proc.common.names import ACCESS_LOG_SERVICE, EXT_PROC_SERVICE
from ext_proc.config.load import config_from_dict
from ext_proc.envoy.proto import envoy_wire_pb2 as pb
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.service.app import Running, running_service
from ext_proc.vocab.types import RouteRequest, Status
from tests.unit.test_docs_names import documented_metrics

pytestmark = pytest.mark.component

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "decision_span.json"
SECRET = "SECRET-PROMPT-TEXT"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ENVOY_SPAN_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An in-process OTLP/gRPC trace receiver."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Any]:
        return [
            s
            for r in self.requests
            for rs in r.resource_spans
            for ss in rs.scope_spans
            for s in ss.spans
        ]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    # A thread-pool server, not one on the test's event loop: the service flushes its
    # exporter synchronously at shutdown, from that loop.
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(None)


def _config(otlp_port: int) -> Any:
    return config_from_dict(
        {
            "policy": "gorgo",
            "tuner": {"mode": "off"},
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "telemetry": {"otlp_endpoint": f"127.0.0.1:{otlp_port}"},
            "backends": [
                {"id": "us-ashburn", "address": "127.0.0.1:1", "rtt_prior_ms": 1},
                {"id": "ap-seoul", "address": "127.0.0.1:2", "rtt_prior_ms": 180},
            ],
        }
    )


async def _one_request(svc: Running, rid: str, traceparent: str | None) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}")
    process = channel.stream_stream(
        f"/{EXT_PROC_SERVICE}/Process",
        request_serializer=pb.ProcessingRequest.SerializeToString,
        response_deserializer=pb.ProcessingResponse.FromString,
    )
    metadata = (("traceparent", traceparent),) if traceparent else None
    # the routing filter's stream
    call = process(metadata=metadata)
    req = pb.ProcessingRequest()
    req.protocol_config.request_body_mode = pb.ProcessingMode.BUFFERED
    headers = {":path": "/v1/chat/completions", "x-request-id": rid, "x-session-id": "alice"}
    for k, v in headers.items():
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    await call.write(req)
    await call.read()
    body = pb.ProcessingRequest()
    prompt = {
        "model": "qwen",
        "messages": [{"role": "user", "content": SECRET * 40}],
        "max_tokens": 64,
        "stream": True,
    }
    body.request_body.body = json.dumps(prompt).encode()
    body.request_body.end_of_stream = True
    await call.write(body)
    await call.read()
    # the observer: first chunk
    obs = process(metadata=metadata)
    h = pb.ProcessingRequest(observability_mode=True)
    h.protocol_config.response_body_mode = pb.ProcessingMode.STREAMED
    for k, v in headers.items():
        h.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    await obs.write(h)
    chunk = pb.ProcessingRequest()
    chunk.response_body.body = b"data: {}\n\n"
    await obs.write(chunk)
    chunk.response_body.body = b'data: {"token": 1}\n\n'  # the second: one token's event
    await obs.write(chunk)
    await obs.read()
    # completion through the access log
    msg = pb.StreamAccessLogsMessage()
    e = msg.http_logs.log_entry.add()
    e.request.request_id = rid
    e.response.response_code.value = 200
    e.common_properties.route_name = "gorgo"
    e.common_properties.time_to_last_downstream_tx_byte.CopyFrom(Duration(nanos=250_000_000))
    log = channel.stream_unary(
        f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs",
        request_serializer=pb.StreamAccessLogsMessage.SerializeToString,
        response_deserializer=pb.StreamAccessLogsResponse.FromString,
    )
    await log(iter([msg]))
    await channel.close()


def _measured(key: str) -> bool:
    """A field whose value depends on timing (the queue, and the predictions it is in)."""
    last = key.rpartition(".")[2]
    return last == "queue_ms" or (last.startswith("predicted_") and last.endswith("_ms"))


def _normalize(span: Any) -> dict[str, Any]:
    """A span without ids, times or measured values: what must stay stable."""
    attrs = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        value = getattr(v, kind)
        if kv.key in ("gorgo.ttft_ms", "gorgo.e2e_ms") or _measured(kv.key):
            value = f"<{kind}>"  # measured: present and typed, value varies
        elif kv.key == "gorgo.candidates":  # a JSON array: the same inside it
            value = [
                {k: f"<{type(x).__name__}>" if _measured(k) else x for k, x in c.items()}
                for c in json.loads(value)
            ]
        attrs[kv.key] = value
    return {"name": span.name, "kind": span.kind, "attributes": dict(sorted(attrs.items()))}


async def test_decision_span_continues_envoys_trace(receiver: tuple[Receiver, int]) -> None:
    rec, port = receiver
    async with running_service(_config(port)) as svc:
        await _one_request(svc, "req-1", f"00-{TRACE_ID}-{ENVOY_SPAN_ID}-01")
    # leaving running_service flushed the batch exporter
    (span,) = rec.spans()
    assert span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == ENVOY_SPAN_ID
    (resource,) = {rs.resource.SerializeToString(): rs.resource for r in rec.requests
                   for rs in r.resource_spans}.values()  # fmt: skip
    said = {kv.key: kv.value.string_value for kv in resource.attributes}
    assert (said["service.name"], said["service.version"]) == ("gorgo", package_version())
    assert span.end_time_unix_nano > span.start_time_unix_nano
    got = _normalize(span)
    assert SECRET not in json.dumps(got) and "alice" not in json.dumps(got)
    if os.environ.get("GORGO_UPDATE_GOLDEN"):  # regenerate on purpose, then review the diff
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(GOLDEN.read_text())


async def test_without_traceparent_a_new_trace_starts_and_without_endpoint_nothing_exports(
    receiver: tuple[Receiver, int],
) -> None:
    rec, port = receiver
    async with running_service(_config(port)) as svc:
        await _one_request(svc, "req-2", None)
    (span,) = rec.spans()
    assert span.trace_id.hex() != TRACE_ID and not span.parent_span_id
    cfg = _config(port)
    no_export = config_from_dict(
        {"backends": [{"id": b.id, "address": b.address} for b in cfg.backends],
         "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"}}
    )  # fmt: skip
    async with running_service(no_export) as svc:
        await _one_request(svc, "req-3", f"00-{TRACE_ID}-{ENVOY_SPAN_ID}-01")
        assert svc.telemetry.provider is None
    assert len(rec.spans()) == 1


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A strict-enough parser of the text format: every sample line must parse."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        if "{" in name_labels:
            name, labels = name_labels.split("{", 1)
            pairs = tuple(tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",") if p)
            pairs = tuple((k, v.strip('"')) for k, v in pairs)
        else:
            name, pairs = name_labels, ()
        out[(name, pairs)] = float(value)
    return out


async def test_metrics_count_what_was_routed(receiver: tuple[Receiver, int]) -> None:
    _, port = receiver
    async with running_service(_config(port)) as svc:
        for i in range(3):
            await _one_request(svc, f"m{i}", None)
        url = f"http://127.0.0.1:{svc.admin_port}/metrics"
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
            text = await r.text()
            m = parse_prometheus(text)
    # every family scraped is one docs/operations.md lists (the table holds every one the
    # router can export: tests/unit/test_docs_names.py)
    scraped = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert {n for n in scraped if not n.endswith("_created")} <= documented_metrics()
    build = {dict(labels)["version"]: v for (n, labels), v in m.items() if n == "gorgo_build_info"}
    assert build == {package_version(): 1.0}
    decisions = sum(v for (n, _), v in m.items() if n == "gorgo_decisions_total")
    assert decisions == 3
    assert m[("gorgo_completions_total", (("backend", "us-ashburn"), ("status", "ok")))] == 3
    assert m[("gorgo_ttft_seconds_count", (("backend", "us-ashburn"),))] == 3
    assert m[("gorgo_e2e_seconds_count", (("backend", "us-ashburn"),))] == 3
    assert m[("gorgo_e2e_seconds_sum", (("backend", "us-ashburn"),))] == pytest.approx(0.75)
    assert m[("gorgo_cost_term_seconds_count", (("term", "prefill"),))] == 3
    assert m[("gorgo_prompt_tokens_total", ())] > 0
    assert m[("gorgo_in_flight", (("backend", "us-ashburn"),))] == 0
    assert m[("gorgo_weight", (("name", "rtt"),))] == 1.0
    assert m[("gorgo_rtt_seconds", (("backend", "ap-seoul"),))] == 0.18  # its prior, 180 ms
    await asyncio.sleep(0)


async def test_prediction_error_reaches_metrics_and_state(receiver: tuple[Receiver, int]) -> None:
    _, port = receiver
    async with running_service(_config(port)) as svc:
        # Envoy's access log carries no usage: a request closed by it reports no error
        await _one_request(svc, "p0", None)
        # a closing path that knows the engine's report (as the simulator's does)
        body = json.dumps({"messages": [{"role": "user", "content": SECRET * 40}]}).encode()
        d = svc.router.decide(RouteRequest("p1", parse_body(CHAT, body), "alice"))
        svc.router.close("p1", Status.OK, cached_tokens=d.chosen.cached_tokens + 46)
        base = f"http://127.0.0.1:{svc.admin_port}"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/metrics") as r:
                m = parse_prometheus(await r.text())
            async with s.get(f"{base}/state") as r:
                state = await r.json()
    labels = (("backend", d.backend), ("prefix_state", "approximate"))
    assert m[("gorgo_prefix_prediction_error_ratio_count", labels)] == 1
    assert m[("gorgo_prefix_prediction_error_ratio_sum", labels)] == pytest.approx(46 / 184)
    assert state["backends"][d.backend]["prefix_prediction"] == {
        "approximate": {"requests": 1, "mean_error_ratio": round(46 / 184, 6)}
    }
