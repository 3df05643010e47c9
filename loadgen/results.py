"""The result schema shared by `gorgo replay` and `gorgo simulate` (a contract:
change it only on purpose, with docs).

    {"meta": {...},
     "summary": {"requests", "ok", "errors", "refused": {status: n},
                 "ttft_ms": {p50, p90, p95, p99, mean}, "e2e_ms": {...}, "itl_ms": {...},
                 "slip_ms": {..., "max", "waited"}, "cache_hit_rate",
                 "ttft_prediction": {"mape", "bias_ms", "requests", "rho"},
                 "ttft_prediction_by_backend": {backend: {"mape", "bias_ms", "requests"}},
                 "e2e_prediction": {...}, "e2e_prediction_by_backend": {...}},
     "requests": [{"id", "backend", "ttft_ms", "e2e_ms", "input_tokens", "output_tokens",
                   "cached_tokens", "status", "error", "slip_ms", "predicted_ttft_ms",
                   "predicted_e2e_ms", ...}, ...]}

ITL statistics are over every inter-token gap of every successful request.

The prediction figures set the TTFT and E2E the router predicted for the backend it chose
(`predicted_ttft_ms`, `predicted_e2e_ms`: None where not known, as in `gorgo replay`)
beside the measured ones: MAPE is the mean |predicted - measured| / measured (a fraction),
bias_ms the mean predicted - measured (> 0: predicted slower), rho the Spearman rank
correlation of predicted and measured (how the GORGO paper's authors validated their cost
model: the random policy's dispatches, predicted against measured TTFT), over the successful
requests with both after the first 20 % of the requests by arrival (the rows' order), so an empty
fleet's warm-up does not flatter the figures; `requests` says how many counted. Slip is how
long a request waited past its arrival for a concurrency slot (loadgen.client.protocol): TTFT and
E2E are measured from dispatch, so slip is reported beside them, never inside.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ext_proc.common.files import write_atomic
from ext_proc.estimate.latency_error import LatencyError, error_summary

QUANTILES = (50, 90, 95, 99)


@dataclass
class RequestResult:
    id: str
    backend: str = ""
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    status: str = "ok"
    error: str = ""
    # What the router predicted the chosen engine had cached (the simulator: to measure
    # its prefix state against the engine's report); None where not known.
    predicted_cached_tokens: int | None = None
    # The client's region, where sessions come from several (simulated front doors).
    region: str | None = None
    # How long it waited past its due time before it was sent (a concurrency slot, or a
    # client that fell behind); TTFT and E2E start at dispatch. None where not measured.
    slip_ms: float | None = None
    # The TTFT and E2E the router predicted on the backend it chose, counted from where
    # ttft_ms and e2e_ms count (None where not known).
    predicted_ttft_ms: float | None = None
    predicted_e2e_ms: float | None = None
    # Its request class and tenant (gorgo simulate --classes; None: not classed).
    objective: str | None = None
    tenant: str | None = None
    # Not in the file: inter-token gaps feed the ITL summary.
    itl_ms: list[float] = field(default_factory=list, repr=False)

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        del out["itl_ms"]
        for key in ("ttft_ms", "e2e_ms", "slip_ms", "predicted_ttft_ms", "predicted_e2e_ms"):
            if out[key] is not None:
                out[key] = round(out[key], 3)
        return out


def stats(values: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=float)
    if not len(arr):
        empty: dict[str, float | None] = {f"p{q}": None for q in QUANTILES}
        empty["mean"] = None
        return empty
    out: dict[str, float | None] = {
        f"p{q}": round(float(np.percentile(arr, q)), 3) for q in QUANTILES
    }
    out["mean"] = round(float(arr.mean()), 3)
    return out


def summarize(
    results: Sequence[RequestResult], itl_ms: Iterable[float] | None = None
) -> dict[str, Any]:
    ok = [r for r in results if r.status == "ok"]
    gaps = list(itl_ms) if itl_ms is not None else [g for r in ok for g in r.itl_ms]
    prompt = sum(r.input_tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "refused": refused_counts(results),
        "ttft_ms": stats([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "e2e_ms": stats([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "itl_ms": stats(gaps),
        "slip_ms": slip_stats(results),
        "cache_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None,
        **prediction_summary(results),
    }


def refused_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    """The requests the router answered itself (status "refused", error "HTTP CODE ..."),
    by HTTP status: 404 unknown model, 400 none named, 503 none in rotation, 429 shed."""
    out: dict[str, int] = {}
    for r in results:
        if r.status == "refused":
            code = r.error.split()[1] if r.error.startswith("HTTP ") else "?"
            out[code] = out.get(code, 0) + 1
    return dict(sorted(out.items()))


# The share of the requests (by arrival) left out of the prediction figures: the warm-up.
PREDICTION_WARMUP = 0.2


def prediction_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """The TTFT and E2E prediction error over the successful requests after the first
    PREDICTION_WARMUP of `results` (in arrival order), overall and per backend."""
    after = [r for r in results[int(len(results) * PREDICTION_WARMUP) :] if r.status == "ok"]
    out: dict[str, Any] = {}
    for measure in ("ttft", "e2e"):
        errs: dict[str, list[LatencyError]] = {}
        for r in after:
            predicted, measured = getattr(r, f"predicted_{measure}_ms"), getattr(r, f"{measure}_ms")
            if predicted is not None and measured is not None and measured > 0:
                errs.setdefault(r.backend, []).append(LatencyError(predicted, measured))
        every = [e for es in errs.values() for e in es]
        out[f"{measure}_prediction"] = error_summary(every)
        out[f"{measure}_prediction_by_backend"] = {b: error_summary(errs[b]) for b in sorted(errs)}
    pairs = [
        (r.predicted_ttft_ms, r.ttft_ms)
        for r in after
        if r.predicted_ttft_ms is not None and r.ttft_ms is not None
    ]
    out["ttft_prediction"]["rho"] = spearman_rho(pairs)
    return out


def spearman_rho(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Spearman's rank correlation (ties by average rank); None under 3 pairs."""
    if len(pairs) < 3:
        return None
    a, b = (_ranks(np.array(col, dtype=float)) for col in zip(*pairs, strict=True))
    if a.std() == 0 or b.std() == 0:
        return None
    return round(float(np.corrcoef(a, b)[0, 1]), 4)


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    # average the ranks of ties
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return np.asarray(sums[inverse] / counts[inverse])


