"""A streaming OpenAI client that times each request as a user would see it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ext_proc.common.names import HEADER_BACKEND


@dataclass
class Result:
    id: str
    backend: str = ""
    status: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    # Chunks that carried content (output tokens when the server reports no usage).
    chunks: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def chat_body(content: str, max_tokens: int, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "default",
        "stream": stream,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


async def send_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    request_id: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = 600.0,
) -> Result:
    """POST a chat request (see send_stream)."""
    return await send_stream(session, url, CHAT_PATH, body, request_id, headers, timeout_s)


async def send_stream(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any] | bytes,
    request_id: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = 600.0,
) -> Result:
    """POST an OpenAI request (chat or completions) and time it as a user would see it:
    TTFT at the first chunk with content (`choices[0].delta.content` for chat,
    `choices[0].text` for completions), ITL the gaps between content chunks, E2E at the
    end of the stream. `body` is a JSON object, or one already encoded (a load generator
    encodes ahead of the send time). A JSON response is a whole answer; anything else is
    read as a server-sent event stream. Failures (HTTP status, connection, timeout, a
    malformed or cut-off stream) are returned in `error`, never raised."""
    result = Result(request_id)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.perf_counter()
    last: float | None = None
    try:
        async with session.post(
            f"{url}{path}",
            data=data,
            headers={"content-type": "application/json", **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            result.status = resp.status
            result.backend = resp.headers.get(HEADER_BACKEND, "")
            if resp.status != 200:
                text = (await resp.text()).strip()[:200]
                result.error = f"HTTP {resp.status}: {text}" if text else f"HTTP {resp.status}"
                return result
            if resp.content_type == "application/json":
                whole = await resp.json()
                result.ttft_ms = (time.perf_counter() - start) * 1e3
                _usage(result, whole.get("usage"))
                return result
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                now = time.perf_counter()
                if _has_content(chunk):
                    result.chunks += 1
                    if result.ttft_ms is None:
                        result.ttft_ms = (now - start) * 1e3
                    elif last is not None:
                        result.itl_ms.append((now - last) * 1e3)
                    last = now
                _usage(result, chunk.get("usage"))
            if not done:
                result.error = "stream ended before data: [DONE]"
    except (TimeoutError, aiohttp.ClientError) as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except (ValueError, TypeError) as e:  # a chunk that is not JSON, an over-long line
        result.error = f"bad response stream: {e}"
    finally:
        result.e2e_ms = (time.perf_counter() - start) * 1e3
    return result


def _has_content(chunk: Any) -> bool:
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    return bool(choice.get("text") or (isinstance(delta, dict) and delta.get("content")))


def _usage(result: Result, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    result.input_tokens = int(usage.get("prompt_tokens", 0))
    result.output_tokens = int(usage.get("completion_tokens", 0))
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = int(details.get("cached_tokens", 0) or 0)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def closed_loop(
    url: str,
    clients: int,
    body_of: Callable[[int, int], dict[str, Any]],
    running: Callable[[], bool],
    timeout_s: float = 60.0,
) -> list[tuple[float, Result]]:
    """`clients` clients, each sending its next chat as soon as the last one ended, while
    `running()`; `body_of(client, turn)` is each request's body. Returns every result
    with the monotonic time it was sent."""
    sent: list[tuple[float, Result]] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        async def client(i: int) -> None:
            n = 0
            while running():
                t = time.monotonic()
                sent.append(
                    (t, await send_chat(s, url, body_of(i, n), f"c{i}-{n}", timeout_s=timeout_s))
                )
                n += 1

        await asyncio.gather(*(client(i) for i in range(clients)))
    return sent
