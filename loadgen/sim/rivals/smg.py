"""The SGLang Model Gateway (SMG 1.13.0, smg-project/smg, Rust) policies over HTTP: what
`smg launch --policy cache_aware|least_load|prefix_hash` does with its defaults.

Sources (paths under model_gateway/src/; read at commits f8daa88 and 65e5d81 of
smg-project/smg, the v1.9 line, with the 1.13 changes from `smg launch --help` 1.13.0 and
/work/shared/peer-routers.md §1):
- policies/least_load.rs `LeastLoadPolicy::score`: the expected wait
  W = (Q + R·p + D)/T + λ·k/(1-k) (the R·p term is 1.13's, per the shared survey; the v1.9
  code read has none: `running_term`); Q = the engine's waiting uncached tokens, else its
  waiting requests · p; D = tokens dispatched since the last poll (p a request over HTTP,
  reset by each poll); T = its gen_throughput, else 2000 tok/s; k = KV usage ≤ 0.999;
  p = 1024; λ = 0.15 s. A worker with no report while others report: load·p/T̄ (mean
  reported throughput); none reporting: load (join-shortest-queue). Ties at random;
  the winner is credited p.
- worker/monitor.rs: the loads come from a poll of each engine every
  `--load-monitor-interval` (10 s), unconditional in 1.13.
- worker/overload.rs: a worker whose last poll read waiting ≥ 8 or KV ≥ 0.8 is left out
  (on by default in 1.13: --worker-overload-waiting-requests 8, --worker-overload-token-usage
  0.8); all of them out: the least loaded.
- policies/cache_aware.rs `select_worker_with_text`, `gate_selected_candidate`: the text tree
  (trees.TextTree), a hit above --cache-threshold 0.3 goes to the holders of the deepest
  matched node, less those over --balance-rel-threshold 1.5 x mean load AND mean + margin
  (--balance-abs-threshold 64, capped by 1.13's help at "two standard deviations" of the
  in-flight count at the current mean, never under 4: taken as 2·√mean, a Poisson count's);
  argmin W among the rest (1.13; v1.9 took the least loaded); a miss: argmin W over all.
  Then the text is inserted under the chosen worker; LRU eviction every
  --eviction-interval-secs 60 down to --max-tree-size 2^26 characters shared by all workers.
- policies/prefix_hash.rs `load_ok`, `find_worker_with_load_balance` and
  worker/hash_ring.rs (150 virtual nodes a worker): the key is the first
  --prefix-token-count 256 tokens (1024 characters of text; here the prompt's first trace
  block); keep the ring owner if load ≤ max(1.25·avg, avg + 10), avg = (Σ load + 1)/n; else
  the least loaded worker within that bound; else the owner.

`load()` is SMG's own count of requests it sent and has not seen finish: the candidates'
`in_flight` (the router's books in the simulator are the same books).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ext_proc.vocab.policy import Choice
from ext_proc.vocab.types import Candidate, RouteRequest, Weights
from loadgen.sim.rivals.base import (
    EngineLoad,
    RivalPolicy,
    RivalView,
    argmin_random,
    register_rival,
)
from loadgen.sim.rivals.trees import TextTree


@dataclass(frozen=True)
class SmgParams:
    # --load-monitor-interval (s): how often each engine's load is polled.
    load_monitor_interval_s: float = 10.0
    # LeastLoadPolicy::new() (least_load.rs DEFAULT_*): λ (s), fallback T (tok/s), p.
    kv_pressure_weight_s: float = 0.15
    default_throughput_tok_s: float = 2000.0
    mean_prefill_tokens: int = 1024
    # W's R·p term (1.13 per the shared survey; absent from the v1.9 code read).
    running_term: bool = True
    # The overload veto (worker/overload.rs; 1.13 defaults); None: off.
    overload_waiting_requests: int | None = 8
    overload_token_usage: float | None = 0.8
    # cache_aware (--cache-threshold, --balance-*-threshold, --eviction-interval-secs,
    # --max-tree-size).
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_chars: int = 2**26
    # prefix_hash (--prefix-hash-load-factor, --prefix-hash-balance-abs-threshold).
    prefix_hash_load_factor: float = 1.25
    prefix_hash_abs_threshold: int = 10


# Ties of W within this are broken at random (least_load.rs: exact equality, in f64; one
# microsecond here, as the survey has it, since our floats take other paths).
TIE_S = 1e-6
# worker/hash_ring.rs VIRTUAL_NODES_PER_WORKER.
VNODES = 150


class _Smg(RivalPolicy):
    """What every SMG policy shares: the polled loads, the overload veto, W."""

    poll_tokens = True

    def __init__(self, rng: random.Random, params: SmgParams | None = None) -> None:
        super().__init__(rng)
        self.p = params or SmgParams()
        self.poll_interval_s = self.p.load_monitor_interval_s
        self.loads: dict[str, EngineLoad] = {}
        self.vetoed: set[str] = set()
        # tokens dispatched since each worker's last poll (D)
        self.since_poll: dict[str, float] = {}

    def on_poll(self, backend: str, load: EngineLoad) -> None:
        self.loads[backend] = load
        self.since_poll[backend] = 0.0
        p = self.p
        over = (
            p.overload_waiting_requests is not None
            and load.waiting_reqs >= p.overload_waiting_requests
        ) or (p.overload_token_usage is not None and load.kv_usage >= p.overload_token_usage)
        if over:
            self.vetoed.add(backend)
        else:
            self.vetoed.discard(backend)

    def eligible(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """The workers not vetoed for overload at their last poll."""
        return [c for c in candidates if c.backend_id not in self.vetoed]

    def expected_wait_s(self, among: Sequence[Candidate]) -> dict[str, float]:
        """W of each worker in `among` (least_load.rs `score`)."""
        p = self.p
        reported = [self.loads[c.backend_id] for c in among if c.backend_id in self.loads]
        rates = [r.gen_throughput_tok_s for r in reported if r.gen_throughput_tok_s > 0]
        nominal = sum(rates) / len(rates) if rates else p.default_throughput_tok_s
        out: dict[str, float] = {}
        for c in among:
            load = self.loads.get(c.backend_id)
            if load is None:
                out[c.backend_id] = (
                    c.in_flight * p.mean_prefill_tokens / nominal if reported else c.in_flight
                )
                continue
            queued = load.waiting_uncached_tokens or load.waiting_reqs * p.mean_prefill_tokens
            running = load.running_reqs * p.mean_prefill_tokens if p.running_term else 0
            rate = load.gen_throughput_tok_s or p.default_throughput_tok_s
            k = min(max(load.kv_usage, 0.0), 0.999)
            work = queued + running + self.since_poll.get(c.backend_id, 0.0)
            out[c.backend_id] = work / rate + p.kv_pressure_weight_s * k / (1 - k)
        return out

    def least_wait(self, among: Sequence[Candidate]) -> tuple[str, dict[str, float]]:
        """argmin W, ties at random; the winner is credited one request's tokens (p: the
        HTTP path knows no token count)."""
        scores = self.expected_wait_s(among)
        chosen = argmin_random(scores, self.rng, TIE_S)
        self.credit(chosen)
        return chosen, scores

    def credit(self, backend: str) -> None:
        self.since_poll[backend] = self.since_poll.get(backend, 0.0) + self.p.mean_prefill_tokens

    def least_loaded(self, candidates: Sequence[Candidate]) -> str:
        """Every worker vetoed: the request goes to the least loaded (by `load()`)."""
        return argmin_random({c.backend_id: float(c.in_flight) for c in candidates}, self.rng)


@register_rival("smg_least_load")
class SmgLeastLoad(_Smg):
    """SMG `--policy least_load`: argmin of the expected wait W over the workers not vetoed.
    Built as the benchmark runs it (emulator/rivals, issue 50): `--load-monitor-interval 2`
    and `--least-load-default-throughput` from the engine profile, unless given params."""

    name = "smg_least_load"

    def __init__(self, rng: random.Random, params: SmgParams | None = None) -> None:
        self._bench = params is None
        super().__init__(rng, params or SmgParams(load_monitor_interval_s=2.0))

    def bind(self, view: RivalView) -> None:
        super().bind(view)
        if self._bench:
            rate = self.view.decode_throughput_tok_s()
            self.p = SmgParams(load_monitor_interval_s=2.0, default_throughput_tok_s=rate)

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        among = self.eligible(candidates)
        if not among:
            return Choice(self.least_loaded(candidates), {})
        chosen, scores = self.least_wait(among)
        return Choice(chosen, scores)


@register_rival("smg_cache_aware")
class SmgCacheAware(_Smg):
    """SMG's default policy, `--policy cache_aware`, over HTTP with its defaults."""

    name = "smg_cache_aware"

    def __init__(self, rng: random.Random, params: SmgParams | None = None) -> None:
        super().__init__(rng, params)
        self.tree = TextTree()
        self._next_eviction_s = self.p.eviction_interval_s

    def spill_margin(self, mean: float) -> float:
        """The absolute part of the spill gate: --balance-abs-threshold, capped at two
        standard deviations of the in-flight count at the mean (2·√mean), never under 4
        unless the threshold is lower."""
        abs_t = float(self.p.balance_abs_threshold)
        return min(abs_t, max(min(4.0, abs_t), 2.0 * math.sqrt(max(mean, 0.0))))

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        now_s = self.view.now_s()
        while now_s >= self._next_eviction_s:
            self.tree.evict(self.p.max_tree_chars, per_tenant=False)
            self._next_eviction_s += self.p.eviction_interval_s
        prompt = self.view.prompt(request.request_id)
        among = self.eligible(candidates)
        if not among:
            chosen = self.least_loaded(candidates)
            self.tree.insert(prompt, chosen, now_s)
            return Choice(chosen, {})
        match = self.tree.match(prompt)
        pool = among
        if match.rate > self.p.cache_threshold:
            mean = sum(c.in_flight for c in among) / len(among)
            margin = self.spill_margin(mean)
            rel = self.p.balance_rel_threshold

            def spills(c: Candidate) -> bool:
                return c.in_flight > rel * mean and c.in_flight > mean + margin

            holders = [c for c in among if c.backend_id in match.tenants and not spills(c)]
            pool = holders or [c for c in among if not spills(c)] or among
        chosen, scores = self.least_wait(pool)
        self.tree.insert(prompt, chosen, now_s)
        return Choice(chosen, scores)


