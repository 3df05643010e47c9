"""The emulated engine as the component tests run it: the fast profile (1 ms steps, no
jitter), the request paths and a chat, an engine on a free port, an SSE reader, and prompt
text of an exact token count."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp

from emulator.engine.config import EngineConfig
from emulator.engine.server import EngineServer
from ext_proc.estimate.profile import load_profile
from ext_proc.prompt.tokens import count_tokens

DEFAULT = load_profile()
# 1 ms per step, no jitter: fast and deterministic where timing is not the point.
FAST = replace(
    DEFAULT,
    name="fast-test",
    prefill_base_ms=1.0,
    prefill_tokens_per_s=1e6,
    decode_base_ms=1.0,
    decode_batch_ms=0.0,
    decode_per_request_ms=0.0,
    decode_per_1k_context_ms=0.0,
    no_cuda_graph_ms=0.0,
    jitter_sigma=0.0,
)
NAME = "us-ashburn"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the weather in Ashburn, please."},
]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"


@contextlib.asynccontextmanager
async def running(cfg: EngineConfig, *, check_idle: bool = True) -> AsyncIterator[EngineServer]:
    """An engine on 127.0.0.1:<free port>; by default nothing may stay in flight after."""
    srv = EngineServer(cfg, "127.0.0.1", 0)
    await srv.start()
    try:
        yield srv
        if check_idle:
            assert srv.engine.stats.in_flight == 0
            assert srv.engine.runner.model.num_running == 0
    finally:
        await srv.stop()


async def read_sse(resp: aiohttp.ClientResponse) -> list[tuple[float, str]]:
    """(arrival time, payload) of every `data:` event of an SSE response."""
    events: list[tuple[float, str]] = []
    buf = b""
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            events.append((now, event[len(b"data: ") :].decode()))
    assert buf == b"", f"trailing bytes after last event: {buf!r}"
    return events


def filler(n_tokens: int, salt: str) -> str:
    """ASCII text of exactly n_tokens tokens (4 bytes each), distinct per salt."""
    text = "".join(f"{salt}{i:07d}|" for i in range(n_tokens))[: 4 * n_tokens]
    assert count_tokens(text) == n_tokens
    return text
