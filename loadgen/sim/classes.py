"""Request classes for `gorgo simulate --classes FILE`: the objectives of the router config,
each with the share of the trace's sessions in it, and optionally tenants, shared out the
same way (a hash of the session id, so a conversation stays in one class and tenant).

    objectives:
      - {name: interactive, share: 0.2, priority: 10, ttft_slo_ms: 8000}
      - {name: batch, share: 0.8, priority: 0, ttft_slo_ms: 90000, sheddable: true}
    tenants:
      - {name: heavy, share: 0.9}
      - {name: light, share: 0.1}
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from emulator.engine.priority import PriorityScheduling
from ext_proc.config.flow import Objective
from loadgen.client.stream import percentile
from loadgen.results import RequestResult


@dataclass(frozen=True)
class Classes:
    """The objectives (router config, without `share`) and the shares of sessions."""

    objectives: tuple[dict[str, Any], ...]
    objective_shares: tuple[tuple[str, float], ...]
    tenant_shares: tuple[tuple[str, float], ...] = ()

    def objective_of(self, session: str) -> str:
        return _pick(self.objective_shares, f"objective:{session}")

    def tenant_of(self, session: str) -> str:
        return _pick(self.tenant_shares, f"tenant:{session}") if self.tenant_shares else ""

    def slo_ms(self) -> dict[str, float]:
        """Each objective's TTFT SLO (0: none)."""
        return {o["name"]: float(o.get("ttft_slo_ms", 0.0)) for o in self.objectives}


def engine_priorities(classes: Classes | None, engine: PriorityScheduling | None) -> dict[str, int]:
    """The priority each objective's requests carry to engines that schedule by it, in
    the engine's sign (the objective's `priority`, higher more urgent; negated for an
    engine that serves low values first). None: the engines ignore it, nothing is sent."""
    if classes is None or engine is None:
        return {}
    sign = -1 if engine.low_values_first else 1
    return {o["name"]: sign * int(o.get("priority", 0)) for o in classes.objectives}


def _pick(shares: Sequence[tuple[str, float]], key: str) -> str:
    x = zlib.crc32(key.encode()) / 2**32 * sum(s for _, s in shares)
    for name, share in shares:
        x -= share
        if x < 0:
            return name
    return shares[-1][0]


def _shares(raw: Any, key: str, path: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: {key}: a list of {{name, share}}")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"{path}: {key}[{i}]: needs a name")
        share = item.get("share")
        if not isinstance(share, int | float) or share < 0:
            raise ValueError(f"{path}: {key}[{i}].share: a number >= 0, got {share!r}")
        out.append((item["name"], float(share)))
    if sum(s for _, s in out) <= 0:
        raise ValueError(f"{path}: {key}: the shares are all 0")
    return tuple(out)


def classes_from_dict(raw: Any, path: str = "classes") -> Classes:
    if not isinstance(raw, dict) or "objectives" not in raw:
        raise ValueError(f"{path}: expected a mapping with `objectives:` (and `tenants:`)")
    unknown = set(raw) - {"objectives", "tenants"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    shares = _shares(raw["objectives"], "objectives", path)
    fields = set(Objective.__dataclass_fields__)
    objectives = []
    for i, item in enumerate(raw["objectives"]):
        extra = set(item) - fields - {"share"}
        if extra:
            raise ValueError(f"{path}: objectives[{i}]: unknown keys {sorted(extra)}")
        objectives.append({k: v for k, v in item.items() if k != "share"})
    tenants = _shares(raw["tenants"], "tenants", path) if raw.get("tenants") else ()
    return Classes(tuple(objectives), shares, tenants)


def load_classes(path: str | Path) -> Classes:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the classes file: {e}") from e
    return classes_from_dict(raw, str(path))


def class_summary(rows: Sequence[RequestResult], classes: Classes | None) -> dict[str, Any]:
    """Per objective: requests, served, rejected and slo_attained (the share of its
    requests served with TTFT within its SLO); goodput (the share of all requests served
    within their class's SLO); per tenant, TTFT p50 and p95 of those served. TTFT counts
    from the arrival at the router, its wait in the gateway queue included."""
    slo = classes.slo_ms() if classes is not None else {}

    def good(r: RequestResult) -> bool:
        limit = slo.get(r.objective or "", 0.0)
        return r.ttft_ms is not None and (not limit or r.ttft_ms <= limit)

    objectives: dict[str, Any] = {}
    for name in sorted({r.objective or "default" for r in rows}):
        mine = [r for r in rows if (r.objective or "default") == name]
        objectives[name] = {
            "requests": len(mine),
            "served": sum(r.ttft_ms is not None for r in mine),
            "rejected": sum(r.status == "rejected" for r in mine),
            "slo_attained": round(sum(map(good, mine)) / len(mine), 4),
        }
    tenants: dict[str, Any] = {}
    for name in sorted({r.tenant or "" for r in rows}):
        ttft = [r.ttft_ms for r in rows if (r.tenant or "") == name and r.ttft_ms is not None]
        tenants[name or "default"] = {
            "requests": sum((r.tenant or "") == name for r in rows),
            "ttft_ms": {"p50": percentile(ttft, 50), "p95": percentile(ttft, 95)},
        }
    goodput = round(sum(map(good, rows)) / len(rows), 4) if rows else None
    return {"objectives": objectives, "goodput": goodput, "tenants": tenants}
