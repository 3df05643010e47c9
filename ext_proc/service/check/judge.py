"""What a look at the fleet (probes.py) means for the router, judged as the router will
read each backend: its prefix state from the engine's KV events or the router's own
estimate, its tokens the engine's or approximated, its queue from the engine's /metrics or
estimated; and every problem, each with a fix that names the key or flag to change.
Pure: a look in, a verdict out.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from ext_proc.config.kv_endpoints import split_tcp_endpoint
from ext_proc.config.schema import PROBE_PATH, Config
from ext_proc.feeds.engine_metrics import RUNNING, WAITING
from ext_proc.feeds.server_info import ENABLE_KEY, priority_writing
from ext_proc.service.check.probes import BackendLook, Look
from ext_proc.service.loops.probe import SLOWER_FACTOR, SLOWER_MARGIN_MS
from ext_proc.vocab.backend import EngineKind, KvEventsMode


@dataclass(frozen=True)
class Problem:
    """Something that will not work as configured: where (a backend, or the fleet), what,
    and the fix, naming the config key or the engine's flag to change."""

    where: str
    what: str
    fix: str

    def line(self) -> str:
        return f"{self.where}: {self.what}. Fix: {self.fix}"


@dataclass(frozen=True)
class Aspect:
    """One thing the router reads of a backend: precise (the engine's own) or approximate
    (the router's estimate), and from where or why."""

    precise: bool
    how: str


@dataclass
class BackendVerdict:
    """One backend as the router will see it."""

    id: str
    address: str
    engine: str
    reachable: bool
    rtt_ms: float | None
    models: list[str]
    prefix: Aspect
    tokens: Aspect
    queue: Aspect
    # Whether requests' priorities are written for its engine's scheduler ("precise":
    # written), and why.
    priority: Aspect


@dataclass
class ModelVerdict:
    """One served model: the backends that serve it, and on which of them each aspect is
    precise."""

    name: str
    backends: list[str]
    prefix_precise: list[str]
    tokens_exact: list[str]
    queue_from_engine: list[str]


@dataclass
class Verdict:
    """The whole check: the tokenizer, each backend and model, the problems (each one is
    an exit status 1) and the notes (approximations chosen by the config, no problem)."""

    tokenizer: str
    backends: list[BackendVerdict] = field(default_factory=list)
    models: list[ModelVerdict] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0


KV_FLAG = "--kv-events-config"
TOKENIZER_FIX = (
    "set tokenizer.path (and tokenizer.chat_template) to the files {model} is served with"
)


def _rtt(look: BackendLook, cfg: Config, out: list[Problem], where: str) -> None:
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


def _queue(look: BackendLook, cfg: Config, out: Verdict, where: str) -> Aspect:
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


def _prefix(look: BackendLook, tokens: Aspect, out: Verdict, where: str) -> Aspect:
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


def _tokens(look: BackendLook, look_all: Look, out: Verdict, where: str) -> Aspect:
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


def _priority(look: BackendLook, out: Verdict, where: str) -> Aspect:
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


def judge_backend(look: BackendLook, fleet: Look, cfg: Config, out: Verdict) -> BackendVerdict:
    b, key = look.backend, f"backends[{look.index}]"
    where = f"backend {b.id}"
    if look.unreachable and not look.rtt_ms:
        out.problems.append(
            Problem(
                where,
                f"http://{b.address}/v1/models: {look.unreachable}",
                f"start its engine, or correct {key}.address (its host:port as the router and "
                "Envoy reach it)",
            )
        )
    elif look.models_error and (cfg.probes.models_interval_s > 0 or b.kv_events.endpoint):
        out.problems.append(
            Problem(
                where,
                f"/v1/models: {look.models_error}",
                f"let the engine's /v1/models answer the router (it reads what each engine "
                f"serves there), or set probes.models_interval_s: 0 and list {key}.models",
            )
        )
    elif look.models_error:
        out.notes.append(f"{where}: /v1/models: {look.models_error} (the router does not read it)")
    if look.models is not None and b.models:
        missing = [m for m in b.models if not look.models.serves(m)]
        if missing:
            out.problems.append(
                Problem(
                    where,
                    f"{key}.models lists {', '.join(map(repr, missing))}, its engine serves "
                    f"{', '.join(map(repr, sorted(look.models.names)))}",
                    f"start its engine serving {missing[0]!r} (--served-model-name), or correct "
                    f"{key}.models",
                )
            )
    _rtt(look, cfg, out.problems, where)
    tokens = _tokens(look, fleet, out, where)
    models = look.models.restricted_to(b.models) if look.models and b.models else look.models
    return BackendVerdict(
        b.id,
        b.address,
        str(b.engine),
        not look.unreachable,
        round(statistics.median(look.rtt_ms), 2) if look.rtt_ms else None,
        sorted(models.names) if models is not None else [],
        _prefix(look, tokens, out, where),
        tokens,
        _queue(look, cfg, out, where),
        _priority(look, out, where),
    )


