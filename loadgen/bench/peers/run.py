"""`gorgo bench peers`: gorgo against the routers users deploy instead, live, on the same
emulated fleet.

For each front door in turn (gorgo: Envoy + the router with shipped defaults; the rivals:
SMG or vllm-router with the flags of emulator/rivals/fronts.py) a fresh fleet starts (three
emulated SGLang engines behind their WAN links: cold caches for all), the same trace window
is replayed through it open loop (loadgen/replay), and the fleet stops. `--repeat N` runs
the set N times, the order reversed every other round so drift hits all alike. Per front:
TTFT and E2E p50/p95/p99, failures, the engines' cache hit rate (the usage reports), the
CPU its processes spent per request (gorgo's: the router and its Envoy) and their peak
RSS, and what shows that it routed on the engines' loads (SMG's polls of /v1/loads and its
decisions scored on them; vllm-router's policies read none). `--out` writes
`{"fronts": {NAME: SUMMARY}}` (the shared result schema, the repeats' median, their
spread), and a plot beside it.

`--pd` runs each front on a fresh P/D fleet instead (emulator/stack/pd.py: a prefill and a
decode twin per region, the router given both roles, KV links between regions): gorgo as
its Envoy front door, the rivals in their P/D modes (emulator/rivals/fronts.py PD_FRONTS)
pointed at the same twins, each on the twins of the one protocol it speaks; gorgo runs on
`--pd-protocol`, or, without it, once on each protocol a rival speaks, so each rival is
compared with gorgo on its own protocol (docs/results.md, "Against the routers users
deploy"). The twins' /stats tell where each front's legs went: prefill legs per prefill
twin, decodes per decode twin, and the pairs (which prefill's KV each decode received).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from emulator.rivals.fronts import (
    DEFAULT_FRONTS,
    GORGO,
    PD_FRONTS,
    RivalFront,
    default_throughput_tok_s,
)
from emulator.rivals.fronts import front as rival_front
from emulator.rivals.process import RivalProcess, smg_decisions, start_rival
from emulator.stack.pd import DEFAULT_KV_LINK_GBPS, PROTOCOLS, PdSettings
from emulator.stack.ports import free_ports
from emulator.stack.settings import StackPorts, StackSettings, regions_for_profile
from emulator.stack.stack import Stack
from emulator.wan import RTT_PROFILES
from ext_proc.common.names import HEADER_SESSION
from ext_proc.config.dump import config_as_dict
from ext_proc.config.load import config_from_dict
from ext_proc.estimate.profile import load_profile
from loadgen.bench.peers.classes import (
    SMG_PRIORITY_ARGS,
    class_headers,
    class_report,
    classed,
    scheduler_metrics,
)
from loadgen.bench.peers.pd import legs_line, pd_legs, pd_workers
from loadgen.bench.peers.summary import FrontRun, failures, median_summary, pd_ratios, ratios
from loadgen.replay.loop import HeadersFor, replay
from loadgen.results import summarize, table
from loadgen.sim.classes import Classes, class_summary, load_classes
from loadgen.traces.load import load_trace
from loadgen.traces.request import TraceRequest
from loadgen.traces.windows import scaled, window

# The same cap as `gorgo replay`'s open protocol would allow: the window's arrivals decide.
MAX_CONCURRENCY = 512
# The model name the replay's requests carry (loadgen/replay/requests.py).
REPLAY_MODEL = "default"


@dataclass(frozen=True)
class RivalsOptions:
    trace: str
    start_s: float = 0.0
    duration_s: float = 60.0
    time_scale: float = 3.0
    repeat: int = 1
    rtt_profile: str = "network"
    fronts: tuple[str, ...] = DEFAULT_FRONTS
    out: str | None = None
    api: str = "chat"
    seed: int = 0
    # Request classes (loadgen/sim/classes.py's file): gorgo runs with flow control and
    # these objectives, SMG with its priority scheduler, each told a request's class its
    # own way (CLASS_HEADERS); the summary adds per-class SLO attainment and goodput.
    classes: str | None = None
    # P/D (module docstring): each front on a fresh P/D fleet whose KV links carry
    # kv_link_gbps (None: the stack's default); gorgo on pd_protocol, or (None) on each
    # protocol a rival in `fronts` speaks.
    pd: bool = False
    pd_protocol: str | None = None
    kv_link_gbps: float | None = None

    def problems(self) -> list[str]:
        out = []
        for name in self.fronts:
            if name != GORGO:
                try:
                    f = rival_front(name)
                except ValueError as e:
                    out.append(f"--fronts: {e}")
                    continue
                out += self._pd_problems(f)
        if not self.pd and (self.pd_protocol is not None or self.kv_link_gbps is not None):
            out.append("--pd-protocol and --kv-link-gbps go with --pd")
        if self.pd_protocol is not None and self.pd_protocol not in PROTOCOLS:
            out.append(f"--pd-protocol must be one of {', '.join(PROTOCOLS)}")
        if self.kv_link_gbps is not None and not self.kv_link_gbps >= 0:
            out.append(f"--kv-link-gbps must be >= 0, got {self.kv_link_gbps}")
        if self.pd and self.classes is not None:
            out.append("--classes goes without --pd (no P/D front has classes here)")
        if len(set(self.fronts)) != len(self.fronts):
            out.append(f"--fronts names one twice: {','.join(self.fronts)}")
        if self.rtt_profile not in RTT_PROFILES:
            out.append(f"--rtt-profile must be one of {', '.join(RTT_PROFILES)}")
        if self.repeat < 1:
            out.append(f"--repeat must be >= 1, got {self.repeat}")
        if not self.time_scale > 0:
            out.append(f"--time-scale must be > 0, got {self.time_scale}")
        if not self.duration_s > 0:
            out.append(f"--duration-s must be > 0, got {self.duration_s}")
        if self.classes is not None:
            try:
                load_classes(self.classes)
            except ValueError as e:
                out.append(f"--classes: {e}")
        return out

    def _pd_problems(self, f: RivalFront) -> list[str]:
        """A rival front against --pd and --pd-protocol: a P/D front needs --pd and runs
        on its own protocol's twins; an aggregated one does not go with --pd."""
        if not self.pd:
            if f.pd_protocol is not None:
                return [f"--fronts: {f.name} is a P/D front: add --pd"]
            return []
        if f.pd_protocol is None:
            return [
                f"--fronts: {f.name} routes aggregated engines; with --pd the fronts are "
                f"{', '.join((GORGO, *PD_FRONTS))}"
            ]
        if self.pd_protocol is not None and self.pd_protocol not in f.pd_protocols:
            return [
                f"--fronts: {f.name} speaks {' and '.join(f.pd_protocols)}'s P/D protocol "
                f"only, not --pd-protocol {self.pd_protocol}"
            ]
        return []

    def entries(self) -> list[Entry]:
        """What runs, in --fronts order: each rival once (a P/D one on --pd-protocol, else on
        its usual protocol), gorgo once, or with --pd and no --pd-protocol once per protocol
        the rivals run on (named gorgo@PROTOCOL when more than one)."""
        if not self.pd:
            return [Entry(n, n, None) for n in self.fronts]
        theirs = {
            n: self.pd_protocol or rival_front(n).pd_protocol for n in self.fronts if n != GORGO
        }
        spoken = sorted({p for p in theirs.values() if p})
        ours = [self.pd_protocol] if self.pd_protocol else spoken or [PdSettings().protocol]
        out: list[Entry] = []
        for n in self.fronts:
            if n != GORGO:
                out.append(Entry(n, n, theirs[n]))
                continue
            out += [Entry(n if len(ours) == 1 else f"{n}@{p}", n, p) for p in ours]
        return out


