"""Each thing the router reads of one backend, judged from a look at it (probes.py): its
RTT probes, its queue (the engine's /metrics or the router's estimate), its prefix state
(the engine's KV events or the router's estimate), its tokens (the engine's or
approximated) and whether requests' priorities are written for its scheduler; each with
the problems found, every one with a fix naming the key or flag to change. Pure.
"""

from __future__ import annotations

import statistics

from ext_proc.config.kv_endpoints import split_tcp_endpoint
from ext_proc.config.schema import PROBE_PATH, Config
from ext_proc.feeds.engine_metrics import RUNNING, WAITING
from ext_proc.feeds.server_info import ENABLE_KEY, priority_writing
from ext_proc.service.check.probes import BackendLook, Look
from ext_proc.service.check.verdict import Aspect, Problem, Verdict
from ext_proc.service.loops.probe import SLOWER_FACTOR, SLOWER_MARGIN_MS
from ext_proc.vocab.backend import EngineKind, KvEventsMode

KV_FLAG = "--kv-events-config"
TOKENIZER_FIX = (
    "set tokenizer.path (and tokenizer.chat_template) to the files {model} is served with"
)


def rtt_problems(look: BackendLook, cfg: Config, out: list[Problem], where: str) -> None:
    """Probes of a path that fail, or that make the engine work (their RTT its queue)."""
    b = look.backend
    path = cfg.probe_path(b)
    if look.rtt_failures and not look.rtt_ms and not look.unreachable:
        fix = (
            f"set probes.path to a path the engine answers without work (empty: the "
            f"engine's own, {PROBE_PATH[b.engine]})"
            if cfg.probes.path
            else f"check backends[{look.index}].engine ({b.engine}: the router probes {path})"
        )
        out.append(Problem(where, f"RTT probes of {path} fail (5xx or no answer)", fix))
    if look.rtt_ms and look.reference_rtt_ms:
        probe_ms = statistics.median(look.rtt_ms)
        ref_ms = statistics.median(look.reference_rtt_ms)
        if probe_ms > SLOWER_FACTOR * ref_ms + SLOWER_MARGIN_MS:
            out.append(
                Problem(
                    where,
                    f"probes of {path} answer in {probe_ms:.0f} ms, {PROBE_PATH[b.engine]} in "
                    f"{ref_ms:.0f} ms: {path} makes the engine work, so its RTT includes the "
                    "engine's queue",
                    "set probes.path to a path the engine answers without work (empty: the "
                    f"engine's own, {PROBE_PATH[b.engine]})",
                )
            )


def queue_aspect(look: BackendLook, cfg: Config, out: Verdict, where: str) -> Aspect:
    """The backend's queue: from the engine's /metrics, or the router's own estimate."""
    b, key = look.backend, f"backends[{look.index}]"
    own = "the router's own estimate"
    if cfg.probes.metrics_interval_s <= 0:
        return Aspect(False, f"{own} (probes.metrics_interval_s is 0)")
    if look.unreachable:
        return Aspect(False, f"{own} (the engine does not answer)")
    if look.metrics_missing:
        fix = (
            "start SGLang with --enable-metrics (or set probes.metrics_interval_s: 0)"
            if b.engine == EngineKind.SGLANG
            else f"vLLM always serves /metrics: check {key}.engine, and that a proxy in front "
            "of the engine passes /metrics"
        )
        out.problems.append(Problem(where, f"http://{b.address}/metrics answers 404", fix))
        return Aspect(False, f"{own} (no /metrics)")
    if look.metrics is None:
        out.problems.append(
            Problem(
                where,
                f"http://{b.address}/metrics: {look.metrics_error}",
                f"let the engine's /metrics answer the router at {key}.address (a proxy in "
                "front must pass it), or set probes.metrics_interval_s: 0",
            )
        )
        return Aspect(False, f"{own} (/metrics: {look.metrics_error})")
    report = look.metrics
    if report.waiting is None or report.running is None:
        out.problems.append(
            Problem(
                where,
                f"its /metrics has no {' or '.join(WAITING)} and {' or '.join(RUNNING)}",
                f"point {key}.address at the engine itself (an SGLang or vLLM /metrics)",
            )
        )
        return Aspect(False, f"{own} (/metrics lacks the queue gauges)")
    if report.kv_capacity_tokens is None and not b.kv_capacity_tokens:
        out.notes.append(
            f"{where}: its /metrics does not report its KV pool: the prefix index is sized to "
            f"engine profile {b.engine_profile}'s; set {key}.kv_capacity_tokens to the engine's"
        )
    return Aspect(
        True,
        f"the engine's /metrics (waiting {report.waiting:g}, running {report.running:g}) "
        "beside the router's own count",
    )


