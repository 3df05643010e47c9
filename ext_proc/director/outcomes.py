"""What the recipe gives a transport for a request (the Envoy session, the simulator): sent
to a backend, answered by the router, left to Envoy's fallback route, or waiting in the
gateway queue; and how a wait there ends (`Settled`, from the admission's `pump`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ext_proc.flow.queue import Waiting
from ext_proc.vocab.types import Decision, Refusal


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


@dataclass(frozen=True)
class Queued:
    """Waiting in the gateway queue: its outcome comes later, `Settled` by a pump."""

    ticket: Waiting


Outcome = Routed | Refused | Unrouted


class Settled(NamedTuple):
    """A wait in the gateway queue is over: the request was released to a backend (Routed,
    or Unrouted with no backend active) or refused. Each is handed out once, by the pump
    that follows its settling."""

    ticket: Waiting
    outcome: Outcome
