"""What `gorgo replay` sends for a trace row and what it records of the answer: the pure
core of the live replay (no sockets, no clock). `build_request` turns a trace row into an
HTTP request (`Encoded`: its body ready to go), `to_result` the client's measurements into
a result row of `loadgen.results`' schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ext_proc.common.names import HEADER_SESSION
from loadgen.client.stream import CHAT_PATH, COMPLETIONS_PATH, Result
from loadgen.results import RequestResult
from loadgen.traces.prompts import PromptSynth
from loadgen.traces.request import TraceRequest

APIS = ("completions", "chat")


@dataclass(frozen=True)
class HttpRequest:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]

    def encoded(self) -> Encoded:
        return Encoded(self.path, json.dumps(self.body).encode(), self.headers)


@dataclass(frozen=True)
class Encoded:
    """A request ready to go: its JSON body already encoded (done ahead of time)."""

    path: str
    data: bytes
    headers: dict[str, str]


def build_request(r: TraceRequest, api: str, synth: PromptSynth) -> HttpRequest:
    """The request a trace row sends. Mooncake rows: a synthesized prompt of exactly
    r.input_tokens tokens, r.output_tokens out (ignore_eos), to /v1/completions, or as one
    user message to /v1/chat/completions. ART-Chat rows send their own chat body. Always
    streamed with a usage chunk; the session rides in `x-session-id`."""
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    headers = {HEADER_SESSION: r.session}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    if r.body is not None:
        body = {**r.body, **stream, "max_tokens": r.output_tokens}
        options = r.body.get("stream_options")
        if isinstance(options, dict):
            body["stream_options"] = {**options, "include_usage": True}
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = r.output_tokens
        return HttpRequest(CHAT_PATH, body, headers)
    text = synth.prompt(r)
    common = {"model": "default", "max_tokens": r.output_tokens, "ignore_eos": True, **stream}
    if api == "chat":
        return HttpRequest(
            CHAT_PATH, {**common, "messages": [{"role": "user", "content": text}]}, headers
        )
    return HttpRequest(COMPLETIONS_PATH, {**common, "prompt": text}, headers)


def to_result(r: TraceRequest, res: Result) -> RequestResult:
    """Client measurements -> a result row. Token counts are the server's usage report
    (output falls back to content chunks when it sends none)."""
    return RequestResult(
        id=r.id,
        backend=res.backend,
        ttft_ms=res.ttft_ms,
        e2e_ms=res.e2e_ms,
        input_tokens=res.input_tokens,
        output_tokens=res.output_tokens or res.chunks,
        cached_tokens=res.cached_tokens,
        status="ok" if res.ok else "error",
        error="" if res.ok else (res.error or f"HTTP {res.status}"),
        itl_ms=res.itl_ms,
    )
