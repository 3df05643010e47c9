"""Every backend's record by id (`core.backend.BackendState`), and what updates one from
outside a request's flow: its RTT probes, its engine's load reports and served models, its
ejection for failing requests. The fleet's state (core.state.FleetState) adds the requests
in flight on top.

Pure and synchronous; every time comes from the caller (seconds on one monotonic clock).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ext_proc.core.backend import BackendState
from ext_proc.estimate.profile import EngineProfile
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.served_models import ServedModels


class BackendRecords:
    """Each backend's record, and its health, reports and served models as heard."""

    def __init__(self) -> None:
        self.backends: dict[str, BackendState] = {}
        # Every name some engine serves as a LoRA adapter (their blocks are keyed apart).
        self.adapters: frozenset[str] = frozenset()

    def is_adapter(self, model: str) -> bool:
        """Whether some backend's engine serves `model` as a LoRA adapter."""
        return model in self.adapters

    def set_discovered(self, backend: str, served: ServedModels | None) -> bool:
        """What the backend's engine lists now (None: not known); returns whether that
        changed."""
        b = self.backends.get(backend)
        if b is None or b.engine.discovered == served:
            return False
        b.engine.discovered = served
        self.adapters = frozenset(
            a
            for x in self.backends.values()
            if x.engine.discovered
            for a in x.engine.discovered.adapters
        )
        return True

    def add(self, b: BackendState) -> BackendState:
        """A new backend's record (ValueError if the id is known)."""
        if b.id in self.backends:
            raise ValueError(f"backend {b.id!r} exists")
        self.backends[b.id] = b
        return b

    @property
    def profiles(self) -> Mapping[str, EngineProfile]:
        """Every backend's engine profile, a live view."""
        return _Profiles(self.backends)

    def available(self, b: BackendState, now_s: float) -> bool:
        """In rotation: probes answer, and not ejected for failing requests. An ejection
        ends by itself; the next request there then tests the backend (half-open)."""
        if not b.health.ejected_at(now_s):
            b.health.ejected_until_s = None
        return not b.health.suspect and b.health.ejected_until_s is None

    def eject_failing(self, backend: str, now_s: float, after: int, base_s: float) -> bool:
        """Eject a backend whose last `after` requests failed, for base_s doubling with
        each ejection in a row (at most 16x). Returns True if it was ejected now."""
        b = self.backends[backend]
        if b.health.request_failures < after or b.health.ejected_until_s is not None:
            return False
        b.health.ejections += 1
        b.health.ejected_until_s = now_s + base_s * 2 ** min(b.health.ejections - 1, 4)
        b.health.request_failures = 0
        return True

    def record_fallback(self, backend: str) -> None:
        if backend in self.backends:
            self.backends[backend].stats.fallback_completed += 1

    def record_probe(
        self, backend: str, rtt_ms: float | None, alpha: float, suspect_after: int
    ) -> None:
        """An RTT probe answered in rtt_ms, or failed (None). A backend removed while its
        probe was out is ignored."""
        b = self.backends.get(backend)
        if b is None:
            return
        if rtt_ms is None:
            b.health.probe_failures += 1
            b.health.suspect = b.health.probe_failures >= suspect_after
            return
        b.health.probe_failures = 0
        b.health.suspect = False
        # The first sample replaces the configured prior; later ones are smoothed.
        if b.health.rtt_samples == 0:
            b.health.rtt_ms = rtt_ms
        else:
            d = rtt_ms - b.health.rtt_ms
            b.health.rtt_ms += alpha * d
            b.health.rtt_var_ms2 = (1 - alpha) * (b.health.rtt_var_ms2 + alpha * d * d)
        b.health.rtt_samples += 1

    def record_engine_report(self, backend: str, report: EngineReport, now_s: float) -> bool:
        """Returns whether the engine's KV pool is new (first reported, or changed): the
        prefix index is resized to it unless the config sets the backend's."""
        b = self.backends.get(backend)
        if b is None:  # removed while the scrape was out
            return False
        b.engine.report, b.engine.report_at_s = report, now_s
        pool = report.kv_capacity_tokens
        if not pool or pool == b.engine.kv_capacity_tokens:
            return False
        b.engine.kv_capacity_tokens = pool
        b.prefix.set_capacity(b.kv_capacity[0])
        return True


class _Profiles(Mapping[str, EngineProfile]):
    def __init__(self, backends: dict[str, BackendState]) -> None:
        self._backends = backends

    def __getitem__(self, backend: str) -> EngineProfile:
        return self._backends[backend].profile

    def __iter__(self) -> Iterator[str]:
        return iter(self._backends)

    def __len__(self) -> int:
        return len(self._backends)
