"""The tuner through a regime change, computed (what the tuner is for): mid-run the RTT to
one region and the request rate go up; the paired tuner against frozen defaults, the room
static weights leave, and the false-accept rate on noise, into dataclasses
(loadgen.bench.tuner.report renders them)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ext_proc.core.router import Router
from ext_proc.learn.settings import PAIRED, TunerSettings
from loadgen.bench.tuner.study import GridPoint, false_accept_rate
from loadgen.client.protocol import PAPER
from loadgen.progress import say, tracked
from loadgen.results import RequestResult, summarize
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate
from loadgen.traces.request import TraceRequest


@dataclass(frozen=True)
class RegimeChange:
    """Mid-run, the RTT to one region is multiplied by rtt_factor and the request rate by
    rate_factor (arrivals after at_s, trace time, come closer together)."""

    at_s: float
    region: str = "eu-frankfurt"
    rtt_factor: float = 3.0
    rate_factor: float = 1.5


def changed_trace(trace: Sequence[TraceRequest], change: RegimeChange) -> list[TraceRequest]:
    """The trace with its arrivals after the change compressed by rate_factor."""
    at, f = change.at_s, change.rate_factor
    return [
        r if r.arrival_s < at else replace(r, arrival_s=at + (r.arrival_s - at) / f) for r in trace
    ]


@dataclass(frozen=True)
class RegimeRun:
    tune: str
    seed: int
    # p95 TTFT / E2E (ms) of the first `after` requests completed after the change
    ttft_p95_ms: float
    e2e_p95_ms: float
    # the weights serving when the change came, and when the scoring ended
    at_change: tuple[float, float]
    final: tuple[float, float]


class _Scored(Exception):
    """The run has scored what it needed: stop it there."""


def regime_run(
    trace: Sequence[TraceRequest],
    ts: float,
    change: RegimeChange,
    tune: str,
    seed: int,
    after: int = 600,
    weights: tuple[float, float] | None = None,
    objective: str = "ttft",
    venue: RegimeVenue | None = None,
) -> RegimeRun:
    """One run through the change from `weights` (the policy's defaults unless given),
    tuning online (`tune`) or frozen ("off"); scored on the first `after` completions of
    requests sent after it (the run stops there)."""
    from emulator.wan import DelaySettings
    from loadgen.sim.simulate import Simulation

    v = venue or RegimeVenue()
    weights = weights or v.defaults
    router: dict[str, Any] = {
        "policies": {v.policy: {"weights": {"rtt": weights[0], "queue": weights[1]}}}
    }
    if objective != "ttft" and tune != "off":
        router["tuner"] = {"mode": tune, "objective": objective}
    sim = Simulation(
        changed_trace(trace, change),
        replace(v.base, policy=v.policy, time_scale=ts, seed=seed, tune=tune, router=router),
    )
    at_change = [weights]

    def apply() -> None:
        if sim.router.tuner is not None:
            at_change[0] = sim.router.tuner.state.parent
        for (_door, backend), link in sim.links.items():
            if backend == change.region:
                s = link.settings
                link.settings = DelaySettings(
                    s.rtt_ms * change.rtt_factor, s.jitter_ms * change.rtt_factor
                )

    sim.at(change.at_s * ts, apply)
    done: list[RequestResult] = []
    sent_after = {r.id for r in changed_trace(trace, change) if r.arrival_s >= change.at_s}

    def hook(res: RequestResult, _router: Router) -> None:
        if res.id in sent_after:
            done.append(res)
            if len(done) >= after:
                raise _Scored

    sim.hook = hook
    with contextlib.suppress(_Scored):
        sim.run()
    s = summarize(done)
    tuner = sim.router.tuner
    return RegimeRun(
        tune,
        seed,
        float(s["ttft_ms"]["p95"]),
        float(s["e2e_ms"]["p95"]),
        at_change[0],
        weights if tuner is None else tuner.state.parent,
    )


REGIME_TARGET = 0.90  # tuned p95 TTFT at most this x the frozen defaults'
ROOM_SEEDS = (0, 1)


@dataclass(frozen=True)
class RegimeVenue:
    """Where a regime change runs: the policy whose weights are tuned, its defaults, the
    simulation's other settings, and the static weights (the whole run) that show how
    much room the frozen defaults leave after the change."""

    policy: str = "gorgo"
    defaults: tuple[float, float] = (1.0, 1.0)
    base: SimSettings = field(default_factory=SimSettings)
    room: tuple[tuple[float, float], ...] = tuple(
        (r, q) for r in (1.0, 16.0, 64.0) for q in (0.25, 1.0)
    )


def _regime_run(args: tuple[Any, ...]) -> RegimeRun:
    trace, ts, change, tune, seed, weights, venue = args
    return regime_run(trace, ts, change, tune, seed, weights=weights, venue=venue)


def regime_runs(
    trace: Sequence[TraceRequest],
    ts: float,
    change: RegimeChange,
    runs: Sequence[tuple[str, int, tuple[float, float] | None]],
    venue: RegimeVenue,
    jobs: int = 2,
) -> list[RegimeRun]:
    """regime_run for each (tune, seed, weights), `jobs` in parallel, in the given order."""
    from concurrent.futures import ProcessPoolExecutor

    args = [(trace, ts, change, tune, seed, w, venue) for tune, seed, w in runs]
    if jobs <= 1:
        return [_regime_run(a) for a in tracked(args, len(args), "tuner regime")]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(tracked(pool.map(_regime_run, args), len(args), "tuner regime"))


def regime_room(
    trace: Sequence[TraceRequest],
    ts: float,
    change: RegimeChange,
    seeds: Sequence[int],
    venue: RegimeVenue | None = None,
    jobs: int = 2,
) -> list[GridPoint]:
    """Each of the venue's static weights through the change: mean p95s over seeds."""
    v = venue or RegimeVenue()
    todo = [("off", s, w) for w in v.room for s in seeds]
    runs = regime_runs(trace, ts, change, todo, v, jobs)
    out = []
    for i, (r, q) in enumerate(v.room):
        mine = runs[i * len(seeds) : (i + 1) * len(seeds)]
        out.append(
            GridPoint(
                r,
                q,
                float(np.mean([x.ttft_p95_ms for x in mine])),
                float(np.mean([x.e2e_p95_ms for x in mine])),
            )
        )
        say(f"  regime room rtt {r:g} queue {q:g}: p95 TTFT {out[-1].ttft_p95_ms:.0f}")
    return out


# The paper's tuning window under the paper's protocol, with the paper's measured RTTs
# (37 / 279 / 456 ms, eu-frankfurt's tripled to 837): the RTT is a large part of a TTFT
# there. Both cost forms, each with static weights around its defaults.
PAPER_REGIME_VENUES = (
    RegimeVenue(
        "gorgo",
        (1.0, 1.0),
        SimSettings(protocol=PAPER, rtt_profile="paper"),
        tuple((r, q) for r in (0.25, 1.0, 4.0) for q in (0.5, 1.0)),
    ),
    RegimeVenue(
        "gorgo_tokens",
        (0.5, 0.1),
        SimSettings(protocol=PAPER, rtt_profile="paper"),
        tuple((r, q) for r in (0.125, 0.5, 2.0) for q in (0.05, 0.1)),
    ),
)


@dataclass(frozen=True)
class RegimeSeed:
    """One seed through the change: the frozen defaults' run and the tuned one's."""

    seed: int
    off: RegimeRun
    on: RegimeRun

    @property
    def ratio(self) -> float:
        return self.on.ttft_p95_ms / self.off.ttft_p95_ms

    @property
    def ok(self) -> bool:
        return self.ratio <= REGIME_TARGET and self.on.e2e_p95_ms <= self.off.e2e_p95_ms


@dataclass(frozen=True)
class RegimeStudy:
    """The seeds' runs, the room (static weights through the change, if measured) and the
    false-accept rates on noise (if measured) of the paired and the paper's settings."""

    venue: RegimeVenue
    change: RegimeChange
    ts: float
    seeds: tuple[RegimeSeed, ...]
    room_seeds: tuple[int, ...]
    room: tuple[GridPoint, ...] = ()
    false_accept_paired: float | None = None
    false_accept_paper: float | None = None

    @property
    def met(self) -> int:
        return sum(s.ok for s in self.seeds)

    @property
    def ratios(self) -> list[float]:
        return [s.ratio for s in self.seeds]

    @property
    def room_best(self) -> GridPoint:
        return min(self.room, key=lambda p: p.ttft_p95_ms)

    @property
    def room_defaults(self) -> GridPoint:
        return next(p for p in self.room if (p.rtt, p.queue) == self.venue.defaults)


def regime_study(
    trace: Sequence[TraceRequest],
    ts: float,
    change: RegimeChange,
    seeds: Sequence[int],
    room_seeds: Sequence[int] = ROOM_SEEDS,
    venue: RegimeVenue | None = None,
    false_accepts: bool = True,
    jobs: int = 2,
) -> RegimeStudy:
    """The tuner against frozen defaults through a regime change, the room the defaults
    leave there, and (false_accepts) the tuner's false-accept rate on pure noise."""
    v = venue or RegimeVenue()
    print(f"tuner: regime change ({v.policy}), seeds {list(seeds)}", file=sys.stderr)
    runs = regime_runs(
        trace, ts, change, [(t, seed, None) for seed in seeds for t in ("off", PAIRED)], v, jobs
    )
    study = RegimeStudy(
        v,
        change,
        ts,
        tuple(
            RegimeSeed(seed, off, on)
            for seed, off, on in zip(seeds, runs[::2], runs[1::2], strict=True)
        ),
        tuple(room_seeds),
    )
    if room_seeds:
        print("tuner: the room the defaults leave after the change", file=sys.stderr)
        study = replace(study, room=tuple(regime_room(trace, ts, change, room_seeds, v, jobs)))
    if not false_accepts:
        return study
    res = simulate(trace, replace(v.base, policy=v.policy, time_scale=ts))
    pool = [(r.ttft_ms, r.e2e_ms) for r in res.requests if r.ttft_ms and r.e2e_ms]
    return replace(
        study,
        false_accept_paired=false_accept_rate(pool, TunerSettings(), 1000),
        false_accept_paper=false_accept_rate(pool, TunerSettings.paper(), 1000),
    )
