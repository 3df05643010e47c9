"""The router's own answers to a request (Envoy's ImmediateResponse in OpenAI's error
shape) and the id a request is tracked by."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from ext_proc.envoy import codec
from ext_proc.vocab.errors import UNAVAILABLE, ApiError

# A client's request id longer than this is shortened (its start and a hash of it).
MAX_REQUEST_ID_CHARS = 200


def no_endpoint(reason: str) -> codec.ProcessingResponse:
    """The endpoint-picker protocol's answer when no endpoint can take the request."""
    return json_error(UNAVAILABLE, f"no endpoint can take the request: {reason}")


def own_request_id(request_id: str, in_flight: Mapping[str, object]) -> str:
    """The id the router tracks a request by, and Envoy then logs it by (the router's reply
    rewrites x-request-id when it differs): the client's own, unless a request with that
    id is still in flight (a client reusing one: each must count, and close, apart) or it
    is absurdly long (kept in the decision log and the page's feed)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).hexdigest()
        request_id = f"{request_id[:64]}~{digest}"
    own, n = request_id, 1
    while own in in_flight:
        n += 1
        own = f"{request_id}~{n}"
    return own


def json_error(
    error: ApiError, message: str, headers: dict[str, str] | None = None
) -> codec.ProcessingResponse:
    """Answer the client directly, in the OpenAI error shape its SDK already parses
    (ext_proc/vocab/errors.py); Envoy logs the code as the response code details."""
    all_headers = {**(headers or {}), "content-type": "application/json"}
    return codec.immediate_response(
        error.status, error.body(message), all_headers, details=f"gorgo_{error.code}"
    )
