"""Online tuning of the cost weights by a (1+1) evolution strategy in log space.

Pure: time comes from the caller's completions, randomness from an injected RNG, and its
state goes to an injected sink (the shell persists it; see `state_from_doc` to restore).
The same object runs in `gorgo serve` (fed by Envoy's access log) and in `gorgo simulate`.

Two modes:

- `paper`: the GORGO paper's method, kept to reproduce it. The current weights serve all
  traffic; every `rescore_every` completions the score is the p95 TTFT of the last
  `window` completions; a child is kept if its score is at most 0.5 % *worse* than the
  parent's (the paper's tolerance sign), the parent's score is never re-measured, and
  sigma follows Rechenberg's 1/5 rule with no bounds.
- `paired` (default): parent and child run at the same time on interleaved traffic (a hash
  of the request id, or with `arm_key` "session" of its session key, picks the arm), so
  both face the same load; every round re-measures the parent; a child wins only if a
  bootstrap over the round's samples says it is better with `confidence`, and only if its
  p95 E2E is not worse than the parent's by more than `e2e_guard`; sigma stays within
  [sigma_min, sigma_max]. After `freeze_after` rounds in a row without a better child at
  minimal sigma, the parent is frozen (all traffic); if its p95 later drifts above
  `drift` x what it earned, exploration resumes. A child that wins a round runs another
  and is accepted only if it wins that too (`confirm_rounds`); a round already sure
  either way at `early_arm_size` per arm ends there.

The objective (`objective`) says what a completion's TTFT sample is: its TTFT (`ttft`,
default), or its excess over its own floor (`excess_ttft`: TTFT minus what the prompt
alone costs on an idle engine, which the caller passes and no weight changes), so that
an arm's score is not set by which arm drew the longest prompts. E2E is never adjusted.
"""

from __future__ import annotations

import logging
import math
import random
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ext_proc.config.schema import TunerArmKey, TunerMode, TunerObjective
from ext_proc.core.types import Weights

log = logging.getLogger("gorgo.tuner")

PAPER = TunerMode.PAPER
PAIRED = TunerMode.PAIRED
TTFT, EXCESS_TTFT = TunerObjective.TTFT, TunerObjective.EXCESS_TTFT
PARENT, CHILD = "parent", "child"
Bounds = tuple[tuple[float, float], tuple[float, float]]
# Receives the tuner's state (a JSON-able dict) after every step.
StateSink = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class TunerSettings:
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

    @staticmethod
    def paper() -> TunerSettings:
        return TunerSettings(mode=PAPER, rtt_bounds=(0.05, 2.0), queue_bounds=(0.05, 0.5))

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


@dataclass
class TunerState:
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


def _p95(values: Sequence[float] | np.ndarray) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), 95))


def tail_mean(values: np.ndarray, fraction: float, axis: int = -1) -> Any:
    """The mean of the slowest `fraction` of the values (at least one) along `axis`."""
    v = np.sort(np.asarray(values, dtype=float), axis=axis)
    k = max(1, round(v.shape[axis] * fraction))
    return np.take(v, np.arange(v.shape[axis] - k, v.shape[axis]), axis=axis).mean(axis=axis)


