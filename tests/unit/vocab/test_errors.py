"""The router's error answers as the OpenAI SDK reads them: every kind, through the SDK's
own response handling (its exception class by status, and `type`, `code`, `param` and
the message from the body), and when to retry, both ways."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx2
import openai
import pytest

from ext_proc.envoy.answers import json_error
from ext_proc.vocab import errors
from ext_proc.vocab.errors import ROUTER_ERRORS, ApiError, retry_headers

EXCEPTION_BY_STATUS = {
    400: openai.BadRequestError,
    404: openai.NotFoundError,
    429: openai.RateLimitError,
    503: openai.InternalServerError,
}


@pytest.mark.parametrize(
    ("wait_s", "seconds", "ms"),
    [
        (0.3, "1", "300"),  # sub-second: the seconds round up to 1, the ms say 300
        (2.0, "2", "2000"),
        (2.007, "3", "2007"),  # 2007.0000000000002 ms in floats: not 2008
        (2.5, "3", "2500"),
        (0.0, "1", "1"),  # never 0: it reads "at once", and the SDK skips a 0
        (-1.0, "1", "1"),
        (0.0004, "1", "1"),
    ],
)
def test_retry_headers_in_whole_seconds_rounded_up_and_exact_ms(
    wait_s: float, seconds: str, ms: str
) -> None:
    assert retry_headers(wait_s) == {"retry-after": seconds, "retry-after-ms": ms}


def _answer(error: ApiError, message: str, headers: dict[str, str]) -> httpx2.Response:
    """The router's immediate response for `error`, as the client receives it."""
    ir = json_error(error, message, headers).immediate_response
    sent = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    assert ir.status.code == error.status and ir.details == f"gorgo_{error.code}"
    return httpx2.Response(ir.status.code, headers=sent, content=ir.body)


@pytest.mark.parametrize("error", ROUTER_ERRORS, ids=lambda e: e.code)
def test_every_error_the_router_answers_is_read_by_the_openai_sdk(error: ApiError) -> None:
    message = f"what went wrong ({error.code})"
    answer = _answer(error, message, retry_headers(0.25) if error.status >= 429 else {})
    body = json.loads(answer.content)
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    client = openai.OpenAI(
        base_url="http://router.invalid/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(lambda _: answer)),
    )
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    e = caught.value
    assert type(e) is EXCEPTION_BY_STATUS[error.status]
    assert (e.type, e.code, e.param) == (error.type, error.code, error.param)
    assert message in e.message and e.status_code == error.status


def test_the_sdk_waits_what_retry_after_ms_says_not_the_rounded_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 429 saying 250 ms (Retry-After: 1) and then a success: the SDK's one retry waits
    0.25 s, the milliseconds' wait (its own backoff would be 0.375-0.5 s; the seconds', 1)."""
    answers = [
        _answer(errors.RATE_LIMITED, "the queue is full", retry_headers(0.25)),
        httpx2.Response(200, json={"object": "list", "data": []}),
    ]
    client = openai.OpenAI(
        base_url="http://router.invalid/v1",
        api_key="unused",
        max_retries=1,
        http_client=httpx2.Client(transport=httpx2.MockTransport(lambda _: answers.pop(0))),
    )
    with caplog.at_level(logging.INFO, logger="openai"):
        assert list(client.models.list()) == []
    waits = [r.args[0] for r in caplog.records if r.msg.startswith("Retrying request in")]
    assert waits == [0.25] and not answers


def test_each_kind_is_named_once() -> None:
    kinds = [v for v in vars(errors).values() if isinstance(v, ApiError)]
    assert len({(k.status, k.code) for k in kinds}) == len(kinds)
    assert {k.type for k in kinds} == {
        errors.INVALID_REQUEST,
        errors.RATE_LIMIT,
        errors.SERVER_ERROR,
    }


def test_the_operations_doc_lists_every_kind_as_the_code_names_it() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs/operations.md").read_text()
    section = doc.split("## Error answers\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| status")
    ]
    listed = {(status, type_, code) for status, type_, code, *_ in rows}
    kinds = {*ROUTER_ERRORS, *errors.ENVOY_ERRORS}
    named = {
        (f"{k.status // 100}xx" if k in CATCH_ALL else str(k.status), k.type, k.code) for k in kinds
    }
    assert listed == named
    for _, _, code, param, *_ in rows:
        kind = next(k for k in kinds if k.code == code)
        assert param == (kind.param or "null") or kind is errors.CONTEXT_LENGTH, (code, param)


# Envoy's catch-alls: whatever 5xx or 4xx of its own carries a response flag.
CATCH_ALL = {errors.UPSTREAM_ERROR, errors.BAD_REQUEST}
