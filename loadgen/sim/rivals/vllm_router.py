"""vllm-router 0.1.17 (vllm-project/router, Rust) policies with their defaults.

Sources (read in vllm-project/router, about 0.1.10, and /work/shared/peer-routers.md §2):
- src/policies/cache_aware.rs `select_worker_cache_aware_with_decision`: the old SGLang
  rule. Over all workers, if max - min load > --balance-abs-threshold 64 AND max >
  --balance-rel-threshold 1.5 x min: the least loaded (`min_by_key`: the first of the
  least). Otherwise the text tree (trees.TextTree): a match rate above --cache-threshold
  0.3 goes to the tenant the tree returns for the deepest matched node (src/tree.rs takes
  the first of a hash map's keys: here the first by a fixed hash of the worker's id),
  else the least loaded. Then the text is inserted under the chosen worker; LRU eviction
  every --eviction-interval 120 s down to --max-tree-size 2^25 characters per worker.
- src/policies/sticky_least_loaded.rs `select_worker_with_headers`: the session key
  (x-session-id, ...; here the request's session) keeps the worker it was given; a new
  session goes to the worker with the fewest active sessions, ties by rendezvous hashing of
  "key:worker"; sessions end only by /finish_session or after 7200 s unused (swept at most
  every 60 s). A request without a key goes to the fewest-sessions worker, not recorded.

`load()` is the router's own count of requests in flight: the candidates' `in_flight`.
"""

from __future__ import annotations

import hashlib
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from ext_proc.vocab.policy import Choice
from ext_proc.vocab.types import Candidate, RouteRequest, Weights
from loadgen.sim.rivals.base import RivalPolicy, register_rival
from loadgen.sim.rivals.trees import TextTree


@dataclass(frozen=True)
class VllmRouterParams:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_chars: int = 2**25
    # sticky_least_loaded: DEFAULT_SESSION_EXPIRATION_SECS, SWEEP_INTERVAL_SECS.
    session_expiration_s: float = 7200.0
    sweep_interval_s: float = 60.0


def _first_of(tenants: frozenset[str]) -> str:
    """The tenant a hash map's iteration meets first: fixed for a given set."""
    return min(tenants, key=lambda t: (zlib.crc32(t.encode()), t))


def _least_loaded(candidates: Sequence[Candidate]) -> str:
    """`min_by_key(load)`: the first of the least loaded, in the workers' order."""
    return min(candidates, key=lambda c: c.in_flight).backend_id


@register_rival("vllm_router_cache_aware")
class VllmRouterCacheAware(RivalPolicy):
    """vllm-router's default policy, `--policy cache_aware`."""

    name = "vllm_router_cache_aware"

    def __init__(self, rng: random.Random, params: VllmRouterParams | None = None) -> None:
        super().__init__(rng)
        self.p = params or VllmRouterParams()
        self.tree = TextTree()
        self._next_eviction_s = self.p.eviction_interval_s

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        now_s = self.view.now_s()
        while now_s >= self._next_eviction_s:
            self.tree.evict(self.p.max_tree_chars, per_tenant=True)
            self._next_eviction_s += self.p.eviction_interval_s
        prompt = self.view.prompt(request.request_id)
        loads = [c.in_flight for c in candidates]
        lo, hi = min(loads), max(loads)
        scores = {c.backend_id: float(c.in_flight) for c in candidates}
        if hi - lo > self.p.balance_abs_threshold and hi > self.p.balance_rel_threshold * lo:
            chosen = _least_loaded(candidates)
        else:
            match = self.tree.match(prompt)
            live = match.tenants & set(scores)
            if match.rate > self.p.cache_threshold and live:
                chosen = _first_of(frozenset(live))
            else:
                chosen = _least_loaded(candidates)
        self.tree.insert(prompt, chosen, now_s)
        return Choice(chosen, scores)


def _rendezvous(key: str, worker: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(f"{key}:{worker}".encode(), digest_size=8).digest(), "big"
    )


@register_rival("vllm_router_sticky_least_loaded")
class VllmRouterStickyLeastLoaded(RivalPolicy):
    """vllm-router `--policy sticky_least_loaded`, sessions by x-session-id."""

    name = "vllm_router_sticky_least_loaded"

    def __init__(self, rng: random.Random, params: VllmRouterParams | None = None) -> None:
        super().__init__(rng)
        self.p = params or VllmRouterParams()
        # session -> (worker, last used)
        self.sessions: dict[str, tuple[str, float]] = {}
        self.active: dict[str, int] = {}
        self._last_sweep_s = 0.0

    def _sweep(self, now_s: float) -> None:
        if now_s - self._last_sweep_s < self.p.sweep_interval_s:
            return
        for key, (worker, used_s) in list(self.sessions.items()):
            if now_s - used_s >= self.p.session_expiration_s:
                del self.sessions[key]
                self.active[worker] -= 1
        self._last_sweep_s = now_s

    def _fewest(self, candidates: Sequence[Candidate], key: str) -> str:
        counts = {c.backend_id: self.active.get(c.backend_id, 0) for c in candidates}
        least = min(counts.values())
        tied = [b for b, n in counts.items() if n == least]
        return max(tied, key=lambda b: _rendezvous(key, b))

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        now_s = self.view.now_s()
        self._sweep(now_s)
        scores = {c.backend_id: float(self.active.get(c.backend_id, 0)) for c in candidates}
        key = request.session_key
        if not key:
            return Choice(self._fewest(candidates, request.request_id), scores)
        known = self.sessions.get(key)
        if known is not None:
            worker = known[0]
            if worker in scores:
                self.sessions[key] = (worker, now_s)
                return Choice(worker, scores)
            del self.sessions[key]
            self.active[worker] -= 1
        worker = self._fewest(candidates, key)
        self.sessions[key] = (worker, now_s)
        self.active[worker] = self.active.get(worker, 0) + 1
        return Choice(worker, scores)
