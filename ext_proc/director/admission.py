"""The admission seam: between the router's own admission (core.router.Router.admit) and
scheduling, whether a request goes on now, waits for room, or is refused. Two sides, as
llm-d's Director has its admission controllers (legacy, or flow control): `PassThrough`
with flow control off, every request scheduled as it arrives; and the flow controller
(director.flow_control). A transport drives either through this one interface: `admit`
each request, and when room may have come (a first byte, a completion, an engine report,
a timer) `pump`, which returns the waits it settled.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from ext_proc.config.flow import Objective
from ext_proc.core.router import NoRoom, RoomCheck
from ext_proc.director.outcomes import Outcome, Queued, Routed, Settled, Unrouted
from ext_proc.feeds.peers import Head
from ext_proc.flow.queue import Waiting
from ext_proc.vocab.types import RouteRequest


class Schedule(Protocol):
    """The recipe's schedule step (director.recipe.Director.schedule): the policy's choice,
    the dispatch recorded where that backend has `room` (None: any), else NoRoom."""

    def __call__(
        self,
        request: RouteRequest,
        served: str | None,
        room: RoomCheck | None = None,
        waited_ms: float = 0.0,
        behind: int = 0,
    ) -> Routed | Unrouted | NoRoom: ...


class Admission(Protocol):
    """Whether and when an admitted request is scheduled."""

    def admit(
        self, request: RouteRequest, objective: Objective, served: str | None, body_bytes: int
    ) -> Outcome | Queued:
        """Scheduled now (Routed, Unrouted), refused, or Queued: its outcome comes from a
        later `pump`."""
        ...

    def pump(self) -> list[Settled]:
        """Offer room to what waits: the waits settled since the last pump (released or
        refused), in order, each once. Only the caller that holds the tickets pumps."""
        ...

    def cancel(self, ticket: Waiting) -> None:
        """Its client went away while it waited."""
        ...

    def next_expiry_s(self) -> float:
        """When the next wait runs out (inf: none waits)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """/state's `flow`."""
        ...

    # -- several routers over one view (flow.shared) ----------------------------------------

    def confirm(self, request_ids: list[str]) -> int:
        """The fleet bus carried these dispatches: how many were ours."""
        ...

    def hear_claims(self, router: str, claims: dict[str, Head], heads: list[Head]) -> None:
        """A peer router's claims: what its queue waits for."""
        ...

    def claims_to_send(self) -> tuple[dict[str, Head], list[Head]] | None:
        """Ours, when due to go to the peers (None: not now)."""
        ...


class PassThrough:
    """Flow control off: every admitted request is scheduled as it arrives (the engines'
    queues hold it); nothing waits, so a pump settles nothing."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def admit(
        self, request: RouteRequest, objective: Objective, served: str | None, body_bytes: int
    ) -> Outcome | Queued:
        placed = self.schedule(request, served)
        assert not isinstance(placed, NoRoom)  # no room check: always placed
        return placed

    def pump(self) -> list[Settled]:
        return []

    def cancel(self, ticket: Waiting) -> None:
        return None

    def next_expiry_s(self) -> float:
        return math.inf

    def snapshot(self) -> dict[str, Any]:
        return {"enabled": False}

    def confirm(self, request_ids: list[str]) -> int:
        return 0

    def hear_claims(self, router: str, claims: dict[str, Head], heads: list[Head]) -> None:
        return None

    def claims_to_send(self) -> tuple[dict[str, Head], list[Head]] | None:
        return None
