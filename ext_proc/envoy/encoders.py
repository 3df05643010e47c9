"""How a decision reaches Envoy, chosen once at startup: the routing header naming the
backend's cluster, or (endpoint_picker mode) the Gateway API Inference Extension's
endpoint header inside one pool cluster. The reply goes with the request's body
(BUFFERED), or with its headers once the body is complete (FULL_DUPLEX_STREAMED: the body
then follows in chunks of its own). Each encoder also answers what differs between the
two modes for a request without a decision, and for the endpoint that served one, so a
session never asks which encoder it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

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
from ext_proc.envoy.answers import no_endpoint
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.types import Decision


class DecisionEncoder(Protocol):
    """Turns the router's decisions into Envoy's language, in one of the two modes."""

    def encode(
        self,
        d: Decision,
        body: bytes | None = None,
        request_id: str | None = None,
        phase: str = codec.REQUEST_BODY,
    ) -> codec.ProcessingResponse:
        """The reply sending the request to the decision's backend."""
        ...

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """The fleet changed."""
        ...

    def backends_at(self, endpoints: Iterable[str]) -> frozenset[str] | None:
        """The backends at the endpoints of a subset hint (None: the hint does not apply)."""
        ...

    def unrouted(self, reason: str) -> codec.ProcessingResponse | None:
        """The reply for a request no backend can take now (None: Envoy's fallback route
        takes it)."""
        ...

    def undecided(self, ranked: Callable[[], Sequence[str]]) -> codec.ProcessingResponse | None:
        """The request headers' reply on a streamed stream for a request the policy does
        not decide on; `ranked`: the backends to name, best first, asked only when the
        encoder names any (None: no backend to name, no endpoint can take it)."""
        ...

    def served(self, endpoint: str, chosen: str) -> str | None:
        """The backend that served a request sent to `chosen`, as the endpoint the data
        plane reports (empty: none reported) says; None: this mode does not say, and the
        picker echoes nothing."""
        ...


class ClusterHeaderEncoder:
    """The backend's cluster in x-gorgo-backend (as raw_value) with clear_route_cache:
    the route's cluster_header picks it up."""

    def encode(
        self,
        d: Decision,
        body: bytes | None = None,
        request_id: str | None = None,
        phase: str = codec.REQUEST_BODY,
    ) -> codec.ProcessingResponse:
        """`body`: the request's new body (its model rewritten), with its length (in a
        body-phase reply the body itself too); `request_id`: the id the router gave it,
        when not the client's; `phase`: the message answered."""
        return codec.continue_response(
            phase,
            set_headers={
                HEADER_BACKEND: d.backend,
                **_length(body),
                **_deadline(d),
                **_renamed(request_id),
            },
            clear_route_cache=True,
            body=body if phase == codec.REQUEST_BODY else None,
        )

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """The fleet changed: a cluster name is the backend id, nothing to learn."""

    def backends_at(self, endpoints: Iterable[str]) -> frozenset[str] | None:
        """Clusters are named, not endpoints: a subset hint does not apply (None)."""
        return None

    def unrouted(self, reason: str) -> codec.ProcessingResponse | None:
        """Envoy's fallback route takes what the router cannot route (None)."""
        return None

    def undecided(self, ranked: Callable[[], Sequence[str]]) -> codec.ProcessingResponse | None:
        """Envoy's own route takes it: the headers go on as they came."""
        return codec.bare_continue(codec.REQUEST_HEADERS)

    def served(self, endpoint: str, chosen: str) -> str | None:
        """Envoy knows the cluster it sent the request to: nothing to learn or echo."""
        return None


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
        self,
        d: Decision,
        body: bytes | None = None,
        request_id: str | None = None,
        phase: str = codec.REQUEST_BODY,
    ) -> codec.ProcessingResponse:
        ranked = d.ranked()[: 1 + self.connect_retries]
        return self.name_endpoints(
            [self.addresses[b] for b in ranked],
            phase,
            {**_length(body), **_deadline(d), **_renamed(request_id)},
            body,
        )

    def name_endpoints(
        self,
        endpoints: list[str],
        phase: str,
        extra_headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> codec.ProcessingResponse:
        """The endpoints, in order, as the header and the envoy.lb metadata (the protocol
        wants both to say the same)."""
        endpoint = ",".join(endpoints)
        return codec.continue_response(
            phase,
            set_headers={HEADER_GATEWAY_ENDPOINT: endpoint, **(extra_headers or {})},
            # the routing header changed: a route matching on it is chosen again
            clear_route_cache=phase == codec.REQUEST_HEADERS,
            dynamic_metadata={LB_METADATA_NAMESPACE: {HEADER_GATEWAY_ENDPOINT: endpoint}},
            body=body if phase == codec.REQUEST_BODY else None,
        )

    def backends_at(self, endpoints: Iterable[str]) -> frozenset[str]:
        """The backends at these endpoints ("ip:port"; an entry without a port names every
        backend on that host), for a subset hint."""
        wanted = {_endpoint_key(e) for e in endpoints}
        hosts = {host for host, port in wanted if port is None}
        return frozenset(
            b
            for b, address in self.addresses.items()
            if _endpoint_key(address) in wanted or _endpoint_key(address)[0] in hosts
        )

    def backend_at(self, endpoint: str) -> str | None:
        """The backend at this "ip:port" (the endpoint that served a request), if any."""
        key = _endpoint_key(endpoint)
        return next((b for b, a in self.addresses.items() if _endpoint_key(a) == key), None)

    def unrouted(self, reason: str) -> codec.ProcessingResponse | None:
        """The endpoint-picker protocol: no endpoint can take it, say so (503)."""
        return no_endpoint(reason)

    def undecided(self, ranked: Callable[[], Sequence[str]]) -> codec.ProcessingResponse | None:
        """The pool's Envoy has no route of its own: the endpoints of the backends ranked,
        as many as a decision names (None: none)."""
        endpoints = [self.addresses[b] for b in ranked() if b in self.addresses]
        if not endpoints:
            return None
        return self.name_endpoints(endpoints[: 1 + self.connect_retries], codec.REQUEST_HEADERS)

    def served(self, endpoint: str, chosen: str) -> str | None:
        """The backend at the endpoint the data plane reports, else the chosen one."""
        return (self.backend_at(endpoint) if endpoint else None) or chosen


def _endpoint_key(endpoint: str) -> tuple[str, int | None]:
    """("host", port) of an "ip:port" / "[v6]:port" / bare host, for comparing endpoints
    as the data plane writes them with backends' addresses."""
    value = endpoint.strip().lower()
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or (value.startswith("[") and not host.endswith("]")):
        return value.strip("[]"), None  # a bare host (or an IPv6 address without port)
    if not value.startswith("[") and ":" in host:
        return value, None  # an IPv6 address without brackets: no port to split off
    return host.strip("[]"), int(port)


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


def decision_encoder(cfg: Config) -> DecisionEncoder:
    if cfg.envoy.mode == EnvoyMode.ENDPOINT_PICKER:
        return EndpointPickerEncoder(
            {b.id: b.address for b in cfg.backends}, cfg.envoy.connect_retries
        )
    return ClusterHeaderEncoder()
