"""A dispatched request's lifecycle after its decision: its first byte, the one path that
closes it whatever ends it (`close`: `expire` and `lose` close through it too), and the
listeners that hear each event. The router (core.router) decides, and builds on this.

Pure and synchronous with an injected clock, as the router.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType

from ext_proc.config.schema import Config
from ext_proc.core.features import Features
from ext_proc.core.fleet import Fleet
from ext_proc.vocab.events import BackendChanged, Closed, FirstByte, Listener
from ext_proc.vocab.types import InFlight, Status

log = logging.getLogger("gorgo.router")


class RequestLifecycle:
    """Every request dispatched, from its first byte to its close, exactly once whatever
    ends it; its fleet's records (`_fleet`), the candidates' computer (`_features`, which
    learns here whether first bytes are seen at all) and the listeners (`subscribe`)."""

    __slots__ = ("_features", "_fleet", "_listeners", "clock")

    def __init__(self, cfg: Config, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._fleet = Fleet(cfg, clock, self._emit)
        self._features = Features(self._fleet, clock)
        # Who hears each event, in order (the router's decision log first, then the
        # learners: core.build.build_router).
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @property
    def cfg(self) -> Config:
        """The config in force (its backends and live keys change at run time)."""
        return self._fleet.cfg

    @property
    def in_flight(self) -> Mapping[str, InFlight]:
        """This router's requests in flight, in dispatch order, read-only."""
        return MappingProxyType(self._fleet.state.in_flight)

    @property
    def peer_in_flight(self) -> Mapping[str, InFlight]:
        """Other routers' requests in flight, as their dispatches told us."""
        return MappingProxyType(self._fleet.state.peer_in_flight)

    def first_byte(self, request_id: str) -> FirstByte | None:
        """The first response byte reached the proxy (None: not in flight, or seen)."""
        now_s = self.clock()
        seen = self._fleet.state.first_byte(request_id, now_s)
        if seen is None:
            return None
        self._features.sees_first_bytes = True
        ttft_ms, rec = seen
        event = FirstByte(request_id, rec.served_by or rec.backend, ttft_ms, now_s)
        for listener in self._listeners:
            listener.on_first_byte(event)
        return event

    def prefill_done(self, request_id: str, kv_sent: bool = False) -> None:
        """A disaggregated request's prefill leg answered: vLLM's one-token prefill as its
        prefill ends, SGLang's leg once its KV is sent (`kv_sent`). Frees the prefill
        engine and teaches its speed (core.state.FleetState.prefill_done)."""
        self._fleet.state.prefill_done(request_id, self.clock(), kv_sent)

    def response_ended(self, request_id: str, e2e_ms: float | None) -> bool:
        """Envoy says a streamed response ended (e2e_ms) before its first byte was seen:
        the first byte came no later. Returns whether the request waits for that first
        byte (True: close it a moment later), False if there is nothing to wait for."""
        rec = self._fleet.state.in_flight.get(request_id)
        if rec is None or not rec.streaming or rec.first_byte_s is not None:
            return False
        rec.ended_e2e_ms = e2e_ms
        return True

    def close(
        self,
        request_id: str,
        status: Status,
        e2e_ms: float | None = None,
        cached_tokens: int | None = None,
        served_by: str | None = None,
        reason: str = "",
    ) -> Closed | None:
        """The one way a request ends, however it ends; idempotent (a second call returns
        None). served_by: the backend that answered, if known (or `inputs.served_by`): if
        not the chosen one (Envoy retried a connect failure elsewhere), it failed over.
        `reason`: what ended it, for the log and /state."""
        now_s = self.clock()
        state = self._fleet.state
        served_ok = status == Status.OK
        served_by = state.served_elsewhere(request_id, served_by)
        if served_by is not None:
            status = Status.FAILED_OVER
        closed = state.close(request_id, now_s, status, e2e_ms, reason, served_ok)
        if closed is None:
            return None
        rec, measured_e2e_ms = closed
        ttft_ms = None if rec.first_byte_s is None else (rec.first_byte_s - rec.arrived_s) * 1e3
        event = Closed(
            request_id=request_id,
            backend=rec.backend,
            status=status,
            ttft_ms=ttft_ms,
            e2e_ms=measured_e2e_ms,
            record=rec,
            now_s=now_s,
            served_by=served_by if served_by in state.backends else None,
            cached_tokens=cached_tokens,
            reason=reason,
            served_ok=served_ok and served_by in state.backends,
        )
        for listener in self._listeners:
            listener.on_close(event)
        self._fleet.remove_if_drained(rec.backend)  # draining: its last request may have closed
        if rec.prefill_backend is not None:  # and its prefill engine's
            self._fleet.remove_if_drained(rec.prefill_backend)
        return event

    def expire(self) -> list[Closed]:
        """Close the requests whose completion never arrived by their deadline
        (core.state.lost_after_s)."""
        now_s = self.clock()
        state = self._fleet.state
        for r in state.missed_first_byte(now_s):
            log.warning(
                "backend %s suspect: no first byte of %s by its deadline", r.backend, r.request_id
            )
        state.expire_peers(now_s, self.cfg.bus.peer_ttl_s)
        overdue = state.overdue(now_s, self.cfg.request_timeout_s)
        closed = [c for rid in overdue if (c := self.close(rid, Status.EXPIRED)) is not None]
        for backend in self._fleet.draining:  # any left by a record that went without a close
            self._fleet.remove_if_drained(backend)
        return closed

    def lose(self, envoys: set[str]) -> list[Closed]:
        """The Envoys named went away (their access-log streams ended): the requests they
        carried will never be reported. Close them as lost, now."""
        gone = [r.request_id for r in self._fleet.state.in_flight.values() if r.envoy in envoys]
        return [c for rid in gone if (c := self.close(rid, Status.LOST, reason="envoy gone"))]

    def _emit(self, e: BackendChanged) -> None:
        for listener in self._listeners:
            listener.on_backend(e)
