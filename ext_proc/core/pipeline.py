"""The request's recipe, one short function every transport calls (the Envoy session, the
simulator): resolve the model it asks for, admit it, schedule it (the candidates and the
policy's choice), record the dispatch. In the spirit of llm-d's `Director.HandleRequest`
(parse, admit, locate, prepare, schedule), in our own words; parsing and tokenizing stay
with the transport, which knows the wire.

Pure and synchronous: the router it drives runs on an injected clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ext_proc.core.features import NoActiveBackend
from ext_proc.core.router import Router
from ext_proc.vocab.types import Decision, Refusal, RouteRequest


@dataclass(frozen=True)
class Routed:
    """Sent to `decision.backend`."""

    decision: Decision
    # The name the request goes to the engine as, when the client asked for an alias (the
    # transport rewrites the body's `model`); None: as asked.
    served_model: str | None = None


@dataclass(frozen=True)
class Refused:
    """Answered by the router itself: no engine could serve it now."""

    refusal: Refusal


@dataclass(frozen=True)
class Unrouted:
    """No backend is active (a fleet replaced whole, for the moment Envoy takes to learn
    the new one): the transport lets Envoy's fallback route take it."""

    reason: str


Outcome = Routed | Refused | Unrouted


class Director:
    """Runs one request through the router's steps, in order."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def handle(self, request: RouteRequest) -> Outcome:
        request, served = self.resolve_model(request)
        refused = self.router.admit(request)
        if refused is not None:
            return Refused(refused)
        try:
            decision = self.router.decide(request)
        except NoActiveBackend as e:
            return Unrouted(str(e))
        return Routed(decision, served)

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
