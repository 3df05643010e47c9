"""The rival routers' configurations that `gorgo bench peers` and tests/peers put in front of
the emulated fleet: which tool, which policy, which extra flags and why, and the header
that carries a session id. `argv` builds a front's whole command line.

Every flag was checked against ``--help`` of the pinned versions (emulator/rivals/install.py:
smg 1.13.0 ``smg launch --help``, vllm-router 0.1.17 ``vllm-router --help``); what each
policy does is in ../shared/peer-routers.md and docs.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulator.rivals.install import DEFAULT_VENV

SMG, VLLM_ROUTER = "smg", "vllm-router"
# The front that is gorgo itself (Envoy + the router): `gorgo bench peers` starts it, not
# this module.
GORGO = "gorgo"
# Both tools poll a new worker every 30 s by default until it is healthy: 1 s gets them
# routing within a second or two of the fleet being up.
STARTUP_CHECK_INTERVAL_S = 1
# SMG's default load poll is 10 s; least_load is built on the polled loads, so the bench
# gives it a 2 s poll (../shared/peer-routers.md section 5, configuration 2).
LEAST_LOAD_POLL_S = 2


@dataclass(frozen=True)
class RivalFront:
    """One rival router configuration.

    ``args`` are the flags beyond the common ones `argv` adds; a ``{name}`` in them is an
    engine fact `argv` fills from its keyword arguments (e.g. ``{default_throughput_tok_s}``).
    ``session_header`` is the header the client must send the session id in (None: the
    policy reads none); ``reason`` says in one line why these flags, for docs. A P/D front
    (``pd_protocol``) is given prefill and decode workers (`PdWorkers`) instead of worker
    URLs; its ``policy`` is each leg's."""

    name: str
    tool: str
    policy: str
    args: tuple[str, ...]
    session_header: str | None
    reason: str
    # The P/D protocols a disaggregated front speaks, its usual one first ("sglang": the
    # bootstrap fields in both bodies; "vllm": NIXL's two steps); () for an aggregated one.
    pd_protocols: tuple[str, ...] = ()

    @property
    def pd_protocol(self) -> str | None:
        """Its usual P/D protocol (None: an aggregated front)."""
        return self.pd_protocols[0] if self.pd_protocols else None

    def facts(self) -> tuple[str, ...]:
        """The engine facts ``args`` needs, in order of first use."""
        names: list[str] = []
        for arg in self.args:
            for _text, field, _spec, _conv in string.Formatter().parse(arg):
                if field and field not in names:
                    names.append(field)
        return tuple(names)


def _front(
    tool: str, policy: str, reason: str, args: Sequence[str] = (), session: str | None = None
) -> RivalFront:
    return RivalFront(f"{tool}:{policy}", tool, policy, tuple(args), session, reason)


_ALL = (
    _front(
        SMG,
        "cache_aware",
        "SMG's default policy with its defaults (overload veto on): what SGLang users get "
        "out of the box.",
    ),
    _front(
        SMG,
        "least_load",
        "SMG's expected-wait policy, the nearest rival to a latency cost: its fallback "
        "throughput from the engine profile and a 2 s load poll (default 10 s).",
        (
            "--least-load-default-throughput",
            "{default_throughput_tok_s}",
            "--load-monitor-interval",
            str(LEAST_LOAD_POLL_S),
        ),
    ),
    _front(
        SMG,
        "prefix_hash",
        "SMG's prefix ring (first 256 tokens or 1024 characters) with its load walk: cheap "
        "affinity for shared system prompts.",
    ),
    _front(
        SMG,
        "round_robin",
        "The load-blind floor: round robin with the overload veto off, so nothing but the "
        "rotation decides.",
        ("--disable-worker-overload-protection",),
    ),
    _front(
        SMG,
        "power_of_two",
        "SMG's two random choices compared by expected wait (its default metric).",
    ),
    _front(
        SMG,
        "consistent_hashing",
        "Session affinity with no load feedback (the paper's baseline): the session in "
        "X-SMG-Routing-Key, and no Authorization header, which would pin all traffic.",
        session="x-smg-routing-key",
    ),
    _front(
        VLLM_ROUTER,
        "cache_aware",
        "vllm-router's default: the classic SGLang-router rule (imbalance switch, "
        "character tree) many forks still ship.",
    ),
    _front(
        VLLM_ROUTER,
        "sticky_least_loaded",
        "Multi-turn sessions kept on one worker, new sessions to the worker with fewest: "
        "the session in x-session-id and no x-request-id (which would make every request "
        "a new session).",
        session="x-session-id",
    ),
    _front(
        VLLM_ROUTER,
        "power_of_two",
        "vllm-router's two random choices by in-flight count (its /get_load reading finds "
        "no top-level load on SGLang).",
    ),
)