class Tuner:
    HISTORY = 500

    def __init__(
        self,
        settings: TunerSettings,
        initial: Weights,
        rng: random.Random,
        restored: TunerState | None = None,
        sink: StateSink | None = None,
    ) -> None:
        self.s = settings
        self.rng = rng
        self._sink = sink
        init = settings.clip((initial.rtt, initial.queue))
        self.state = restored or TunerState(init, init, settings.sigma0)
        st = self.state
        # paper mode scores the initial weights first; paired mode starts a child at once
        if st.child == st.parent and not st.frozen and settings.mode == PAIRED:
            st.child = self._mutate(st.parent)
        # Arm and weights of each request in flight, and this round's samples per arm:
        # (ttft, e2e).
        self._arm: dict[str, tuple[str, tuple[float, float]]] = {}
        self._round: dict[str, list[tuple[float, float]]] = {PARENT: [], CHILD: []}
        self._recent: deque[float] = deque(maxlen=settings.window)
        self._since_score = 0
        # Steps taken by this process, by outcome (the metrics' counters; `history` is
        # capped and comes back from the state file).
        self.steps_accepted = 0
        self.steps_rejected = 0
        # Completions not scored: their request was decided by weights since replaced.
        self.stale_samples = 0

    # -- serving ----------------------------------------------------------------------

    def arm_for(self, request_id: str, session_key: str | None = None) -> str:
        if self.s.mode == PAPER:
            return CHILD  # the weights under evaluation serve everything
        if self.state.frozen:
            return PARENT
        # A hash, not alternation: arrivals correlated with the order cannot bias an arm.
        if self.s.arm_key == TunerArmKey.SESSION and session_key:
            # Salted: the simulator shards sessions by crc32(key) % routers.
            return CHILD if zlib.crc32(f"arm:{session_key}".encode()) & 1 else PARENT
        return CHILD if zlib.crc32(request_id.encode()) & 1 else PARENT

    def weights_for(self, request_id: str, session_key: str | None = None) -> Weights:
        arm = self.arm_for(request_id, session_key)
        w = self._arm_weights(arm)
        self._arm[request_id] = (arm, w)
        return Weights(*w)

    def _arm_weights(self, arm: str) -> tuple[float, float]:
        return self.state.child if arm == CHILD else self.state.parent

    @property
    def weights(self) -> Weights:
        return Weights(*self.state.parent)

    # -- learning ---------------------------------------------------------------------

    def forget(self, request_id: str) -> None:
        """A request closed without saying anything about its weights (cancelled)."""
        self._arm.pop(request_id, None)

    def observe(
        self,
        request_id: str,
        ttft_ms: float | None,
        e2e_ms: float | None,
        floor_ms: float = 0.0,
    ) -> Step | None:
        """A request completed. Returns the step taken, if this completion ended one.
        `floor_ms`: the request's own decision-independent TTFT (the `excess_ttft`
        objective scores ttft_ms - floor_ms; the `ttft` objective ignores it)."""
        tag = self._arm.pop(request_id, None)
        if tag is None or ttft_ms is None:
            return None
        arm, w = tag
        if self.s.mode != PAPER and w != self._arm_weights(arm):
            self.stale_samples += 1  # decided by weights a finished round replaced
            return None
        self.state.samples += 1
        e2e = e2e_ms if e2e_ms is not None else ttft_ms
        if self.s.objective == EXCESS_TTFT:
            ttft_ms -= floor_ms
        if self.s.mode == PAPER:
            return self._observe_paper(ttft_ms)
        self._round[arm].append((ttft_ms, e2e))
        if self.state.frozen:
            return self._watch_frozen()
        n = min(len(v) for v in self._round.values())
        if n >= self.s.arm_size:
            return self._paired_round()
        # Looked at once each time the shorter arm reaches a multiple of early_arm_size.
        if len(self._round[arm]) == n and n % self.s.early_arm_size == 0:
            return self._paired_round(early=True)
        return None

    def _observe_paper(self, ttft_ms: float) -> Step | None:
        self._recent.append(ttft_ms)
        self._since_score += 1
        if self._since_score < self.s.rescore_every or len(self._recent) < self.s.window:
            return None
        self._since_score = 0
        score = _p95(self._recent)
        st = self.state
        if st.parent_score_ms is None:  # the first window scores the initial weights
            st.parent_score_ms = score
            step = self._record(False, score, None, "parent scored")
            st.child = self._mutate(st.parent)
            return step
        # The paper's test: a child up to 0.5 % worse is still accepted (sign error), and
        # the parent's score stands from whenever it was measured.
        accepted = score <= st.parent_score_ms * 1.005
        if accepted:
            st.parent, st.parent_score_ms = st.child, score
        return self._finish_round(accepted, st.parent_score_ms, score, bounded=False)

    def _paired_round(self, early: bool = False) -> Step | None:
        parent = np.array(self._round[PARENT], dtype=float)
        child = np.array(self._round[CHILD], dtype=float)
        better = self._confidence_better(parent[:, 0], child[:, 0])
        if early and 1 - self.s.early_confidence < better < self.s.early_confidence:
            return None  # not sure yet: the round goes on to arm_size
        self._round = {PARENT: [], CHILD: []}
        p95_parent, p95_child = _p95(parent[:, 0]), _p95(child[:, 0])
        e2e_ok = bool(
            self._score(child[:, 1]) <= self._score(parent[:, 1]) * (1 + self.s.e2e_guard)
        )
        won = better >= self.s.confidence and e2e_ok
        note = f"P(child better) {better:.2f}" + ("" if e2e_ok else ", E2E guard")
        if early:
            note += f", decided at {min(len(parent), len(child))} per arm"
        st = self.state
        if won and st.wins + 1 < self.s.confirm_rounds:
            # Won once: the same child runs again on fresh requests before it is accepted.
            st.wins += 1
            return self._record(False, p95_parent, p95_child, note + "; to confirm", True)
        accepted, st.wins = won, 0
        if accepted:
            st.parent, st.earned_p95_ms, st.stale_rounds = st.child, p95_child, 0
        else:
            st.earned_p95_ms = p95_parent
            at_min = st.sigma <= self.s.sigma_min * 1.0001
            st.stale_rounds = st.stale_rounds + 1 if at_min else 0
        freeze = st.stale_rounds >= self.s.freeze_after
        note += "; frozen" if freeze else ""
        step = self._finish_round(accepted, p95_parent, p95_child, bounded=True, note=note)
        if freeze:
            st.frozen, st.child = True, st.parent
            self._save()
        return step

    def _watch_frozen(self) -> Step | None:
        samples = self._round[PARENT]
        if len(samples) < 2 * self.s.arm_size:
            return None
        p95 = _p95([t for t, _ in samples])
        self._round[PARENT] = []
        st = self.state
        if st.earned_p95_ms is not None and p95 > self.s.drift * st.earned_p95_ms:
            st.frozen, st.sigma, st.stale_rounds, st.wins = False, self.s.sigma0, 0, 0
            st.child = self._mutate(st.parent)
            return self._record(False, p95, None, "drift: exploring again")
        return None

    def _confidence_better(self, parent: np.ndarray, child: np.ndarray) -> float:
        """Bootstrap probability that the child's p95 TTFT is below the parent's."""
        rng = np.random.default_rng(self.rng.getrandbits(32))
        b = self.s.bootstrap
        ps = self._score(rng.choice(parent, (b, len(parent))))
        cs = self._score(rng.choice(child, (b, len(child))))
        return float(np.mean(cs < ps))

    def _score(self, samples: np.ndarray) -> Any:
        """Each row's score (the last axis holds an arm's samples)."""
        if self.s.score == "p95":
            return np.percentile(samples, 95, axis=-1)
        if self.s.score == "mean":
            return np.mean(samples, axis=-1)
        return tail_mean(samples, self.s.tail_fraction)

    def _finish_round(
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
        step = self._record(accepted, parent_ms, child_ms, note)
        st.child = self._mutate(st.parent)
        self._save()
        return step

    def _record(
        self,
        accepted: bool,
        parent_ms: float | None,
        child_ms: float | None,
        note: str,
        confirming: bool = False,
    ) -> Step:
        st = self.state
        step = Step(
            st.samples,
            st.parent,
            st.child,
            accepted,
            st.sigma,
            parent_ms,
            child_ms,
            note,
            confirming,
        )
        if accepted:
            self.steps_accepted += 1
        elif not confirming:
            self.steps_rejected += 1
        st.history = [*st.history, asdict(step)][-self.HISTORY :]
        return step

    # -- weights ----------------------------------------------------------------------

    def _mutate(self, w: tuple[float, float]) -> tuple[float, float]:
        sigma = self.state.sigma
        return self.s.clip(
            (
                math.exp(math.log(w[0]) + sigma * self.rng.gauss(0, 1)),
                math.exp(math.log(w[1]) + sigma * self.rng.gauss(0, 1)),
            )
        )

    # -- operations -------------------------------------------------------------------

    def freeze(self) -> None:
        self.state.frozen, self.state.child, self.state.wins = True, self.state.parent, 0
        self._save()

    def unfreeze(self) -> None:
        st = self.state
        st.frozen, st.sigma, st.stale_rounds, st.wins = False, self.s.sigma0, 0, 0
        st.child = self._mutate(st.parent)
        self._save()

    def set_weights(self, w: Weights) -> None:
        st = self.state
        st.parent = st.child = self.s.clip((w.rtt, w.queue))
        st.parent_score_ms, st.earned_p95_ms, st.wins = None, None, 0
        if not st.frozen and self.s.mode == PAIRED:
            st.child = self._mutate(st.parent)
        self._round = {PARENT: [], CHILD: []}
        self._save()

    def snapshot(self) -> dict[str, Any]:
        st = self.state
        return {
            "mode": self.s.mode,
            "objective": self.s.objective,
            "weights": {"rtt": st.parent[0], "queue": st.parent[1]},
            "child": {"rtt": st.child[0], "queue": st.child[1]},
            "sigma": st.sigma,
            "samples": st.samples,
            "frozen": st.frozen,
            "arm_sizes": {k: len(v) for k, v in self._round.items()},
            "recent_steps": st.history[-10:],
        }

    def _save(self) -> None:
        if self._sink is not None:
            self._sink({"mode": str(self.s.mode), **asdict(self.state)})

    @property
    def in_flight_arms(self) -> int:
        """Requests whose arm is remembered until they close."""
        return len(self._arm)


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
