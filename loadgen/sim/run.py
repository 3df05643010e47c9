"""`gorgo simulate`: every policy side by side on a trace, on a virtual clock.

Writes one result file per policy and time_scale (the shared schema), `summary.md` with
the side-by-side table, and figures: the TTFT CDF per policy (per time_scale) and p95
TTFT / p95 E2E against time_scale.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.progress import bar, counter, say
from loadgen.results import RequestResult, summarize, table, write_result
from loadgen.sim.classes import class_summary
from loadgen.sim.figures import convergence_plot, write_figures
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate
from loadgen.traces.request import TraceRequest
from loadgen.traces.stats import stats_line, workload_stats
from loadgen.traces.windows import spread_arrivals, window


def run_simulations(
    trace: Sequence[TraceRequest],
    policies: Sequence[str],
    time_scales: Sequence[float],
    out_dir: Path,
    base: SimSettings,
    label: str = "",
) -> dict[tuple[str, float], dict[str, Any]]:
    """Simulate each (policy, time_scale); write the result files; return their summaries."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries: dict[tuple[str, float], dict[str, Any]] = {}
    with bar(len(time_scales) * len(policies), label or "simulate", unit="run") as runs:
        for ts in time_scales:
            for policy in policies:
                settings = replace(base, policy=policy, time_scale=ts)
                t0 = time.perf_counter()
                with bar(len(trace), f"{policy} ts {ts:g}", unit="req", leave=False) as requests:
                    res = simulate(trace, settings, progress=counter(requests))
                wall_s = time.perf_counter() - t0
                tuner, knobs = res.router.tuner, res.router.pair_tuner
                if tuner is not None:
                    convergence_plot(
                        tuner.state.history,
                        f"{policy}, {base.tune} mode",
                        out_dir / f"tuner-{policy}-ts{ts:g}.png",
                    )
                if knobs is not None and knobs.state.history:
                    convergence_plot(
                        knobs.state.history,
                        f"{policy}, the P/D knobs",
                        out_dir / f"knobs-{policy}-ts{ts:g}.png",
                        knobs.s.names,
                    )
                meta = {
                    "mode": "simulate",
                    "label": label,
                    "policy": policy,
                    "time_scale": ts,
                    "rtt_profile": base.rtt_profile,
                    "engine_profile": base.engine_profile,
                    "fleet": base.fleet.path or None,
                    "router_knows_fleet": base.router_knows_fleet,
                    "router_overrides": base.router,
                    "seed": base.seed,
                    "tune": base.tune,
                    "prefix_state": base.prefix_state,
                    "routers": base.routers,
                    "engine_reports": base.engine_reports,
                    "front_doors": base.front_doors,
                    "share_dispatches": base.share_dispatches,
                    "protocol": base.protocol.meta(),
                    "dropped": res.dropped,
                    "refused": {str(k): v for k, v in res.refused.items()},
                    "final_weights": None
                    if tuner is None
                    else {"rtt": tuner.state.parent[0], "queue": tuner.state.parent[1]},
                    "requests": len(trace),
                    "wall_s": round(wall_s, 2),
                }
                meta["flow_control"] = base.flow_control
                if knobs is not None and base.pd:  # absent without P/D: rows as before
                    meta["final_knobs"] = dict(zip(knobs.s.names, knobs.state.parent, strict=True))
                if base.pd or base.pd_aggregated:  # absent without P/D: rows as before
                    meta["pd"] = {
                        "layout": "pd" if base.pd else "aggregated",
                        "kv_link_gbps": base.kv_link_gbps,
                        "local_kv_link_gbps": base.local_kv_link_gbps,
                        "protocol": base.pd_protocol,
                        **(res.kv.as_json() if res.kv is not None else {}),
                    }
                if base.engine_priority is not None:  # absent when off: rows as before
                    meta["engine_priority"] = {
                        **vars(base.engine_priority),
                        "preempted_by_priority": res.preempted,
                    }
                classed = (
                    class_summary(res.requests, base.classes)
                    if base.flow_control or base.classes is not None
                    else None
                )
                doc = write_result(
                    out_dir / f"{policy}-ts{ts:g}.json", res.requests, meta, res.itl_ms, classed
                )
                summaries[(policy, ts)] = s = doc["summary"]
                if base.front_doors:
                    s["regions"] = by_region(res.requests)
                slip = (
                    ""
                    if base.protocol.max_concurrency is None
                    else f"slip p50/p95 {s['slip_ms']['p50']:.0f}/{s['slip_ms']['p95']:.0f} ms  "
                )
                mape, rho = s["ttft_prediction"]["mape"], s["ttft_prediction"]["rho"]
                e2e_mape = s["e2e_prediction"]["mape"]
                refused = ", ".join(f"{n} x {code}" for code, n in s["refused"].items())
                say(
                    f"  {policy:<16} time_scale {ts:<4g} TTFT p50/p95 {s['ttft_ms']['p50']:.0f}/"
                    f"{s['ttft_ms']['p95']:.0f} ms  E2E p95 {s['e2e_ms']['p95']:.0f} ms  {slip}"
                    f"cache prediction error {prediction_error(res.requests):.2%}  "
                    f"TTFT prediction MAPE {'-' if mape is None else f'{mape:.1%}'}, "
                    f"rank rho {'-' if rho is None else f'{rho:.3f}'}, "
                    f"E2E prediction MAPE {'-' if e2e_mape is None else f'{e2e_mape:.1%}'}  "
                    f"{f'refused {refused}  ' if refused else ''}({wall_s:.1f} s)"
                )
                if classed is not None:
                    classes = "  ".join(
                        f"{name} slo_attained {o['slo_attained']:.3f} ({o['rejected']} rejected)"
                        for name, o in classed["objectives"].items()
                    )
                    say(f"    goodput {classed['goodput']:.3f}  {classes}")
                for region, rs in s.get("regions", {}).items():
                    say(
                        f"    clients in {region:<13} {rs['requests']:>6} requests  TTFT p95 "
                        f"{rs['ttft_ms']['p95']:.0f} ms  E2E p95 {rs['e2e_ms']['p95']:.0f} ms"
                    )
                runs.update()
    return summaries


