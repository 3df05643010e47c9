"""The request's recipe, one short function every transport calls (the Envoy session, the
simulator): resolve the model it asks for and its class, let the router admit it, pass it
through the admission seam (straight on, or the gateway queue until a backend has room:
director.admission), schedule it (the candidates and the policy's choice) and record the
dispatch. In the spirit of llm-d's `Director.HandleRequest` (parse, admit, locate,
prepare, schedule) and its admission controllers, in our own words; parsing and
tokenizing stay with the transport, which knows the wire.

Pure and synchronous: the router it drives runs on an injected clock. A request that must
wait comes back `Queued`; the transport calls `admission.pump()` when room may have come
(a first byte, a completion, an engine report, a timer), which returns the waits settled.
"""

from __future__ import annotations

from dataclasses import replace

from ext_proc.core.features import NoActiveBackend
from ext_proc.core.router import NoRoom, RoomCheck, Router
from ext_proc.director.admission import Admission, PassThrough
from ext_proc.director.flow_control import FlowController
from ext_proc.director.outcomes import Outcome, Queued, Refused, Routed, Unrouted
from ext_proc.flow.classify import Objectives
from ext_proc.vocab.types import RouteRequest


class Director:
    """Runs one request through the router's steps, in order."""

    def __init__(self, router: Router, shared: bool | None = None) -> None:
        """`shared`: several routers over one view (flow.shared; None: when a fleet bus
        is configured)."""
        self.router = router
        settings = router.cfg.flow_control
        self.objectives = Objectives(settings)
        # Between the router's admission and scheduling: the gateway queue with flow
        # control on, else every request scheduled as it arrives.
        self.admission: Admission = (
            FlowController(router, self.objectives, self.schedule, shared)
            if settings.enabled
            else PassThrough(self.schedule)
        )

    def handle(self, request: RouteRequest, body_bytes: int = 0) -> Outcome | Queued:
        """Resolve, admit (routed, queued or refused), schedule, record."""
        request, served = self.resolve_model(request)
        refused = self.router.admit(request)  # the router's own answers: 404, 400, 503, 429
        if refused is not None:
            return Refused(refused)
        objective = self.objectives.of(request)
        if objective.priority != request.priority:
            # its class, for the engines that schedule by priority (with or without the
            # gateway queue: Decision.engine_priority)
            request = replace(request, priority=objective.priority)
        # scheduled now (self.schedule), refused, or queued until a backend has room
        return self.admission.admit(request, objective, served, body_bytes)

    def schedule(
        self,
        request: RouteRequest,
        served: str | None,
        room: RoomCheck | None = None,
        waited_ms: float = 0.0,
        behind: int = 0,
    ) -> Routed | Unrouted | NoRoom:
        """The policy's choice among the candidates and the dispatch recorded, where that
        backend has `room` (None: any; else NoRoom, nothing recorded). `waited_ms`,
        `behind`: its wait in the gateway queue, and how many waited when it joined."""
        try:
            placed = self.router.place(request, room, waited_ms, behind)
        except NoActiveBackend as e:
            return Unrouted(str(e))
        return placed if isinstance(placed, NoRoom) else Routed(placed, served)

    def resolve_model(self, request: RouteRequest) -> tuple[RouteRequest, str | None]:
        """A public model name the config maps to served ones (an alias, a rollout's
        split) as the name the engine serves; the request unchanged otherwise."""
        llm = request.llm
        if llm is None:
            return request, None
        served = self.router.served_name(llm.model, request.session_key or request.request_id)
        if served is None or served == llm.model:
            return request, None
        return replace(request, llm=replace(llm, model=served)), served