# The P/D fronts: each tool in its P/D mode on the protocol it speaks, each leg picked by
# its own policy instance with no regard to the other (../shared/peer-routers.md section 6;
# /work/pd-rules.md: SMG's pd_router.rs select_pd_pair, vllm-router's vllm_pd_router.rs).
PD_POLICY = "cache_aware"  # both tools' default --policy, which an unset leg falls back to
_PD = (
    RivalFront(
        "smg:pd",
        SMG,
        PD_POLICY,
        (
            "--pd-disaggregation",
            "--prefill-policy",
            PD_POLICY,
            "--decode-policy",
            PD_POLICY,
        ),
        None,
        "SMG's P/D router as it ships: cache_aware on each leg, picked independently (no "
        "transfer cost, no topology), SGLang's bootstrap fields in both bodies at once "
        "(its vLLM path hands no KV over to --prefill/--decode URLs).",
        # SMG 1.13 runs vLLM workers' legs in sequence but adds kv_transfer_params only
        # for a worker whose metadata names its connector (routers/common/kv_transfer.rs
        # kv_connector_mode: from the smg.ai/kv-connector pod annotation); a --prefill URL
        # has none, so the decode recomputes the prompt (seen live on the vLLM twins).
        ("sglang",),
    ),
    RivalFront(
        "vllm-router:pd",
        VLLM_ROUTER,
        PD_POLICY,
        (
            "--vllm-pd-disaggregation",
            "--prefill-policy",
            PD_POLICY,
            "--decode-policy",
            PD_POLICY,
        ),
        None,
        "vllm-router's vLLM P/D mode as it ships: cache_aware on each leg over the whole "
        "serialized body, picked independently, then NIXL's two steps (the one-token "
        "prefill, its kv_transfer_params into the decode).",
        ("vllm",),
    ),
)
FRONTS: dict[str, RivalFront] = {f.name: f for f in (*_ALL, *_PD)}
PD_FRONTS: tuple[str, ...] = tuple(f.name for f in _PD)

# The bench's default set, gorgo first; each name is its JSON key in the bench's output.
DEFAULT_FRONTS: tuple[str, ...] = (
    GORGO,
    "smg:cache_aware",
    "smg:least_load",
    "smg:prefix_hash",
    "vllm-router:cache_aware",
    "vllm-router:sticky_least_loaded",
    "smg:round_robin",
)


def front(name: str) -> RivalFront:
    """The rival front called ``name``, or a ValueError listing the known ones."""
    try:
        return FRONTS[name]
    except KeyError:
        raise ValueError(
            f"unknown rival front {name!r}: expected one of {', '.join(FRONTS)}"
        ) from None


@dataclass(frozen=True)
class PdWorkers:
    """A P/D front's workers: each prefill's URL with the bootstrap port a router names
    in SGLang's protocol (None: none, vLLM's), and each decode's URL."""

    prefills: tuple[tuple[str, int | None], ...]
    decodes: tuple[str, ...]

    def flags(self) -> list[str]:
        """``--prefill URL [PORT]`` per prefill, ``--decode URL`` per decode (both tools'
        syntax)."""
        out: list[str] = []
        for url, port in self.prefills:
            out += ["--prefill", url, *([str(port)] if port is not None else [])]
        for url in self.decodes:
            out += ["--decode", url]
        return out

    def __len__(self) -> int:
        return len(self.prefills) + len(self.decodes)


