"""The soak's verdict, pure: which requests each fault may be blamed for, how long it took
to recover, and whether the router's memory and open files stayed flat. No clock, no
processes: `loadgen.soak.run` records, this judges."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import fmean

# The part a fault hits when it is the front door's (router, Envoy, NATS, config): every
# request through it is "on the faulted part". A backend's fault names the backend.
FRONT_DOOR = "front door"
# A request still open this long after its fault recovered is still the fault's (a stream
# the fault slowed ends after the recovery).
GRACE_S = 10.0
# Flatness: the last window's mean within this of the first window's (after warm-up).
FLAT_WITHIN = 0.10


@dataclass(frozen=True)
class FaultRecord:
    """One fault as it was done: when (seconds on the load's clock), what it hit, when it
    was lifted (healed_s; the same as at_s for a one-off such as a kill) and when its part
    served again (None: not within the time allowed)."""

    name: str
    part: str
    at_s: float
    healed_s: float
    recovered_s: float | None
    note: str = ""


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it."""

    sent_s: float
    end_s: float
    backend: str
    ok: bool
    # Refused on purpose (HTTP 429: a sheddable request flow control could not serve in
    # its SLO), with its Retry-After: by design, not a failure.
    refused: bool = False
    error: str = ""


@dataclass
class FaultRow:
    record: FaultRecord
    requests: int = 0  # open at some time between the fault and its recovery (+ grace)
    failed: int = 0
    failed_elsewhere: int = 0  # failed, but not on the faulted part: a defect
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def recover_s(self) -> float | None:
        r = self.record
        # from the fault's end: a stall held 20 s is judged by how it comes back after
        return None if r.recovered_s is None else r.recovered_s - r.healed_s


def reason(error: str) -> str:
    """An error's kind, for the table: its first words (HTTP status, exception name)."""
    head = error.split(":", 1)[0].strip()
    return head[:60] or "unknown"


def window_of(r: FaultRecord) -> tuple[float, float]:
    end = r.recovered_s if r.recovered_s is not None else r.healed_s
    return r.at_s, max(end, r.healed_s) + GRACE_S


def judge(
    records: Sequence[FaultRecord], outcomes: Sequence[Outcome]
) -> tuple[list[FaultRow], list[Outcome]]:
    """Each fault's row, and the failures no fault window holds (each one a defect).

    A request open at any time in a fault's window counts among its requests; a failure
    belongs to one fault: among the windows that hold the moment it failed (its end), the
    fault on its backend, else one of the front door's, else the latest (where it counts as
    failed elsewhere: a fault's failure must stay on the part it hit)."""
    rows = [FaultRow(r) for r in records]
    unexplained: list[Outcome] = []
    for o in outcomes:
        holding: list[FaultRow] = []
        for row in rows:
            start, end = window_of(row.record)
            if o.end_s < start or o.sent_s > end:
                continue
            row.requests += 1
            if start <= o.end_s <= end:
                holding.append(row)
        if o.ok or o.refused:
            continue
        if not holding:
            unexplained.append(o)
            continue
        row = next(
            (r for r in holding if r.record.part == o.backend),
            next((r for r in reversed(holding) if r.record.part == FRONT_DOOR), holding[-1]),
        )
        row.failed += 1
        row.reasons[reason(o.error)] += 1
        if row.record.part not in (FRONT_DOOR, o.backend):
            row.failed_elsewhere += 1
    return rows, unexplained


@dataclass(frozen=True)
class Sample:
    at_s: float
    rss_mb: float
    fds: int


@dataclass(frozen=True)
class Flatness:
    first_rss_mb: float
    last_rss_mb: float
    first_fds: float
    last_fds: float

    @property
    def rss_ratio(self) -> float:
        return self.last_rss_mb / self.first_rss_mb if self.first_rss_mb else 0.0

    @property
    def fds_ratio(self) -> float:
        return self.last_fds / self.first_fds if self.first_fds else 0.0

    @property
    def flat(self) -> bool:
        return all(abs(x - 1.0) <= FLAT_WITHIN for x in (self.rss_ratio, self.fds_ratio))


def flatness(samples: Sequence[Sample], warm_s: float, window_s: float) -> Flatness | None:
    """The mean of the samples in the first `window_s` after `warm_s` against those in the
    last `window_s`; None when the run is too short for two windows apart."""
    if not samples:
        return None
    end_s = samples[-1].at_s
    first = [s for s in samples if warm_s <= s.at_s < warm_s + window_s]
    last = [s for s in samples if s.at_s > end_s - window_s]
    if not first or not last or end_s - window_s < warm_s + window_s:
        return None
    return Flatness(
        fmean(s.rss_mb for s in first),
        fmean(s.rss_mb for s in last),
        fmean(s.fds for s in first),
        fmean(s.fds for s in last),
    )


def table(rows: Sequence[FaultRow]) -> str:
    """The per-fault table (markdown), as docs/reliability.md keeps it."""
    lines = [
        "| fault | at (s) | lasted (s) | requests open | failed | on the faulted part | why "
        "| serving again after its end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row.record
        why = ", ".join(f"{k} x{n}" for k, n in row.reasons.most_common(3)) or "-"
        rec = "not within the limit" if row.recover_s is None else f"{row.recover_s:.1f} s"
        on_part = row.failed - row.failed_elsewhere
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.name}{note} | {r.at_s:.0f} | {r.healed_s - r.at_s:.0f} | {row.requests} | "
            f"{row.failed} | "
            f"{on_part} | {why} | {rec} |"
        )
    return "\n".join(lines)
