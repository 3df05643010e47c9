"""The fleet: backends added, drained and removed at run time, and the config they make.

(pending ->) active -> draining -> removed. Pending (`confirm_new_backends`): added, not a
candidate until the shell says Envoy can route to it. A draining backend is no candidate
of any decision (so no policy, failover list or fallback of the router names it); its
requests in flight finish, and the close of its last one (or its expiry) removes its
record. Listeners hear each step (`BackendChanged`): the shell starts and stops the
backend's probes and KV-event subscriber and tells Envoy. `cfg.backends` is always the
pending, active and draining ones, in the order they came.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ext_proc.config.dump import backend_as_dict
from ext_proc.config.schema import Config
from ext_proc.core.admission import serving
from ext_proc.core.backend import BackendState, EngineView, Learned
from ext_proc.core.state import FleetState
from ext_proc.estimate.cost import PrefillModel
from ext_proc.estimate.engine_index import EngineBlocks
from ext_proc.estimate.latency_error import LatencyStats
from ext_proc.estimate.latency_model import LatencyModel
from ext_proc.estimate.prediction import PredictionStats
from ext_proc.estimate.prefix import PrefixCache
from ext_proc.estimate.profile import load_profile
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.events import BackendChanged
from ext_proc.vocab.types import BackendChange, BackendLifecycle

# How many removed backends /state and the lifecycle metric still show.
RECENT_REMOVED = 16
_ACTIVE = BackendLifecycle.ACTIVE
_PENDING = BackendLifecycle.PENDING
_DRAINING = BackendLifecycle.DRAINING

# Keys a reload applies live: read from the config at each use, by nothing else.
LIVE_KEYS = (
    "routing.shed_queue_ms",
    "routing.stall_grace_ms",
    "routing.optimistic_ttl_s",
    "routing.unreadable_body",
    "routing.pace_sigmas",
    "routing.pace_max_ms",
    "routing.first_byte_factor",
    "routing.first_byte_slack_ms",
)
# Top-level keys a reload applies live (the model aliases' shares: a rollout moves by
# reload).
LIVE_TOP_KEYS = ("models",)

# A backend's fields that say which engine it is and how the router reaches it: changed
# in place, what the router knew of the old engine is forgotten (`Fleet.update`).
IDENTITY_FIELDS = ("address", "engine", "kv_events")


class UnknownBackend(LookupError):
    """No backend with that id (pending, active or draining)."""


class FleetConflict(ValueError):
    """The change cannot be made: the id exists, or it would leave no active backend."""


@dataclass(frozen=True)
class FleetChanges:
    """What `Fleet.reconcile` did, by backend id."""

    added: tuple[str, ...] = ()
    reactivated: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.reactivated or self.updated or self.draining)


def new_record(b: Backend, cfg: Config, now_s: float) -> BackendState:
    """A backend's record as it joins: its engine profile and prefill model, an empty
    prefix cache sized to its KV pool, and the engine's blocks when it publishes events."""
    profile = load_profile(b.engine_profile)
    return BackendState(
        id=b.id,
        rtt_prior_ms=b.rtt_prior_ms,
        config=b,
        profile=profile,
        prefill=PrefillModel(profile),
        prefix=PrefixCache(
            b.kv_capacity_tokens or profile.kv_capacity_tokens, cfg.routing.block_tokens
        ),
        engine=EngineView(blocks=EngineBlocks() if b.kv_events.endpoint else None),
        learned=Learned(speed=LatencyModel(cfg.routing.learn_latency)),
        lifecycle_since_s=now_s,
    )


