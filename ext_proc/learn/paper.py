"""The GORGO paper's tuning rule (`paper` mode), kept to reproduce it: the weights under
evaluation serve all traffic; every `rescore_every` completions the score is the p95 TTFT
of the last `window`; a child up to 0.5 % worse is still kept (the paper's tolerance
sign), and the parent's score is never re-measured."""

from __future__ import annotations

from collections import deque

from ext_proc.learn.settings import CHILD, PARENT, Step, TunerCore, p95


class PaperRule:
    """The `paper` mode's Strategy: one arm serves everything and is scored every
    `rescore_every` completions on the last `window`; kept only to reproduce the paper."""

    checks_stale = False  # one arm: every completion scores the weights in force

    def __init__(self, tuner: TunerCore) -> None:
        self.t = tuner
        self._recent: deque[float] = deque(maxlen=tuner.s.window)
        self._since_score = 0

    def start(self) -> None:
        """The initial weights are scored first: no child yet."""

    def reset(self) -> None:
        """The paper keeps its window across a change of weights."""

    def arm_for(self, request_id: str, session_key: str | None) -> str:
        return CHILD  # the weights under evaluation serve everything

    def arm_sizes(self) -> dict[str, int]:
        return {PARENT: 0, CHILD: 0}

    def decided(self, alike: bool) -> Step | None:
        """The paper's rule scores every window, whatever the weights decided."""
        return None

    def observe(
        self, arm: str, ttft_ms: float, e2e_ms: float, alike: bool | None = None
    ) -> Step | None:
        self._recent.append(ttft_ms)
        self._since_score += 1
        if self._since_score < self.t.s.rescore_every or len(self._recent) < self.t.s.window:
            return None
        self._since_score = 0
        now_p95 = p95(self._recent)
        st = self.t.state
        if st.parent_score_ms is None:  # the first window scores the initial weights
            st.parent_score_ms = now_p95
            step = self.t.record(False, now_p95, None, "parent scored")
            st.child = self.t.mutate(st.parent)
            return step
        # The paper's test: a child up to 0.5 % worse is still accepted (sign error), and
        # the parent's score stands from whenever it was measured.
        accepted = now_p95 <= st.parent_score_ms * 1.005
        if accepted:
            st.parent, st.parent_score_ms = st.child, now_p95
        return self.t.finish_round(accepted, st.parent_score_ms, now_p95, bounded=False)
