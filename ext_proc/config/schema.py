"""The config's schema: one YAML file configures the service, and the Envoy config is
generated from it. Every section is a frozen dataclass; each field's range sits beside it
(`bounded(...)`). A leaf: it imports nothing of the router but the engine profiles' names
(`ext_proc.config.load` decodes and checks it).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ext_proc.config.discovery import Discovery
from ext_proc.config.flow import FlowControl
from ext_proc.config.kv_link import KvLinks
from ext_proc.config.transport import EnvoySettings, Listen
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.vocab.backend import Backend, EngineKind
from ext_proc.vocab.params import NON_NEGATIVE, POSITIVE, bounded


class TunerMode(enum.StrEnum):
    """`tuner.mode`: whether and how the cost weights are tuned online (docs/tuner.md)."""

    # Static weights (default: measured, online tuning gained nothing on average,
    # docs/results.md, "The tuner through a regime change").
    OFF = "off"
    # Parent and child on interleaved traffic, re-measured every round.
    PAIRED = "paired"
    # The published method, kept to reproduce it.
    PAPER = "paper"


class TunerObjective(enum.StrEnum):
    """`tuner.objective`: what a completion's TTFT sample is when an arm is scored."""

    # Each arm scored by its requests' TTFT (default).
    TTFT = "ttft"
    # By each request's TTFT minus its own floor: the prefill of its whole prompt, uncached,
    # on an idle engine of the fleet's fastest profile (what no routing decision changes).
    EXCESS_TTFT = "excess_ttft"


class TunerArmKey(enum.StrEnum):
    """`tuner.arm_key`: what the paired mode hashes to pick a request's arm."""

    # paired: each request's arm from a hash of its request id (default).
    REQUEST = "request"
    # From a hash of its session key (x-session-id, else `user`), so that all turns of a
    # conversation see the same arm; the request id when it has none.
    SESSION = "session"


# A path each engine answers without work, the default RTT probe: SGLang's /health runs a
# one-token generation (python/sglang/srt/entrypoints/http_server.py, unless
# SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false), so it would time the engine's queue;
# its /v1/models is answered by the HTTP process alone. vLLM's /health only checks that the
# engine process is alive.
PROBE_PATH = {EngineKind.SGLANG: "/v1/models", EngineKind.VLLM: "/health"}


class TtftModel(enum.StrEnum):
    """`routing.ttft_model`: how the queue and prefill terms are estimated."""

    # The profile's queue-plus-prefill estimate times the learned speed factors.
    PROFILE = "profile"
    # The engine's scheduler replayed over what is on the backend, with a step model
    # fitted online (ext_proc/estimate/replay.py).
    REPLAY = "replay"


class UnreadableBody(enum.StrEnum):
    """`routing.unreadable_body`: what becomes of a body the router cannot read (bad JSON,
    wrong types)."""

    # Send it on by the fallback route; the backend answers it.
    ROUTE = "route"
    # Answer 400 with a JSON error naming the problem, without loading a backend.
    REJECT = "reject"


