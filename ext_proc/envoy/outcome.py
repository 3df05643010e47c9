"""Whose doing a request's end was, read from Envoy's access-log entry: the response code,
the response flags and the response code details, as Envoy documents them
(docs/root/configuration/observability/access_log/usage.rst, %RESPONSE_FLAGS%;
envoy/stream_info/stream_info.h, ResponseCodeDetailValues).

Only evidence about the backend counts against it (and can eject it): a connection that
failed or was reset from upstream, a timeout waiting for its response, a 5xx it answered.
A client that went away (code 0, or a 1xx such as the `100 Continue` Envoy answers itself
to `Expect: 100-continue` when the client then hangs up: Envoy logs that 100, with no
flag), a 4xx, or Envoy refusing on its own (no healthy upstream, overflow) never does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.vocab.types import Status

# The client ended it: disconnected, reset its stream, or spoke bad HTTP.
CLIENT_FLAGS = frozenset({"DC", "DR", "DPE"})
# The backend (or the network to it) failed it: connection refused, reset or terminated
# from upstream, a timeout waiting for its response (the route's, or a per-try timeout:
# the first-byte deadline), the retries spent on such failures.
UPSTREAM_FLAGS = frozenset({"UF", "UC", "UR", "UPE", "URX", "UT", "UMSDR"})
# Envoy refused or could not send it on by itself: no healthy host, circuit breaker,
# no route or cluster, rate limits, overload, faults injected on purpose.
GATEWAY_FLAGS = frozenset(
    {"UH", "UO", "NR", "NC", "NFCF", "IH", "RL", "RLSE", "FI", "DI", "OM", "DF", "LH"}
)
# Details that say the upstream reset the stream, before or after the response began
# (`upstream_reset_before_response_started{...}`), or that the first byte did not come
# in time (`upstream_per_try_timeout`).
UPSTREAM_DETAILS = ("upstream_reset_", "upstream_per_try", "response_timeout")
VIA_UPSTREAM = "via_upstream"


@dataclass(frozen=True)
class Outcome:
    """Whose doing a request's end was, read from one access-log entry by `outcome_of`:
    only `Status.ERROR` counts against the backend."""

    status: Status
    # What Envoy said, for the log and /state (code, flags, details).
    reason: str


def outcome_of(code: int, flags: frozenset[str], details: str) -> Outcome:
    """Classify one access-log entry (first rule that matches)."""
    said = " ".join(x for x in (str(code), ",".join(sorted(flags)), details) if x)
    answered = 200 <= code < 300
    client_left = bool(flags & CLIENT_FLAGS) or details.startswith("downstream_remote_disconnect")
    if code == 0 or 100 <= code < 200 or (client_left and not answered):
        # No final response: the client went away first (an upstream failure gets
        # Envoy's own 5xx).
        return Outcome(Status.CANCELLED, said)
    if not client_left and (flags & UPSTREAM_FLAGS or details.startswith(UPSTREAM_DETAILS)):
        return Outcome(Status.ERROR, said)
    if flags & GATEWAY_FLAGS:
        return Outcome(Status.GATEWAY_ERROR, said)
    if answered:
        # served; a client that closed its connection before the stream's very end (read
        # to `[DONE]`, then gone) is logged DC all the same
        return Outcome(Status.OK, said)
    if 400 <= code < 500:
        return Outcome(Status.CLIENT_ERROR, said)
    if code >= 500:
        # A 5xx the backend answered is its failure; one of Envoy's own without a flag
        # that blames the upstream is not.
        upstream = details in ("", VIA_UPSTREAM)
        return Outcome(Status.ERROR if upstream else Status.GATEWAY_ERROR, said)
    return Outcome(Status.OK, said)  # 3xx
