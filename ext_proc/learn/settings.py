"""The tuner's settings, its persisted state and its steps, and how an arm's samples are
scored: shared by the tuner and its two strategies (`paired`, `paper`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from ext_proc.config.schema import TunerArmKey, TunerMode, TunerObjective

PAPER = TunerMode.PAPER
PAIRED = TunerMode.PAIRED
TTFT, EXCESS_TTFT = TunerObjective.TTFT, TunerObjective.EXCESS_TTFT
PARENT, CHILD = "parent", "child"
Bounds = tuple[tuple[float, float], tuple[float, float]]
# Receives the tuner's state (a JSON-able dict) after every step.
StateSink = Callable[[dict[str, Any]], None]


# How an arm's samples can be scored (`TunerSettings.score`).
SCORES = ("p95", "tail", "mean")


@dataclass(frozen=True)
class TunerSettings:
    """The tuner's constants: its mode, sigma and the 1/5 rule, the weights' bounds, round
    sizes, confidence and ties. Built by core.build.tuner_settings from the `tuner:`
    section and the policy's bounds; the other fields are not config keys."""

    mode: TunerMode = PAIRED
    sigma0: float = 0.5
    # 1/5 rule: over the last `success_window` outcomes, sigma /= factor when more than a
    # fifth succeeded, sigma *= factor when fewer.
    success_window: int = 8
    factor: float = 0.817
    # Bounds of each weight (log-space search, clipped), for the time form, where 1.0 is
    # the physical weight of a millisecond of RTT or queue: from where the term stops
    # changing decisions (1/16) to where it overrides the others (w_rtt 256: 90 ms weigh
    # 23 s); the measured optimum, w_rtt 32-64, is inside (docs/tuner.md). `paper` mode
    # uses the paper's bounds.
    rtt_bounds: tuple[float, float] = (1 / 16, 256.0)
    queue_bounds: tuple[float, float] = (1 / 16, 16.0)
    # paper mode: score = p95 TTFT over the last `window` completions, every `rescore_every`.
    window: int = 128
    rescore_every: int = 32
    # paired mode: samples per arm per round (a round costs 2x this many completions).
    arm_size: int = 24
    sigma_min: float = 0.05
    sigma_max: float = 1.0
    confidence: float = 0.8
    # A round ends early, once both arms hold `early_arm_size` samples, when the test is
    # already this sure either way: a child far better or far worse costs few requests.
    early_arm_size: int = 12
    early_confidence: float = 0.97
    # A child that wins a round is kept for the next, and accepted only when it has won
    # `confirm_rounds` rounds in a row: one round's false accept (a round's p95 of 24 is
    # noisy) is not enough to move the parent. 1 = accept on the first win.
    confirm_rounds: int = 2
    # What a TTFT sample is: the TTFT, or its excess over the request's own floor.
    objective: TunerObjective = TTFT
    # What the arm's hash is of: the request id, or the session key when there is one.
    arm_key: TunerArmKey = TunerArmKey.REQUEST
    # How an arm's samples are scored (TTFT for the test, E2E for the guard): "p95",
    # "tail", the mean of the slowest `tail_fraction` of them, or "mean".
    score: str = "p95"
    tail_fraction: float = 0.25
    bootstrap: int = 300
    e2e_guard: float = 0.05
    freeze_after: int = 6
    drift: float = 1.5
    # A round whose arms decided alike tells nothing: the router reports, per decision,
    # whether the other arm's weights would have chosen the same backend. A child whose
    # first `tie_decisions` decisions (both arms) all agree with the parent's, or whose
    # round ends with fewer than `tie_share` of its decisions different, ties: no
    # 1/5-rule outcome, sigma grows by 1 / factor up to tie_sigma_max (if above
    # sigma_max, the next verdict bounds it by sigma_max again; 3 did harm from the
    # defaults, docs/tuner.md), and a new child is drawn. Without the reports (a policy
    # without `would_pick`) every round is judged on its samples alone.
    # Off by default: measured, ties leave the worst corner but do not reach the target
    # and, as they keep the tuner from settling, cost 7-24 % of p95 TTFT from the
    # defaults (docs/tuner.md, "The tuner's targets"). With ties on, children are also
    # reflected at the bounds instead of clipped onto them.
    ties: bool = False
    tie_decisions: int = 16
    tie_share: float = 0.1
    tie_sigma_max: float = 1.0
    # What the two values are called (/state, the history) and the label of the pair:
    # the cost weights, or the P/D pair's knobs (PAIR_KNOBS_TUNER).
    label: str = "weights"
    names: tuple[str, str] = ("rtt", "queue")
    # Hashed before a request's key to pick its arm: two tuners with different salts split
    # the same traffic independently (each one's arms see the other's alike).
    arm_salt: str = ""

    @staticmethod
    def paper() -> TunerSettings:
        return TunerSettings(mode=PAPER, rtt_bounds=(0.05, 2.0), queue_bounds=(0.05, 0.5))

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"tuner score {self.score!r}: expected one of {', '.join(SCORES)}")

    def clip(self, w: tuple[float, float]) -> tuple[float, float]:
        (rlo, rhi), (qlo, qhi) = self.rtt_bounds, self.queue_bounds
        return (min(rhi, max(rlo, w[0])), min(qhi, max(qlo, w[1])))