def _kv_fix(look: BackendLook, endpoint: str, replay: bool) -> str:
    b, key = look.backend, f"backends[{look.index}].kv_events"
    port = split_tcp_endpoint(endpoint, key)[1]
    if replay:
        return (
            f'start the engine with "replay_endpoint": "tcp://*:{port}" in {KV_FLAG}, or '
            f"correct {key}.replay_endpoint (empty: no replay, a gap resets the state)"
        )
    vllm = '"enable_kv_cache_events": true, ' if b.engine == EngineKind.VLLM else ""
    if b.kv_events.mode is KvEventsMode.BIND:
        return (
            f'start the engine with {KV_FLAG} \'{{{vllm}"publisher": "zmq", "endpoint": '
            f'"tcp://ROUTER_HOST:{port}"}}\' (with mode bind it connects to the router), or '
            f"correct {key}.endpoint"
        )
    return (
        f'start the engine with {KV_FLAG} \'{{{vllm}"publisher": "zmq", "endpoint": '
        f'"tcp://*:{port}"}}\', or correct {key}.endpoint'
    )


def prefix_aspect(look: BackendLook, tokens: Aspect, out: Verdict, where: str) -> Aspect:
    """The backend's prefix state: the engine's KV events (with its own tokens), or the
    router's own estimate."""
    kv = look.backend.kv_events
    own = "the router's own estimate from its decisions"
    if not kv.endpoint:
        return Aspect(False, f"{own} (no kv_events)")
    down = [k for k in look.kv if k.error]
    for k in look.kv:
        rank = f" (DP rank {k.rank})" if kv.dp_ranks > 1 else ""
        if k.error and not look.unreachable:
            out.problems.append(
                Problem(where, f"KV events{rank}: {k.error}", _kv_fix(look, kv.endpoint, False))
            )
        if k.replay_error and not look.unreachable:
            out.problems.append(
                Problem(
                    where,
                    f"KV replay{rank}: {k.replay_error}",
                    _kv_fix(look, kv.replay_endpoint, True),
                )
            )
    if down:
        return Aspect(False, f"{own} (KV events down: {down[0].error})")
    if not tokens.precise:
        return Aspect(False, f"{own} (KV events up, but the tokens are not the engine's)")
    replay = " with replay" if kv.replay_endpoint else ""
    return Aspect(True, f"the engine's KV events ({look.kv[0].address}{replay})")


def tokens_aspect(look: BackendLook, look_all: Look, out: Verdict, where: str) -> Aspect:
    """The backend's tokens: the engine's own (checked against it), or approximated."""
    t, has_kv = look.tokens, bool(look.backend.kv_events.endpoint)
    if t is None:
        return Aspect(False, "not checked: the engine does not answer")
    if t.exact:
        return Aspect(True, t.reason)
    model = look.served[0] if look.served else "the model"
    tokenizer = look_all.tokenizer
    if t.mismatch:
        found = f" (found {tokenizer.where})" if tokenizer.source == "discovered" else ""
        out.problems.append(
            Problem(where, f"{t.reason}{found}", TOKENIZER_FIX.format(model=repr(model)))
        )
    elif has_kv and tokenizer.engine is not None:
        out.problems.append(
            Problem(
                where,
                t.reason,
                "let the engine's tokenize endpoint (vLLM /tokenize, SGLang /v1/tokenize) "
                "answer the router",
            )
        )
    return Aspect(False, t.reason)


def priority_aspect(look: BackendLook, out: Verdict, where: str) -> Aspect:
    """Whether the router will write requests' priorities for this engine; a vLLM that
    refuses one, or an SGLang told `on` whose scheduler ignores it, is a problem."""
    b, key = look.backend, f"backends[{look.index}].priority_scheduling"
    w = priority_writing(b, look.scheduling, look.scheduling_error)
    order = "lower values first" if w.lower_first else "higher values first"
    if not w.writes:
        return Aspect(False, w.reason)
    trial = look.priority_trial
    if b.engine is EngineKind.VLLM and trial is not None:
        status, said = trial
        if status == 400:
            out.problems.append(
                Problem(
                    where,
                    f"the engine answers 400 to a request with a priority ({said.strip()}): it "
                    "does not schedule by priority, so every request of a class other than 0 "
                    "would fail",
                    f"start vLLM with --scheduling-policy priority, or set {key}: off",
                )
            )
            return Aspect(False, "written, and refused by the engine (400)")
        if status == 200:
            # vLLM's v1 engine (0.32 here) takes a priority with or without
            # --scheduling-policy priority and ignores it without: a 200 proves nothing more.
            out.notes.append(
                f"{where}: the engine took a request with a priority; vLLM (v1) also takes "
                "one when it does not schedule by priority, so make sure it runs with "
                "--scheduling-policy priority"
            )
            return Aspect(True, f"{order}: the engine took a request with a priority")
        shown = f"HTTP {status}" if status else said
        out.notes.append(f"{where}: the request with a priority was not answered ({shown})")
    if (
        b.engine is EngineKind.SGLANG
        and look.scheduling is not None
        and not look.scheduling.priority
    ):
        out.problems.append(
            Problem(
                where,
                f"{key} is on, its /server_info says {ENABLE_KEY} false: the engine ignores "
                "the priority the router writes",
                f"start SGLang with --enable-priority-scheduling, or set {key}: auto",
            )
        )
    return Aspect(True, w.reason)