def _fleet_models(cfg: Config, fleet: Look, out: Verdict) -> None:
    """Models the config names that no backend serves; with none named, a backend that
    serves other models than the rest of the fleet."""
    answered = [look for look in fleet.backends if look.models is not None]
    if not answered:
        return
    served = {v.id: set(v.models) for v in out.backends}
    for j, alias in enumerate(cfg.models):
        for k, share in enumerate(alias.served):
            if not any(share.model in names for names in served.values()):
                out.problems.append(
                    Problem(
                        "fleet",
                        f"models[{j}] ({alias.name!r}) sends requests to {share.model!r}, which "
                        "no backend serves",
                        f"serve {share.model!r} on a backend, or correct "
                        f"models[{j}].served[{k}].model",
                    )
                )
    if cfg.models or any(b.models for b in cfg.backends):
        return
    bases = {look.backend.id: look.models.base for look in answered if look.models}
    counts = Counter(bases.values()).most_common()
    if len(counts) < 2:
        return
    if counts[0][1] > counts[1][1]:
        usual = counts[0][0]
        for backend, base in bases.items():
            if base != usual:
                out.problems.append(
                    Problem(
                        f"backend {backend}",
                        f"serves {', '.join(map(repr, sorted(base)))}, the other backends "
                        f"{', '.join(map(repr, sorted(usual)))}",
                        f"start its engine with {sorted(usual)[0]!r}, or, for a fleet of "
                        "several models, list each backend's in backends[].models",
                    )
                )
        return
    said = "; ".join(f"{b}: {', '.join(sorted(m))}" for b, m in sorted(bases.items()))
    out.problems.append(
        Problem(
            "fleet",
            f"the backends serve different models ({said})",
            "start every engine with the same model, or, for a fleet of several models, list "
            "each backend's in backends[].models",
        )
    )


def _per_model(out: Verdict) -> list[ModelVerdict]:
    names = sorted({m for v in out.backends for m in v.models})
    verdicts = []
    for name in names:
        on = [v for v in out.backends if name in v.models]
        verdicts.append(
            ModelVerdict(
                name,
                [v.id for v in on],
                [v.id for v in on if v.prefix.precise],
                [v.id for v in on if v.tokens.precise],
                [v.id for v in on if v.queue.precise],
            )
        )
    return verdicts


def judge(cfg: Config, fleet: Look) -> Verdict:
    t = fleet.tokenizer
    if t.source == "config":
        said = f"configured: {t.where}"
    elif t.source == "discovered":
        said = f"found {t.where}"
    else:
        said = f"none: 4 bytes per token ({t.not_found})"
    out = Verdict(said)
    for look in fleet.backends:
        out.backends.append(judge_backend(look, fleet, cfg, out))
    _fleet_models(cfg, fleet, out)
    out.models = _per_model(out)
    with_kv = [look for look in fleet.backends if look.backend.kv_events.endpoint]
    if t.engine is None and any(not look.unreachable for look in with_kv):
        served = next((look.served[0] for look in with_kv if look.served), "")
        model = f"the tokenizer.json {served!r} is served with" if served else "its tokenizer.json"
        out.problems.append(
            Problem(
                "tokenizer",
                f"the KV events of {', '.join(look.backend.id for look in with_kv)} need the "
                f"engine's tokens, and no tokenizer is at hand ({t.not_found})",
                f"set tokenizer.path to {model} (and tokenizer.chat_template unless the "
                "tokenizer_config.json beside it carries the template)",
            )
        )
    if t.engine is None and not with_kv:
        out.notes.append(
            "tokens are approximated (4 bytes per token): set tokenizer.path to the served "
            "model's tokenizer.json for exact counts"
        )
    if not any(b.kv_events.endpoint for b in cfg.backends):
        out.notes.append(
            "prefix state is the router's own estimate: give backends[].kv_events for the "
            "engines' own (docs/configuration.md)"
        )
    return out
