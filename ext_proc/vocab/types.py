"""The core's shared types, which every step may import: what a request asks
(`RouteRequest`), what the router knows of each candidate (`Candidate`), what it chose
(`Decision`), what it keeps of a request in flight (`InFlight`), the cost weights, and the
enums of a request's and a backend's life. They import only the parsed body's type
(`prompt.parse.LlmRequest`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from ext_proc.vocab.errors import ApiError
from ext_proc.vocab.request import LlmRequest
from ext_proc.vocab.terms import TERMS


class Status(enum.StrEnum):
    """How a request was closed."""

    OK = "ok"
    # The backend failed it (5xx, a connection refused or reset from upstream, no first
    # byte by its deadline, an error inside the stream): the only status that is evidence
    # against the backend.
    ERROR = "error"
    # The backend answered 4xx: the request's fault, not the backend's.
    CLIENT_ERROR = "client_error"
    # The client went away: says nothing about the backend.
    CANCELLED = "cancelled"
    # Envoy refused or could not send it on by itself (no healthy host, overflow, its own
    # 5xx without an upstream failure): not the backend's doing.
    GATEWAY_ERROR = "gateway_error"
    # No completion arrived by its deadline (a lost access-log entry).
    EXPIRED = "expired"
    # The Envoy that carried it went away (its access-log stream ended): no report of it
    # will ever come.
    LOST = "lost"
    # Envoy could not connect to the chosen backend and another one served it.
    FAILED_OVER = "failed_over"


class PrefixState(enum.StrEnum):
    """Where a backend's cached-token prediction comes from."""

    # The engine's own KV events (the stream is up and caught up).
    PRECISE = "precise"
    # The router's own prefix index (no events, or their stream is down).
    APPROXIMATE = "approximate"
    # The engine's events are up but may lack what it cached before the router heard
    # it: the larger of the events' prediction and the router's own index.
    WARMING = "warming"


class BackendLifecycle(enum.StrEnum):
    """Where a backend is in its life: (pending ->) active -> draining -> removed."""

    # Added, not yet a candidate: the shell waits until Envoy can route to it (with
    # envoy.xds_dir), so no decision names a cluster Envoy does not have yet.
    PENDING = "pending"
    # A candidate of every decision (while healthy).
    ACTIVE = "active"
    # No new decisions; its requests in flight finish, then it is removed.
    DRAINING = "draining"
    # Gone from the router's state (its requests in flight had all closed).
    REMOVED = "removed"


class BackendChange(enum.StrEnum):
    """What happened to a backend (`BackendChanged`)."""

    ADDED = "added"
    # Pending, now active (Envoy has its cluster).
    ACTIVATED = "activated"
    DRAINING = "draining"
    # Draining, and back in rotation before it was removed (a reload named it again).
    REACTIVATED = "reactivated"
    # Its fields changed in place (a reload); `reset`: what the router knew of the engine
    # behind it was forgotten (address, engine or kv_events changed).
    UPDATED = "updated"
    REMOVED = "removed"


@dataclass(frozen=True)
class Weights:
    """The two cost weights the router owns and its tuner moves: `rtt` weighs the request's
    trip, `queue` the wait ahead of it. Each policy form has its own starting values
    (TimeWeights, TokenWeights)."""

    rtt: float
    queue: float