@dataclass(frozen=True)
class Routing:
    """The `routing:` section: the prefix index's block size, what is learned of each
    backend, passive health, stall detection, load shedding, dispatch pacing and the
    first-byte deadline."""

    # Prefix-index granularity (tokens per hashed block). 256 = the ART-Chat traces'
    # blocks; a 128k-token prompt is 512 blocks, hashed in ~0.3-0.6 ms.
    block_tokens: int = bounded(256, **POSITIVE)
    # Learn each backend's speed against its profile from its completions (prefill and
    # decode factors, ext_proc/estimate/latency_model.py); off: the profile as it is.
    learn_latency: bool = True
    # How the wait and the prefill are estimated: "profile" or "replay" (docs/cost-model.md,
    # "Replay").
    ttft_model: TtftModel = TtftModel.REPLAY
    # Passive health: this many failed requests in a row (5xx, reset) eject a backend for
    # eject_s, doubling while it keeps failing when re-admitted (0 = never eject).
    eject_after_errors: int = bounded(2, **NON_NEGATIVE)
    eject_s: float = bounded(5.0, **NON_NEGATIVE)
    # A body the router cannot read (bad JSON, wrong types): route it on, or reject it.
    unreadable_body: UnreadableBody = UnreadableBody.ROUTE
    # Stall detection: a request still waiting for its first token past its estimated
    # TTFT by more than max(this grace, that estimate) makes its backend's queue estimate
    # grow with the lateness, so a stalled backend is avoided while it still answers
    # probes (0 = off).
    stall_grace_ms: float = bounded(500.0, **NON_NEGATIVE)
    # Shed load: when every backend's queue estimate exceeds this (ms), answer 429 with
    # Retry-After instead of queueing (0 = never shed).
    shed_queue_ms: float = bounded(0.0, **NON_NEGATIVE)
    # With KV events: a prompt dispatched this recently counts as cached where it went,
    # until the engine's own events say what it stored (they follow within a step).
    optimistic_ttl_s: float = bounded(10.0, **NON_NEGATIVE)
    # Dispatch pacing (docs/cost-model.md): keep a request until this many probe-RTT
    # standard deviations after the previous one sent to its backend, so that the WAN's
    # jitter does not reorder them at the engine; never longer than the queue it is
    # predicted to meet there on arrival, nor than pace_max_ms (Envoy awaits the decision
    # within envoy.message_timeout_ms). 0 = off.
    pace_sigmas: float = bounded(2.0, **NON_NEGATIVE)
    pace_max_ms: float = bounded(250.0, **NON_NEGATIVE)
    # First-byte deadline: a request whose backend has not begun its response this long
    # after the dispatch (factor x its predicted TTFT, or E2E when not streamed, plus the
    # slack) is given up there by Envoy (a per-try timeout: retried on another backend
    # like a connect failure, else a 504) and makes the backend suspect. Envoy's timer
    # stops when response headers arrive (vLLM sends them at once, SGLang with the first
    # token). 0 and 0 = off.
    first_byte_factor: float = bounded(4.0, **NON_NEGATIVE)
    first_byte_slack_ms: float = bounded(5000.0, **NON_NEGATIVE)
    # A disaggregated fleet (backends[].role prefill/decode): the links the prompt's KV
    # crosses between two engines' regions, and the KV bytes per prompt token when the
    # engine profile's (its kv_bytes_per_token) is not the model served (0: the
    # profile's). docs/cost-model.md, "The pair's price".
    kv_link: KvLinks = field(default_factory=KvLinks)
    kv_bytes_per_token: int = bounded(0, **NON_NEGATIVE)
    # A disaggregated request's prefill leg, sent by the router (docs/envoy.md, "Prefill
    # and decode apart"): vLLM's one-token prefill is awaited this long, SGLang's leg this
    # long to go out, and its answer (which follows the KV transfer, drained in the
    # background) no later than this after it was sent; past it the client gets a 504
    # naming the prefill engine (SGLang: the decode's transfer fails). 30 s: a long
    # prompt's prefill behind a queue, and Envoy holds the routing reply this long (the
    # routing filter's max_message_timeout covers it).
    prefill_timeout_s: float = bounded(30.0, gt=0.0, le=600.0)


@dataclass(frozen=True)
class TunerConfig:
    """The `tuner:` section: online tuning of a weighted policy's cost weights, off by
    default (`learn.tuner` has the method)."""

    # Only policies with weights are tuned.
    mode: TunerMode = TunerMode.OFF
    # Weights, sigma and history are saved here after every step and restored on start
    # ("" = not persisted).
    state_file: str = ""
    # paired: completions per arm per round (4 is the least a p95 can be read from).
    arm_size: int = bounded(24, ge=4)
    # What an arm is scored by: "ttft", or "excess_ttft" (TTFT minus the prompt's own
    # floor, decision-independent; docs/tuner.md). The E2E guard is the same in both.
    objective: TunerObjective = TunerObjective.TTFT
    # paired: what picks a request's arm: "request" (its id) or "session" (its session
    # key, else its id; docs/tuner.md).
    arm_key: TunerArmKey = TunerArmKey.REQUEST


@dataclass(frozen=True)
class Probes:
    """The `probes:` section: how often each backend's RTT is probed and its load
    (/metrics) and models (/v1/models) are read, and when failed probes make it suspect."""

    # RTT probe period per backend: fresh enough to follow a changing WAN within seconds
    # (the paper's 30 s was too slow), cheap (one small GET per backend).
    interval_s: float = bounded(2.0, **POSITIVE)
    timeout_s: float = bounded(2.0, **POSITIVE)
    # EWMA weight of a new RTT sample (the paper's 0.3).
    ewma_alpha: float = bounded(0.3, gt=0.0, le=1.0)
    # Consecutive probe failures before a backend is suspect (not chosen while others
    # are healthy); one success clears it.
    suspect_after: int = bounded(2, **POSITIVE)
    # What the probe GETs; "" = each engine's path that does no work (PROBE_PATH). Another
    # path is checked against that one now and then: one much slower makes the engine
    # work, and a warning says so.
    path: str = ""
    # Scrape each engine's Prometheus /metrics this often (0 = off; down to 0.1 s: a page
    # costs the engine 10-20 ms of CPU, measured on the real vLLM here); a report older
    # than metrics_stale_s ages out to the router's own estimate.
    metrics_interval_s: float = bounded(1.0, **NON_NEGATIVE)
    metrics_stale_s: float = bounded(10.0, **POSITIVE)
    # Read each engine's /v1/models this often (what it serves: models and LoRA adapters
    # loaded at run time; 0 = never, config's backends[].models or every model).
    models_interval_s: float = bounded(5.0, **NON_NEGATIVE)