@dataclass
class Step:
    """One decision of the tuner, for /state and the convergence plot."""

    samples: int
    parent: tuple[float, float]
    child: tuple[float, float]
    accepted: bool
    sigma: float
    parent_p95_ms: float | None
    child_p95_ms: float | None
    note: str = ""
    # The child won this round and runs another before it is accepted (no verdict yet).
    confirming: bool = False
    # The arms decided alike: no verdict, a wider step (TunerSettings.tie_decisions).
    tie: bool = False


@dataclass
class TunerState:
    """What the tuner has learned: the parent's and the child's (rtt, queue) weights, sigma,
    recent outcomes and the history. Handed to the sink after every step (tuner.state_file)
    and restored by `state_from_doc`."""

    parent: tuple[float, float]
    child: tuple[float, float]
    sigma: float
    samples: int = 0
    outcomes: list[bool] = field(default_factory=list)
    parent_score_ms: float | None = None
    frozen: bool = False
    earned_p95_ms: float | None = None
    stale_rounds: int = 0
    # Rounds in a row the current child has won (confirm_rounds).
    wins: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def p95(values: Sequence[float] | np.ndarray) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), 95))


def tail_mean(values: np.ndarray, fraction: float, axis: int = -1) -> Any:
    """The mean of the slowest `fraction` of the values (at least one) along `axis`."""
    v = np.sort(np.asarray(values, dtype=float), axis=axis)
    k = max(1, round(v.shape[axis] * fraction))
    return np.take(v, np.arange(v.shape[axis] - k, v.shape[axis]), axis=axis).mean(axis=axis)


def state_from_doc(doc: Any, settings: TunerSettings) -> TunerState | None:
    """A saved state (the sink's dict) for these settings. None if it was saved in
    another mode; ValueError if it is not a valid state."""
    try:
        raw = dict(doc)
        if raw.pop("mode") != settings.mode:
            return None
        st = TunerState(**raw)
        st.parent = settings.clip(tuple(st.parent))  # type: ignore[arg-type]
        st.child = settings.clip(tuple(st.child))  # type: ignore[arg-type]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"not a tuner state: {e}") from e
    if not all(math.isfinite(v) and v > 0 for v in (*st.parent, *st.child, st.sigma)):
        raise ValueError("weights and sigma must be positive numbers")
    return st


def score(settings: TunerSettings, samples: np.ndarray) -> Any:
    """Each row's score (the last axis holds an arm's samples)."""
    if settings.score == "p95":
        return np.percentile(samples, 95, axis=-1)
    if settings.score == "mean":
        return np.mean(samples, axis=-1)
    return tail_mean(samples, settings.tail_fraction)  # "tail" (checked at construction)


# The largest exponent taken: exp(709.8) overflows a float. A weight's bounds lie far
# below exp(700), so a step capped there is clipped to them as before; a sigma grown
# without bound (the paper's mode has no cap) no longer raises OverflowError.
MAX_EXPONENT = 700.0


def _exp(x: float) -> float:
    return math.exp(min(x, MAX_EXPONENT))


def _reflect(x: float, lo: float, hi: float) -> float:
    """exp(x), with x mirrored once at log(lo) or log(hi) when it lies beyond it."""
    a, b = math.log(lo), math.log(hi)
    return _exp(2 * a - x if x < a else 2 * b - x if x > b else x)


