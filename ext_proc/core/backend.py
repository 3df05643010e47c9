"""One backend's record as the router sees it (`BackendState`): its config, engine profile
and prefill model, prefix cache, the engine's reported blocks, counters, RTT, health and
prediction figures. `core.state.FleetState` holds them all with the in-flight table.

Pure and synchronous; every time comes from the caller.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ext_proc.estimate.cost import PrefillModel
from ext_proc.estimate.engine_index import EngineBlocks
from ext_proc.estimate.latency_error import LatencyStats
from ext_proc.estimate.latency_model import LatencyModel
from ext_proc.estimate.prediction import PredictionStats
from ext_proc.estimate.prefix import PrefixCache
from ext_proc.estimate.profile import EngineProfile
from ext_proc.estimate.replay import StepFit, profile_coefficients
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.served_models import ServedModels
from ext_proc.feeds.server_info import EngineScheduling, PriorityWriting, priority_writing
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.types import BackendLifecycle, InFlight

# How many recent TTFT/E2E samples /state shows per backend.
RECENT_SAMPLES = 16


@dataclass(frozen=True)
class TokenCheck:
    """Whether the router's token ids are the engine's, as far as the KV events need them
    (ext_proc/service/engine_tokenizer.py checks them against the engine's own tokenizer).
    A backend whose ids are not known to be the engine's keeps approximate prefix state:
    its events could never match a request."""

    ok: bool = True
    # Why not (or what was verified), for /state and the log.
    reason: str = ""


@dataclass
class Health:
    """Whether the backend can be reached and serves: its probes and its requests."""

    # The probes' smoothed round trip (the config's prior until the first answers), how
    # many answered, and their exponentially weighted variance (ms^2): the WAN's jitter.
    rtt_ms: float
    rtt_samples: int = 0
    rtt_var_ms2: float = 0.0
    probe_failures: int = 0
    # Probes fail (or a first byte missed its deadline): not chosen while others are well.
    suspect: bool = False
    # Passive health: its requests that failed in a row, and until when it is out of
    # rotation because of them (None: in rotation).
    request_failures: int = 0
    # When the newest failed request of that streak was dispatched: a success reported
    # later but sent before it (a batched access-log entry) does not end the streak.
    failed_dispatch_s: float = float("-inf")
    ejections: int = 0
    ejected_until_s: float | None = None
    # What ended its last failed requests (newest last), shown with an ejection.
    recent_failures: deque[str] = field(default_factory=lambda: deque(maxlen=4))

    def ejected_at(self, now_s: float) -> bool:
        """Out for failing requests at now_s (an ejection ends by itself)."""
        return self.ejected_until_s is not None and now_s < self.ejected_until_s


@dataclass
class Load:
    """What this router and its peers have sent there and not yet seen end."""

    in_flight: int = 0
    # Dispatched and not yet past the first response byte (still queued or prefilling).
    waiting_first_byte: int = 0
    # Prompt tokens of the requests in flight, decoding ones included (the paper's queue
    # load, in tokens).
    in_flight_tokens: int = 0
    # This backend's share of the in-flight table (ours and peers').
    records: dict[str, InFlight] = field(default_factory=dict)
    # When the last request routed here was sent on (dispatch pacing; -inf: never).
    sent_s: float = float("-inf")
    # Running mean of the prefill estimates of requests sent here (ms).
    mean_prefill_ms: float = 100.0


@dataclass
class EngineView:
    """What its engine says of itself: its load, its KV pool, its models, its cache."""

    # The engine's last report of its own load (/metrics), and when it was read (None:
    # never).
    report: EngineReport | None = None
    report_at_s: float | None = None
    # The KV pool its engine reports (None: not reported), kept across stale reports.
    kv_capacity_tokens: int | None = None
    # What its engine lists on /v1/models (None: not read yet, or discovery is off).
    discovered: ServedModels | None = None
    # What the engine's KV events say it holds (None: it publishes none), and whether
    # that stream is up now (down, the router's own estimate serves).
    blocks: EngineBlocks | None = None
    events_up: bool = False
    tokens: TokenCheck = field(default_factory=TokenCheck)
    # What its /server_info says of its priority scheduling (SGLang; None: not read, or
    # unreadable: scheduling_error says why).
    scheduling: EngineScheduling | None = None
    scheduling_error: str = ""


@dataclass
class Learned:
    """How the engine behaves against its profile and the router's predictions, learned."""

    # How much faster or slower than its profile the engine runs: the base model's, and
    # each LoRA adapter's apart (an adapter's requests run slower).
    speed: LatencyModel = field(default_factory=LatencyModel)
    adapter_speed: dict[str, LatencyModel] = field(default_factory=dict)
    # How far its cached-token predictions were from the engine's reports.
    prediction: PredictionStats = field(default_factory=PredictionStats)
    # How far its TTFT and E2E predictions were from what the router measured.
    latency: LatencyStats = field(default_factory=LatencyStats)
    # Its engine's step time (routing.ttft_model: replay), made from its profile once
    # needed (BackendState.step_fit).
    step: StepFit | None = None


@dataclass
class Stats:
    """Its closed requests, by whose doing: the backend's failures (the only evidence
    against it), the clients' (4xx, gone before the end), Envoy's own refusals, and those
    whose end was never reported (lost with their Envoy, expired)."""

    completed: int = 0
    errors: int = 0
    client_errors: int = 0
    cancelled: int = 0
    gateway_errors: int = 0
    lost: int = 0
    # Requests sent here that Envoy served elsewhere (a connect failure, a missed
    # first-byte deadline).
    failovers: int = 0
    # Requests that reached this backend by Envoy's fallback route, not by our decision.
    fallback_completed: int = 0
    recent_ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))
    recent_e2e_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))


