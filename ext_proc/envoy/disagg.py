"""A routing session's disaggregated decision (`Decision.prefill` set): the router sends
the prefill leg (ext_proc/envoy/prefill.py) while Envoy waits for the routing reply, then
answers with the decode engine named as for any decision (x-gorgo-backend, or the
endpoint picker's endpoint) and the decode leg's body, plus the prefill engine named in
x-gorgo-prefill-backend (echoed to the client). A failed prefill leg: a decode engine
whose role is `both` serves the request whole (the client's body, nothing of the pair in
it); else it is answered here (503 naming the prefill engine, 504 when it ran out of
time) and the request closed at once, not against the decode engine (a gateway error,
its reason naming the prefill engine). Never a decode body with dangling bootstrap or KV
parameters.
The same for the plain (BUFFERED) and the endpoint-picker (FULL_DUPLEX_STREAMED) sessions:
the session's own `_routed` builds the reply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from ext_proc.common.names import HEADER_PREFILL_BACKEND
from ext_proc.config.flow import HOLD_SLACK_S
from ext_proc.core.pairs import prefills_itself
from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.envoy.answers import json_error
from ext_proc.envoy.prefill import PrefillFailed, PrefillSender
from ext_proc.envoy.session_base import Reply
from ext_proc.vocab.backend import BackendRole
from ext_proc.vocab.errors import UNAVAILABLE, UPSTREAM_TIMEOUT
from ext_proc.vocab.types import Decision, Status

log = logging.getLogger("gorgo.server")


@dataclass(frozen=True)
class PendingPrefill:
    """A decision whose prefill leg is still to send: the body (the model rewritten) and
    the id the router gave the request, when not the client's."""

    decision: Decision
    body: bytes
    renamed: str | None


def hold_for_prefill_s(prefill_timeout_s: float) -> float:
    """How long Envoy is asked to wait for the routing reply of a request whose prefill
    leg the router sends first (override_message_timeout)."""
    return prefill_timeout_s + HOLD_SLACK_S


async def send_prefill(session: PrefillingSession, sender: PrefillSender) -> Reply:
    """Send the session's pending prefill leg; the reply that sends the decode leg on, or
    the error answer."""
    pending = session.pending_prefill
    assert pending is not None and pending.decision.prefill is not None
    session.pending_prefill = None
    d, prefill = pending.decision, pending.decision.prefill.backend
    result = await sender.send(prefill, session.path, pending.body, session.request_id)
    if isinstance(result, PrefillFailed) and _whole(session.router, d.backend):
        # the decode engine can serve the request whole: sent there as an aggregated
        # request (the body without bootstrap or KV parameters)
        log.warning(
            "request %s: prefill leg failed, served whole on %s: %s",
            session.request_id,
            d.backend,
            result.reason,
        )
        return session.routed_reply(d, pending.body, pending.renamed)
    if isinstance(result, PrefillFailed):
        session.done = True
        log.warning("request %s: prefill leg failed: %s", session.request_id, result.reason)
        # The request's record is the decode engine's, which did nothing wrong: closed as
        # not its doing (an ERROR, or a failover to the prefill engine, would count
        # against the decode engine and eject it); the reason names the prefill engine.
        session.router.close(
            session.request_id,
            Status.GATEWAY_ERROR,
            reason=f"prefill on {prefill} failed: {result.reason}",
        )
        error = UPSTREAM_TIMEOUT if result.timed_out else UNAVAILABLE
        return json_error(error, result.reason, {HEADER_PREFILL_BACKEND: prefill})
    session.prefilled_by = prefill
    if result.answered:  # vLLM's one-token prefill answered: the prefill engine is done
        session.router.prefill_done(session.request_id)
    reply = session.routed_reply(d, result.decode_body, pending.renamed)
    first = reply[0] if isinstance(reply, list) else reply
    if first is not None:
        phase = first.WhichOneof("response")
        if phase in (codec.REQUEST_HEADERS, codec.REQUEST_BODY):
            codec.add_headers(first, phase, {HEADER_PREFILL_BACKEND: prefill})
    return reply


class PrefillingSession(Protocol):
    """The session's side of it (RoutingSession and its FULL_DUPLEX_STREAMED kind), as a
    protocol so that this module does not import the sessions."""

    router: Router
    path: str
    request_id: str
    done: bool
    pending_prefill: PendingPrefill | None
    prefilled_by: str | None

    def routed_reply(self, d: Decision, new_body: bytes | None, renamed: str | None) -> Reply:
        """The reply that sends the request to the decision's backend."""
        ...


def _whole(router: Router, backend: str) -> bool:
    """Whether the decode engine may serve a request whole: its role is `both`, or it is
    a vLLM decode engine, which prefills a request without kv_transfer_params itself
    (core.pairs.prefills_itself)."""
    state = router.backends.get(backend)
    if state is None:
        return False
    return state.config.role == BackendRole.BOTH or (
        state.config.role == BackendRole.DECODE and prefills_itself(state)
    )
