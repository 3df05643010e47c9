"""Builders shared by the tests: the one router factory, requests, and what they put in a
router through its public surface."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config
from ext_proc.core.backend import BackendState
from ext_proc.core.build import build_router
from ext_proc.core.fleet import new_record
from ext_proc.core.router import Router
from ext_proc.core.terms.base import TermInputs
from ext_proc.core.terms.catalog import TERMS
from ext_proc.envoy import codec
from ext_proc.envoy.encoders import decision_encoder
from ext_proc.envoy.roles import open_session
from ext_proc.envoy.session_base import Session
from ext_proc.estimate.cost import PrefillModel
from ext_proc.estimate.latency_model import LatencyModel
from ext_proc.estimate.profile import EngineProfile
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.vocab.events import Dispatched, Listener
from ext_proc.vocab.types import Candidate, RouteRequest
from tests.fakes import FakeClock

# The default fleet: three backends at the default RTT prior.
BACKENDS = ("a", "b", "c")
# Three regions 1 / 90 / 180 ms away.
REGIONS = (
    {"id": "near", "address": "127.0.0.1:1", "rtt_prior_ms": 1},
    {"id": "mid", "address": "127.0.0.1:2", "rtt_prior_ms": 90},
    {"id": "far", "address": "127.0.0.1:3", "rtt_prior_ms": 180},
)

BackendSpec = str | Mapping[str, object]


def make_config(
    policy: str = "least_request",
    timeout_s: float = 60.0,
    backends: Sequence[BackendSpec] = BACKENDS,
    **extra: object,
) -> Config:
    """A config of `backends` (an id alone: on 127.0.0.1, one port each in order), static
    weights unless `extra` asks for a tuner; extra config keys merged in. The TTFT model is
    the profile's unless `extra` names one: the unit tests' sums are done by hand on its
    formulas (the replay, the default, has tests of its own in tests/unit/estimate/
    test_replay.py, and every test through `gorgo serve`, the simulator or Envoy runs it)."""
    routing = {"ttft_model": "profile", **dict(extra.pop("routing", {}))}  # type: ignore[call-overload]
    return config_from_dict(
        {
            "policy": policy,
            "request_timeout_s": timeout_s,
            "tuner": {"mode": "off"},
            "backends": [
                {"id": b, "address": f"127.0.0.1:{i + 1}"} if isinstance(b, str) else dict(b)
                for i, b in enumerate(backends)
            ],
            "routing": routing,
            **extra,
        }
    )


def make_router(
    policy: str = "least_request",
    timeout_s: float = 60.0,
    *,
    backends: Sequence[BackendSpec] = BACKENDS,
    seed: int = 0,
    clock: FakeClock | None = None,
    listeners: Iterable[Listener] = (),
    **extra: object,
) -> tuple[Router, FakeClock]:
    """The tests' one router factory: the service's own (`build_router`) on a clock the
    test moves, with `make_config`'s config."""
    clock = clock if clock is not None else FakeClock()
    cfg = make_config(policy, timeout_s, backends, **extra)
    return build_router(cfg, clock, random.Random(seed), listeners=listeners), clock


def candidate(backend_id: str = "a", **kw: Any) -> Candidate:
    """A candidate as the framework builds one: its fields, and each built-in cost term
    from a `<name>_ms` keyword (0 unless given), in the registry's order."""
    terms = {name: float(kw.pop(f"{name}_ms", 0.0)) for name in TERMS}
    kw.setdefault("in_flight", 0)
    kw.setdefault("waiting_first_byte", 0)
    return Candidate(backend_id, terms=terms, **kw)


# An engine profile in round numbers, for sums done by hand: a prefill of 10 ms a chunk of
# 1,000 tokens plus 1 ms a token (x (1 + (cached + uncached / 2) / 10,000)); a decode step
# of 10 ms + 1 ms a running request + 2 ms per 1k tokens of context; 4 requests running at
# most; a KV pool of 10,000 tokens.
ROUND_PROFILE = EngineProfile(
    name="round",
    prefill_base_ms=10.0,
    prefill_tokens_per_s=1000.0,
    prefill_context_tokens=10_000.0,
    chunk_tokens=1000,
    decode_base_ms=10.0,
    decode_per_request_ms=1.0,
    decode_per_1k_context_ms=2.0,
    kv_capacity_tokens=10_000,
    max_running_requests=4,
)