@dataclass
class BackendState:
    """Everything the router knows of one backend, in one record grouped by concern:
    what it is (config, engine profile, prefill model, lifecycle), what the router
    believes it caches (prefix), its health, its load, what its engine says, what was
    learned of it, and its closed requests. Added and removed in one step
    (core.state.FleetState)."""

    id: str
    rtt_prior_ms: float
    config: Backend
    profile: EngineProfile
    prefill: PrefillModel
    # What the router believes the engine caches (its own estimate from its decisions).
    prefix: PrefixCache
    health: Health = field(init=False)
    load: Load = field(default_factory=Load)
    engine: EngineView = field(default_factory=EngineView)
    learned: Learned = field(default_factory=Learned)
    stats: Stats = field(default_factory=Stats)
    # Active, or draining (no new decisions) since `lifecycle_since_s`.
    lifecycle: BackendLifecycle = BackendLifecycle.ACTIVE
    lifecycle_since_s: float = 0.0
    # `priority` as last made, and what it was made from.
    _priority: tuple[Backend, EngineScheduling | None, str, PriorityWriting] | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.health = Health(self.rtt_prior_ms)

    @property
    def precise(self) -> bool:
        """Its prefix state comes from its engine's events (they are up, and the router's
        token ids are the engine's)."""
        e = self.engine
        return e.events_up and e.blocks is not None and e.tokens.ok

    @property
    def kv_capacity(self) -> tuple[int, str]:
        """The KV pool the prefix index is sized to, and where it comes from: the
        config's backends[].kv_capacity_tokens wins, then what the engine reports, then
        the engine profile's."""
        if self.config.kv_capacity_tokens:
            return self.config.kv_capacity_tokens, "config"
        if self.engine.kv_capacity_tokens:
            return self.engine.kv_capacity_tokens, "engine"
        return self.profile.kv_capacity_tokens, "profile"

    @property
    def priority(self) -> PriorityWriting:
        """Whether a request's priority is written into its body for this engine, in
        which order, and why (backends[].priority_scheduling and its /server_info).
        Made again only when one of those changed (it is read per candidate)."""
        e, cached = self.engine, self._priority
        if (
            cached is None
            or cached[0] is not self.config
            or cached[1] is not e.scheduling
            or cached[2] is not e.scheduling_error
        ):
            writing = priority_writing(self.config, e.scheduling, e.scheduling_error)
            cached = self._priority = (self.config, e.scheduling, e.scheduling_error, writing)
        return cached[3]

    @property
    def models(self) -> ServedModels | None:
        """What it may be sent: what its engine lists, only the configured ones of it when
        `backends[].models` is set; the configured ones until the engine has answered;
        None (anything) with neither."""
        pinned = self.config.models
        discovered = self.engine.discovered
        if discovered is not None:
            return discovered.restricted_to(pinned) if pinned else discovered
        return ServedModels(frozenset(pinned)) if pinned else None

    def serves(self, model: str | None) -> bool:
        """Whether a request for `model` may go here (None, no model named: anywhere)."""
        served = self.models
        return model is None or served is None or served.serves(model)

    @property
    def step_fit(self) -> StepFit:
        """Its engine's step model (routing.ttft_model: replay), from its profile at first."""
        if self.learned.step is None:
            self.learned.step = StepFit(profile_coefficients(self.profile))
        return self.learned.step

    def speed_for(self, model: str | None) -> LatencyModel:
        """The speed a request for `model` runs at here: its adapter's, or the base's."""
        served = self.models
        learned = self.learned
        if model is None or served is None or model not in served.adapters:
            return learned.speed
        speed = learned.adapter_speed.get(model)
        if speed is None:
            base = learned.speed
            speed = LatencyModel(base.learn, base.prefill_factor, base.decode_factor)
            learned.adapter_speed[model] = speed
        return speed

    def learn_prefill(self, rec: InFlight, engine_ms: float) -> None:
        """What a request's queue and prefill took on this engine (`engine_ms`, its trips
        taken off) against what was predicted for it at its dispatch: its speed's
        prefill factor and, when it was priced by the replay, the step model."""
        speed = self.speed_for(rec.model)
        speed.observe_ttft((rec.queue_ms + rec.prefill_ms) / rec.prefill_factor, engine_ms)
        if rec.replay_features is not None and speed.learn:
            self.step_fit.observe(rec.replay_features, engine_ms + rec.replay_credit_ms)

    def as_json(self, now_s: float) -> dict[str, Any]:
        h, load, e, learned, st = self.health, self.load, self.engine, self.learned, self.stats
        ejected = h.ejected_at(now_s)
        return {
            "lifecycle": str(self.lifecycle),
            "rtt_ms": round(h.rtt_ms, 3),
            # The probes' jitter: dispatch pacing sends requests a multiple of it apart.
            "rtt_std_ms": round(math.sqrt(h.rtt_var_ms2), 3),
            "rtt_samples": h.rtt_samples,
            "suspect": h.suspect,
            "tokens": {"ok": e.tokens.ok, "reason": e.tokens.reason},
            "speed": learned.speed.as_json(),
            # routing.ttft_model: replay: the step model's multipliers on the profile's
            # coefficients, and the completions it learned from (None: not in use).
            "step_model": None if learned.step is None else learned.step.as_json(),
            "adapter_speed": {k: v.as_json() for k, v in sorted(learned.adapter_speed.items())},
            "models": None if self.models is None else self.models.as_json(),
            "ejected": ejected,
            "ejected_for": list(h.recent_failures) if ejected else [],
            "kv_capacity_tokens": self.kv_capacity[0],
            "kv_capacity_source": self.kv_capacity[1],
            # Whether requests' priorities are written for its engine's scheduler, and why.
            "priority": self.priority.as_json(),
            "in_flight": load.in_flight,
            "waiting_first_byte": load.waiting_first_byte,
            "in_flight_tokens": load.in_flight_tokens,
            "completed": st.completed,
            "errors": st.errors,
            "client_errors": st.client_errors,
            "cancelled": st.cancelled,
            "gateway_errors": st.gateway_errors,
            "lost": st.lost,
            "failovers": st.failovers,
            "fallback_completed": st.fallback_completed,
            "last_ttft_ms": [round(v, 3) for v in st.recent_ttft_ms],
            "last_e2e_ms": [round(v, 3) for v in st.recent_e2e_ms],
        }
