"""Whose doing a request's end was, from Envoy's access-log entry (code, flags, details)."""

import pytest

from ext_proc.envoy.outcome import outcome_of
from ext_proc.vocab.types import Status

DISCONNECT = "downstream_remote_disconnect"
RESET_BEFORE = "upstream_reset_before_response_started{connection_termination}"
RESET_AFTER = "upstream_reset_after_response_started{remote_reset}"

CASES = [
    # the client sent `Expect: 100-continue`, Envoy answered 100 itself, the client hung up
    # before the response: Envoy logs 100 and no flag
    (100, set(), DISCONNECT, Status.CANCELLED),
    (100, set(), "", Status.CANCELLED),
    (0, {"DC"}, DISCONNECT, Status.CANCELLED),
    (0, set(), "", Status.CANCELLED),
    # the client left while Envoy was failing over: still the client's doing
    (503, {"DC", "UF"}, DISCONNECT, Status.CANCELLED),
    (0, {"DR"}, "", Status.CANCELLED),
    # the backend's: connect failure, reset, a per-try timeout (the first-byte deadline),
    # a reset after the response began (its 200 is no success), a 5xx it answered
    (503, {"UF", "URX"}, "upstream_reset_before_response_started{connection_failure}", None),
    (503, {"UC"}, RESET_BEFORE, None),
    (200, {"UR"}, RESET_AFTER, None),
    (200, set(), RESET_AFTER, None),
    (504, {"UT"}, "upstream_per_try_timeout", None),
    (504, {"UT"}, "response_timeout", None),
    (500, set(), "via_upstream", None),
    (502, {"UPE"}, "upstream_reset_before_response_started{protocol_error}", None),
    # Envoy's own refusals: no healthy host, overflow, no cluster
    (503, {"UH"}, "no_healthy_upstream", Status.GATEWAY_ERROR),
    (503, {"UO"}, "upstream_overflow", Status.GATEWAY_ERROR),
    (503, {"NC"}, "cluster_not_found", Status.GATEWAY_ERROR),
    (503, set(), "ext_proc_error_gRPC_error", Status.GATEWAY_ERROR),
    # 4xx: the request's
    (400, set(), "via_upstream", Status.CLIENT_ERROR),
    (404, set(), "via_upstream", Status.CLIENT_ERROR),
    (429, set(), "via_upstream", Status.CLIENT_ERROR),
    (413, set(), "request_payload_too_large", Status.CLIENT_ERROR),
    (200, set(), "via_upstream", Status.OK),
    # served, the client closed its connection before the stream's very end
    (200, {"DC"}, DISCONNECT, Status.OK),
    (200, set(), "", Status.OK),
]


@pytest.mark.parametrize(("code", "flags", "details", "status"), CASES)
def test_outcome(code: int, flags: set[str], details: str, status: Status | None) -> None:
    out = outcome_of(code, frozenset(flags), details)
    assert out.status == (status or Status.ERROR)
    assert str(code) in out.reason and all(f in out.reason for f in flags)