@dataclass(frozen=True)
class TelemetryConfig:
    """The `telemetry:` section: where the decision spans go (OTLP), what share is traced,
    and how many decisions the operator's page keeps."""

    # OTLP/gRPC collector for the router's decision spans, host:port with no scheme ("" =
    # the standard OTEL_EXPORTER_OTLP_ENDPOINT variable, and if that is unset too, no export).
    otlp_endpoint: str = ""
    # TLS to the collector, checked against a PEM CA bundle ("" = system roots); cert+key: mTLS
    otlp_tls: bool = False
    otlp_ca_file: str = ""
    otlp_cert_file: str = ""
    otlp_key_file: str = ""
    # Share of decisions traced; a decision under a sampled Envoy span follows Envoy's.
    sample_ratio: float = bounded(1.0, ge=0.0, le=1.0)
    service_name: str = "gorgo"
    # Decisions kept for the operator's page (/ui) and /state, with their outcomes. A
    # decision over 64 backends costs ~20 KB (its candidates' terms).
    recent_decisions: int = bounded(1000, ge=8, le=100_000)
    # Where the page links a decision's trace: a URL with {trace_id}, for example Jaeger's
    # http://127.0.0.1:16686/trace/{trace_id} ("" = the trace id is shown, not linked).
    trace_url: str = ""


@dataclass(frozen=True)
class BusConfig:
    """The `bus:` section (once `fleet:`): several routers, one view: each publishes its
    dispatches to its peers (the other routers) over NATS (ext_proc.feeds.peers). Off
    (empty nats_url) for a single router."""

    # nats://host:port of the NATS server (or cluster) the routers share.
    nats_url: str = ""
    # Subject prefix: each router publishes on <subject>.<router_id> and hears <subject>.*.
    subject: str = "gorgo.fleet"
    # This router's name on the bus (default: host name and process id).
    router_id: str = ""
    # A peer's request whose close never came (that router died) stops counting after this.
    peer_ttl_s: float = bounded(300.0, **POSITIVE)


@dataclass(frozen=True)
class ServedShare:
    """One served model of an alias (`models[].served`) and its share of the alias's
    requests; weights are relative to the alias's other shares."""

    # A model name the engines serve, and its share of the alias's requests (relative).
    model: str
    weight: float = bounded(1.0, gt=0.0)


@dataclass(frozen=True)
class ModelAlias:
    """A public model name that the router maps to served names, in shares: an alias, or
    a rollout from one version to the next (`served: [{model: v1, weight: 90}, {model:
    v2, weight: 10}]`). A session keeps its share; the body's `model` is rewritten."""

    name: str
    served: tuple[ServedShare, ...]


@dataclass(frozen=True)
class Config:
    """The whole config file, one field per top-level key, decoded and checked by
    `load_config` (ext_proc/config/load.py). Frozen: a reload decodes a new one
    (ext_proc/service/reloader.py says what changes live)."""

    # Required unless `discovery` finds them (then these are kept beside the discovered).
    backends: tuple[Backend, ...] = ()
    policy: str = "gorgo"
    seed: int = 0
    # Each policy's own parameters, decoded by its parameter class (policies.<name>).
    # Policies not named here run with their defaults.
    policies: Mapping[str, Any] = field(default_factory=dict, metadata={"decode": "policies"})
    routing: Routing = field(default_factory=Routing)
    flow_control: FlowControl = field(default_factory=FlowControl)
    tuner: TunerConfig = field(default_factory=TunerConfig)
    probes: Probes = field(default_factory=Probes)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    listen: Listen = field(default_factory=Listen)
    envoy: EnvoySettings = field(default_factory=EnvoySettings)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # The routers' shared bus. Its old name, `fleet:` (the backends are the fleet), still
    # loads, with a warning (load.py, `renamed_from`).
    bus: BusConfig = field(default_factory=BusConfig, metadata={"renamed_from": "fleet"})
    # Backends found at run time (a Kubernetes InferencePool's pods).
    discovery: Discovery = field(default_factory=Discovery)
    # Public model names mapped to served ones (aliases, version splits).
    models: tuple[ModelAlias, ...] = ()
    # In-flight records whose completion never arrives (lost access log) expire after
    # this long, so the in-flight table stays bounded.
    request_timeout_s: float = bounded(900.0, **POSITIVE)

    @property
    def backend_ids(self) -> tuple[str, ...]:
        return tuple(b.id for b in self.backends)

    @property
    def ext_proc_address(self) -> str:
        return (self.envoy.ext_proc_addresses or (self.envoy.ext_proc_address,))[
            0
        ] or self.listen.grpc

    @property
    def ext_proc_addresses(self) -> tuple[str, ...]:
        """Every router process Envoy reaches."""
        return self.envoy.ext_proc_addresses or (self.ext_proc_address,)

    def probe_path(self, b: Backend) -> str:
        return self.probes.path or PROBE_PATH[b.engine]
