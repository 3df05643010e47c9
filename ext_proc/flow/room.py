"""When a backend has room for one more request (docs/cost-model.md, "Room").

A request sent now reaches the backend one network half-trip later. Work there not yet
started (the prefill owed to requests waiting for their first token, less what the engine
has worked off since the oldest arrived; the engine's own waiting count; a KV pool that
admits nothing: `Candidate.unstarted_ms`) keeps the engine busy until then; more than that
only waits in the engine's queue, where the router can no longer reorder it or send it
elsewhere. So a backend has room while that work, in ms, is below its one-way delay plus
a margin (what the estimate may be off by, and the gap between one request and the next),
and under the optional caps on requests and tokens waiting there. A far backend thus takes
more work ahead of it than a near one: the one-way delay is time it would otherwise sit
idle. Room gates the backend the policy chooses (late binding, core.router.Router.place):
a request is not pushed onto a worse backend because that one has room.
"""

from __future__ import annotations

from ext_proc.config.flow import FlowControl
from ext_proc.vocab.types import Candidate


def has_room(c: Candidate, settings: FlowControl) -> bool:
    if c.unstarted_ms > c.rtt_ms / 2 + settings.room_margin_ms:
        return False
    return within_caps(c, settings)


# How long a class (band, tenant, objective, own SLO) counts as present after its last
# request arrived: about the longest a request waits in the queue by default
# (flow_control.max_wait_s), so a class arriving once a minute still finds the engines
# kept clear for it.
MIX_WINDOW_S = 60.0


class Mix:
    """Whether holding a request can gain anything (docs/cost-model.md, "Room").

    The queue can only reorder what it holds, and refuse what is sheddable: with one class
    of request arriving (the same band, tenant, objective and SLO), its order is arrival
    order, the engine's own; holding then only delays, and near capacity it cost up to 2.6x
    p95 TTFT (paper-synthetic at time_scale 0.75) against flow control off. So a backend's
    room is gated only while two classes or more arrived within MIX_WINDOW_S, or the
    request is sheddable; else the request goes as it would without flow control (the
    caps on requests and tokens waiting still hold)."""

    def __init__(self, window_s: float = MIX_WINDOW_S) -> None:
        self.window_s = window_s
        self._last_s: dict[tuple[object, ...], float] = {}

    def seen(self, key: tuple[object, ...], now_s: float) -> None:
        self._last_s[key] = now_s
        if len(self._last_s) > 64:  # forget classes gone quiet (tenants come and go)
            self._last_s = {k: t for k, t in self._last_s.items() if now_s - t < self.window_s}

    def mixed(self, now_s: float) -> bool:
        """Two classes or more arrived within the window."""
        recent = 0
        for t in self._last_s.values():
            recent += now_s - t < self.window_s
            if recent > 1:
                return True
        return False


def within_caps(c: Candidate, settings: FlowControl) -> bool:
    """Under the optional caps on requests and tokens waiting there (room without the
    work test: a request that cannot gain by waiting)."""
    if settings.max_waiting_requests and c.waiting_first_byte >= settings.max_waiting_requests:
        return False
    return not (settings.max_waiting_tokens and c.waiting_tokens >= settings.max_waiting_tokens)
