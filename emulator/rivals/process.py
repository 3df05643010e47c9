"""One rival router as a child process: `start_rival` starts it (its output to a log file) and
returns once it routes, `RivalProcess.stop` ends it by PID. Also what its log and metrics
say about the engines' loads it routed on.

"Routes" is each tool's own readiness: both SMG 1.13 and vllm-router 0.1.17 serve
``GET /readiness`` → ``{"status": "ready", "healthy_workers": H, "total_workers": T}``
(200 once a worker is healthy); the wait goes on until every worker given is registered and
healthy (H == T == the number of worker URLs), so the first request finds the whole fleet.
In its P/D mode vllm-router answers ``{"status": "ready", "prefill": {"healthy": H,
"total": T}, "decode": {...}}`` instead: the sums count (SMG's P/D keeps the first shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from emulator.rivals.fronts import SMG, PdWorkers, RivalFront, argv
from emulator.rivals.install import DEFAULT_VENV, rival_binary

# SMG's routing decisions are logged at debug by its policies (least_load.rs: "<policy>
# selected <url> (score S, in_flight N)", the score being the expected wait from the polled
# engine loads); only that module at debug keeps the log small. SMG_CACHE_TRACE=1 asks for
# its per-decision JSON too (observability/cache_trace.rs; 1.13 writes it on the gRPC
# token path, not for HTTP workers).
SMG_ENV = {"SMG_CACHE_TRACE": "1", "RUST_LOG": "info,smg::policies=debug"}
# SIGTERM first; SMG then waits up to --shutdown-grace-period-secs (180 s) for requests in
# flight, after a fixed 5 s readiness drain (measured: SIGTERM to exit 5.0 s idle); a
# bench that is done with the rival has no use for more.
STOP_GRACE_S = 8.0
_POLL_S = 0.2


class RivalStartError(RuntimeError):
    """The rival exited or did not route in time; the message holds its log's tail."""


@dataclass
class RivalProcess:
    front: RivalFront
    pid: int
    url: str
    metrics_url: str
    log_path: Path
    argv: list[str]
    _proc: subprocess.Popen[bytes] = field(repr=False)
    _log: IO[bytes] = field(repr=False)

    def returncode(self) -> int | None:
        return self._proc.poll()

    async def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the rival's PID, SIGKILL after ``grace_s``; its exit code."""
        try:
            if self._proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while self._proc.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if self._proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGKILL)
                    await asyncio.to_thread(self._proc.wait)
            return self._proc.returncode
        finally:
            self._log.close()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = _strip_ansi(path.read_text(errors="replace"))
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


async def _ready(session: aiohttp.ClientSession, url: str, workers: int) -> bool:
    try:
        async with session.get(f"{url}/readiness") as r:
            if r.status != 200:
                return False
            body = await r.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return False
    if not isinstance(body, dict):
        return False
    if "healthy_workers" not in body and isinstance(body.get("prefill"), dict):
        legs: list[dict[str, Any]] = [
            leg for leg in (body.get("prefill"), body.get("decode")) if isinstance(leg, dict)
        ]
        healthy = sum(int(leg.get("healthy", 0)) for leg in legs)
        total = sum(int(leg.get("total", 0)) for leg in legs)
        return len(legs) == 2 and healthy == total == workers
    return body.get("healthy_workers") == workers and body.get("total_workers") == workers


async def start_rival(
    front: RivalFront,
    worker_urls: Sequence[str],
    model: str,
    *,
    port: int,
    metrics_port: int,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 60.0,
    venv: Path = DEFAULT_VENV,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    pd_workers: PdWorkers | None = None,
    **engine_facts: Any,
) -> RivalProcess:
    """Start ``front`` in front of ``worker_urls`` (a P/D front: ``pd_workers``) and return
    once all of them are healthy in it. ``env`` adds to this process's environment (SMG
    also gets `SMG_ENV`); ``engine_facts`` go to `emulator.rivals.fronts.argv`. Raises
    RivalStartError (with the log's tail) if it exits or is not ready within
    ``ready_timeout_s``; the process is stopped then."""
    rival_binary(front.tool, venv)  # a clear error naming `make peers` when missing
    cmd = argv(
        front,
        worker_urls,
        model,
        port,
        metrics_port,
        venv=venv,
        host=host,
        extra_args=extra_args,
        pd_workers=pd_workers,
        **engine_facts,
    )
    workers = len(pd_workers) if pd_workers is not None else len(worker_urls)
    full_env = dict(os.environ)
    if front.tool == SMG:
        full_env.update(SMG_ENV)
    full_env.update(env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("wb")
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env
    )
    rival = RivalProcess(
        front=front,
        pid=proc.pid,
        url=f"http://{host}:{port}",
        metrics_url=f"http://{host}:{metrics_port}/metrics",
        log_path=log_path,
        argv=cmd,
        _proc=proc,
        _log=log,
    )
    deadline = time.monotonic() + ready_timeout_s
    timeout = aiohttp.ClientTimeout(total=2)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if proc.poll() is not None:
                    raise RivalStartError(
                        f"{front.name} exited with {proc.returncode} before routing; "
                        f"{log_path}:\n{_tail(log_path)}"
                    )
                if await _ready(session, rival.url, workers):
                    return rival
                if time.monotonic() > deadline:
                    raise RivalStartError(
                        f"{front.name} not routing to all {workers} workers after "
                        f"{ready_timeout_s:g} s; {log_path}:\n{_tail(log_path)}"
                    )
                await asyncio.sleep(_POLL_S)
    except BaseException:
        await rival.stop()
        raise


