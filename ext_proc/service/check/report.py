"""A verdict (judge.py) as people read it, or as JSON for machines."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ext_proc.service.check.probes import Look
from ext_proc.service.check.verdict import Aspect, Verdict

# The words for an aspect that is precise, and one that is not.
LABELS = {
    "prefix": ("precise", "approximate"),
    "tokens": ("exact", "approximate"),
    "queue": ("precise", "estimated"),
    "priority": ("written", "not written"),
}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary(verdict: Verdict) -> str:
    """The last line: all is well, or how many problems."""
    fleet = f"{_plural(len(verdict.backends), 'backend')}, {_plural(len(verdict.models), 'model')}"
    if not verdict.problems:
        return f"gorgo check: all is well ({fleet})"
    return f"gorgo check: {_plural(len(verdict.problems), 'problem')} ({fleet})"


def _aspect(name: str, aspect: Aspect) -> str:
    word = LABELS[name][0 if aspect.precise else 1]
    return f"  {name:<7} {word}: {aspect.how}"


def render_text(source: str, verdict: Verdict, look: Look) -> str:
    lines = [
        f"gorgo check: {source}: {_plural(len(verdict.backends), 'backend')} looked at in "
        f"{look.elapsed_s:.1f} s (at most {look.timeout_s:g} s per request)",
        f"tokenizer: {verdict.tokenizer}",
    ]
    for b in verdict.backends:
        rtt = f"RTT {b.rtt_ms:g} ms" if b.rtt_ms is not None else "no RTT"
        lines += ["", f"backend {b.id}  {b.address}  {b.engine}  {rtt}"]
        lines.append(f"  {'models':<7} {', '.join(b.models) or '(none read)'}")
        for name in LABELS:
            lines.append(_aspect(name, getattr(b, name)))
    if verdict.models:
        lines.append("")
    for m in verdict.models:
        n = len(m.backends)
        lines.append(
            f"model {m.name}: on {', '.join(m.backends)}; prefix precise on "
            f"{len(m.prefix_precise)} of {n}, tokens exact on {len(m.tokens_exact)} of {n}, "
            f"queue from the engine on {len(m.queue_from_engine)} of {n}"
        )
    if verdict.notes:
        lines += ["", "notes:", *(f"  - {n}" for n in verdict.notes)]
    if verdict.problems:
        lines += ["", "problems:", *(f"  - {p.line()}" for p in verdict.problems)]
    lines += ["", summary(verdict)]
    return "\n".join(lines) + "\n"


def as_json(source: str, verdict: Verdict, look: Look) -> dict[str, Any]:
    out: dict[str, Any] = {
        "config": source,
        "ok": not verdict.problems,
        "exit_code": verdict.exit_code,
        "elapsed_s": round(look.elapsed_s, 3),
        "timeout_s": look.timeout_s,
        **dataclasses.asdict(verdict),
        "summary": summary(verdict),
    }
    return out


def render_json(source: str, verdict: Verdict, look: Look) -> str:
    return json.dumps(as_json(source, verdict, look), indent=2) + "\n"
