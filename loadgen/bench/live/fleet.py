"""`gorgo bench live --fleet FLEET.yaml`: does the router learn a heterogeneous fleet live?

The stack `gorgo up --fleet FLEET.yaml` starts (Envoy, gorgo, the emulated engines with
the fleet's profiles behind WAN links at the network RTTs; the router keeps the shipped
profile and must learn them), one slice of the trace replayed through the front door,
then the router's own account from /state: per backend its completions, the TTFT and E2E
prediction error over its last completions (`latency_prediction`: MAPE and bias over the
window of ext_proc/estimate/latency_error.py) and the speed factors it learned. The live
prediction target: per-backend TTFT MAPE <= 15 % once every backend has >= 200 completions.

Writes the replay's result file and the final /state to --work.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulator.stack.fleet import load_fleet
from emulator.stack.settings import StackPorts, StackSettings, regions_for_profile
from emulator.stack.stack import Stack
from loadgen.replay.loop import replay
from loadgen.results import summarize, table, write_result
from loadgen.traces.readers import read_trace
from loadgen.traces.windows import scaled, window

TARGET_MAPE = 0.15
TARGET_COMPLETIONS = 200


@dataclass(frozen=True)
class BackendFigures:
    """One backend's prediction figures as /state shows them."""

    backend: str
    completed: int
    ttft: Mapping[str, Any]  # latency_prediction.ttft: mape, bias_ms, window, requests
    e2e: Mapping[str, Any]
    speed: Mapping[str, Any]  # the learned factors

    @property
    def ok(self) -> bool:
        mape = self.ttft.get("mape")
        return self.completed >= TARGET_COMPLETIONS and mape is not None and mape <= TARGET_MAPE


def figures_from_state(state: Mapping[str, Any]) -> list[BackendFigures]:
    """Per backend of a /state document, its prediction figures."""
    out = []
    for bid, b in sorted(state["backends"].items()):
        lp = b.get("latency_prediction") or {}
        out.append(
            BackendFigures(bid, b["completed"], lp.get("ttft", {}), lp.get("e2e", {}), b["speed"])
        )
    return out


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x:+.0f}"


def figures_markdown(figs: list[BackendFigures]) -> str:
    lines = [
        "| backend | completed | TTFT MAPE | TTFT bias ms | E2E MAPE | E2E bias ms | "
        "window | prefill factor | decode factor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figs:
        lines.append(
            f"| {f.backend} | {f.completed} | {_pct(f.ttft.get('mape'))} | "
            f"{_ms(f.ttft.get('bias_ms'))} | {_pct(f.e2e.get('mape'))} | "
            f"{_ms(f.e2e.get('bias_ms'))} | {f.ttft.get('window', 0)} | "
            f"{f.speed.get('prefill_factor', '-')} | {f.speed.get('decode_factor', '-')} |"
        )
    return "\n".join(lines)


def verdict(figs: list[BackendFigures]) -> tuple[bool, str]:
    """Pass when every backend has >= TARGET_COMPLETIONS and TTFT MAPE <= TARGET_MAPE."""
    short = [f.backend for f in figs if f.completed < TARGET_COMPLETIONS]
    over = [f.backend for f in figs if (f.ttft.get("mape") or 0.0) > TARGET_MAPE]
    ok = bool(figs) and not short and not over and all(f.ok for f in figs)
    worst = max((f.ttft.get("mape") or 0.0 for f in figs), default=0.0)
    parts = [f"worst TTFT MAPE {worst:.1%} (target <= {TARGET_MAPE:.0%})"]
    if short:
        parts.append(f"under {TARGET_COMPLETIONS} completions: {', '.join(short)}")
    if over:
        parts.append(f"over target: {', '.join(over)}")
    return ok, ("PASS" if ok else "FAIL") + ": " + "; ".join(parts)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _settle(stack: Stack, timeout_s: float = 30.0) -> dict[str, Any]:
    """/state once nothing is in flight (the last closes are counted), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = _get_json(f"{stack.admin_url}/state")
    while state["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.5)
        state = _get_json(f"{stack.admin_url}/state")
    return state


def run_fleet_live(
    trace_path: str,
    fleet_path: str,
    policy: str,
    start_s: float,
    duration_s: float | None,
    limit: int | None,
    time_scale: float,
    work: Path,
) -> int:
    regions = regions_for_profile("network")
    try:
        fleet = load_fleet(fleet_path, [r.id for r in regions])
    except ValueError as e:
        print(f"gorgo bench live: {e}", file=sys.stderr)
        return 2
    trace = scaled(window(read_trace(trace_path), start_s, duration_s, limit), time_scale)
    stack = Stack(
        StackSettings(  # as `gorgo up --fleet FLEET.yaml --policy POLICY`
            policy=policy,
            regions=regions,
            ports=StackPorts.ephemeral(len(regions)),
            rtt_profile="network",
            engine_profiles=fleet.profiles,
            engine_models=fleet.models,
            engine_loras=fleet.loras,
        )
    )
    print(
        f"{fleet_path}: {len(trace)} requests at time_scale {time_scale:g} through {policy}...",
        file=sys.stderr,
    )
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    stack.start()
    try:
        run = asyncio.run(
            replay(trace, stack.front_door_url, max_concurrency=512, progress=sys.stderr)
        )
        state = _settle(stack)
    finally:
        stack.stop()
    work.mkdir(parents=True, exist_ok=True)
    meta = {
        "mode": "replay",
        "bench": "live --fleet",
        "fleet": fleet_path,
        "policy": policy,
        "time_scale": time_scale,
        "window": {"start_s": start_s, "duration_s": duration_s, "limit": limit},
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    stem = f"fleet-live-{Path(fleet_path).stem}-{policy}"
    write_result(work / f"{stem}.json", run.results, meta)
    (work / f"{stem}-state.json").write_text(json.dumps(state, indent=1))
    figs = figures_from_state(state)
    print(table([(f"{policy} on {Path(fleet_path).stem}", summarize(run.results))]))
    print()
    print(figures_markdown(figs))
    ok, line = verdict(figs)
    print()
    print(
        f"{len(trace)} requests, time_scale {time_scale:g}, wall {time.monotonic() - t0:.0f} s, "
        f"load {meta['load_before']} -> {meta['load_after']} ({os.cpu_count()} cores)"
    )
    print(line)
    return 0 if ok else 1
