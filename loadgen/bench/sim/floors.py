"""The per-request references of `gorgo bench target` (loadgen/bench/sim/target.py, whose
docstring says what each is): the no-queue floor, the burst floor and the clairvoyant
greedy scheduler (with an unbounded cache, or the engines' real KV pool)."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ext_proc.estimate.profile import EngineProfile, load_profile
from loadgen.sim.settings import SimSettings
from loadgen.sim.world import sub_blocks
from loadgen.traces.request import TraceRequest


def _engine_keys(r: TraceRequest, engine_block_tokens: int) -> list[int]:
    """The engine's keys for a request's full blocks (as the simulator submits them)."""
    per = max(1, r.block_tokens // engine_block_tokens)
    keys = sub_blocks(r.block_ids, per, 0)
    return keys[: r.input_tokens // engine_block_tokens]


def _reusable_cached(
    requests: Sequence[TraceRequest], profile: EngineProfile
) -> list[tuple[TraceRequest, int]]:
    """Each request (in arrival order) with the prompt tokens an earlier request of the
    run computed: its leading engine blocks among their full blocks, at most all but the
    last prompt token (the engine always computes one)."""
    bt = profile.block_tokens
    seen: set[int] = set()
    out: list[tuple[TraceRequest, int]] = []
    for r in sorted(requests, key=lambda r: r.arrival_s):
        keys = _engine_keys(r, bt)
        matched = 0
        for k in keys:
            if k not in seen:
                break
            matched += 1
        out.append((r, min(matched, (r.input_tokens - 1) // bt) * bt))
        seen.update(keys)
    return out


def _fleet(rtt_profile: str, engine_profile: str | None) -> tuple[EngineProfile, float, int]:
    """The engine profile, the smallest mean RTT (ms) and the number of backends."""
    s = SimSettings(rtt_profile=rtt_profile)
    profile = load_profile(engine_profile or s.engine_profile)
    return profile, min(s.rtt_ms(s.doors[0], b)[0] for b in s.regions), len(s.regions)


def floor_ttfts_ms(
    requests: Sequence[TraceRequest], rtt_profile: str, engine_profile: str | None = None
) -> list[float]:
    """Each request's no-queue floor (in arrival order): alone on an idle engine, every
    prefix an earlier request computed cached, plus the smallest mean RTT (module
    docstring)."""
    profile, min_rtt_ms, _ = _fleet(rtt_profile, engine_profile)
    return [
        profile.lone_ttft_ms(r.input_tokens, cached) + min_rtt_ms
        for r, cached in _reusable_cached(requests, profile)
    ]


def burst_floor_ttfts_ms(
    requests: Sequence[TraceRequest], rtt_profile: str, engine_profile: str | None = None
) -> list[float]:
    """Lower bounds that also count the queue a burst forces: of the requests arriving at
    one instant, sorted by TTFT, the k-th is at least the k-th smallest of their own
    floors, and at least the smallest RTT + one step's base + the token work (prefill
    without step bases, which steps share) of the ceil(k / backends) smallest of them:
    the backend that runs the most of the first k runs at least that many, one after
    another (prefill before decode, FCFS); and the last is at least the smallest RTT + a
    base + their token work / backends (some backend holds that share). Work left from
    earlier bursts is not counted,
    so it stays a lower bound; the sorted TTFTs of every policy dominate these."""
    profile, min_rtt_ms, backends = _fleet(rtt_profile, engine_profile)
    cached = _reusable_cached(requests, profile)
    base_ms = min_rtt_ms + profile.prefill_base_ms
    out: list[float] = []
    i = 0
    while i < len(cached):
        j = i
        while j < len(cached) and cached[j][0].arrival_s == cached[i][0].arrival_s:
            j += 1
        own: list[float] = []
        work: list[float] = []
        for r, c in cached[i:j]:
            lone_ms = profile.lone_ttft_ms(r.input_tokens, c)
            chunks = -(-(r.input_tokens - c) // profile.chunk_tokens)
            own.append(lone_ms + min_rtt_ms)
            work.append(lone_ms - chunks * profile.prefill_base_ms)
        own.sort()
        prefix = np.cumsum(sorted(work))
        bounds = [
            max(own[k - 1], base_ms + float(prefix[-(-k // backends) - 1]))
            for k in range(1, j - i + 1)
        ]
        # and the last of them is at least where the busiest backend's share ends
        bounds[-1] = max(bounds[-1], base_ms + float(prefix[-1]) / backends)
        out.extend(bounds)
        i = j
    return out


def clairvoyant_greedy_ttfts_ms(
    requests: Sequence[TraceRequest],
    rtt_profile: str,
    engine_profile: str | None = None,
    pool: bool = False,
    spill_ms: float = 0.0,
) -> list[float]:
    """A reference, not a bound: the TTFTs of a router that knows everything gorgo
    estimates, exactly, and decides as gorgo does, one request at a time in arrival order.
    Each request goes to the backend where its first token would come soonest: that
    backend's mean RTT, plus the prefill backlog it holds when the request reaches it,
    plus the request's own prefill there (`EngineProfile.lone_ttft_ms`) after the prefix
    that backend caches (every block it ever computed: an unbounded cache per backend).
    Its engines only prefill (a decode step never delays a prefill) and nothing jitters.
    A better schedule exists (it would look ahead, or reorder a burst), so a policy can
    beat it; but a target below it asks an online router to beat perfect information.

    `pool`: each engine caches only what its KV pool holds (`kv_capacity_tokens`, the
    least recently used block evicted first, as SGLang's radix cache and vLLM's prefix
    cache do), and the requests running there take none of it. `spill_ms` > 0: every
    session has a home backend (a hash of its key) and goes elsewhere only when its first
    token would come more than `spill_ms` sooner there (inf: always home, session
    affinity with perfect information)."""
    profile, _, _ = _fleet(rtt_profile, engine_profile)
    s = SimSettings(rtt_profile=rtt_profile)
    rtts_ms = {b: s.rtt_ms(s.doors[0], b)[0] for b in s.regions}
    homes = list(rtts_ms)
    bt = profile.block_tokens
    capacity_blocks = profile.kv_capacity_tokens // bt if pool else None
    # Each backend's cached blocks, least recently used first.
    held: dict[str, OrderedDict[int, None]] = {b: OrderedDict() for b in rtts_ms}
    free_ms = dict.fromkeys(rtts_ms, 0.0)
    out: list[float] = []
    for r in sorted(requests, key=lambda r: r.arrival_s):
        keys = _engine_keys(r, bt)
        at_ms = r.arrival_s * 1000
        home = homes[zlib.crc32(r.session.encode()) % len(homes)] if spill_ms else None
        best: tuple[float, float, str, float] | None = None  # score, TTFT, backend, done
        for b, rtt_ms in rtts_ms.items():
            matched = next((i for i, k in enumerate(keys) if k not in held[b]), len(keys))
            cached = min(matched, (r.input_tokens - 1) // bt) * bt
            done_ms = max(free_ms[b], at_ms + rtt_ms / 2) + profile.lone_ttft_ms(
                r.input_tokens, cached
            )
            ttft_ms = done_ms + rtt_ms / 2 - at_ms
            score = ttft_ms if home in (None, b) else ttft_ms + spill_ms
            if best is None or score < best[0]:
                best = (score, ttft_ms, b, done_ms)
        assert best is not None
        _, ttft_ms, b, free_ms[b] = best
        cache = held[b]
        for k in keys:
            cache[k] = None
            cache.move_to_end(k)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
        out.append(ttft_ms)
    return out