@dataclass(frozen=True)
class Entry:
    """One front door's runs: its name in the output, the front (gorgo or a rival's
    name) and the P/D protocol its fleet's twins speak (None: an aggregated fleet)."""

    key: str
    front: str
    protocol: str | None


def order(fronts: Sequence[str], repeat: int) -> list[list[str]]:
    """The fronts of each round: as given, then reversed, and so on (drift hits all)."""
    return [list(fronts) if r % 2 == 0 else list(reversed(fronts)) for r in range(repeat)]


class Sampler:
    """Samples the RSS of a set of processes (and their children) every `every_s`."""

    def __init__(self, pids: Callable[[], Sequence[int]], every_s: float = 1.0) -> None:
        self.pids = pids
        self.every_s = every_s
        self.peak_mb = 0.0

    def rss_mb(self) -> float:
        total = 0
        for pid in self.pids():
            try:
                p = psutil.Process(pid)
                total += p.memory_info().rss + sum(
                    c.memory_info().rss for c in p.children(recursive=True)
                )
            except psutil.Error:
                continue
        return total / 2**20

    async def run(self) -> None:
        while True:
            self.peak_mb = max(self.peak_mb, self.rss_mb())
            await asyncio.sleep(self.every_s)


def cpu_s(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


def _get_json(url: str) -> Any:
    return json.loads(_get_text(url))


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def engine_stats(stack: Stack) -> list[dict[str, Any]]:
    """Each engine's /stats: with P/D, the decode twins' (on the engines' ports) then the
    prefill twins'."""
    n = len(stack.settings.regions)
    urls = [stack.engine_url(i) for i in range(n)]
    if stack.settings.pd is not None:
        pd = stack.settings.pd_layout()
        urls += [f"http://127.0.0.1:{pd.prefill(i)}" for i in range(n)]
    return [_get_json(f"{url}/stats") for url in urls]


def load_polls(stats: Sequence[Mapping[str, Any]]) -> int:
    """GETs of an engine's load report (SGLang /v1/loads, /get_load, /metrics) over the fleet."""
    return sum(
        n
        for s in stats
        for path, n in s.get("gets", {}).items()
        if path.split("?")[0] in ("/v1/loads", "/get_load", "/metrics")
    )


def _stack(opts: RivalsOptions, classes: Classes | None, protocol: str | None = None) -> Stack:
    """A fresh fleet: three emulated SGLang engines, or (`protocol`) a P/D fleet whose
    twins speak it. vLLM's twins, as vLLM, refuse a model they do not serve: they serve
    the name the replay asks for (vllm-router has no alias)."""
    regions = regions_for_profile(opts.rtt_profile)
    pd = None
    if protocol is not None:
        gbps = DEFAULT_KV_LINK_GBPS if opts.kv_link_gbps is None else opts.kv_link_gbps
        pd = PdSettings(protocol=protocol, kv_link_gbps=gbps)
    stack = Stack(
        StackSettings(
            regions=regions,
            ports=StackPorts.ephemeral(3),
            rtt_profile=opts.rtt_profile,
            seed=opts.seed,
            keep_logs=False,
            flavor=protocol or "sglang",
            pd=pd,
            engine_models={r.id: REPLAY_MODEL for r in regions} if protocol == "vllm" else {},
        )
    )
    if classes is not None:  # gorgo's gateway queue with the classes' objectives
        raw = config_as_dict(stack.config)
        flow = dict(raw.get("flow_control") or {})
        flow.update(enabled=True, objectives=list(classes.objectives))
        raw["flow_control"] = flow
        stack.config = config_from_dict(raw)
    return stack


def _merge(*fns: Callable[[TraceRequest], Mapping[str, str]] | None) -> HeadersFor | None:
    got = [fn for fn in fns if fn is not None]
    if not got:
        return None
    return lambda r: {k: v for fn in got for k, v in fn(r).items()}


def session_headers(f: RivalFront | None) -> Callable[[TraceRequest], Mapping[str, str]] | None:
    """The front's session header, when it reads one the replay does not send."""
    if f is None or f.session_header in (None, HEADER_SESSION):
        return None
    name = f.session_header
    return lambda r: {name: r.session}


def _served_model(stack: Stack) -> str:
    return str(_get_json(f"{stack.engine_url(0)}/v1/models")["data"][0]["id"])


async def _run_front(
    entry: Entry,
    stack: Stack,
    trace: Sequence[TraceRequest],
    opts: RivalsOptions,
    logs: Path,
    classes: Classes | None,
) -> FrontRun:
    rival: RivalProcess | None = None
    name = entry.key
    f = None if entry.front == GORGO else rival_front(entry.front)
    if f is None:
        url = stack.front_door_url
        pids = [stack.procs[n].pid for n in ("gorgo-serve", "envoy")]
    else:
        port, metrics_port = free_ports(2)
        facts: dict[str, Any] = {"served_model": _served_model(stack)}
        if "default_throughput_tok_s" in f.facts():
            facts["default_throughput_tok_s"] = default_throughput_tok_s(load_profile())
        smg_classes = classes is not None and f.tool == "smg"
        pd = pd_workers(stack) if f.pd_protocol is not None else None
        rival = await start_rival(
            f,
            [] if pd else [stack.backend_url(i) for i in range(len(stack.settings.regions))],
            REPLAY_MODEL,
            port=port,
            metrics_port=metrics_port,
            log_path=logs / f"{name.replace(':', '-')}.log",
            extra_args=SMG_PRIORITY_ARGS if smg_classes else (),
            pd_workers=pd,
            **facts,
        )
        url, pids = rival.url, [rival.pid]
    try:
        sampler = Sampler(lambda: pids)
        sampling = asyncio.ensure_future(sampler.run())
        cpu0, t0 = cpu_s(pids), time.monotonic()
        run = await replay(
            trace,
            url,
            api=opts.api,
            max_concurrency=MAX_CONCURRENCY,
            progress=sys.stderr,
            label=name,
            headers_for=_merge(
                session_headers(f), class_headers(f, classes) if classes is not None else None
            ),
        )
        cpu1, wall = cpu_s(pids), time.monotonic() - t0
        sampling.cancel()
        stats = engine_stats(stack)
        spread = {s["name"]: int(s["completed_total"]) for s in stats}
        evidence = f"engine load polls {load_polls(stats)}"
        legs = pd_legs(stack, stats) if stack.settings.pd is not None else {}
        if legs:
            evidence += f", {legs_line(legs)}"
        scheduler: dict[str, float] = {}
        if rival is not None and f is not None and f.tool == "smg":
            scored = smg_decisions(rival.log_path)
            evidence += f", SMG decisions scored on engine loads {len(scored)}"
            if classes is not None:
                scheduler = scheduler_metrics(_get_text(rival.metrics_url))
                evidence += f", SMG scheduler series {len(scheduler)}"
        results = run.results if classes is None else classed(run.results, trace, classes)
        return FrontRun(
            name, results, cpu1 - cpu0, sampler.peak_mb, wall, spread, evidence, scheduler, legs
        )
    finally:
        if rival is not None:
            await rival.stop()


def run_round(
    entries: Sequence[Entry],
    trace: Sequence[TraceRequest],
    opts: RivalsOptions,
    logs: Path,
    classes: Classes | None = None,
) -> list[FrontRun]:
    out = []
    for entry in entries:
        name, ours = entry.key, entry.front == GORGO
        stack = _stack(opts, classes if ours else None, entry.protocol)
        fleet = f"{opts.rtt_profile} RTTs" + (
            f", P/D {entry.protocol} twins" if entry.protocol else ""
        )
        print(f"[peers] {name}: fresh fleet ({fleet})...", file=sys.stderr)
        stack.start(front_door=ours)
        try:
            run = asyncio.run(_run_front(entry, stack, trace, opts, logs, classes))
        finally:
            stack.stop()
        s = summarize(run.results)
        failed = Counter(x.error[:120] for x in run.results if x.status != "ok")
        print(
            f"[peers] {name}: {s['ok']}/{s['requests']} ok"
            + (f" (failed: {dict(failed)})" if failed else "")
            + ", TTFT p95 "
            f"{s['ttft_ms']['p95']} ms, E2E p95 {s['e2e_ms']['p95']} ms, {run.evidence}, "
            f"engines {run.spread} ({run.wall_s:.0f} s)",
            file=sys.stderr,
        )
        out.append(run)
    return out


def report(fronts: Mapping[str, Mapping[str, Any]], r: Mapping[str, Any] | None = None) -> str:
    """The tables, and gorgo against the best peer (`r`: those ratios; default `ratios`)."""
    lines = [table([(name, dict(s)) for name, s in fronts.items()])]
    lines.append("")
    lines.append("| front | runs | failed | router CPU ms/request | router peak RSS MiB |")
    lines.append("|---|---|---|---|---|")
    for name, s in fronts.items():
        lines.append(
            f"| {name} | {s['runs']} | {s['errors_total']} / {s['requests_total']} | "
            f"{s['router_cpu_ms_per_request']:.2f} | {s['router_peak_rss_mb']:.0f} |"
        )
    got: Mapping[str, Any] = ratios(fronts) if r is None else r
    by: Mapping[str, Any] = got.get("by_protocol") or {}
    if got:
        lines.append("")
        lines.append(
            f"gorgo against the best peer: p95 TTFT x{got['ttft_ms_p95_vs_best_peer']:.2f}, "
            f"p95 E2E x{got['e2e_ms_p95_vs_best_peer']:.2f}"
            + (" (the larger over the protocols)" if len(by) > 1 else "")
        )
        for p, pr in by.items():
            lines.append(
                f"  on {p}'s twins: p95 TTFT x{pr['ttft_ms_p95_vs_best_peer']:.2f}, "
                f"p95 E2E x{pr['e2e_ms_p95_vs_best_peer']:.2f}"
            )
    return "\n".join(lines)


def plot(fronts: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(fronts)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "e2e_ms", "E2E")):
        for k, q in enumerate(("p50", "p95", "p99")):
            values = [fronts[n][metric][q] / 1e3 for n in names]
            ax.bar([i + (k - 1) * 0.27 for i in range(len(names))], values, 0.27, label=q)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"{title} (s)")
        ax.set_title(f"{title} per front door")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_rivals_bench(opts: RivalsOptions) -> int:
    problems = opts.problems()
    if problems:
        print(f"gorgo bench peers: {'; '.join(problems)}", file=sys.stderr)
        return 2
    trace = scaled(window(load_trace(opts.trace), opts.start_s, opts.duration_s), opts.time_scale)
    if not trace:
        print(f"gorgo bench peers: {opts.trace}: no requests in the window", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="gorgo-bench-peers-"))
    print(
        f"[peers] {len(trace)} requests ({opts.trace}, {opts.start_s:g} s + {opts.duration_s:g} s "
        f"at time_scale {opts.time_scale:g}), fronts {', '.join(opts.fronts)}, "
        f"{opts.repeat} round(s); peer logs in {logs}",
        file=sys.stderr,
    )
    classes = load_classes(opts.classes) if opts.classes else None
    entries = {e.key: e for e in opts.entries()}
    runs: dict[str, list[FrontRun]] = {k: [] for k in entries}
    for keys in order(list(entries), opts.repeat):
        for run in run_round([entries[k] for k in keys], trace, opts, logs, classes):
            runs[run.front].append(run)
    fronts = {n: median_summary(rs) for n, rs in runs.items()}
    for n, rs in runs.items():
        fronts[n]["evidence"] = [r.evidence for r in rs]
        fronts[n]["engines"] = [r.spread for r in rs]
        if opts.pd:
            fronts[n]["pd_protocol"] = entries[n].protocol
            fronts[n]["pd_legs"] = [r.legs for r in rs]
        if classes is not None:
            fronts[n]["classes"] = [class_summary(r.results, classes) for r in rs]
            fronts[n]["smg_scheduler"] = [r.scheduler for r in rs]
    vs = pd_ratios(fronts, {k: e.protocol for k, e in entries.items()}) if opts.pd else None
    print(report(fronts, vs))
    if classes is not None:
        print(class_report(fronts))
    if opts.out:
        out = Path(opts.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "trace": opts.trace,
            "start_s": opts.start_s,
            "duration_s": opts.duration_s,
            "time_scale": opts.time_scale,
            "rtt_profile": opts.rtt_profile,
            "repeat": opts.repeat,
            "requests": len(trace),
            "classes": opts.classes,
            "pd": None
            if not opts.pd
            else {
                "protocol": opts.pd_protocol,
                "kv_link_gbps": DEFAULT_KV_LINK_GBPS
                if opts.kv_link_gbps is None
                else opts.kv_link_gbps,
            },
            "fronts": fronts,
            "gorgo_vs_best_peer": ratios(fronts) if vs is None else vs,
        }
        out.write_text(json.dumps(doc, indent=1))
        plot(fronts, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")
    # With classes, refusals (429: a sheddable request gorgo's queue or SMG's scheduler
    # turned away) are the policy at work, not failures.
    bad = [
        n
        for n, rs in runs.items()
        if failures(rs, classes is not None) > 0.01 * sum(len(r.results) for r in rs)
    ]
    if bad:
        print(f"gorgo bench peers: over 1 % failed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0
