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
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.served_models import ServedModels
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
class BackendState:
    id: str
    rtt_prior_ms: float
    config: Backend
    profile: EngineProfile
    prefill: PrefillModel
    # What the router believes the engine caches (its own estimate from its decisions).
    prefix: PrefixCache
    # What the engine's KV events say it holds (None: it publishes none), and whether
    # that stream is up now (down, the router's own estimate serves).
    engine_blocks: EngineBlocks | None = None
    events_up: bool = False
    tokens: TokenCheck = field(default_factory=TokenCheck)
    # How far its cached-token predictions were from the engine's reports.
    prediction: PredictionStats = field(default_factory=PredictionStats)
    # How far its TTFT and E2E predictions were from what the router measured.
    latency: LatencyStats = field(default_factory=LatencyStats)
    # How much faster or slower than its profile the engine runs, learned online: the
    # base model's, and each LoRA adapter's apart (an adapter's requests run slower).
    speed: LatencyModel = field(default_factory=LatencyModel)
    adapter_speed: dict[str, LatencyModel] = field(default_factory=dict)
    # What its engine lists on /v1/models (None: not read yet, or discovery is off).
    discovered: ServedModels | None = None
    rtt_ms: float = 0.0
    rtt_samples: int = 0
    # Exponentially weighted variance of the probe samples (ms^2): the WAN's jitter.
    rtt_var_ms2: float = 0.0
    # When the last request routed here was sent on (dispatch pacing; -inf: never).
    sent_s: float = float("-inf")
    probe_failures: int = 0
    suspect: bool = False
    # Passive health: requests that failed in a row, and until when the backend is out
    # of rotation because of them (None: in rotation).
    request_failures: int = 0
    ejections: int = 0
    ejected_until_s: float | None = None
    in_flight: int = 0
    # Dispatched and not yet past the first response byte (still queued or prefilling).
    waiting_first_byte: int = 0
    # Prompt tokens of the requests in flight, decoding ones included (the paper's queue
    # load, in tokens).
    in_flight_tokens: int = 0
    completed: int = 0
    # Closed requests by whose doing: the backend's failures (the only evidence against
    # it), the clients' (4xx, gone before the end), Envoy's own refusals, and those whose
    # end was never reported (lost with their Envoy, expired).
    errors: int = 0
    client_errors: int = 0
    cancelled: int = 0
    gateway_errors: int = 0
    lost: int = 0
    # What ended its last failed requests (newest last), shown with an ejection.
    recent_failures: deque[str] = field(default_factory=lambda: deque(maxlen=4))
    # Requests sent here that Envoy retried elsewhere because it could not connect.
    failovers: int = 0
    # Requests that reached this backend by Envoy's fallback route, not by our decision.
    fallback_completed: int = 0
    # The engine's last report of its own load (/metrics), and when it was read (None:
    # never).
    engine: EngineReport | None = None
    engine_at_s: float | None = None
    # The KV pool its engine reports (None: not reported), kept across stale reports.
    engine_kv_capacity_tokens: int | None = None
    # Running mean of the prefill estimates of requests sent here (ms).
    mean_prefill_ms: float = 100.0
    recent_ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))
    recent_e2e_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))
    # This backend's share of the in-flight table.
    records: dict[str, InFlight] = field(default_factory=dict)
    # Active, or draining (no new decisions) since `lifecycle_since_s`.
    lifecycle: BackendLifecycle = BackendLifecycle.ACTIVE
    lifecycle_since_s: float = 0.0

    def __post_init__(self) -> None:
        self.rtt_ms = self.rtt_prior_ms

    @property
    def precise(self) -> bool:
        """Its prefix state comes from its engine's events (they are up, and the router's
        token ids are the engine's)."""
        return self.events_up and self.engine_blocks is not None and self.tokens.ok

    @property
    def kv_capacity(self) -> tuple[int, str]:
        """The KV pool the prefix index is sized to, and where it comes from: the
        config's backends[].kv_capacity_tokens wins, then what the engine reports, then
        the engine profile's."""
        if self.config.kv_capacity_tokens:
            return self.config.kv_capacity_tokens, "config"
        if self.engine_kv_capacity_tokens:
            return self.engine_kv_capacity_tokens, "engine"
        return self.profile.kv_capacity_tokens, "profile"

    @property
    def models(self) -> ServedModels | None:
        """What it may be sent: what its engine lists, only the configured ones of it when
        `backends[].models` is set; the configured ones until the engine has answered;
        None (anything) with neither."""
        pinned = self.config.models
        if self.discovered is not None:
            return self.discovered.restricted_to(pinned) if pinned else self.discovered
        return ServedModels(frozenset(pinned)) if pinned else None

    def serves(self, model: str | None) -> bool:
        """Whether a request for `model` may go here (None, no model named: anywhere)."""
        served = self.models
        return model is None or served is None or served.serves(model)

    def speed_for(self, model: str | None) -> LatencyModel:
        """The speed a request for `model` runs at here: its adapter's, or the base's."""
        served = self.models
        if model is None or served is None or model not in served.adapters:
            return self.speed
        speed = self.adapter_speed.get(model)
        if speed is None:
            base = self.speed
            speed = LatencyModel(base.learn, base.prefill_factor, base.decode_factor)
            self.adapter_speed[model] = speed
        return speed

    def ejected_at(self, now_s: float) -> bool:
        """Out for failing requests at now_s (an ejection ends by itself)."""
        return self.ejected_until_s is not None and now_s < self.ejected_until_s

    def as_json(self, now_s: float) -> dict[str, Any]:
        return {
            "lifecycle": str(self.lifecycle),
            "rtt_ms": round(self.rtt_ms, 3),
            # The probes' jitter: dispatch pacing holds requests a multiple of it apart.
            "rtt_std_ms": round(math.sqrt(self.rtt_var_ms2), 3),
            "rtt_samples": self.rtt_samples,
            "suspect": self.suspect,
            "tokens": {"ok": self.tokens.ok, "reason": self.tokens.reason},
            "speed": self.speed.as_json(),
            "adapter_speed": {k: v.as_json() for k, v in sorted(self.adapter_speed.items())},
            "models": None if self.models is None else self.models.as_json(),
            "ejected": self.ejected_at(now_s),
            "ejected_for": list(self.recent_failures) if self.ejected_at(now_s) else [],
            "kv_capacity_tokens": self.kv_capacity[0],
            "kv_capacity_source": self.kv_capacity[1],
            "in_flight": self.in_flight,
            "waiting_first_byte": self.waiting_first_byte,
            "in_flight_tokens": self.in_flight_tokens,
            "completed": self.completed,
            "errors": self.errors,
            "client_errors": self.client_errors,
            "cancelled": self.cancelled,
            "gateway_errors": self.gateway_errors,
            "lost": self.lost,
            "failovers": self.failovers,
            "fallback_completed": self.fallback_completed,
            "last_ttft_ms": [round(v, 3) for v in self.recent_ttft_ms],
            "last_e2e_ms": [round(v, 3) for v in self.recent_e2e_ms],
        }