@dataclass(frozen=True)
class Candidate:
    """One backend as a candidate for one request: its load, the request's cached and
    uncached tokens there, and every cost term (`vocab.terms`) by name."""

    backend_id: str
    in_flight: int
    waiting_first_byte: int
    # Prompt tokens of the requests in flight there, decoding ones included (the paper's
    # load, in tokens).
    in_flight_tokens: int = 0
    cached_tokens: int = 0
    uncached_tokens: int = 0
    # Prompt tokens of the requests there still waiting for their first token, and the
    # engine time owed to those whose prefill has not begun (flow control's room, ms).
    waiting_tokens: int = 0
    unstarted_ms: float = 0.0
    # Its engine schedules by priority (the router writes the request's class): the work
    # counted ahead of the request is its class and above (estimate.cost.ahead_of).
    by_priority: bool = False
    # The output the request is expected to generate (its max_tokens, or learned:
    # estimate/output_length.py): its predicted decode and E2E rest on it.
    expected_output_tokens: float = 0.0
    # The multiplier its predicted decode carries (estimate/decode_replay.py
    # DecodeCalibration).
    decode_calibration: float = 1.0
    # Each registered cost term's value there, by name, in registration order (ms for
    # the built-in ones: docs/cost-model.md).
    terms: Mapping[str, float] = field(default_factory=dict)
    # The scheduler's replay there (routing.ttft_model: replay; None: not replayed): its
    # features and the engine time it credited to the work ahead. The chosen candidate's
    # travel with the dispatch (InFlight), to fit the step model from its TTFT.
    replay_features: npt.NDArray[np.float64] | None = field(default=None, compare=False, repr=False)
    replay_credit_ms: float = 0.0

    def term(self, name: str) -> float:
        return self.terms.get(name, 0.0)

    @property
    def rtt_ms(self) -> float:
        return self.term("rtt")

    @property
    def queue_ms(self) -> float:
        return self.term("queue")

    @property
    def prefill_ms(self) -> float:
        return self.term("prefill")

    @property
    def decode_ms(self) -> float:
        """Its own decode: output tokens x the backend's step with it there."""
        return self.term("decode")

    def _ttft_sum(self, leave_out: tuple[str, ...] = ()) -> float:
        total = 0.0
        for name, value in self.terms.items():
            info = TERMS.get(name)
            if info is not None and info.ttft and name not in leave_out:
                total += value
        return total

    @cached_property
    def predicted_ttft_ms(self) -> float:
        """The TTFT the router predicts there: the sum of the terms that make it up (the
        request's trip, the waits ahead of it, its own prefill)."""
        return self._ttft_sum()

    @cached_property
    def wait_ms(self) -> float:
        """Its wait before its own prefill starts: the TTFT terms but the trip and the
        prefill (the queue, a LoRA slot)."""
        return self._ttft_sum(("rtt", "prefill"))

    @property
    def predicted_e2e_ms(self) -> float:
        return self.predicted_ttft_ms + self.decode_ms

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "backend": self.backend_id,
            "in_flight": self.in_flight,
            "in_flight_tokens": self.in_flight_tokens,
            "cached_tokens": self.cached_tokens,
            "uncached_tokens": self.uncached_tokens,
        }
        for name, value in self.terms.items():
            info = TERMS.get(name)
            out[info.key if info is not None else name] = round(value, 3)
        out["predicted_ttft_ms"] = round(self.predicted_ttft_ms, 3)
        out["predicted_e2e_ms"] = round(self.predicted_e2e_ms, 3)
        return out


@dataclass(frozen=True)
class RouteRequest:
    """One request as the router decides on it: its id, the parsed body (None: not an LLM
    call, or unreadable), its session key, and what the caller already knows (prompt
    blocks, trace context, its Envoy). Built by the routing session, or by the simulator
    and the benchmarks."""

    request_id: str
    # None when the request is not an LLM call or its body could not be read.
    llm: LlmRequest | None
    # x-session-id, else the OpenAI `user` field.
    session_key: str | None
    # The prompt's prefix-block hashes when the caller already has them (the simulator
    # derives them from a trace's block ids); None: the router hashes the prompt text.
    blocks: Any = None
    # The prompt's blocks as the engine keys them, when the caller knows (the simulator,
    # whose engine models key blocks by trace ids); None: derived from the prompt's tokens.
    engine_keys: Any = None
    # The caller's W3C trace context (traceparent, tracestate), passed through untouched
    # to the telemetry listener so the decision span joins Envoy's trace.
    trace_context: tuple[tuple[str, str], ...] = ()
    # The Envoy that carries it (its node id; "" = not said): its completion comes from
    # that Envoy's access log, and it is lost if that Envoy goes away.
    envoy: str = ""
    # Flow control (ext_proc/flow/): the objective it names, its tenant, and its own TTFT
    # SLO in ms (0: its objective's), as its headers say ("": none named).
    objective: str = ""
    tenant: str = ""
    ttft_slo_ms: float = 0.0
    # The backends' regions it may go to (its objective's `regions`; empty: any).
    regions: frozenset[str] = frozenset()
    # Its objective's priority (higher: more important): on a backend whose engine
    # schedules by priority, only work of this priority and above is ahead of it.
    priority: int = 0
    # The backends it may go to (the data plane's subset hint, endpoint-picker protocol);
    # None: any. None of them able to take it: no decision (503).
    subset: frozenset[str] | None = None


