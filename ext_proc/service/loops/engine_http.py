"""An engine's HTTP endpoints as the router reads them: one RTT probe, one read of its
`/metrics`, of its `/v1/models` and of SGLang's `/server_info`. The probe loop (probe.py)
calls these on its schedule; `gorgo check` (ext_proc/service/check/) calls the same ones
once, so it judges an engine exactly as the running router will read it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import aiohttp

from ext_proc.feeds.engine_metrics import EngineReport, MetricsError, parse_engine_metrics
from ext_proc.feeds.served_models import ModelsError, ServedModels, parse_models
from ext_proc.feeds.server_info import EngineScheduling, ServerInfoError, parse_server_info

# Errors of a read that did not get an answer (refused, reset, timed out, or a host name
# the resolver refuses: UnicodeError from IDNA, which the address check should have caught).
UNREACHABLE = (aiohttp.ClientError, TimeoutError, OSError, UnicodeError)


class NoMetricsPage(MetricsError):
    """The engine answers 404 on /metrics: SGLang mounts it only with --enable-metrics
    (python/sglang/srt/entrypoints/http_server.py)."""


async def _mark_new_connection(
    session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object
) -> None:
    # Only probes carry a context to mark; other reads may share the session.
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["new_connection"] = True


def probe_session() -> aiohttp.ClientSession:
    """A session for RTT probes: one kept-alive connection per backend (two at most), and
    a trace that tells a probe whether it had to open its connection."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(_mark_new_connection)
    connector = aiohttp.TCPConnector(limit_per_host=2, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, trace_configs=[trace])


def read_session() -> aiohttp.ClientSession:
    """A session for metrics and model reads, on connections of their own: a probe that
    waited for a connection another request holds would time that wait as RTT."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit_per_host=2, keepalive_timeout=60)
    )


async def probe_rtt(session: aiohttp.ClientSession, url: str, timeout_s: float) -> float | None:
    """One probe (a GET of `url` on a `probe_session`): RTT in ms, or None if it failed (no
    answer, or a 5xx). A sample that had to open a connection is not an RTT (it includes
    the handshake): it is retried at once, on the connection now open."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    for _ in range(2):
        ctx: dict[str, bool] = {}
        start = time.perf_counter()
        try:
            async with session.get(url, timeout=timeout, trace_request_ctx=ctx) as resp:
                await resp.read()
                if resp.status >= 500:
                    return None
        except UNREACHABLE:
            return None
        if not ctx.get("new_connection"):
            return (time.perf_counter() - start) * 1000
    return None


async def read_engine_report(
    session: aiohttp.ClientSession, address: str, timeout_s: float
) -> EngineReport:
    """The engine's load from its /metrics page. Raises NoMetricsPage (404), MetricsError
    (another status, not Prometheus text) or one of UNREACHABLE."""
    async with session.get(
        f"http://{address}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as resp:
        text = await resp.text()
        if resp.status == 404:
            raise NoMetricsPage("HTTP 404")
        if resp.status != 200:
            raise MetricsError(f"HTTP {resp.status}")
    return parse_engine_metrics(text)


async def _get_json(
    session: aiohttp.ClientSession,
    address: str,
    path: str,
    timeout_s: float,
    error: type[Exception],
) -> Any:
    """An engine's JSON answer at `path`; `error` for a status other than 200."""
    async with session.get(
        f"http://{address}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as resp:
        if resp.status != 200:
            raise error(f"HTTP {resp.status}")
        return await resp.json(content_type=None)


async def read_served_models(
    session: aiohttp.ClientSession, address: str, timeout_s: float
) -> ServedModels:
    """What the engine serves, from its /v1/models. Raises ModelsError (a status other
    than 200, an answer that cannot be read), ValueError (not JSON) or one of UNREACHABLE."""
    return parse_models(await _get_json(session, address, "/v1/models", timeout_s, ModelsError))


async def read_scheduling(
    session: aiohttp.ClientSession, address: str, timeout_s: float
) -> EngineScheduling:
    """SGLang's priority scheduling, from its /server_info. Raises ServerInfoError (a
    status other than 200, an answer that cannot be read), ValueError (not JSON) or one
    of UNREACHABLE."""
    info = await _get_json(session, address, "/server_info", timeout_s, ServerInfoError)
    return parse_server_info(info)
