"""The config's transport sections: where the router listens (gRPC, admin HTTP, TLS) and
the Envoy it generates a config for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ext_proc.vocab.params import NON_NEGATIVE, POSITIVE, bounded


class EnvoyMode(enum.StrEnum):
    """`envoy.mode`: how Envoy is told the decision: a cluster per backend, or the
    Gateway API Inference Extension's endpoint inside one cluster."""

    # Header x-gorgo-backend names a cluster per backend (cluster_header route).
    CLUSTER = "cluster"
    # The Gateway API Inference Extension protocol: header x-gateway-destination-endpoint
    # and the envoy.lb dynamic metadata name the endpoint inside one cluster.
    ENDPOINT_PICKER = "endpoint_picker"


@dataclass(frozen=True)
class ServerTls:
    """TLS on the ext_proc's gRPC port (PEM files). All empty: plaintext, for loopback or a
    trusted pod network."""

    cert_file: str = ""
    key_file: str = ""
    # Set: every client (Envoy) must present a certificate signed by this CA (mTLS).
    client_ca_file: str = ""


@dataclass(frozen=True)
class ClientTls:
    """How Envoy reaches the ext_proc over TLS (paths as Envoy sees them)."""

    # Set: TLS, the ext_proc's certificate verified against this CA.
    ca_file: str = ""
    # Envoy's client certificate, for an ext_proc that requires mTLS.
    cert_file: str = ""
    key_file: str = ""
    # SNI and the name the certificate must carry; "" = the host of ext_proc_address.
    server_name: str = ""


@dataclass(frozen=True)
class Listen:
    """The `listen:` section: where the router serves its gRPC (ext_proc, access log) and
    its admin HTTP, and who may change state through the admin."""

    grpc: str = "127.0.0.1:50051"
    tls: ServerTls = field(default_factory=ServerTls)
    # Admin HTTP (/healthz, /state): loopback by default, it shows internal state.
    admin: str = "127.0.0.1:9180"
    # Bearer token required by admin calls that change state (POST /tuner, /backends);
    # "" = none, and then such calls are taken from loopback peers only, as JSON with no
    # foreign Origin (the GORGO_ADMIN_TOKEN environment variable is used when this is
    # empty; `gorgo up` generates one).
    admin_token: str = ""
    # More names the admin answers to besides its own address (and localhost on loopback):
    # every request but /healthz must carry one of them in Host, so a web page cannot read
    # it by DNS rebinding. `name` (any port) or `name:port`: a Prometheus target
    # (`gorgo:9180` in docker compose), a Kubernetes Service (`gorgo.gorgo.svc`).
    admin_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class EnvoySettings:
    """The `envoy:` section: what the generated Envoy config says
    (ext_proc/envoy_config/bootstrap.py): its listener and admin, how it reaches the
    ext_proc, its body limit, timeouts and retries, its tracing, and where its backend
    clusters come from."""

    listen: str = "127.0.0.1:10000"
    admin: str = "127.0.0.1:9901"
    # Where Envoy reaches the ext_proc; defaults to listen.grpc.
    ext_proc_address: str = ""
    # Several router processes behind this Envoy (each one's listen.grpc; replaces
    # ext_proc_address): Envoy spreads the ext_proc and access-log streams over them.
    # They must share their dispatches (bus.nats_url), which also carries what one saw
    # of another's request (its first chunk, its completion) to the one that decided it.
    ext_proc_addresses: tuple[str, ...] = ()
    ext_proc_tls: ClientTls = field(default_factory=ClientTls)
    # Whole-body buffering for routing: 128k-token prompts are ~0.5 MB of text, JSON
    # escaping and multimodal parts can multiply that; 16 MiB leaves room.
    max_body_bytes: int = bounded(16 * 1024 * 1024, **POSITIVE)
    # Per-message ext_proc deadline. One Python process answering a burst of new
    # streams needs slack beyond its ~1 ms typical reply; past it Envoy fails open.
    message_timeout_ms: int = bounded(1000, **POSITIVE)
    # Long generations stream for minutes; Envoy's 15 s default route timeout cuts them.
    route_timeout_s: float = bounded(600.0, **POSITIVE)
    # Upstream connect timeout; a WAN hop costs one RTT (<0.5 s) per attempt.
    connect_timeout_s: float = bounded(5.0, **POSITIVE)
    # A request whose backend cannot be reached (connection refused or reset before the
    # request was sent) is retried this many times on other backends (0 = never).
    connect_retries: int = bounded(2, **NON_NEGATIVE)
    # Retry too when the backend's connection is reset before its response began: a
    # backend that died, or a proxy or link in front of it that accepted the connection
    # and then lost it (the request written into a connection that was already dying
    # never reached the engine). Nothing has reached the client yet, and the engine
    # aborts a request whose connection is gone. The cost: a request that itself crashes
    # engines is tried on connect_retries more. False: only connections that never
    # carried the request are retried.
    retry_resets: bool = True
    # How the decision reaches Envoy (see EnvoyMode).
    mode: EnvoyMode = EnvoyMode.CLUSTER
    # endpoint_picker: choose only among the endpoints of the data plane's subset hint
    # (metadata envoy.lb.subset_hint); false = ignore it (the extension's
    # --disable-endpoint-subset-filter).
    obey_subset_hint: bool = True
    # OTLP/gRPC collector (host:port) for Envoy's own spans; "" = no Envoy tracing.
    tracing_endpoint: str = ""
    # Share of requests Envoy traces (percent).
    tracing_sample_percent: float = bounded(100.0, ge=0.0, le=100.0)
    # Directory of the backend clusters' xDS files ("" = static clusters in the bootstrap).
    # Set: the generated Envoy bootstrap reads its backend clusters from files here (CDS,
    # EDS), which the router rewrites when backends are added, drained or removed, so
    # Envoy follows without a restart (docs/envoy.md). Relative to the current directory.
    xds_dir: str = ""