# SMG's decision line (policies/least_load.rs, for least_load and the expected-wait
# choices of cache_aware and power_of_two).
_SMG_DECISION = re.compile(
    r"smg::policies::\w+: \S+ (?P<policy>\w+) selected (?P<worker>\S+) "
    r"\(score (?P<score>[-+0-9.eE]+|inf|NaN), in_flight (?P<in_flight>\d+)\)"
)


@dataclass(frozen=True)
class SmgDecision:
    """One SMG choice by expected wait: the worker, its score (seconds of expected wait
    from the engine's polled load) and SMG's own in-flight count for it."""

    policy: str
    worker: str
    score: float
    in_flight: int


def smg_decisions(log_path: Path) -> list[SmgDecision]:
    """SMG's expected-wait decisions in its log (needs `SMG_ENV`'s debug for policies), and
    any cache-trace JSON lines it wrote, in order."""
    out: list[SmgDecision] = []
    text = _strip_ansi(log_path.read_text(errors="replace"))
    for line in text.splitlines():
        m = _SMG_DECISION.search(line)
        if m:
            out.append(
                SmgDecision(m["policy"], m["worker"], float(m["score"]), int(m["in_flight"]))
            )
    return out


def smg_cache_traces(log_path: Path) -> list[dict[str, Any]]:
    """The per-decision cache-trace JSON objects in an SMG log (SMG_CACHE_TRACE=1)."""
    out: list[dict[str, Any]] = []
    text = _strip_ansi(log_path.read_text(errors="replace"))
    for line in text.splitlines():
        if "cache_trace" not in line:
            continue
        start = line.find("{")
        if start < 0:
            continue
        with contextlib.suppress(ValueError):
            obj = json.loads(line[start:])
            if isinstance(obj, dict):
                out.append(obj)
    return out


# SMG's gauges of what each engine reported at its last poll (observability/metrics.rs).
SMG_ENGINE_GAUGES = {
    "smg_engine_running_requests": "num_running_reqs",
    "smg_engine_waiting_requests": "num_waiting_reqs",
    "smg_engine_token_usage": "token_usage",
    "smg_engine_gen_throughput": "gen_throughput",
    "smg_engine_cache_hit_rate": "cache_hit_rate",
}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def smg_engine_loads(metrics_text: str) -> dict[str, dict[str, float]]:
    """What SMG holds from each engine's last load poll, from its Prometheus page: worker
    URL → {num_running_reqs, num_waiting_reqs, token_usage, gen_throughput, cache_hit_rate}
    (the /v1/loads names), summed over DP ranks (token_usage, cache_hit_rate: their mean)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m["name"] not in SMG_ENGINE_GAUGES:
            continue
        labels = dict(_LABEL.findall(m["labels"]))
        worker = labels.get("worker")
        if worker is None:
            continue
        key = SMG_ENGINE_GAUGES[m["name"]]
        sums.setdefault(worker, {}).setdefault(key, []).append(float(m["value"]))
    mean_keys = {"token_usage", "cache_hit_rate"}
    return {
        w: {k: (sum(v) / len(v) if k in mean_keys else sum(v)) for k, v in fields.items()}
        for w, fields in sums.items()
    }


def smg_load_polls(metrics_text: str) -> dict[str, int]:
    """SMG's count of load polls per worker URL (smg_engine_load_polls_total, mode poll)."""
    out: dict[str, int] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m["name"] != "smg_engine_load_polls_total":
            continue
        labels = dict(_LABEL.findall(m["labels"]))
        if labels.get("mode") == "poll" and "worker" in labels:
            out[labels["worker"]] = out.get(labels["worker"], 0) + int(float(m["value"]))
    return out
