"""Decision spans to a TLS collector: a real gRPC OTLP receiver on a TLS-only port, with
certificates made here (tests/certs.py), and the router's own exporter (ext_proc/service/
telemetry/otlp.py) reaching it with telemetry.otlp_tls, its CA file and, for mTLS, a client
certificate; with the wrong CA nothing arrives and the exporter says so."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from ext_proc.config.load import config_from_dict
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.service.app import running_service
from ext_proc.vocab.types import RouteRequest, Status
from tests.certs import Ca, Pem
from tests.component.test_telemetry import Receiver

pytestmark = pytest.mark.component


class TlsReceiver(Receiver):
    """Also records each export's transport: what gRPC says the connection was."""

    def __init__(self) -> None:
        super().__init__()
        self.auth: list[dict[str, list[bytes]]] = []

    def Export(self, request: Any, context: Any) -> Any:
        self.auth.append(dict(context.auth_context()))
        return super().Export(request, context)


@dataclass
class Collector:
    receiver: TlsReceiver
    port: int
    ca: Ca
    client: Pem  # signed by ca, for mTLS


def _serve(tmp_path: Path, require_client_cert: bool) -> Iterator[Collector]:
    ca = Ca(tmp_path, "collector CA")
    server_pem = ca.issue("otel-collector")  # valid for 127.0.0.1 and localhost
    credentials = grpc.ssl_server_credentials(
        [(server_pem.key.read_bytes(), server_pem.cert.read_bytes())],
        root_certificates=ca.pem.cert.read_bytes() if require_client_cert else None,
        require_client_auth=require_client_cert,
    )
    # A thread-pool server: the service flushes its exporter synchronously at shutdown.
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    rec = TlsReceiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)  # TLS only: no plaintext port
    server.start()
    yield Collector(rec, port, ca, ca.issue("gorgo-router"))
    server.stop(None)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    yield from _serve(tmp_path, require_client_cert=False)


@pytest.fixture
def mtls_collector(tmp_path: Path) -> Iterator[Collector]:
    yield from _serve(tmp_path, require_client_cert=True)


def _config(port: int, **telemetry: Any) -> Any:
    return config_from_dict(
        {
            "tuner": {"mode": "off"},
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "telemetry": {"otlp_endpoint": f"127.0.0.1:{port}", "otlp_tls": True, **telemetry},
            "backends": [{"id": "us-ashburn", "address": "127.0.0.1:1", "rtt_prior_ms": 1}],
        }
    )


async def _one_decision(cfg: Any) -> str:
    """A decision and its close through a running service; leaving it flushes the spans."""
    body = json.dumps({"messages": [{"role": "user", "content": "hello"}]}).encode()
    async with running_service(cfg) as svc:
        d = svc.router.decide(RouteRequest("tls-1", parse_body(CHAT, body), "alice"))
        assert not isinstance(d, tuple)
        svc.router.close(d.request_id, Status.OK)
    return d.request_id


def _request_ids(rec: Receiver) -> list[str]:
    return [
        kv.value.string_value
        for s in rec.spans()
        for kv in s.attributes
        if kv.key == "gorgo.request_id"
    ]


async def test_spans_reach_a_tls_collector_checked_against_the_ca_file(
    collector: Collector,
) -> None:
    cfg = _config(collector.port, otlp_ca_file=str(collector.ca.pem.cert))
    rid = await _one_decision(cfg)
    assert _request_ids(collector.receiver) == [rid]
    (auth,) = collector.receiver.auth
    assert auth["transport_security_type"] == [b"ssl"]
    assert "x509_common_name" not in auth  # no client certificate was asked for


async def test_spans_reach_an_mtls_collector_with_the_client_certificate(
    mtls_collector: Collector,
) -> None:
    c = mtls_collector
    cfg = _config(
        c.port,
        otlp_ca_file=str(c.ca.pem.cert),
        otlp_cert_file=str(c.client.cert),
        otlp_key_file=str(c.client.key),
    )
    rid = await _one_decision(cfg)
    assert _request_ids(c.receiver) == [rid]
    (auth,) = c.receiver.auth
    assert auth["transport_security_type"] == [b"ssl"]
    assert auth["x509_common_name"] == [b"gorgo-router"]


async def test_with_the_wrong_ca_nothing_arrives_and_the_exporter_logs_the_failure(
    collector: Collector,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The exporter retries an unreachable collector until its deadline (10 s by default).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    stranger = Ca(tmp_path, "stranger CA")  # a CA that did not sign the collector's cert
    caplog.set_level(logging.WARNING, logger="opentelemetry.exporter.otlp.proto.grpc")
    await _one_decision(_config(collector.port, otlp_ca_file=str(stranger.pem.cert)))
    assert collector.receiver.requests == []
    failed = [r for r in caplog.records if "Failed to export" in r.getMessage()]
    assert failed and "CERTIFICATE_VERIFY_FAILED" in failed[0].getMessage()
