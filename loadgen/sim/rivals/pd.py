"""The P/D routers' rules (prefill and decode on different engines), each a `PairPolicy`
(ext_proc/vocab/policy.py) whose legs are the single-engine rules of this package, with the
defaults and the coupling each router's P/D mode has (the sources, read for issue 59:
/work/pd-rules.md's findings, cited by file here).

- `smg_pd`: SMG `--pd-disaggregation` (model_gateway/src/routers/http/pd_router.rs
  `select_pd_pair`): the prefill worker by `--prefill-policy`, the decode worker by
  `--decode-policy`, each unset one falling back to `--policy` (default cache_aware) as an
  instance of its own (routers/factory.rs `create_pd_router`); neither looks at the
  other's pick. Both legs `smg_cache_aware`.
- `vllm_router_pd`: vllm-router `--vllm-pd-disaggregation` (src/routers/http/
  vllm_pd_router.rs; routers/factory.rs `create_vllm_pd_router`): the same shape, default
  cache_aware on both legs, independent. Both legs `vllm_router_cache_aware`.
- `llmd_pd`: llm-d's disagg profile handler, decode first (pkg/epp/framework/plugins/
  scheduling/profilehandler/disagg/disagg_profile_handler.go `pickDecodeFirst`): the decode
  pod by its profile (llm-d-router deploy/config, pd-epp-config: prefix-cache 2 + queue 1,
  max-score picker); then `prefix-based-pd-decider` (prefix_based_pd_decider.go `disaggregate`)
  sends the prompt to a prefill pod only if its tokens not cached on that decode pod are
  at least nonCachedTokens (16 in the shipped configs), else the decode pod prefills it; the
  prefill pod by prefix-cache 2 + queue 1 + topology-affinity 1 (pd-topology-epp-config.
  yaml; scorer/topologyaffinity/scorer.go: host 1.0, rack 0.2, zone 0.05, region 0.02;
  here a region is a zone: 0.05 for a prefill engine in the decode's region, else 0).
- `dynamo_pd`: Dynamo's disaggregated serving, prefill first (docs/components/router/
  router-disaggregated-serving.md): the prefill worker by the KV router's cost (overlap
  weight 1: `dynamo_kv`); the decode worker by load alone (overlap credit 0: decode
  blocks), among those in the prefill worker's zone (topology-aware-kv-transfer.md,
  enforcement `required`, the default). Conditional disaggregation is off by default.

Each leg's rule keeps its own books, as each router keeps one policy instance per leg;
the loads they read (`Candidate.in_flight`) are the router's, where a prefill leg counts
on its engine until its answer reached the router or the decode's first byte came (SMG
holds it to the stream's end, vllm-router to the prefill's answer: a difference of books,
not of rule).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ext_proc.vocab.events import BackendChanged, Closed, Dispatched, FirstByte
from ext_proc.vocab.policy import Choice, PairPick
from ext_proc.vocab.types import Candidate, RouteRequest, Weights
from loadgen.sim.rivals.base import EngineLoad, RivalPolicy, RivalView, register_rival
from loadgen.sim.rivals.dynamo import DynamoKv, DynamoParams
from loadgen.sim.rivals.llmd import LlmdParams, LlmdWeighted
from loadgen.sim.rivals.smg import SmgCacheAware
from loadgen.sim.rivals.vllm_router import VllmRouterCacheAware

# llm-d's P/D profiles (llm-d-router deploy/config, pd-epp-config): prefix-cache 2 + queue 1.
LLMD_PD = LlmdParams(prefix_weight=2.0, queue_weight=1.0, kv_weight=0.0)
# prefix_based_pd_decider.go nonCachedTokens, as the shipped P/D configs set it.
LLMD_NON_CACHED_TOKENS = 16
# topologyaffinity/scorer.go levelScores: a zone shared (a region here), its weight 1.
LLMD_ZONE_AFFINITY = 0.05


class LegByLeg(RivalPolicy):
    """A P/D router: a rule of its own for each leg, hearing what both would."""

    def __init__(self, rng: random.Random, prefill: RivalPolicy, decode: RivalPolicy) -> None:
        super().__init__(rng)
        self.prefill, self.decode = prefill, decode
        legs = (prefill, decode)
        polls = [leg.poll_interval_s for leg in legs if leg.poll_interval_s is not None]
        self.poll_interval_s = min(polls) if polls else None
        self.poll_tokens = any(leg.poll_tokens for leg in legs)
        self.kv_events = any(leg.kv_events for leg in legs)

    def bind(self, view: RivalView) -> None:
        super().bind(view)
        self.prefill.bind(view)
        self.decode.bind(view)

    def on_poll(self, backend: str, load: EngineLoad) -> None:
        self.prefill.on_poll(backend, load)
        self.decode.on_poll(backend, load)

    def on_kv_events(self, backend: str, changes: Sequence[tuple[Any, ...]]) -> None:
        self.prefill.on_kv_events(backend, changes)
        self.decode.on_kv_events(backend, changes)

    def on_dispatch(self, e: Dispatched) -> None:
        self.prefill.on_dispatch(e)
        self.decode.on_dispatch(e)

    def on_first_byte(self, e: FirstByte) -> None:
        self.prefill.on_first_byte(e)
        self.decode.on_first_byte(e)

    def on_close(self, e: Closed) -> None:
        self.prefill.on_close(e)
        self.decode.on_close(e)

    def on_backend(self, e: BackendChanged) -> None:
        self.prefill.on_backend(e)
        self.decode.on_backend(e)

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        """A fleet without prefill engines: the decode leg's rule alone."""
        return self.decode.choose(request, candidates, weights)

    def choose_pair(
        self, request: RouteRequest, decodes: Sequence[Candidate], prefills: Sequence[Candidate]
    ) -> PairPick:
        """Each leg by its own rule, neither looking at the other's pick."""
        prefill = self.prefill.choose(request, prefills, None).backend_id if prefills else None
        return PairPick(self.decode.choose(request, decodes, None).backend_id, prefill)

    def region(self, backend: str) -> str:
        return self.view.region_of(backend)