@dataclass
class InFlight:
    """What the router keeps of a request from its dispatch to its close: the decision's
    estimates and predictions, to learn from the outcome, and its times (`*_s`: seconds
    on the router's clock). Another router's request gets one too, without predictions."""

    request_id: str
    backend: str
    dispatched_s: float
    input_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    # Where that cached-token prediction came from (the chosen backend's prefix state).
    prefix_state: PrefixState = PrefixState.APPROXIMATE
    # The decision's estimates, kept to learn from the outcome.
    prefill_ms: float = 0.0
    rtt_ms: float = 0.0
    queue_ms: float = 0.0
    # What it predicted for the chosen backend (None: no prediction, a peer's record),
    # judged against the measured TTFT and E2E at the close (estimate.latency_error).
    predicted_ttft_ms: float | None = None
    predicted_e2e_ms: float | None = None
    # The output it was expected to generate when chosen (Candidate.expected_output_tokens;
    # None: a peer's record, whose budget `output_tokens` stands for it).
    expected_output_tokens: float | None = None
    # Its max_tokens (None: it set none), objective and tenant ("": none named): its
    # output length is learned by them (estimate/output_length.py).
    max_output_tokens: int | None = None
    objective: str = ""
    tenant: str = ""
    # Its session key (RouteRequest.session_key; None: none): its turns' lengths are alike.
    session: str | None = None
    # The output tokens it generated, set before its close by a caller that knows them (the
    # simulator, or the response's size: RouterInputs.response_size; None: not known).
    generated_tokens: int | None = None
    # The size of one token's event in its response stream (RouterInputs.stream_sample;
    # None: not measured).
    token_event_bytes: float | None = None
    # The multiplier its predicted decode carried (Candidate.decode_calibration).
    decode_calibration: float = 1.0
    # The backend's learned speed factors when it was chosen (its estimates carry them).
    prefill_factor: float = 1.0
    decode_factor: float = 1.0
    # The scheduler's replay at its dispatch (routing.ttft_model: replay): its features and
    # the engine time credited to the work ahead, to fit the step model from its TTFT.
    replay_features: npt.NDArray[np.float64] | None = None
    replay_credit_ms: float = 0.0
    # How long dispatch pacing kept it before it was sent on (its TTFT includes that).
    pace_ms: float = 0.0
    # How long it waited in the gateway queue before this dispatch (flow control): its
    # reported TTFT and E2E count from its arrival, that wait included.
    waited_ms: float = 0.0
    # Its objective's priority (RouteRequest.priority): on a backend whose engine schedules
    # by priority, a later request of a higher one goes ahead of it there.
    priority: int = 0
    # When its response must have begun (None: no deadline): routing.first_byte_factor.
    first_byte_deadline_s: float | None = None
    # The model it asked for (None: none named): its LoRA adapter's speed learns from it.
    model: str | None = None
    # The prompt's prefix blocks (for trimming the index) and when the chosen backend had
    # last used each block it was believed to hold.
    blocks: npt.NDArray[np.uint64] | None = None
    matched_last_used_s: npt.NDArray[np.float64] | None = None
    first_byte_s: float | None = None
    # The client asked for a stream: the first response byte is the first token. Without
    # a stream it comes only when generation ends.
    streaming: bool = True
    # The response already ended this long after it began (Envoy's E2E), before its first
    # byte was reported: the first byte cannot have come later.
    ended_e2e_ms: float | None = None
    # The Envoy that carries it (RouteRequest.envoy).
    envoy: str = ""
    # Another backend that served it, known before its close (the endpoint-picker
    # protocol's served endpoint: Envoy went on to the next endpoint after a connect
    # failure): its TTFT and E2E are that backend's, the failover the chosen one's.
    served_by: str | None = None
    # Prefilled on another engine (Decision.prefill; None: `backend` does both): that
    # engine, and the predicted transfer of the KV to `backend` (ms) and its bandwidth
    # part (without the link's RTT): what the observed transfer corrects.
    prefill_backend: str | None = None
    transfer_ms: float = 0.0
    transfer_bandwidth_ms: float = 0.0
    # What the transfer took as observed at the decode's first byte (the time since the
    # dispatch less the rest of the prediction; None: not observed).
    observed_transfer_ms: float | None = None

    @property
    def arrived_s(self) -> float:
        """When it reached the router: its TTFT and E2E count from here."""
        return self.dispatched_s - self.waited_ms / 1000 if self.waited_ms else self.dispatched_s


