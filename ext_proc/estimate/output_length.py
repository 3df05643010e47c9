"""How many tokens a request will generate, learned from completions (docs/cost-model.md,
"E2E"): per model, and per objective and tenant when the request names them.

A client's `max_tokens` is a cap, not a length: some clients set it to the length they
want (the simulator's trace replays do), most to a bound the answer rarely reaches. So
each key keeps two things, both forgetting old completions geometrically:
- the share of its completions that stopped at their `max_tokens` (those that set one),
  starting at 1 (the cap is the length, as the router assumed before it learned);
- a histogram of the output lengths of the completions that did not, in log-spaced
  buckets, each with the mean of what fell in it.
A request's expected output is then  p_hit * cap + (1 - p_hit) * E[min(X, cap)]  (no cap:
E[X]). The most specific key with enough completions answers; none: the cap, or
`DEFAULT_OUTPUT_TOKENS` (a typical chat answer) without one.

A conversation's turns are alike (on the shared conversation trace successive turns'
output lengths correlate 0.53): so E[min(X, cap)] is shrunk toward the session's own
recent outputs, (S + K * E) / (N + K) with S and N its decayed sum and count
(SESSION_DECAY per turn) and K = SESSION_PRIOR turns; the last MAX_SESSIONS sessions
are kept.

Pure: no clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# Output assumed when a request names no max tokens and nothing is learned yet: a typical
# chat answer (the router's budget for KV before this module).
DEFAULT_OUTPUT_TOKENS = 256
# Geometric forgetting per completion of a key: an effective memory of ~200 completions,
# so a tenant whose answers change is relearned within minutes of its traffic.
FORGET = 0.995
# A key answers once it holds this much (decayed) weight; a rarer one defers to the next,
# more general key (a new tenant starts at its model's lengths).
MIN_WEIGHT = 8.0
# Buckets: log2-spaced, a quarter octave each, from 1 token to 2^20 (any real limit).
BUCKETS_PER_OCTAVE = 4
N_BUCKETS = 20 * BUCKETS_PER_OCTAVE + 1
# A completion "stopped at its max_tokens" when it generated at least this share of it
# (an engine may stop a token or two short: a stop string, the end of the context).
HIT_SHARE = 0.98
# The prior on "the cap is the length": worth this many completions, forgotten as they are.
HIT_PRIOR_WEIGHT = 2.0

# A session's earlier turns count SESSION_DECAY less per turn; the key's mean is worth
# SESSION_PRIOR turns of its own (both measured on the shared conversation trace: the
# median relative error of the next turn's length 0.29 against 0.37 for the mean alone).
SESSION_DECAY = 0.8
SESSION_PRIOR = 1.0
# Sessions remembered (least recently ended forgotten first): a few hours of a busy
# router's conversations, ~100 bytes each.
MAX_SESSIONS = 50_000

Key = tuple[str, ...]


def _bucket(tokens: int) -> int:
    return min(N_BUCKETS - 1, max(0, int(math.log2(max(1, tokens)) * BUCKETS_PER_OCTAVE)))


@dataclass
class _Lengths:
    """One key's decayed figures."""

    # per bucket: decayed weight and decayed sum of the lengths in it
    weight: list[float] = field(default_factory=lambda: [0.0] * N_BUCKETS)
    total: list[float] = field(default_factory=lambda: [0.0] * N_BUCKETS)
    # the decayed count of completions, of those that set a cap, and of those that
    # reached it (the latter two starting at the prior's, forgotten like the data's)
    seen: float = 0.0
    capped: float = HIT_PRIOR_WEIGHT
    hit: float = HIT_PRIOR_WEIGHT
    completions: int = 0

    @property
    def mass(self) -> float:
        return sum(self.weight)

    def observe(self, tokens: int, cap: int | None) -> None:
        self.completions += 1
        self.seen = self.seen * FORGET + 1.0
        reached = cap is not None and tokens >= HIT_SHARE * cap
        if cap is not None:
            self.capped = self.capped * FORGET + 1.0
            self.hit = self.hit * FORGET + (1.0 if reached else 0.0)
        if reached:
            return  # censored at its cap: says nothing of the uncapped length
        self.weight = [w * FORGET for w in self.weight]
        self.total = [t * FORGET for t in self.total]
        b = _bucket(tokens)
        self.weight[b] += 1.0
        self.total[b] += tokens

    @property
    def p_hit(self) -> float:
        """The share that stopped at their cap (the prior: all did)."""
        return self.hit / self.capped

    def mean_below(self, cap: int | None) -> float | None:
        """E[min(X, cap)] over the uncapped lengths (None: none seen)."""
        mass = self.mass
        if mass <= 0:
            return None
        s = 0.0
        for w, t in zip(self.weight, self.total, strict=True):
            if w > 0:
                mean = t / w
                s += w * (mean if cap is None else min(mean, cap))
        return s / mass