@register_rival("smg_pd")
class SmgPd(LegByLeg):
    """SMG's P/D mode with its defaults: cache_aware on each leg."""

    name = "smg_pd"

    def __init__(self, rng: random.Random) -> None:
        legs = (SmgCacheAware(random.Random(rng.random())) for _ in range(2))
        super().__init__(rng, *legs)


@register_rival("vllm_router_pd")
class VllmRouterPd(LegByLeg):
    """vllm-router's P/D mode with its defaults: cache_aware on each leg."""

    name = "vllm_router_pd"

    def __init__(self, rng: random.Random) -> None:
        legs = (VllmRouterCacheAware(random.Random(rng.random())) for _ in range(2))
        super().__init__(rng, *legs)


@register_rival("llmd_pd")
class LlmdPd(LegByLeg):
    """llm-d's P/D: decode first, then a prefill pod if enough of the prompt is uncached on
    the decode pod, scored with the topology-affinity scorer (module docstring)."""

    name = "llmd_pd"

    def __init__(self, rng: random.Random) -> None:
        prefill = LlmdWeighted(random.Random(rng.random()), LLMD_PD)
        decode = LlmdWeighted(random.Random(rng.random()), LLMD_PD)
        super().__init__(rng, prefill, decode)
        self.prefill_leg, self.decode_leg = prefill, decode

    def choose_pair(
        self, request: RouteRequest, decodes: Sequence[Candidate], prefills: Sequence[Candidate]
    ) -> PairPick:
        # the decode pod's prefix match, as the decider reads it (before its own PreRequest)
        _, prompt, hashes, prefix = self.decode_leg.lookup(request, decodes)
        decode = self.decode_leg.choose(request, decodes, None).backend_id
        cached = round(prefix[decode] * len(hashes)) * self.decode_leg.block_tokens()
        if not prefills or prompt.input_tokens - cached < LLMD_NON_CACHED_TOKENS:
            return PairPick(decode, None)  # the decode pod prefills it itself
        home = self.region(decode)
        self.prefill_leg.extra = {
            c.backend_id: LLMD_ZONE_AFFINITY for c in prefills if self.region(c.backend_id) == home
        }
        try:
            return PairPick(decode, self.prefill_leg.choose(request, prefills, None).backend_id)
        finally:
            self.prefill_leg.extra = {}


@register_rival("dynamo_pd")
class DynamoPd(LegByLeg):
    """Dynamo's disaggregated serving: prefill first by the KV router's cost, then the
    decode by load alone in the prefill worker's zone (module docstring)."""

    name = "dynamo_pd"

    def __init__(self, rng: random.Random) -> None:
        prefill = DynamoKv(random.Random(rng.random()))
        decode = DynamoKv(random.Random(rng.random()), DynamoParams(overlap_score_weight=0.0))
        super().__init__(rng, prefill, decode)

    def choose_pair(
        self, request: RouteRequest, decodes: Sequence[Candidate], prefills: Sequence[Candidate]
    ) -> PairPick:
        if not prefills:  # no prefill worker: decode-only
            return PairPick(self.decode.choose(request, decodes, None).backend_id, None)
        prefill = self.prefill.choose(request, prefills, None).backend_id
        zone = self.region(prefill)
        # `required`: only the decode workers in the prefill's zone (all, in a fleet
        # whose zone has none: the simulator's fleets have a decode engine in each region)
        near = [c for c in decodes if self.region(c.backend_id) == zone] or list(decodes)
        return PairPick(self.decode.choose(request, near, None).backend_id, prefill)