def _fleet_note(base: SimSettings) -> str:
    if not base.fleet.path:
        return ""
    told = "their true profiles" if base.router_knows_fleet else "the engine profile"
    return f", engines per fleet `{base.fleet.path}` (the router told {told})"


def by_region(requests: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    """The summary of each client region's requests."""
    regions = sorted({r.region for r in requests if r.region})
    return {g: summarize([r for r in requests if r.region == g]) for g in regions}


def prediction_error(requests: Sequence[RequestResult]) -> float:
    """Mean |predicted - engine-reported cached tokens| per request, as a share of its
    prompt: how well the router knows what the engine it chose holds."""
    errors = [
        abs(r.predicted_cached_tokens - r.cached_tokens) / r.input_tokens
        for r in requests
        if r.input_tokens and r.predicted_cached_tokens is not None
    ]
    return sum(errors) / len(errors) if errors else float("nan")


def summary_markdown(
    summaries: dict[tuple[str, float], dict[str, Any]],
    title: str,
    note: str = "",
    slip: bool = False,
) -> str:
    scales = sorted({ts for _, ts in summaries})
    parts = [f"## {title}\n"]
    if note:
        parts.append(note + "\n")
    for ts in scales:
        rows = [(p, s) for (p, t), s in summaries.items() if t == ts]
        parts.append(f"time_scale {ts:g} (ms):\n\n{table(rows, slip=slip)}\n")
        refused = [
            f"{p} {', '.join(f'{n} x {code}' for code, n in s['refused'].items())}"
            for p, s in rows
            if s.get("refused")
        ]
        if refused:
            parts.append(f"Refused by the router (no engine reached): {'; '.join(refused)}.\n")
    return "\n".join(parts)


def run_simulate_command(
    trace: Sequence[TraceRequest],
    policies: Sequence[str],
    time_scales: Sequence[float],
    out_dir: Path,
    base: SimSettings,
    start_s: float,
    duration_s: float | None,
    limit: int | None,
    trace_name: str,
    spread_s: float = 0.0,
) -> int:
    sliced = spread_arrivals(window(trace, start_s, duration_s, limit), spread_s)
    if not sliced:
        print("gorgo simulate: the window holds no requests", file=sys.stderr)
        return 2
    protocol = base.protocol
    kept, dropped = protocol.apply(sliced)
    if not kept:
        print("gorgo simulate: the protocol dropped every request", file=sys.stderr)
        return 2
    if dropped:
        print(
            f"gorgo simulate: dropped {dropped} of {len(sliced)} requests with prompts over "
            f"{protocol.max_input_tokens} tokens (--max-input-tokens)",
            file=sys.stderr,
        )
    print(
        f"simulating {len(kept)} requests x {len(policies)} policies x "
        f"{len(time_scales)} time_scales ({protocol.describe()})...",
        file=sys.stderr,
    )
    summaries = run_simulations(sliced, policies, time_scales, out_dir, base)
    note = (
        f"Trace `{trace_name}`, window start {start_s:g} s, "
        f"{'whole' if duration_s is None else f'{duration_s:g} s'}"
        f"{'' if limit is None else f', at most {limit} requests'} ({len(sliced)} requests"
        f"{f', {dropped} dropped by the protocol' if dropped else ''}); {protocol.describe()}; "
        f"RTT profile `{base.rtt_profile}`, engine profile `{base.engine_profile}`"
        f"{_fleet_note(base)}, seed "
        f"{base.seed}"
        f"{f'; arrivals spread over {spread_s:g} s' if spread_s else ''}. "
        f"Workload as run: {stats_line(workload_stats(kept))}."
    )
    md = summary_markdown(
        summaries,
        "Simulated policies side by side",
        note,
        slip=protocol.max_concurrency is not None,
    )
    (out_dir / "summary.md").write_text(md)
    print(md)
    for p in write_figures(out_dir, summaries):
        print(f"wrote {p}", file=sys.stderr)
    return 0