def _fill(f: RivalFront, engine_facts: Mapping[str, Any]) -> list[str]:
    missing = [k for k in f.facts() if engine_facts.get(k) is None]
    if missing:
        raise ValueError(f"rival front {f.name} needs {', '.join(missing)} (an engine fact)")
    return [arg.format_map(engine_facts) for arg in f.args]


def argv(
    front: RivalFront,
    worker_urls: Sequence[str],
    model: str,
    port: int,
    metrics_port: int,
    *,
    venv: Path = DEFAULT_VENV,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    pd_workers: PdWorkers | None = None,
    **engine_facts: Any,
) -> list[str]:
    """The whole command line of ``front`` routing to ``worker_urls`` (a P/D front: to
    ``pd_workers``, with ``worker_urls`` empty) on ``host:port``, its
    Prometheus page on ``host:metrics_port`` (both tools default to 30000 and 29000, so
    each needs its own).

    ``model`` is the name clients send. Engine facts: ``served_model`` (the name the
    engines serve; when it differs, SMG gets ``--model-alias model=served_model``, as it
    refuses a name no worker serves) and whatever the front's ``args`` name (e.g.
    ``default_throughput_tok_s`` for smg:least_load: `default_throughput_tok_s`).
    ``extra_args`` go last (a later flag wins in both tools' parsers), for tests and
    one-off runs, not for the bench's configurations."""
    if front.pd_protocol is not None:
        if pd_workers is None or not pd_workers.prefills or not pd_workers.decodes:
            raise ValueError(f"rival front {front.name}: prefill and decode workers needed")
        if worker_urls:
            raise ValueError(f"rival front {front.name}: P/D workers, not worker URLs")
    elif pd_workers is not None:
        raise ValueError(f"rival front {front.name} is not a P/D front: no P/D workers")
    elif not worker_urls:
        raise ValueError(f"rival front {front.name}: no worker URLs")
    for p, what in ((port, "port"), (metrics_port, "metrics_port")):
        if not 0 < p < 65536:
            raise ValueError(f"rival front {front.name}: {what} {p} is not a TCP port")
    if port == metrics_port:
        raise ValueError(f"rival front {front.name}: port and metrics_port are both {port}")
    extra = _fill(front, engine_facts)
    binary = str(venv / "bin" / front.tool)
    common = [
        "--host",
        host,
        "--port",
        str(port),
        *(pd_workers.flags() if pd_workers is not None else ["--worker-urls", *worker_urls]),
        "--policy",
        front.policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-check-interval",
        str(STARTUP_CHECK_INTERVAL_S),
    ]
    if front.tool == SMG:
        served = engine_facts.get("served_model") or model
        alias = ["--model-alias", f"{model}={served}"] if served != model else []
        return [binary, "launch", *common, *alias, *extra, *extra_args]
    if front.tool == VLLM_ROUTER:
        return [binary, *common, *extra, *extra_args]
    raise ValueError(f"rival front {front.name}: unknown tool {front.tool!r}")


def default_throughput_tok_s(
    profile: Any, batch: int | None = None, context_tokens: int = 2048
) -> float:
    """A decode throughput (generated tokens/s) for SMG's ``--least-load-default-throughput``
    from an engine profile (ext_proc/estimate/profile.py EngineProfile): ``batch`` requests
    (default: its max_running_requests) decoding one token each per step of
    ``profile.decode_ms(batch, batch * context_tokens)``. SMG divides queued work by it
    when an engine reports no gen_throughput."""
    b = batch if batch is not None else int(profile.max_running_requests)
    if b < 1:
        raise ValueError(f"batch must be >= 1, got {b}")
    step_ms = float(profile.decode_ms(b, b * context_tokens))
    if step_ms <= 0:
        raise ValueError(f"profile {profile.name}: decode step of {step_ms} ms")
    return round(b / step_ms * 1e3, 1)
