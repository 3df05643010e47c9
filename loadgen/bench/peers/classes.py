"""Request classes as each front reads them (`gorgo bench peers --classes`): gorgo's
objective header, SMG's priority header and scheduler series; vllm-router has none."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from emulator.rivals.fronts import RivalFront
from ext_proc.config.flow import FlowControl
from loadgen.results import RequestResult
from loadgen.sim.classes import Classes
from loadgen.traces.request import TraceRequest


def scheduler_metrics(text: str) -> dict[str, float]:
    """SMG's priority scheduler's series (name with labels -> value) that are not zero: what
    shows the classes took effect there (admitted, queued, preempted per class)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "sched" not in line.split("{")[0]:
            continue
        series, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        if v:
            out[series] = v
    return out


# SMG's classes (middleware/scheduler: bulk < default < interactive < system); anonymous
# requests may use up to interactive (--priority-scheduler-default-max-class).
SMG_CLASSES = ("bulk", "default", "interactive")
SMG_PRIORITY_ARGS = (
    "--priority-scheduler-enabled",
    "--priority-scheduler-default-max-class",
    "interactive",
)


def smg_class_of(classes: Classes) -> dict[str, str]:
    """Each objective's SMG class by priority rank: the highest interactive, the lowest
    bulk, any between default."""
    ranked = sorted(classes.objectives, key=lambda o: int(o.get("priority", 0)))
    out = {}
    for i, o in enumerate(ranked):
        top, bottom = i == len(ranked) - 1, i == 0
        out[o["name"]] = "interactive" if top else "bulk" if bottom else "default"
    return out


def class_headers(
    f: RivalFront | None, classes: Classes
) -> Callable[[TraceRequest], Mapping[str, str]]:
    """A request's class as the front reads it: gorgo's objective header, SMG's priority
    header; vllm-router has no classes (none)."""
    if f is None:
        header = FlowControl().objective_header
        return lambda r: {header: classes.objective_of(r.session)}
    if f.tool == "smg":
        smg = smg_class_of(classes)
        return lambda r: {"x-smg-priority": smg[classes.objective_of(r.session)]}
    return lambda r: {}


def classed(
    results: Sequence[RequestResult], trace: Sequence[TraceRequest], classes: Classes
) -> list[RequestResult]:
    """Each result with its request's class (its session's), for the per-class summary."""
    of = {r.id: classes.objective_of(r.session) for r in trace}
    return [replace(x, objective=of.get(x.id)) for x in results]


def class_report(fronts: Mapping[str, Mapping[str, Any]]) -> str:
    """Per front: each objective's SLO attainment and the goodput (median over repeats)."""
    lines = [
        "| front | goodput | " + "objective slo_attained (served / requests) |",
        "|---|---|---|",
    ]
    for name, s in fronts.items():
        runs = s["classes"]
        good = statistics.median(c["goodput"] for c in runs)
        parts = []
        for obj in sorted(runs[0]["objectives"]):
            att = statistics.median(c["objectives"][obj]["slo_attained"] for c in runs)
            o = runs[0]["objectives"][obj]
            parts.append(f"{obj} {att:.3f} ({o['served']} / {o['requests']})")
        lines.append(f"| {name} | {good:.3f} | {', '.join(parts)} |")
    return "\n".join(lines)
