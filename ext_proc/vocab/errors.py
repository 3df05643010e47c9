"""Every error the front door answers itself (the router's refusals and Envoy's own local
replies), in OpenAI's error shape, named once: `{"error": {"message", "type", "param",
"code"}}`.

What clients read. The OpenAI SDK maps the HTTP status to its exception class
(RateLimitError for 429, NotFoundError for 404, InternalServerError for 5xx) and reads
`type`, `param` and `code` from the `error` object, `code` as a string (openai
`_exceptions.APIError`; the API's `ErrorObject` types `code` and `param` as optional
strings). OpenAI's own API answers `type` `invalid_request_error` for a bad request,
`server_error` for its own failures, and names the failure in `code`
(`model_not_found`, `context_length_exceeded`, `rate_limit_exceeded`, ...). The engines
behind us differ: vLLM's `ErrorInfo` carries the HTTP status as an integer `code` and an
exception-like `type` (`NotFoundError`, `BadRequestError`; vllm/entrypoints/openai/
protocol.py), SGLang a flat `ErrorResponse` of the same fields (serving_base.py). The
router's answers follow OpenAI's, as a client written against OpenAI expects; an engine's
own errors reach the client as the engine wrote them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

# `type`: whose fault, in OpenAI's words.
INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


@dataclass(frozen=True)
class ApiError:
    """One kind of error answer: its HTTP status, `type`, `code` and the request
    parameter it is about (`param`; None: the request as a whole)."""

    status: int
    type: str
    code: str
    param: str | None = None

    def body(self, message: str) -> bytes:
        return orjson.dumps(self.as_json(message))

    def as_json(self, message: str) -> dict[str, Any]:
        error = {"message": message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}


# -- the router's answers (ext_proc/core/admission.py, ext_proc/director/flow_control.py,
# ext_proc/envoy/sessions.py) ---------------------------------------------------------------

# A body the router cannot read, with routing.unreadable_body: reject.
INVALID_BODY = ApiError(400, INVALID_REQUEST, "invalid_body")
# No model named while the fleet serves several.
MODEL_REQUIRED = ApiError(400, INVALID_REQUEST, "missing_required_parameter", "model")
# A model no backend serves.
MODEL_NOT_FOUND = ApiError(404, INVALID_REQUEST, "model_not_found", "model")
# A prompt longer than the context of every backend that serves its model (param: the
# field that holds the prompt, by API: PROMPT_PARAM).
CONTEXT_LENGTH = ApiError(400, INVALID_REQUEST, "context_length_exceeded")
# Not now, come back later (Retry-After): flow control's refusals (a full queue, a wait
# past the objective's longest, an SLO it cannot meet) and load shedding. One type and
# code for all; flow control's reason is in the x-gorgo-flow-reason header.
RATE_LIMITED = ApiError(429, RATE_LIMIT, "rate_limit_exceeded")
# No backend can serve the request now: every one serving its model ejected or draining,
# none in its objective's regions.
UNAVAILABLE = ApiError(503, SERVER_ERROR, "service_unavailable")

# The request field that holds the prompt, by API (ext_proc/prompt/parse.py's names).
PROMPT_PARAM = {"chat": "messages", "completions": "prompt", "generate": "text"}

# -- Envoy's own local replies (ext_proc/envoy_config/bootstrap.py's local_reply_config) --------

# A body over the front door's buffer limit.
BODY_TOO_LARGE = ApiError(413, INVALID_REQUEST, "request_too_large")
# An upstream that did not answer in time (a response or per-try timeout).
UPSTREAM_TIMEOUT = ApiError(504, SERVER_ERROR, "request_timeout")
# (A 503 with a flag, no healthy upstream, a connect failure, an overflow: UNAVAILABLE.)
# Any other reply of Envoy's own that carries a response flag, with the status Envoy gave
# it: a 5xx of another kind ...
UPSTREAM_ERROR = ApiError(500, SERVER_ERROR, "server_error")
# ... or a 4xx (a request Envoy refused).
BAD_REQUEST = ApiError(400, INVALID_REQUEST, "invalid_request")

ROUTER_ERRORS = (
    INVALID_BODY,
    MODEL_REQUIRED,
    MODEL_NOT_FOUND,
    CONTEXT_LENGTH,
    RATE_LIMITED,
    UNAVAILABLE,
)
ENVOY_ERRORS = (BODY_TOO_LARGE, UPSTREAM_TIMEOUT, UNAVAILABLE, UPSTREAM_ERROR, BAD_REQUEST)


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """When to retry, both ways: `retry-after` in whole seconds, rounded up, as RFC 9110
    defines it (at least 1: a 0 reads as "at once"), and `retry-after-ms` exact to the
    millisecond (at least 1), which the OpenAI SDKs read first: a 300 ms wait is 300 ms
    there, not the 1 s the whole seconds round it to."""
    return {
        "retry-after": str(max(1, math.ceil(retry_after_s))),
        # rounded to the microsecond first: 2.007 s is 2007.0000000000002 ms in floats
        "retry-after-ms": str(max(1, math.ceil(round(retry_after_s * 1000, 3)))),
    }
