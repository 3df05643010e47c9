"""The router's OTLP/gRPC span exporter: plaintext (the default, as the shipped Jaeger
takes it), or TLS with the collector's certificate checked against a CA bundle or the
system roots, and a client certificate for a collector that requires mTLS."""

from __future__ import annotations

from pathlib import Path

import grpc
from opentelemetry.sdk.trace.export import SpanExporter

from ext_proc.config.schema import TelemetryConfig


def _pem(path: str) -> bytes | None:
    # None tells gRPC: its default (the system roots; no client certificate).
    return Path(path).read_bytes() if path else None


def otlp_exporter(cfg: TelemetryConfig, endpoint: str) -> SpanExporter:
    """`endpoint`: host:port (the config's; OTEL_EXPORTER_OTLP_ENDPOINT's may carry a
    scheme, which the exporter reads: https:// there means TLS too)."""
    # Imported here: the exporter pulls in its protobuf stubs, only needed when tracing.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    if not cfg.otlp_tls:
        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_pem(cfg.otlp_ca_file),
        private_key=_pem(cfg.otlp_key_file),
        certificate_chain=_pem(cfg.otlp_cert_file),
    )
    return OTLPSpanExporter(endpoint=endpoint, insecure=False, credentials=credentials)
