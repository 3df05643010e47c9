"""The decision span: its name and attributes (each one documented in docs/operations.md),
built from a decision, its dispatch and its close. Pure."""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Any

import orjson

from ext_proc.common.names import (
    SPAN_KV_TRANSFER_MS,
    SPAN_KV_TRANSFER_OBSERVED_MS,
    SPAN_PREFILL_BACKEND,
)
from ext_proc.core.backend import BackendState
from ext_proc.core.terms.catalog import TERMS
from ext_proc.vocab.events import Dispatched
from ext_proc.vocab.types import Candidate, Decision

SPAN_NAME = "gorgo.route"
# Attribute names (docs/operations.md lists them all).
A_POLICY = "gorgo.policy"
A_BACKEND = "gorgo.backend"
# OpenTelemetry's GenAI semantic conventions (gen_ai.*, as the installed
# opentelemetry-semantic-conventions names them: gen_ai.provider.name, which replaced
# gen_ai.system) and the server's address, where they say what the router knows: the
# request's operation, model, output budget, stream flag and prompt tokens (the router's
# count), the engine kind and address of the backend it went to, the cached tokens the
# engine reported, and error.type for a request that did not end ok. Each attribute costs
# the exporter ~4 us to encode: only these.
A_OPERATION = "gen_ai.operation.name"
A_PROVIDER = "gen_ai.provider.name"
A_MODEL = "gen_ai.request.model"
A_MAX_TOKENS = "gen_ai.request.max_tokens"
A_STREAM = "gen_ai.request.stream"
A_INPUT_TOKENS = "gen_ai.usage.input_tokens"
A_SERVER_ADDRESS = "server.address"
A_SERVER_PORT = "server.port"
A_ERROR_TYPE = "error.type"
# gen_ai.operation.name by API (ext_proc/prompt/parse.py's names): a chat, or a text
# completion (SGLang's native /generate takes a text or token ids and completes them).
OPERATIONS = {"chat": "chat", "completions": "text_completion", "generate": "text_completion"}
A_SESSION_HASH = "gorgo.session_hash"
A_WEIGHT_RTT = "gorgo.weights.rtt"
A_WEIGHT_QUEUE = "gorgo.weights.queue"
A_WEIGHTS_VERSION = "gorgo.weights.version"
A_TUNER_ARM = "gorgo.tuner.arm"
A_REQUEST_ID = "gorgo.request_id"
# Every candidate in one JSON attribute (an array of objects, one per backend): one
# attribute per candidate field cost the exporter ~4 us each, 30 for three backends and
# 640 for sixty-four, more than the decision itself.
A_CANDIDATES = "gorgo.candidates"
A_TTFT_MS = "gorgo.ttft_ms"
A_E2E_MS = "gorgo.e2e_ms"
A_STATUS = "gorgo.status"
# The chosen backend's prefix state at the decision, and what it predicted was cached.
A_PREFIX_STATE = "gorgo.prefix_state"
A_PREDICTED_CACHED = "gorgo.predicted_cached_tokens"
A_KV_EVENT_AGE_S = "gorgo.kv_events.age_s"
A_KV_EVENT_GAPS = "gorgo.kv_events.gaps"
A_KV_EVENT_RESETS = "gorgo.kv_events.resets"
A_ENGINE_REPORT_AGE_S = "gorgo.engine_report.age_s"
# At close, when the engine reported its cached tokens: the report and the error.
A_ENGINE_CACHED = "gen_ai.usage.cache_read.input_tokens"
A_PREDICTION_ERROR_TOKENS = "gorgo.prediction_error_tokens"
A_PREDICTION_ERROR_RATIO = "gorgo.prediction_error_ratio"
# The chosen backend's predicted TTFT and E2E (beside gorgo.ttft_ms and gorgo.e2e_ms).
A_PREDICTED_TTFT_MS = "gorgo.predicted_ttft_ms"
A_PREDICTED_E2E_MS = "gorgo.predicted_e2e_ms"
# Backends left out of the decision because they are draining (only when there are some).
A_DRAINING_BACKENDS = "gorgo.draining_backends"
# How long dispatch pacing kept the request before it was sent on (only when it did).
A_PACE_HOLD_MS = "gorgo.pace_hold_ms"
# Its wait in the gateway queue before this decision (flow control), and how many times
# it was offered room and found none.
A_FLOW_WAITED_MS = "gorgo.flow.waited_ms"
A_FLOW_QUEUED_BEHIND = "gorgo.flow.queued_behind"
# A disaggregated decision (only then): its prefill engine and the KV's predicted transfer.
A_PREFILL_BACKEND = SPAN_PREFILL_BACKEND
A_KV_TRANSFER_MS = SPAN_KV_TRANSFER_MS
A_KV_TRANSFER_OBSERVED_MS = SPAN_KV_TRANSFER_OBSERVED_MS