class OutputLengths:
    """The learned output lengths of one router's requests, by key (see the module)."""

    def __init__(self) -> None:
        self._keys: dict[Key, _Lengths] = {}
        # session -> (decayed sum, decayed count) of its uncapped outputs
        self._sessions: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def observe(
        self, keys: Sequence[Key], tokens: int, cap: int | None, session: str | None = None
    ) -> None:
        """A completion of `tokens` output tokens whose request set `cap` (None: none), for
        every key it belongs to (most specific first, the most general last), and its
        session (None: none known)."""
        if tokens <= 0:
            return
        for key in keys:
            self._keys.setdefault(key, _Lengths()).observe(tokens, cap)
        if session is not None and not (cap is not None and tokens >= HIT_SHARE * cap):
            s, n = self._sessions.pop(session, (0.0, 0.0))
            self._sessions[session] = (s * SESSION_DECAY + tokens, n * SESSION_DECAY + 1)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def expected(self, keys: Sequence[Key], cap: int | None, session: str | None = None) -> float:
        """The expected output of a request of these keys (most specific first) that set
        `cap` (None: none), in `session` (None: none known): the first key with MIN_WEIGHT
        of completions answers."""
        for key in keys:
            k = self._keys.get(key)
            if k is None or k.seen < MIN_WEIGHT:
                continue
            below = k.mean_below(cap)
            if below is not None:
                below = self._in_session(session, below, cap)
            if cap is None:
                if below is not None:
                    return below
                continue  # all its completions stopped at a cap: no uncapped length
            p = k.p_hit
            return p * cap + (1 - p) * (below if below is not None else cap)
        return float(cap) if cap is not None else float(DEFAULT_OUTPUT_TOKENS)

    def _in_session(self, session: str | None, mean: float, cap: int | None) -> float:
        """The key's mean shrunk toward the session's own outputs (module docstring)."""
        if session is None or (seen := self._sessions.get(session)) is None:
            return mean
        s, n = seen
        own = s / n if cap is None else min(s / n, cap)
        return (own * n + SESSION_PRIOR * mean) / (n + SESSION_PRIOR)

    def as_json(self) -> dict[str, dict[str, float | int | None]]:
        """Per key ("model/objective=x"...): completions, the share that stopped at their
        max_tokens, and the mean uncapped length."""
        out: dict[str, dict[str, float | int | None]] = {}
        for key, k in self._keys.items():
            below = k.mean_below(None)
            out["/".join(key) or "*"] = {
                "completions": k.completions,
                "stopped_at_max_tokens": round(k.p_hit, 4),
                "mean_tokens": None if below is None else round(below, 1),
            }
        return out


def keys_for(model: str | None, objective: str, tenant: str) -> list[Key]:
    """A request's keys, most specific first: its model and objective, its model and
    tenant, its model, any model."""
    m = model or ""
    keys: list[Key] = []
    if objective:
        keys.append((m, f"objective={objective}"))
    if tenant:
        keys.append((m, f"tenant={tenant}"))
    keys.append((m,))
    if m:
        keys.append(())
    return keys
