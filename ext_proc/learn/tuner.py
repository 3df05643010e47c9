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
  either way at `early_arm_size` per arm ends there. A round whose arms decide alike
  (the router reports, per decision, whether the other arm's weights would have chosen
  the same backend: `decided`) is a tie: it tells nothing, so it is no 1/5-rule failure;
  sigma grows instead and a new child is drawn (`tie_decisions`, `tie_share`).

The objective (`objective`) says what a completion's TTFT sample is: its TTFT (`ttft`,
default), or its excess over its own floor (`excess_ttft`: TTFT minus what the prompt
alone costs on an idle engine, which the caller passes and no weight changes), so that
an arm's score is not set by which arm drew the longest prompts. E2E is never adjusted.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ext_proc.config.schema import TunerMode
from ext_proc.learn.paired import PairedRounds
from ext_proc.learn.paper import PaperRule
from ext_proc.learn.settings import (
    CHILD,
    EXCESS_TTFT,
    PAIRED,
    PAPER,
    PARENT,
    StateSink,
    Step,
    Strategy,
    TunerCore,
    TunerSettings,
    TunerState,
)
from ext_proc.vocab.types import Weights


@dataclass(slots=True)
class _Tag:
    """A request in flight: its arm, that arm's weights, and whether the other arm would
    have decided it alike (None: not reported)."""

    arm: str
    weights: tuple[float, float]
    alike: bool | None = None


# One strategy per mode: how arms are served and when a round ends.
STRATEGIES: dict[TunerMode, Callable[[TunerCore], Strategy]] = {
    PAIRED: PairedRounds,
    PAPER: PaperRule,
}


class Tuner(TunerCore):
    """Tunes the cost weights online (the module's docstring): each request gets its arm's
    weights (`weights_for`), each completion scores that arm (`observe`), and the mode's
    Strategy decides when a child replaces the parent. core.build makes one only for a
    weighted policy with tuning on."""

    def __init__(
        self,
        settings: TunerSettings,
        initial: Weights | tuple[float, float],
        rng: random.Random,
        restored: TunerState | None = None,
        sink: StateSink | None = None,
    ) -> None:
        values = (initial.rtt, initial.queue) if isinstance(initial, Weights) else initial
        init = settings.clip(values)
        super().__init__(settings, restored or TunerState(init, init, settings.sigma0), rng, sink)
        if settings.mode not in STRATEGIES:
            raise ValueError(f"tuner mode {settings.mode!r} has no strategy")
        self._strategy = STRATEGIES[settings.mode](self)
        if self.state.child == self.state.parent:
            self._strategy.start()
        # Arm and weights of each request in flight, and whether the other arm would
        # have decided it alike (None: not reported).
        self._arm: dict[str, _Tag] = {}
        # Completions not scored: their request was decided by weights since replaced.
        self.stale_samples = 0

    # -- serving ----------------------------------------------------------------------

    def arm_for(self, request_id: str, session_key: str | None = None) -> str:
        return self._strategy.arm_for(request_id, session_key)

    def weights_for(self, request_id: str, session_key: str | None = None) -> Weights:
        return Weights(*self.values_for(request_id, session_key))

    def values_for(self, request_id: str, session_key: str | None = None) -> tuple[float, float]:
        """The two values this request's arm serves (remembered until it closes)."""
        arm = self.arm_for(request_id, session_key)
        w = self._arm_weights(arm)
        self._arm[request_id] = _Tag(arm, w)
        return w

    def _arm_weights(self, arm: str) -> tuple[float, float]:
        return self.state.child if arm == CHILD else self.state.parent

    @property
    def weights(self) -> Weights:
        return Weights(*self.state.parent)

    def other_weights(self, request_id: str) -> Weights | None:
        """The weights of the arm that did not decide this request in flight (None when
        no comparison is running: frozen, the paper's mode, or a request not seen)."""
        tag = self._arm.get(request_id)
        if tag is None or self.state.frozen or self.s.mode != PAIRED or not self.s.ties:
            return None
        return Weights(*self._arm_weights(PARENT if tag.arm == CHILD else CHILD))

    # -- learning ---------------------------------------------------------------------

    def decided(self, request_id: str, alike: bool) -> Step | None:
        """The router's report on a decision: `alike` if the other arm's weights
        (`other_weights`) would have chosen the same backend. Returns the step taken, if
        it ended one (a round whose arms decide alike is a tie, see TunerSettings)."""
        tag = self._arm.get(request_id)
        if tag is None or not self._current(tag):
            return None  # decided by weights a finished round replaced
        tag.alike = alike
        return self._strategy.decided(alike)

    def _current(self, tag: _Tag) -> bool:
        """Decided by the weights its arm still has."""
        return tag.weights == self._arm_weights(tag.arm)

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
        if self._strategy.checks_stale and not self._current(tag):
            self.stale_samples += 1  # decided by weights a finished round replaced
            return None
        self.state.samples += 1
        e2e = e2e_ms if e2e_ms is not None else ttft_ms
        if self.s.objective == EXCESS_TTFT:
            ttft_ms -= floor_ms
        return self._strategy.observe(tag.arm, ttft_ms, e2e, tag.alike)

    # -- operations -------------------------------------------------------------------

    def freeze(self) -> None:
        self.state.frozen, self.state.child, self.state.wins = True, self.state.parent, 0
        self.save()

    def unfreeze(self) -> None:
        st = self.state
        st.frozen, st.sigma, st.stale_rounds, st.wins = False, self.s.sigma0, 0, 0
        st.child = self.mutate(st.parent)
        self.save()

    def set_weights(self, w: Weights) -> None:
        st = self.state
        st.parent = st.child = self.s.clip((w.rtt, w.queue))
        st.parent_score_ms, st.earned_p95_ms, st.wins = None, None, 0
        self._strategy.start()
        self._strategy.reset()
        self.save()

    def snapshot(self) -> dict[str, Any]:
        st, names = self.state, self.s.names
        return {
            "mode": self.s.mode,
            "objective": self.s.objective,
            self.s.label: dict(zip(names, st.parent, strict=True)),
            "child": dict(zip(names, st.child, strict=True)),
            "sigma": st.sigma,
            "samples": st.samples,
            "frozen": st.frozen,
            "arm_sizes": self._strategy.arm_sizes(),
            # Requests whose arm is remembered until they close (a leak would grow it).
            "requests_in_flight": len(self._arm),
            "recent_steps": st.history[-10:],
        }