def session_hash(key: str | None) -> str:
    """A stable, non-reversible tag for a session key (never the key itself)."""
    return "" if not key else hashlib.sha256(key.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1024)
def server_of(address: str) -> tuple[str, int]:
    """server.address and server.port of a backend's `host:port` (an IPv6 host unbracketed)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def dispatch_attributes(e: Dispatched, b: BackendState) -> dict[str, Any]:
    """What is known at the dispatch: the request as the GenAI conventions name it, the
    backend it went to, and that backend's prefix state: where the prediction came from,
    and how fresh the engine's events and load report were."""
    rec = e.record
    host, port = server_of(b.config.address)
    attrs: dict[str, Any] = {
        A_PROVIDER: str(b.config.engine),
        A_SERVER_ADDRESS: host,
        A_SERVER_PORT: port,
        A_PREFIX_STATE: str(rec.prefix_state),
        A_PREDICTED_CACHED: rec.cached_tokens,
    }
    llm = e.request.llm
    if llm is not None:
        attrs[A_OPERATION] = OPERATIONS.get(llm.api, llm.api)
        if llm.max_output_tokens is not None:
            attrs[A_MAX_TOKENS] = llm.max_output_tokens
        if llm.stream:  # the conventions: set if and only if the request streams
            attrs[A_STREAM] = True
    engine = b.engine.blocks
    if engine is not None:
        attrs[A_KV_EVENT_GAPS] = engine.gaps
        attrs[A_KV_EVENT_RESETS] = engine.resets
        if engine.last_ts is not None:  # the engine's wall-clock stamp
            attrs[A_KV_EVENT_AGE_S] = round(max(0.0, time.time() - engine.last_ts), 3)
    if b.engine.report_at_s is not None:
        attrs[A_ENGINE_REPORT_AGE_S] = round(e.now_s - b.engine.report_at_s, 3)
    return attrs


def decision_attributes(
    d: Decision, session_key: str | None, weights_version: int | None
) -> dict[str, Any]:
    """`weights_version`: the tuner's steps at the decision (None: no tuner)."""
    attrs: dict[str, Any] = {
        A_REQUEST_ID: d.request_id,
        A_POLICY: d.policy,
        A_BACKEND: d.backend,
        A_INPUT_TOKENS: d.input_tokens,
        A_SESSION_HASH: session_hash(session_key),
        A_PREDICTED_TTFT_MS: round(d.chosen.predicted_ttft_ms, 3),
        A_PREDICTED_E2E_MS: round(d.chosen.predicted_e2e_ms, 3),
    }
    if d.model:  # the conventions: when the request names one
        attrs[A_MODEL] = d.model
    if d.draining:
        attrs[A_DRAINING_BACKENDS] = list(d.draining)
    if d.pace_ms:
        attrs[A_PACE_HOLD_MS] = round(d.pace_ms, 3)
    if d.waited_ms:
        attrs[A_FLOW_WAITED_MS] = round(d.waited_ms, 3)
        attrs[A_FLOW_QUEUED_BEHIND] = d.queued_behind
    if d.prefill is not None:
        attrs[A_PREFILL_BACKEND] = d.prefill.backend
        attrs[A_KV_TRANSFER_MS] = round(d.prefill.transfer_ms, 3)
    if d.weights is not None:
        attrs[A_WEIGHT_RTT] = d.weights.rtt
        attrs[A_WEIGHT_QUEUE] = d.weights.queue
    if weights_version is not None:
        attrs[A_WEIGHTS_VERSION] = weights_version
        attrs[A_TUNER_ARM] = d.arm or ""
    attrs[A_CANDIDATES] = orjson.dumps([_candidate(d, c) for c in d.candidates]).decode()
    return attrs


def _candidate(d: Decision, c: Candidate) -> dict[str, Any]:
    """One candidate as `gorgo.candidates` lists it: its backend, cost terms
    (`<name>_<unit>`), cached tokens, score and predicted TTFT and E2E."""
    values: dict[str, Any] = {"backend": c.backend_id}
    for name, value in c.terms.items():
        values[TERMS[name].key if name in TERMS else name] = round(value, 3)
    values["cached_tokens"] = c.cached_tokens
    values["cost"] = round(d.scores.get(c.backend_id, 0.0), 3)
    values["predicted_ttft_ms"] = round(c.predicted_ttft_ms, 3)
    values["predicted_e2e_ms"] = round(c.predicted_e2e_ms, 3)
    return values
