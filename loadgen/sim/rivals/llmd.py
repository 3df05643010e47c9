"""llm-d's endpoint picker (llm-d/llm-d-router at v0.10.0, Go): its own default
configuration, and the llm-d guides' "sticky until saturated".

What the EPP sees (v0.10.0):
- Engine metrics scraped every 50 ms (pkg/epp/server/options.go RefreshMetricsInterval):
  the waiting queue (vllm:num_requests_waiting) and KV usage (vllm:kv_cache_usage_perc).
- Its own prefix index (pkg/epp/framework/plugins/requestcontrol/dataproducer/
  approximateprefix/plugin.go `Produce`, `matchLongestPrefix`, `PreRequest`; indexer.go):
  the prompt hashed in blocks of the engine's block size but at least 64 tokens
  (minBlockSizeTokens), matched against per-server LRUs of what it sent there, each of the
  engine's GPU-block count (autoTune from its metrics). Not the engines' KV events: that is
  the precise scorer, not in these configurations.
- In-flight load (dataproducer/inflightload/README.md): per server the uncached prompt
  tokens of the requests it sent (the prompt less its prefix match there), released at the
  first response chunk (streaming).

`llmd_weighted` (config/loader/defaults.go `loadDefaultConfig`): score = 3·prefix + 2·queue
+ 2·kv, max-score picker (ties at random); prefix = matched blocks / prompt blocks
(scorer/prefix, matchLengthWeight 0); queue = (max q - q)/(max q - min q), 1 when all equal
(scorer/queuedepth/queue.go); kv = 1 - KV usage (scorer/kvcacheutilization).

`llmd_sticky` (llm-d/llm-d#2071, the guides' default): prefix-cache-affinity-filter
(filter/prefixcacheaffinity/plugin.go: keep servers with prefix score ≥ 0.80, all when none
passes; but keep all when the best sticky server's TTFT exceeds the best other's by more
than 18000 ms, TTFT = in-flight tokens / 15928 tok/s), then token-load-scorer
(scorer/tokenload: 1 - min(1, in-flight tokens / 4 Mi)), max-score picker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ext_proc.vocab.events import Closed, FirstByte
from ext_proc.vocab.policy import Choice
from ext_proc.vocab.types import Candidate, RouteRequest, Weights
from loadgen.sim.rivals.base import EngineLoad, Prompt, RivalPolicy, argmax_random, register_rival
from loadgen.sim.rivals.trees import LruBlocks

# options.go RefreshMetricsInterval.
SCRAPE_INTERVAL_S = 0.05
# approximateprefix/plugin.go minBlockSizeTokens.
MIN_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class LlmdParams:
    # loadDefaultConfig's weights.
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    # prefix-cache-affinity-filter: affinityThreshold, maxTTFTPenaltyMs,
    # peakPrefillThroughput (tok/s).
    affinity_threshold: float = 0.80
    max_ttft_penalty_ms: float = 18000.0
    peak_prefill_tok_s: float = 15928.0
    # token-load-scorer queueThresholdTokens (4 Mi).
    queue_threshold_tokens: int = 4 * 1024 * 1024


def prefix_blocks(prompt: Prompt, block_tokens: int) -> list[int]:
    """The prompt's full blocks of `block_tokens` (which divides or is a multiple of the
    trace's blocks), each hash naming its prefix: sub-blocks (k, j) of trace block k, or
    runs of trace blocks (the last one's id names the run and what came before)."""
    full = prompt.input_tokens // block_tokens
    if block_tokens <= prompt.block_tokens:
        per = prompt.block_tokens // block_tokens
        return [hash((k, j, "llmd")) for k in prompt.blocks for j in range(per)][:full]
    per = block_tokens // prompt.block_tokens
    return [hash((prompt.blocks[(i + 1) * per - 1], "llmd")) for i in range(full)]


class _Epp(RivalPolicy):
    """The EPP's data: scraped metrics, its prefix index, its in-flight tokens."""

    poll_interval_s = SCRAPE_INTERVAL_S

    def __init__(self, rng: random.Random, params: LlmdParams | None = None) -> None:
        super().__init__(rng)
        self.p = params or LlmdParams()
        self.metrics: dict[str, EngineLoad] = {}
        self.index = LruBlocks()
        self.in_flight_tokens: dict[str, int] = {}
        # request -> (server, tokens it holds there until its first byte)
        self._held: dict[str, tuple[str, int]] = {}

    def on_poll(self, backend: str, load: EngineLoad) -> None:
        self.metrics[backend] = load

    def block_tokens(self) -> int:
        return max(MIN_BLOCK_TOKENS, self.view.engine_block_tokens())

    def lookup(
        self, request: RouteRequest, candidates: Sequence[Candidate]
    ) -> tuple[list[str], Prompt, list[int], dict[str, float]]:
        """The servers, the request's prompt, its blocks' hashes and each server's prefix
        score: what both of the EPP's configurations start from."""
        servers = [c.backend_id for c in candidates]
        prompt = self.view.prompt(request.request_id)
        hashes = prefix_blocks(prompt, self.block_tokens())
        return servers, prompt, hashes, self.prefix_scores(hashes, servers)

    def prefix_scores(self, hashes: Sequence[int], servers: Sequence[str]) -> dict[str, float]:
        """matched blocks / prompt blocks per server (0 for an empty prompt)."""
        matched = self.index.match(hashes)
        total = len(hashes)
        return {s: matched.get(s, 0) / total if total else 0.0 for s in servers}

    def dispatch(
        self, request: RouteRequest, server: str, prompt: Prompt, hashes: list[int], score: float
    ) -> None:
        """PreRequest: the index learns the prompt's blocks on the server; the in-flight
        load takes its uncached tokens."""
        capacity = self.view.kv_capacity_tokens(server) // self.view.engine_block_tokens()
        self.index.add(hashes, server, capacity)
        matched_tokens = round(score * len(hashes)) * self.block_tokens()
        tokens = max(0, prompt.input_tokens - matched_tokens)
        self.in_flight_tokens[server] = self.in_flight_tokens.get(server, 0) + tokens
        self._held[request.request_id] = (server, tokens)

    def _release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            server, tokens = held
            self.in_flight_tokens[server] -= tokens

    def on_first_byte(self, e: FirstByte) -> None:
        self._release(e.request_id)

    def on_close(self, e: Closed) -> None:
        self._release(e.request_id)


@register_rival("llmd_weighted")
class LlmdWeighted(_Epp):
    """The EPP's own default: 3 prefix : 2 queue : 2 KV utilisation, max-score picker."""

    name = "llmd_weighted"
    # Another scorer's weighted score per server, for this request (the P/D prefill
    # profile's topology-affinity scorer: loadgen/sim/rivals/pd.py); none by default.
    extra: dict[str, float] = {}

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        servers, prompt, hashes, prefix = self.lookup(request, candidates)
        queues = {s: self.metrics[s].waiting_reqs if s in self.metrics else 0 for s in servers}
        lo, hi = min(queues.values()), max(queues.values())
        p = self.p
        scores: dict[str, float] = {}
        for s in servers:
            queue = 1.0 if hi == lo else (hi - queues[s]) / (hi - lo)
            kv = 1.0 - (self.metrics[s].kv_usage if s in self.metrics else 0.0)
            scores[s] = p.prefix_weight * prefix[s] + p.queue_weight * queue + p.kv_weight * kv
            scores[s] += self.extra.get(s, 0.0)
        chosen = argmax_random(scores, self.rng)
        self.dispatch(request, chosen, prompt, hashes, prefix[chosen])
        return Choice(chosen, {s: -v for s, v in scores.items()})


@register_rival("llmd_sticky")
class LlmdSticky(_Epp):
    """The llm-d guides' "sticky until saturated": prefix-cache-affinity filter, then the
    token-load scorer, max-score picker."""

    name = "llmd_sticky"

    def ttft_ms(self, server: str) -> float:
        return self.in_flight_tokens.get(server, 0) / self.p.peak_prefill_tok_s * 1000

    def affinity(self, prefix: dict[str, float]) -> list[str]:
        """The filter's survivors: the sticky servers, unless none is or their best TTFT is
        more than the penalty above the best of the others."""
        sticky = [s for s, v in prefix.items() if v >= self.p.affinity_threshold]
        others = [s for s in prefix if s not in sticky]
        if not sticky:
            return list(prefix)
        if others:
            gap_ms = min(map(self.ttft_ms, sticky)) - min(map(self.ttft_ms, others))
            if gap_ms > self.p.max_ttft_penalty_ms:
                return list(prefix)
        return sticky

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        _, prompt, hashes, prefix = self.lookup(request, candidates)
        kept = self.affinity(prefix)
        limit = self.p.queue_threshold_tokens
        scores = {s: 1.0 - min(1.0, self.in_flight_tokens.get(s, 0) / limit) for s in kept}
        chosen = argmax_random(scores, self.rng)
        self.dispatch(request, chosen, prompt, hashes, prefix[chosen])
        return Choice(chosen, {s: -v for s, v in scores.items()})
