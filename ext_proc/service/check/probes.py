"""One look at every backend, with the running router's own readers and at once: what its
engine serves (`/v1/models`, as the probe loop and the token check read it), a few RTT
probes on the probe path (loops/engine_http.py, as the probe loop takes them), one read of
its `/metrics` (when the router would scrape it), its KV-event endpoints (kv.py), SGLang's
`/server_info` (its priority scheduling), for a vLLM backend whose priority is written one
request with a priority (max_tokens 1: without `--scheduling-policy priority` vLLM answers
it 400), and then
whether the router's tokens are the engine's (the token check's own calls,
service/tokenize_client.py), with the tokenizer the router would use: the configured one,
else the one it would find from a backend with KV events (prompt/tokenizer_files.py).
Every request waits at most `timeout_s`; the backends are looked at concurrently, so a
dead fleet answers in about one timeout (two with a tokenizer to check).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import zmq.asyncio

from ext_proc.config.schema import PROBE_PATH, Config
from ext_proc.feeds.engine_metrics import EngineReport, MetricsError
from ext_proc.feeds.served_models import ServedModels
from ext_proc.feeds.server_info import EngineScheduling, priority_writing
from ext_proc.prompt.engine_tokens import EngineTokenizer, load_engine_tokenizer
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.prompt.tokenizer_files import find_tokenizer
from ext_proc.service.check.kv import KvLook, look_at_kv
from ext_proc.service.loops.engine_http import (
    UNREACHABLE,
    NoMetricsPage,
    probe_rtt,
    probe_session,
    read_engine_report,
    read_scheduling,
    read_served_models,
    read_session,
)
from ext_proc.service.tokenize_client import TokenizeUnsupported, served_model, verify_tokens
from ext_proc.vocab.backend import Backend, EngineKind, PriorityScheduling
from ext_proc.vocab.params import ConfigError

# RTT probes per path, one after another on one kept-alive connection (the probe loop's
# spacing, probes.interval_s, is not waited: the median of a few is what is shown).
RTT_PROBES = 3
# The priority the trial request carries: any non-zero value is refused by a vLLM without
# priority scheduling; 1 is served after the default class by one with it.
TRIAL_PRIORITY = 1


def why(e: BaseException, timeout_s: float) -> str:
    """A failed request's error in a few words."""
    if isinstance(e, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect: {e.os_error.strerror or e.os_error}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclass
class TokensLook:
    """Whether the router's token ids are the engine's: `exact` (verified, or trusted when
    the engine has no tokenize endpoint) and why; `mismatch`: the engine tokenizes
    differently."""

    exact: bool
    reason: str
    mismatch: bool = False


@dataclass
class BackendLook:
    """What one backend's engine answered (an error string is "" when it answered)."""

    index: int
    backend: Backend
    models: ServedModels | None = None
    models_error: str = ""
    # An answer of no HTTP endpoint at all (refused, timed out): the engine is not there.
    unreachable: str = ""
    # The base model and its path, as the token check reads them.
    served: tuple[str, str] | None = None
    rtt_ms: list[float] = field(default_factory=list)
    rtt_failures: int = 0
    # With probes.path other than the engine's own: that path's RTTs for comparison.
    reference_rtt_ms: list[float] = field(default_factory=list)
    metrics: EngineReport | None = None
    metrics_error: str = ""
    metrics_missing: bool = False  # 404: SGLang without --enable-metrics
    kv: list[KvLook] = field(default_factory=list)
    tokens: TokensLook | None = None
    # SGLang's /server_info (its priority scheduling; None: not read, error says why).
    scheduling: EngineScheduling | None = None
    scheduling_error: str = ""
    # A vLLM whose priority the router writes: its answer to one request with a priority
    # (status, and the start of its body; None: not sent).
    priority_trial: tuple[int, str] | None = None


@dataclass
class TokenizerLook:
    """The tokenizer the router would use: from the config, found from a backend with KV
    events (`where`), or none (`not_found` says why)."""

    source: str  # "config", "discovered" or ""
    where: str = ""
    engine: EngineTokenizer | None = None
    not_found: str = ""


@dataclass
class Look:
    """The whole look: every backend, the tokenizer, and how long it took."""

    backends: list[BackendLook]
    tokenizer: TokenizerLook
    timeout_s: float
    elapsed_s: float = 0.0


async def _models(look: BackendLook, http: aiohttp.ClientSession, timeout_s: float) -> None:
    address = look.backend.address
    try:
        look.models = await read_served_models(http, address, timeout_s)
    except UNREACHABLE as e:
        look.unreachable = look.models_error = why(e, timeout_s)
        return
    except ValueError as e:
        look.models_error = str(e)
    try:
        look.served = await asyncio.wait_for(served_model(http, address), timeout_s)
    except (*UNREACHABLE, ValueError):
        pass  # said by models_error


async def _rtts(
    look: BackendLook, cfg: Config, session: aiohttp.ClientSession, timeout_s: float
) -> None:
    b = look.backend
    path = cfg.probe_path(b)
    for _ in range(RTT_PROBES):
        rtt_ms = await probe_rtt(session, f"http://{b.address}{path}", timeout_s)
        if rtt_ms is None:
            look.rtt_failures += 1
            if not look.rtt_ms:
                return  # the first failed: a dead backend costs one timeout, not three
        else:
            look.rtt_ms.append(rtt_ms)
    reference = PROBE_PATH[b.engine]
    if path != reference and look.rtt_ms:
        for _ in range(RTT_PROBES):
            rtt_ms = await probe_rtt(session, f"http://{b.address}{reference}", timeout_s)
            if rtt_ms is not None:
                look.reference_rtt_ms.append(rtt_ms)


async def _metrics(look: BackendLook, http: aiohttp.ClientSession, timeout_s: float) -> None:
    try:
        look.metrics = await read_engine_report(http, look.backend.address, timeout_s)
    except NoMetricsPage:
        look.metrics_missing = True
        look.metrics_error = "HTTP 404"
    except UNREACHABLE as e:
        look.metrics_error = why(e, timeout_s)
    except MetricsError as e:
        look.metrics_error = str(e)


async def _scheduling(look: BackendLook, http: aiohttp.ClientSession, timeout_s: float) -> None:
    try:
        look.scheduling = await read_scheduling(http, look.backend.address, timeout_s)
    except UNREACHABLE as e:
        look.scheduling_error = why(e, timeout_s)
    except ValueError as e:
        look.scheduling_error = str(e) or type(e).__name__


async def priority_trial(
    http: aiohttp.ClientSession, address: str, model: str, timeout_s: float
) -> tuple[int, str]:
    """One completion of one token with a non-zero priority: the engine's status and the
    start of its answer."""
    body = {"model": model, "prompt": "gorgo check", "max_tokens": 1, "priority": TRIAL_PRIORITY}
    async with http.post(
        f"http://{address}/v1/completions",
        json=body,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as resp:
        return resp.status, (await resp.text())[:300]


async def _trial(look: BackendLook, http: aiohttp.ClientSession, timeout_s: float) -> None:
    """A vLLM backend whose priority is written: does the engine take one?"""
    if look.unreachable or look.served is None:
        return
    try:
        look.priority_trial = await priority_trial(
            http, look.backend.address, look.served[0], timeout_s
        )
    except UNREACHABLE as e:
        look.priority_trial = (0, why(e, timeout_s))


def _writes_for_vllm(b: Backend) -> bool:
    return b.engine is EngineKind.VLLM and priority_writing(b, None).writes


async def _look_at(
    look: BackendLook,
    cfg: Config,
    sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession],
    ctx: zmq.asyncio.Context,
    timeout_s: float,
) -> None:
    probes, http = sessions
    parts = [_models(look, http, timeout_s), _rtts(look, cfg, probes, timeout_s)]
    if cfg.probes.metrics_interval_s > 0:
        parts.append(_metrics(look, http, timeout_s))

    b = look.backend
    if b.engine is EngineKind.SGLANG and b.priority_scheduling is not PriorityScheduling.OFF:
        parts.append(_scheduling(look, http, timeout_s))

    async def kv() -> None:
        look.kv = await look_at_kv(ctx, look.backend, timeout_s)

    await asyncio.gather(*parts, kv())
    if _writes_for_vllm(b):  # once the engine said what it serves
        await _trial(look, http, timeout_s)


def _load(cfg: TokenizerConfig) -> EngineTokenizer:
    engine = load_engine_tokenizer(cfg)
    assert engine is not None  # a path is set
    return engine


async def find_router_tokenizer(cfg: Config, looks: list[BackendLook]) -> TokenizerLook:
    """The tokenizer the router would use. Without `tokenizer.path` it looks for one only
    for backends with KV events (service/engine_tokenizer.py), the first found in the
    config's order; without such backends it counts 4 bytes per token."""
    if cfg.tokenizer.path:
        engine = await asyncio.to_thread(_load, cfg.tokenizer)
        return TokenizerLook("config", cfg.tokenizer.path, engine)
    watched = [look for look in looks if look.backend.kv_events.endpoint]
    if not watched:
        return TokenizerLook("", not_found="no backend has kv_events, so the router finds none")
    not_found = ""
    for look in watched:
        if look.served is None:
            continue
        model, root = look.served
        found = find_tokenizer([root, model], cfg.tokenizer.cache_entries)
        if found.config is None:
            not_found = not_found or f"{look.backend.id} serves {model!r}: {found.where}"
            continue
        try:
            engine = await asyncio.to_thread(_load, found.config)
        except ConfigError as e:
            not_found = not_found or f"{look.backend.id} serves {model!r}: {found.where}: {e}"
            continue
        return TokenizerLook("discovered", f"from {look.backend.id}: {found.where}", engine)
    return TokenizerLook("", not_found=not_found or "no backend with kv_events said what it serves")


async def check_tokens(
    look: BackendLook, tokenizer: TokenizerLook, http: aiohttp.ClientSession
) -> TokensLook:
    """The router's tokens against this backend's engine (the running check's calls)."""
    engine = tokenizer.engine
    if engine is None:
        return TokensLook(False, "4 bytes per token (no tokenizer)")
    if look.served is None:
        return TokensLook(False, "not checked: the engine did not say what it serves")
    b, model = look.backend, look.served[0]
    try:
        verdict = await verify_tokens(http, b, model, engine)
    except TokenizeUnsupported:
        return TokensLook(True, f"trusted: {b.engine} has no tokenize endpoint to check against")
    except (*UNREACHABLE, ValueError) as e:
        return TokensLook(False, f"tokenize check failed: {e}")
    if verdict:
        return TokensLook(False, verdict, mismatch=True)
    return TokensLook(True, f"verified against {model}")


async def look_at_fleet(cfg: Config, timeout_s: float) -> Look:
    """Look at every backend of `cfg` at once, then check the tokens where the engine
    answered."""
    started = time.perf_counter()
    looks = [BackendLook(i, b) for i, b in enumerate(cfg.backends)]
    ctx = zmq.asyncio.Context()
    probes, http = probe_session(), read_session()
    tokens_http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
    try:
        sessions = (probes, http)
        await asyncio.gather(*(_look_at(look, cfg, sessions, ctx, timeout_s) for look in looks))
        tokenizer = await find_router_tokenizer(cfg, looks)
        answered = [look for look in looks if not look.unreachable]
        verdicts = await asyncio.gather(
            *(check_tokens(look, tokenizer, tokens_http) for look in answered)
        )
        for look, verdict in zip(answered, verdicts, strict=True):
            look.tokens = verdict
    finally:
        for session in (probes, http, tokens_http):
            await session.close()
        ctx.destroy(linger=0)
    return Look(looks, tokenizer, timeout_s, time.perf_counter() - started)
