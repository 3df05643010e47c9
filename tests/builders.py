"""Builders shared by the tests: what they put in a router through its public surface."""

from __future__ import annotations

from ext_proc.core.events import Dispatched, Listener
from ext_proc.core.router import Router
from ext_proc.feeds.peers import PeerEvent, PeerKind


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
    router.apply_peer(
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
        router.apply_peer(PeerEvent(PeerKind.FIRST_BYTE, "peer", request_id, backend))


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
