"""How a decision reaches Envoy, chosen once at startup: the routing header naming the
backend's cluster, or (endpoint_picker mode) the Gateway API Inference Extension's
endpoint header inside one pool cluster.
"""

from __future__ import annotations

from collections.abc import Iterable

from ext_proc.common.names import (
    HEADER_BACKEND,
    HEADER_GATEWAY_ENDPOINT,
    HEADER_PER_TRY_TIMEOUT,
    HEADER_REQUEST_ID,
    LB_METADATA_NAMESPACE,
)
from ext_proc.config.schema import Config
from ext_proc.config.transport import EnvoyMode
from ext_proc.envoy import codec
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.types import Decision


class ClusterHeaderEncoder:
    """The backend's cluster in x-gorgo-backend (as raw_value) with clear_route_cache:
    the route's cluster_header picks it up."""

    def encode(
        self, d: Decision, body: bytes | None = None, request_id: str | None = None
    ) -> codec.ProcessingResponse:
        """`body`: the request's new body (its model rewritten), with its length;
        `request_id`: the id the router gave it, when not the client's."""
        return codec.continue_response(
            codec.REQUEST_BODY,
            set_headers={
                HEADER_BACKEND: d.backend,
                **_length(body),
                **_deadline(d),
                **_renamed(request_id),
            },
            clear_route_cache=True,
            body=body,
        )

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """The fleet changed: a cluster name is the backend id, nothing to learn."""


class EndpointPickerEncoder:
    """Gateway API Inference Extension: the endpoint for override_host, then the next
    best ones, which Envoy tries in order if a connect attempt fails."""

    def __init__(self, addresses: dict[str, str], connect_retries: int) -> None:
        self.addresses = addresses
        self.connect_retries = connect_retries

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """The fleet changed (a backend added, or its address): the endpoints to name."""
        self.addresses = {b.id: b.address for b in backends}

    def encode(
        self, d: Decision, body: bytes | None = None, request_id: str | None = None
    ) -> codec.ProcessingResponse:
        ranked = d.ranked()[: 1 + self.connect_retries]
        endpoint = ",".join(self.addresses[b] for b in ranked)
        return codec.continue_response(
            codec.REQUEST_BODY,
            set_headers={
                HEADER_GATEWAY_ENDPOINT: endpoint,
                **_length(body),
                **_deadline(d),
                **_renamed(request_id),
            },
            dynamic_metadata={LB_METADATA_NAMESPACE: {HEADER_GATEWAY_ENDPOINT: endpoint}},
            body=body,
        )


def _length(body: bytes | None) -> dict[str, str]:
    # A replaced body goes with its own length (the client's no longer holds).
    return {} if body is None else {"content-length": str(len(body))}


def _deadline(d: Decision) -> dict[str, str]:
    # The first-byte deadline, as Envoy's per-try timeout.
    if d.first_byte_deadline_ms is None:
        return {}
    return {HEADER_PER_TRY_TIMEOUT: str(max(1, round(d.first_byte_deadline_ms)))}


def _renamed(request_id: str | None) -> dict[str, str]:
    # Envoy logs and observes the request by its x-request-id from here on.
    return {} if request_id is None else {HEADER_REQUEST_ID: request_id}


DecisionEncoder = ClusterHeaderEncoder | EndpointPickerEncoder


def decision_encoder(cfg: Config) -> DecisionEncoder:
    if cfg.envoy.mode == EnvoyMode.ENDPOINT_PICKER:
        return EndpointPickerEncoder(
            {b.id: b.address for b in cfg.backends}, cfg.envoy.connect_retries
        )
    return ClusterHeaderEncoder()
