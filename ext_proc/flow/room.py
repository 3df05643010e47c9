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
    if settings.max_waiting_requests and c.waiting_first_byte >= settings.max_waiting_requests:
        return False
    return not (settings.max_waiting_tokens and c.waiting_tokens >= settings.max_waiting_tokens)