class Fleet:
    """The backends' records (one each) and their lifecycle; the config they make."""

    def __init__(
        self, cfg: Config, clock: Callable[[], float], emit: Callable[[BackendChanged], None]
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self._emit_event = emit
        self.state = FleetState()
        self.removed: deque[dict[str, Any]] = deque(maxlen=RECENT_REMOVED)
        # Set by a shell that tells Envoy of new backends: they start pending, and the
        # shell activates them once Envoy can route to them (False: active at once).
        self.confirm_new_backends = False
        for b in cfg.backends:
            self.state.add(new_record(b, cfg, clock()))

    def _get(self, backend: str) -> BackendState:
        b = self.state.backends.get(backend)
        if b is None:
            raise UnknownBackend(backend)
        return b

    @property
    def draining(self) -> tuple[str, ...]:
        """The draining backends' ids, in the fleet's order."""
        return tuple(b for b, st in self.state.backends.items() if st.lifecycle is _DRAINING)

    def lifecycle(self, backend: str) -> BackendLifecycle:
        return self._get(backend).lifecycle

    def serving(self, model: str | None) -> list[BackendState]:
        """The backends (any lifecycle) a request for `model` may go to (core.admission)."""
        return serving(self.state, model)

    def add(self, b: Backend, reason: str = "admin") -> BackendLifecycle:
        """A new backend: active at once, or pending until the shell activates it
        (`confirm_new_backends`). FleetConflict if the id is pending, active or draining."""
        if b.id in self.state.backends:
            raise FleetConflict(f"backend {b.id!r} exists ({self.state.backends[b.id].lifecycle})")
        now_s = self.clock()
        st = self.state.add(new_record(b, self.cfg, now_s))
        if self.confirm_new_backends:
            st.lifecycle = _PENDING
        self._sync_cfg()
        self._emit(st, BackendChange.ADDED, now_s, reason)
        return st.lifecycle

    def activate(self, backend: str, reason: str = "envoy") -> bool:
        """A pending backend becomes a candidate (Envoy can route to it now). Returns
        whether it was pending (a backend drained or removed meanwhile stays so)."""
        b = self.state.backends.get(backend)
        if b is None or b.lifecycle is not _PENDING:
            return False
        self._move(b, _ACTIVE, BackendChange.ACTIVATED, reason)
        return True

    def drain(self, backend: str, reason: str = "admin", keep_one: bool = True) -> BackendLifecycle:
        """No new decisions to `backend`; it is removed once this router's requests in
        flight there have closed (at once if there are none). Returns its lifecycle now.
        Draining a draining backend changes nothing. FleetConflict: it is the last
        backend active or pending (the router would have nowhere to send requests), unless
        not `keep_one` (the backends are discovered: a pool may shrink to none)."""
        b = self._get(backend)
        if b.lifecycle is not _DRAINING:
            if (
                keep_one
                and b.lifecycle in (_ACTIVE, _PENDING)
                and not any(
                    o.lifecycle in (_ACTIVE, _PENDING)
                    for o in self.state.backends.values()
                    if o is not b
                )
            ):
                raise FleetConflict(f"backend {backend!r} is the last active or pending one")
            self._move(b, _DRAINING, BackendChange.DRAINING, reason)
        return BackendLifecycle.REMOVED if self.remove_if_drained(backend) else b.lifecycle

    def reactivate(self, backend: str, reason: str = "reload") -> None:
        """A draining backend back in rotation (a reload named it again)."""
        b = self._get(backend)
        if b.lifecycle is _DRAINING:
            self._move(b, _ACTIVE, BackendChange.REACTIVATED, reason)

    def update(self, new: Backend, reason: str = "reload") -> bool:
        """New fields for a backend, applied in place: its requests in flight and counters
        stay. The RTT prior, region, engine profile and KV capacity only change estimates.
        A new address, engine kind or KV-event source is another engine (or another way to
        it): what the router knew of the old one (prefix cache, KV-event state, RTT samples,
        engine report, health) is forgotten, and the shell restarts the backend's probes and
        subscriber. Returns whether it was such a reset."""
        b = self._get(new.id)
        old = b.config
        if old == new:
            return False
        reset = any(getattr(old, f) != getattr(new, f) for f in IDENTITY_FIELDS)
        if new.engine_profile != old.engine_profile or reset:
            b.profile = load_profile(new.engine_profile)
            b.prefill = PrefillModel(b.profile)
            b.learned.latency = LatencyStats()  # another engine, or another model of it
            b.learned.speed = LatencyModel(self.cfg.routing.learn_latency)
            b.learned.adapter_speed = {}
        b.config = new
        if reset:
            b.engine.kv_capacity_tokens = None  # another engine: its pool is read again
            b.prefix = PrefixCache(b.kv_capacity[0], self.cfg.routing.block_tokens)
            b.engine.blocks = EngineBlocks() if new.kv_events.endpoint else None
            b.engine.events_up = False
            b.learned.prediction = PredictionStats()
            b.health.rtt_samples = b.health.probe_failures = b.health.request_failures = 0
            b.health.suspect = False
            b.health.ejected_until_s = b.engine.report = b.engine.report_at_s = None
            self.state.set_discovered(b.id, None)  # what it serves: read again
        else:
            b.prefix.set_capacity(b.kv_capacity[0])  # config, else engine, else profile
        b.rtt_prior_ms = new.rtt_prior_ms
        if b.health.rtt_samples == 0:
            b.health.rtt_ms = new.rtt_prior_ms
        self._sync_cfg()
        self._emit(b, BackendChange.UPDATED, self.clock(), reason, reset)
        return reset

    def reconcile(
        self, backends: Sequence[Backend], reason: str = "reload", keep_one: bool = True
    ) -> FleetChanges:
        """Make the fleet `backends` (a reloaded config's, or the discovered pods'): new
        ids are added, draining ones named again come back, changed ones are updated in
        place, and active ones not named are drained (then removed). Adds come first: a
        fleet that is replaced whole always has an active backend. `keep_one` False: the
        fleet may drain to none (discovery)."""
        wanted = {b.id for b in backends}
        added, back, updated = [], [], []
        for b in backends:
            if b.id not in self.state.backends:
                self.add(b, reason)
                added.append(b.id)
                continue
            st = self.state.backends[b.id]
            if st.lifecycle is _DRAINING:
                self.reactivate(b.id, reason)
                back.append(b.id)
            if st.config != b:
                self.update(b, reason)
                updated.append(b.id)
        gone = [
            bid
            for bid, st in self.state.backends.items()
            if bid not in wanted and st.lifecycle is not _DRAINING
        ]
        for bid in gone:
            self.drain(bid, reason, keep_one)
        return FleetChanges(tuple(added), tuple(back), tuple(updated), tuple(gone))

    def apply_live_keys(self, new: Config) -> list[str]:
        """Take the LIVE_KEYS and LIVE_TOP_KEYS of a reloaded config; returns those that
        changed."""
        fields = [k.split(".")[1] for k in LIVE_KEYS]
        changed = [f for f in fields if getattr(self.cfg.routing, f) != getattr(new.routing, f)]
        if changed:
            routing = replace(self.cfg.routing, **{f: getattr(new.routing, f) for f in changed})
            self.cfg = replace(self.cfg, routing=routing)
        top = [k for k in LIVE_TOP_KEYS if getattr(self.cfg, k) != getattr(new, k)]
        if top:
            self.cfg = replace(self.cfg, **{k: getattr(new, k) for k in top})
        return [f"routing.{f}" for f in changed] + top

    def remove_if_drained(self, backend: str) -> bool:
        """Remove a draining backend whose last request of this router has closed."""
        b = self.state.backends.get(backend)
        if b is None or b.lifecycle is not _DRAINING or self.state.own_in_flight(backend):
            return False
        now_s = self.clock()
        self.state.remove(backend)
        self._sync_cfg()
        self.removed.append(
            {
                "id": backend,
                "removed_s": now_s,
                "drained_s": round(now_s - b.lifecycle_since_s, 3),
                "completed": b.stats.completed,
                "errors": b.stats.errors,
                "failovers": b.stats.failovers,
            }
        )
        self._emit(b, BackendChange.REMOVED, now_s, "drained")
        return True

    def backends_json(self) -> list[dict[str, Any]]:
        """Each backend with its lifecycle, this router's requests in flight there, and its
        config (GET /backends)."""
        now_s = self.clock()
        return [
            {
                "id": b.id,
                "lifecycle": str(b.lifecycle),
                "lifecycle_age_s": round(now_s - b.lifecycle_since_s, 3),
                "in_flight": self.state.own_in_flight(b.id),
                "peer_in_flight": b.load.in_flight - self.state.own_in_flight(b.id),
                "config": backend_as_dict(b.config),
            }
            for b in self.state.backends.values()
        ]

    def removed_json(self, now_s: float) -> list[dict[str, Any]]:
        return [
            {
                **{k: v for k, v in r.items() if k != "removed_s"},
                "age_s": round(now_s - r["removed_s"], 3),
            }
            for r in self.removed
        ]

    def _move(
        self, b: BackendState, to: BackendLifecycle, change: BackendChange, reason: str
    ) -> None:
        now_s = self.clock()
        b.lifecycle, b.lifecycle_since_s = to, now_s
        self._emit(b, change, now_s, reason)

    def _sync_cfg(self) -> None:
        self.cfg = replace(self.cfg, backends=tuple(b.config for b in self.state.backends.values()))

    def _emit(
        self,
        b: BackendState,
        change: BackendChange,
        now_s: float,
        reason: str,
        reset: bool = False,
    ) -> None:
        gone = change is BackendChange.REMOVED
        lifecycle = BackendLifecycle.REMOVED if gone else b.lifecycle
        self._emit_event(
            BackendChanged(
                backend=b.id,
                change=change,
                lifecycle=lifecycle,
                config=b.config,
                now_s=now_s,
                reason=reason,
                reset=reset,
            )
        )