def backend_state(
    backend_id: str = "a", rtt_ms: float = 10.0, profile: EngineProfile = ROUND_PROFILE
) -> BackendState:
    """One backend's record as the fleet makes it (nothing in flight, no engine report),
    on `profile`, at `rtt_ms` (its RTT prior): a record of its own, not in any router."""
    cfg = make_config(
        backends=[{"id": backend_id, "address": "127.0.0.1:1", "rtt_prior_ms": rtt_ms}]
    )
    b = new_record(cfg.backends[0], cfg, 0.0)
    b.profile, b.prefill = profile, PrefillModel(profile)
    return b


def term_inputs(backend: BackendState | None = None, **kw: Any) -> TermInputs:
    """What a cost term reads of `backend` (`backend_state()` by default) for one request:
    a prompt of `input_tokens` (0) with `cached_tokens` of it cached (0), no model, the
    profile's speed, nothing in flight, no engine report, the profile's KV pool, no stall
    grace, at time 0; any field given instead."""
    b = backend if backend is not None else backend_state()
    input_tokens = kw.setdefault("input_tokens", 0)
    cached = kw.setdefault("cached_tokens", 0)
    output = kw.setdefault("output_tokens", 0)
    kw.setdefault("uncached_tokens", input_tokens - cached)
    kw.setdefault("need_kv_tokens", input_tokens + output)
    kw.setdefault("capacity_tokens", b.profile.kv_capacity_tokens)
    defaults: dict[str, Any] = {
        "request": chat(rid="r"),
        "now_s": 0.0,
        "model": None,
        "adapter": False,
        "speed": LatencyModel(),
        "items": [],
        "step_ms": 0.0,
        "report": None,
        "stall_grace_ms": 0.0,
    }
    return TermInputs(backend=b, **(defaults | kw))


def chat(
    text: str = "hello world",
    user: str | None = None,
    rid: str | None = None,
    stream: bool = True,
    model: str | None = None,
) -> RouteRequest:
    """A one-message chat request (a random id unless `rid`)."""
    body: dict[str, object] = {"messages": [{"role": "user", "content": text}]}
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True
    if user:
        body["user"] = user
    rid = rid if rid is not None else f"r{random.random()}"
    return RouteRequest(rid, parse_body(CHAT, json.dumps(body).encode()), user)


def load(
    router: Router,
    request_id: str,
    backend: str,
    input_tokens: int,
    output_tokens: int = 0,
    prefill_ms: float = 0.0,
    decoding: bool = False,
) -> None:
    """A request another router sent to `backend`, in flight from now: it loads the
    queue and KV estimates and the in-flight counts as the router's own requests do, and
    nothing learns from it. decoding: its first byte came now (nothing left to prefill)."""
    router.inputs.apply_peer(
        PeerEvent(
            PeerKind.DISPATCHED,
            "peer",
            request_id,
            backend,
            input_tokens,
            output_tokens,
            prefill_ms=prefill_ms,
        )
    )
    if decoding:
        router.inputs.apply_peer(PeerEvent(PeerKind.FIRST_BYTE, "peer", request_id, backend))


class Dispatches(Listener):
    """Every dispatch the router it subscribes to makes, in order."""

    def __init__(self) -> None:
        self.events: list[Dispatched] = []

    def on_dispatch(self, e: Dispatched) -> None:
        self.events.append(e)

    def times_s(self) -> list[float]:
        return [e.now_s for e in self.events]

    def by_backend(self) -> dict[str, list[str]]:
        """Each backend's request ids, in the order they were sent there."""
        out: dict[str, list[str]] = {}
        for e in self.events:
            out.setdefault(e.decision.backend, []).append(e.request.request_id)
        return out


class Stream:
    """Feeds ext_proc messages as the server loop does: the first one opens the session
    its role calls for."""

    def __init__(self, r: Router) -> None:
        self.router = r
        self.session: Session | None = None

    def handle(self, req: codec.ProcessingRequest) -> codec.ProcessingResponse | None:
        phase = codec.decode(req)
        if self.session is None:
            encoder = decision_encoder(self.router.cfg)
            self.session = open_session(self.router, encoder, req, phase)
        return self.session.handle(phase)

    @property
    def done(self) -> bool:
        return self.session is not None and self.session.done