def slip_stats(results: Sequence[RequestResult]) -> dict[str, float | int | None]:
    """Slip over every request that was sent (any outcome): quantiles, mean, max, and how
    many waited at all."""
    slips = [r.slip_ms for r in results if r.slip_ms is not None]
    out: dict[str, float | int | None] = dict(stats(slips))
    out["max"] = round(max(slips), 3) if slips else None
    out["waited"] = sum(s > 0 for s in slips)
    return out


def write_result(
    path: str | Path,
    results: Sequence[RequestResult],
    meta: dict[str, Any],
    itl_ms: Iterable[float] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`extra`: more of the summary (the simulator's request classes)."""
    doc = {
        "meta": meta,
        "summary": {**summarize(results, itl_ms), **(extra or {})},
        "requests": [r.row() for r in results],
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, json.dumps(doc, indent=1))
    return doc


def print_report(text: str, out: str) -> None:
    """A bench's table on stdout, and in `out` too ('' : not written)."""
    print(text)
    if out:
        p = Path(out)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")


def write_csv(path: str | Path, results: Sequence[RequestResult]) -> None:
    with Path(path).open("w", newline="") as f:
        fields = list(RequestResult("x").row())
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in results:
            w.writerow(r.row())


def read_result(path: str | Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(Path(path).read_text())
    return doc


def fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def table(rows: Sequence[tuple[str, dict[str, Any]]], slip: bool = False) -> str:
    """A markdown table: one row per (label, summary); with `slip`, the slip p50/p95 too
    (runs under a concurrency cap)."""
    head = (
        "| run | requests | errors | TTFT p50 | TTFT p95 | TTFT p99 | E2E p50 | E2E p95 | "
        "E2E p99 | ITL p50 | cache hit |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|---|---|"
    if slip:
        head, rule = head + " slip p50 | slip p95 |", rule + "---|---|"
    lines = [head + "\n" + rule]
    for label, s in rows:
        t, e, i = s["ttft_ms"], s["e2e_ms"], s["itl_ms"]
        hit = s.get("cache_hit_rate")
        line = (
            f"| {label} | {s['requests']} | {s['errors']} | {fmt(t['p50'])} | {fmt(t['p95'])} | "
            f"{fmt(t['p99'])} | {fmt(e['p50'])} | {fmt(e['p95'])} | {fmt(e['p99'])} | "
            f"{fmt(i['p50'], 1)} | {'-' if hit is None else f'{hit:.1%}'} |"
        )
        if slip:
            sl = s.get("slip_ms") or {}
            line += f" {fmt(sl.get('p50'))} | {fmt(sl.get('p95'))} |"
        lines.append(line)
    return "\n".join(lines)