class TunerCore:
    """What the strategies use of the tuner: its settings, state and RNG, and the shared
    steps (sigma's 1/5 rule, the history, mutation, saving); `learn.tuner.Tuner` is one."""

    HISTORY = 500

    def __init__(
        self, settings: TunerSettings, state: TunerState, rng: random.Random, sink: StateSink | None
    ) -> None:
        self.s = settings
        self.state = state
        self.rng = rng
        self._sink = sink
        # Steps taken by this process, by outcome (the metrics' counters; `history` is
        # capped and comes back from the state file).
        self.steps_accepted = 0
        self.steps_rejected = 0
        self.steps_tied = 0

    def finish_round(
        self,
        accepted: bool,
        parent_ms: float | None,
        child_ms: float | None,
        bounded: bool,
        note: str = "",
    ) -> Step:
        st = self.state
        st.outcomes = [*st.outcomes, accepted][-self.s.success_window :]
        if len(st.outcomes) >= self.s.success_window:
            rate = sum(st.outcomes) / len(st.outcomes)
            if rate > 0.2:
                st.sigma /= self.s.factor
            elif rate < 0.2:
                st.sigma *= self.s.factor
        if bounded:
            st.sigma = min(self.s.sigma_max, max(self.s.sigma_min, st.sigma))
        step = self.record(accepted, parent_ms, child_ms, note)
        st.child = self.mutate(st.parent)
        self.save()
        return step

    def finish_tie(self, note: str) -> Step:
        """The arms decided alike: the round says nothing about the child. Not an outcome
        of the 1/5 rule; sigma grows (to sigma_max) and a new child is drawn."""
        st = self.state
        st.sigma = min(self.s.tie_sigma_max, max(self.s.sigma_min, st.sigma / self.s.factor))
        st.wins = st.stale_rounds = 0
        step = self.record(False, None, None, note, tie=True)
        st.child = self.mutate(st.parent)
        self.save()
        return step

    def record(
        self,
        accepted: bool,
        parent_ms: float | None,
        child_ms: float | None,
        note: str,
        confirming: bool = False,
        tie: bool = False,
    ) -> Step:
        st = self.state
        step = Step(
            samples=st.samples,
            parent=st.parent,
            child=st.child,
            accepted=accepted,
            sigma=st.sigma,
            parent_p95_ms=parent_ms,
            child_p95_ms=child_ms,
            note=note,
            confirming=confirming,
            tie=tie,
        )
        if accepted:
            self.steps_accepted += 1
        elif tie:
            self.steps_tied += 1
        elif not confirming:
            self.steps_rejected += 1
        st.history = [*st.history, asdict(step)][-self.HISTORY :]
        return step

    # -- weights ----------------------------------------------------------------------

    def mutate(self, w: tuple[float, float]) -> tuple[float, float]:
        """A Gaussian step in log space, clipped to the bounds; with `ties`, reflected at
        them first (clipping puts half the draws from a corner back on it)."""
        sigma = self.state.sigma
        if not self.s.ties:  # clipped
            return self.s.clip(
                (
                    _exp(math.log(w[0]) + sigma * self.rng.gauss(0, 1)),
                    _exp(math.log(w[1]) + sigma * self.rng.gauss(0, 1)),
                )
            )
        (rlo, rhi), (qlo, qhi) = self.s.rtt_bounds, self.s.queue_bounds
        return self.s.clip(
            (
                _reflect(math.log(w[0]) + sigma * self.rng.gauss(0, 1), rlo, rhi),
                _reflect(math.log(w[1]) + sigma * self.rng.gauss(0, 1), qlo, qhi),
            )
        )

    def save(self) -> None:
        if self._sink is not None:
            self._sink({"mode": str(self.s.mode), **asdict(self.state)})


class Strategy(Protocol):
    """How one mode serves its arms and decides when a round ends (`paired`, `paper`)."""

    # Drop a sample decided by weights a finished round replaced.
    checks_stale: bool

    def start(self) -> None:
        """New weights to tune from (at start, or set by an operator)."""

    def reset(self) -> None:
        """Forget the round in progress."""

    def arm_for(self, request_id: str, session_key: str | None) -> str: ...

    def arm_sizes(self) -> dict[str, int]: ...

    def observe(
        self, arm: str, ttft_ms: float, e2e_ms: float, alike: bool | None = None
    ) -> Step | None:
        """A scored completion of `arm`; the step it ended, if any. `alike`: the other arm
        would have decided it the same way (None: not reported)."""

    def decided(self, alike: bool) -> Step | None:
        """A decision of the current arms: whether the other arm's weights would have
        chosen the same backend; the step it ended (a tie), if any."""
