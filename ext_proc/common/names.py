"""Header, span and metric names, defined once."""

# Routing: set by the ext_proc on the request, read by Envoy's cluster_header route.
HEADER_BACKEND = "x-gorgo-backend"
# Gateway API Inference Extension endpoint-picker header (stripped from clients too).
HEADER_GATEWAY_ENDPOINT = "x-gateway-destination-endpoint"
# Envoy's per-try timeout, set by the router on each request it routes: the first-byte
# deadline (Envoy honours it from a filter; it stops once response headers arrive).
HEADER_PER_TRY_TIMEOUT = "x-envoy-upstream-rq-per-try-timeout-ms"
# The decision span's attributes of a disaggregated decision (Decision.prefill): the
# engine that prefills, and the KV's predicted transfer to the decode engine (ms).
SPAN_PREFILL_BACKEND = "gorgo.prefill_backend"
SPAN_KV_TRANSFER_MS = "gorgo.kv_transfer_ms"
# At its close: the transfer as observed at the decode's first byte (ms).
SPAN_KV_TRANSFER_OBSERVED_MS = "gorgo.kv_transfer_observed_ms"
# A disaggregated request's prefill engine (the backend id), set by the ext_proc on the
# request bound for the decode engine (x-gorgo-backend) and echoed to the client.
HEADER_PREFILL_BACKEND = "x-gorgo-prefill-backend"
# Client-sent copies of these are removed before routing.
ROUTING_HEADERS = (HEADER_BACKEND, HEADER_GATEWAY_ENDPOINT, HEADER_PREFILL_BACKEND)

# Gateway API Inference Extension: the dynamic-metadata namespace override_host reads.
LB_METADATA_NAMESPACE = "envoy.lb"
# Its endpoint-picker protocol (docs/proposals/004-endpoint-picker-protocol): the data plane
# may name the endpoints a request may go to (a list of "ip:port" in the request's
# metadata, namespace envoy.lb.subset_hint), and tells which endpoint served it (envoy.lb
# in the response's metadata; a response header of the same name is read too).
SUBSET_METADATA_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_METADATA_KEY = "x-gateway-destination-endpoint-subset"
HEADER_GATEWAY_ENDPOINT_SERVED = "x-gateway-destination-endpoint-served"
# Its flow-control headers, read beside flow_control.objective_header / tenant_header.
HEADER_GATEWAY_OBJECTIVE = "x-gateway-inference-objective"
HEADER_GATEWAY_FAIRNESS_ID = "x-gateway-inference-fairness-id"

HEADER_SESSION = "x-session-id"
HEADER_REQUEST_ID = "x-request-id"
# gRPC metadata on the ext_proc streams naming the Envoy that opened them (its node id, as
# its access-log streams name it): a request is lost when that Envoy's reports stop.
METADATA_ENVOY_NODE = "x-gorgo-envoy"
# The same id as an Envoy attribute (the observer filter gets no request headers), and the
# attributes namespace Envoy's ext_proc filter sends them under.
REQUEST_ID_ATTRIBUTE = "request.id"
# The response's status and Envoy's word on who produced it (`via_upstream`: the backend),
# sent with the observer's first chunk: a backend's 5xx counts against it before the
# client has read it, not when the access-log entry comes (after the client may have
# sent its next request).
RESPONSE_CODE_ATTRIBUTE = "response.code"
RESPONSE_DETAILS_ATTRIBUTE = "response.code_details"
EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"

# Envoy's gRPC service paths we serve (their wire names, fixed by Envoy).
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
# The standard gRPC health service's names (grpc.health.v1.Health, on every gRPC port):
# "" (the whole server), the endpoint-picker protocol's liveness and readiness, the ext_proc
# service's own name (what its chart's Envoy health-checks) and the extension's.
HEALTH_LIVENESS = "liveness"
HEALTH_READINESS = "readiness"
HEALTH_INFERENCE_EXTENSION = "inference-extension"

# Name of the access log Envoy streams to us; completion records come from it.
ACCESS_LOG_NAME = "gorgo"
# Name of the access log of requests' starts: not read, its streams say an Envoy is there.
ACCESS_LOG_STARTS = "gorgo-starts"

# Envoy route names: the access-log service tells policy-routed and fail-open requests
# apart by them.
ROUTE_GORGO = "gorgo"
ROUTE_FALLBACK = "fallback"

# Flow control's refusals say why in this response header (llm-d's reasons where they
# agree: x-llm-d-request-dropped-reason).
HEADER_FLOW_REASON = "x-gorgo-flow-reason"