def _ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@register_rival("smg_prefix_hash")
class SmgPrefixHash(_Smg):
    """SMG `--policy prefix_hash`: consistent hashing of the prompt's head, bounded load."""

    name = "smg_prefix_hash"

    def __init__(self, rng: random.Random, params: SmgParams | None = None) -> None:
        super().__init__(rng, params)
        self._ring: list[tuple[int, str]] = []
        self._ring_of: tuple[str, ...] = ()

    def owner(self, key: str, among: Sequence[str]) -> str:
        """The ring's first virtual node at or after the key's position whose worker is in
        `among` (hash_ring.rs find_healthy_url)."""
        workers = tuple(sorted(among))
        if not self._ring or not set(workers) <= set(self._ring_of):
            self._ring_of = tuple(sorted(set(self._ring_of) | set(workers)))
            self._ring = sorted(
                (_ring_hash(f"{w}#{i}"), w) for w in self._ring_of for i in range(VNODES)
            )
        at = bisect.bisect_left(self._ring, (_ring_hash(key), ""))
        n = len(self._ring)
        for j in range(n):
            w = self._ring[(at + j) % n][1]
            if w in workers:
                return w
        raise ValueError("no worker on the ring")

    def load_ok(self, load: int, total: int, n: int) -> bool:
        if total == 0:
            return True
        avg = (total + 1) / n
        bound = max(avg * self.p.prefix_hash_load_factor, avg + self.p.prefix_hash_abs_threshold)
        return load <= bound

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        among = self.eligible(candidates)
        if not among:
            return Choice(self.least_loaded(candidates), {})
        prompt = self.view.prompt(request.request_id)
        key = f"{prompt.blocks[0]:x}" if prompt.blocks else request.request_id
        loads = {c.backend_id: c.in_flight for c in among}
        total, n = sum(loads.values()), len(loads)
        owner = self.owner(key, list(loads))
        scores = {b: float(v) for b, v in loads.items()}
        if self.load_ok(loads[owner], total, n):
            return Choice(owner, scores)
        fine = [b for b, v in loads.items() if self.load_ok(v, total, n)]
        if fine:
            return Choice(min(fine, key=lambda b: loads[b]), scores)
        return Choice(owner, scores)
