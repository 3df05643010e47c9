"""The tuner's default strategy (`paired` mode): parent and child serve interleaved
traffic at the same time, each round re-measures the parent, and a child wins only when a
bootstrap says it is better with `confidence` and its E2E is not worse than `e2e_guard`
(see `learn.tuner` for the whole method)."""

from __future__ import annotations

import hashlib
import zlib

import numpy as np

from ext_proc.config.schema import TunerArmKey
from ext_proc.learn.settings import CHILD, PARENT, Step, TunerCore, p95, score


class PairedRounds:
    """The `paired` mode's Strategy: parent and child serve interleaved traffic, picked by a
    hash of the request (or its session), and each round compares them on its own samples."""

    checks_stale = True  # a sample decided by weights a finished round replaced is dropped

    def __init__(self, tuner: TunerCore) -> None:
        self.t = tuner
        # This round's samples per arm: (ttft, e2e).
        self.round: dict[str, list[tuple[float, float]]] = {PARENT: [], CHILD: []}
        # Decisions reported under the current child (both arms), and how many of them
        # the other arm's weights would have decided differently.
        self.decisions = self.differing = 0

    def start(self) -> None:
        """Fresh weights: a child to compare at once (none while frozen)."""
        st = self.t.state
        if not st.frozen:
            st.child = self.t.mutate(st.parent)

    def reset(self) -> None:
        self.round = {PARENT: [], CHILD: []}
        self.decisions = self.differing = 0

    def arm_sizes(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.round.items()}

    def arm_for(self, request_id: str, session_key: str | None) -> str:
        if self.t.state.frozen:
            return PARENT
        # A hash, not alternation: arrivals correlated with the order cannot bias an arm.
        by_session = self.t.s.arm_key == TunerArmKey.SESSION and session_key
        salt = self.t.s.arm_salt
        if salt:  # a second tuner's arms: a hash unrelated to crc32's (CRC is affine, so
            # any bit of crc32(salt + key) is one of crc32(key)'s, flipped by its length)
            key = (session_key if by_session else request_id) or ""
            digest = hashlib.blake2b(f"{salt}{key}".encode(), digest_size=1).digest()
            return CHILD if digest[0] & 1 else PARENT
        if by_session:
            # Salted: the simulator shards sessions by crc32(key) % routers.
            return CHILD if zlib.crc32(f"arm:{session_key}".encode()) & 1 else PARENT
        return CHILD if zlib.crc32(request_id.encode()) & 1 else PARENT

    def observe(
        self, arm: str, ttft_ms: float, e2e_ms: float, alike: bool | None = None
    ) -> Step | None:
        self.round[arm].append((ttft_ms, e2e_ms))
        if self.t.state.frozen:
            return self._watch_frozen()
        n = min(len(v) for v in self.round.values())
        if n >= self.t.s.arm_size:
            return self._round_ends()
        # Looked at once each time the shorter arm reaches a multiple of early_arm_size.
        if len(self.round[arm]) == n and n % self.t.s.early_arm_size == 0:
            return self._round_ends(early=True)
        return None

    def decided(self, alike: bool) -> Step | None:
        if self.t.state.frozen:
            return None
        self.decisions += 1
        self.differing += not alike
        if self.differing == 0 and self.decisions >= self.t.s.tie_decisions:
            return self._tie()
        return None

    def _tie(self) -> Step:
        """The arms decided alike: a new child, from a wider step (TunerCore.finish_tie)."""
        note = f"decided alike ({self.differing} of {self.decisions} decisions differed): tie"
        self.reset()
        return self.t.finish_tie(note)

    def _round_ends(self, early: bool = False) -> Step | None:
        s, st = self.t.s, self.t.state
        parent = np.array(self.round[PARENT], dtype=float)
        child = np.array(self.round[CHILD], dtype=float)
        p95_parent, p95_child = p95(parent[:, 0]), p95(child[:, 0])
        if self.decisions and self.differing < s.tie_share * self.decisions:
            return self._tie()
        better = self._confidence_better(parent[:, 0], child[:, 0])
        if early and 1 - s.early_confidence < better < s.early_confidence:
            return None  # not sure yet: the round goes on to arm_size
        self.reset()
        e2e_ok = bool(score(s, child[:, 1]) <= score(s, parent[:, 1]) * (1 + s.e2e_guard))
        won = better >= s.confidence and e2e_ok
        note = f"P(child better) {better:.2f}" + ("" if e2e_ok else ", E2E guard")
        if early:
            note += f", decided at {min(len(parent), len(child))} per arm"
        if won and st.wins + 1 < s.confirm_rounds:
            # Won once: the same child runs again on fresh requests before it is accepted.
            st.wins += 1
            return self.t.record(False, p95_parent, p95_child, note + "; to confirm", True)
        accepted, st.wins = won, 0
        if accepted:
            st.parent, st.earned_p95_ms, st.stale_rounds = st.child, p95_child, 0
        else:
            st.earned_p95_ms = p95_parent
            at_min = st.sigma <= s.sigma_min * 1.0001
            st.stale_rounds = st.stale_rounds + 1 if at_min else 0
        freeze = st.stale_rounds >= s.freeze_after
        note += "; frozen" if freeze else ""
        step = self.t.finish_round(accepted, p95_parent, p95_child, bounded=True, note=note)
        if freeze:
            st.frozen, st.child = True, st.parent
            self.t.save()
        return step

    def _watch_frozen(self) -> Step | None:
        samples = self.round[PARENT]
        if len(samples) < 2 * self.t.s.arm_size:
            return None
        now_p95 = p95([t for t, _ in samples])
        self.round[PARENT] = []
        st = self.t.state
        if st.earned_p95_ms is not None and now_p95 > self.t.s.drift * st.earned_p95_ms:
            st.frozen, st.sigma, st.stale_rounds, st.wins = False, self.t.s.sigma0, 0, 0
            st.child = self.t.mutate(st.parent)
            return self.t.record(False, now_p95, None, "drift: exploring again")
        return None

    def _confidence_better(self, parent: np.ndarray, child: np.ndarray) -> float:
        """Bootstrap probability that the child's p95 TTFT is below the parent's."""
        rng = np.random.default_rng(self.t.rng.getrandbits(32))
        b = self.t.s.bootstrap
        ps = score(self.t.s, rng.choice(parent, (b, len(parent))))
        cs = score(self.t.s, rng.choice(child, (b, len(child))))
        return float(np.mean(cs < ps))