@dataclass(frozen=True)
class PrefillLeg:
    """The prefill half of a disaggregated decision: the engine that prefills the prompt,
    whose KV then moves over the link to the decode engine (`Decision.backend`)."""

    backend: str
    # The prompt's KV in bytes, and its predicted transfer over the link (RTT + bytes /
    # bandwidth), in ms.
    kv_bytes: int = 0
    transfer_ms: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "kv_bytes": self.kv_bytes,
            "transfer_ms": round(self.transfer_ms, 3),
        }


@dataclass(frozen=True)
class Decision:
    """Where the router sent a request and why: the chosen backend, every candidate with
    its terms and score, the weights and tuner arm used, and how it is sent on: paced by
    `pace_ms`, then given `first_byte_deadline_ms` to begin its response."""

    request_id: str
    backend: str
    policy: str
    input_tokens: int
    candidates: tuple[Candidate, ...]
    scores: dict[str, float]
    # The weights the policy used (None: a policy without weights) and the tuner's arm.
    weights: Weights | None = None
    arm: str | None = None
    # Backends left out because they are draining (never a candidate, nor a failover).
    draining: tuple[str, ...] = ()
    # The model the request asked for (None: none named).
    model: str | None = None
    # How long dispatch pacing keeps the dispatch before sending it on.
    pace_ms: float = 0.0
    # How long after it is sent on the backend must begin its response (Envoy's per-try
    # timeout; None: no deadline).
    first_byte_deadline_ms: float | None = None
    # How long it waited in the gateway queue before this decision (flow control), and
    # how many requests were waiting there when it joined (its position on arrival).
    waited_ms: float = 0.0
    queued_behind: int = 0
    # The `priority` the transport writes into the body for the chosen backend's engine,
    # in that engine's order (None: nothing to write: its engine does not schedule by
    # priority, or the body already says so; ext_proc/feeds/server_info.py).
    engine_priority: int | None = None
    # Prefilled on another engine, then decoded on `backend` (None: `backend` does both).
    prefill: PrefillLeg | None = None

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.backend_id == self.backend)

    def ranked(self) -> list[str]:
        """The chosen backend, then the others from best score to worst: where a retry
        should go when the chosen one cannot be reached."""
        others = [c.backend_id for c in self.candidates if c.backend_id != self.backend]
        others.sort(key=lambda b: self.scores.get(b, float("inf")))
        return [self.backend, *others]

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "backend": self.backend,
            "policy": self.policy,
            "model": self.model,
            "input_tokens": self.input_tokens,
            "candidates": [
                {**c.as_json(), "score": round(self.scores[c.backend_id], 3)}
                if c.backend_id in self.scores
                else c.as_json()
                for c in self.candidates
            ],
        }
        if self.draining:
            out["draining"] = list(self.draining)
        if self.pace_ms:  # /state's name for it (docs/cost-model.md), kept
            out["hold_ms"] = round(self.pace_ms, 3)
        if self.waited_ms:
            out["waited_ms"] = round(self.waited_ms, 3)
            out["queued_behind"] = self.queued_behind
        if self.engine_priority is not None:
            out["engine_priority"] = self.engine_priority
        if self.prefill is not None:
            out["prefill"] = self.prefill.as_json()
        return out


@dataclass(frozen=True)
class Refusal:
    """Admission refused: the router answers the client itself (OpenAI's error shape),
    no engine reached. `error` is the kind of answer (its status, type, code and param:
    ext_proc/vocab/errors.py), `retry_after_s` when to retry (Retry-After)."""

    error: ApiError
    message: str
    retry_after_s: float | None = None
    # Flow control's reason, said in a response header (llm-d's values where they agree:
    # rejected-saturated, rejected-ttl-expired, rejected-no-endpoints; ours: rejected-slo).
    reason: str = ""

    @property
    def status(self) -> int:
        return self.error.status
