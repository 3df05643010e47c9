"""`gorgo bench decide`: how long one routing decision takes, and what the index costs.

The router core alone (no gRPC), with warm prefix indexes (every backend's index filled to
its KV capacity with other prompts, the measured prompt's prefix cached on some backends),
for 1k-, 32k- and 128k-token prompts over 3 and 64 backends. "decide" covers hashing the
prompt into blocks, the index lookup, the cost terms and the policy; "parse + decide"
adds reading the JSON body.

Then with a real tokenizer (`tokenizer:` configured; the real-vLLM tier's tiny byte-level
BPE and ChatML template): the last turn of a multi-turn chat that renders to ~32k tokens,
tokenized (template + tokenizer) and decided on backends with precise prefix state (KV
events: the router chains the prompt's token ids), warm (the conversation's previous turn
already tokenized: only the new messages are) and cold (nothing cached), against the
approximation on the same bodies.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from emulator.engine.tokenizer import TOKENIZER_JSON, tiny_tokenizer_dir
from ext_proc.config.load import config_from_dict
from ext_proc.core.build import build_router
from ext_proc.core.router import Router
from ext_proc.prompt.engine_tokens import EngineTokenizer, PromptCache, PromptTokenizer
from ext_proc.prompt.engine_tokens import load_engine_tokenizer as _load_engine_tokenizer
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.service.app import GC_GEN0_THRESHOLD
from ext_proc.vocab.types import RouteRequest, Status
from loadgen.client.stream import percentile

# Targets from the issue (p99, decide only).
TARGET_P99_MS = {3: 1.0, 64: 5.0}
TARGET_BYTES_PER_BLOCK = 64
# Real tokenization (p99 of tokenize + decide, a 32k-token chat whose earlier turns are
# already tokenized). 32 rounds of ~1k tokens (a question, an answer three times as long);
# a second conversation of 8 rounds (~4k new tokens a turn: an agent's tool output) shows
# how the warm cost grows with what a turn adds.
TARGET_WARM_P99_MS = 5.0
CHAT_TOKENS = 32_768
CHAT_TURNS = 32


def _router(n_backends: int, precise: bool = False, recent_decisions: int = 1000) -> Router:
    """`precise`: every backend's engine publishes KV events (the stream is up, no events
    yet), so a decision chains the prompt's token ids as it matches them. `recent_decisions`:
    the decision log's size (the operator page's; /state shows 8)."""
    events = {"kv_events": {"endpoint": "tcp://127.0.0.1:1"}} if precise else {}
    cfg = config_from_dict(
        {
            "policy": "gorgo",
            "telemetry": {"recent_decisions": recent_decisions},
            "backends": [
                {
                    "id": f"b{i}",
                    "address": f"127.0.0.1:{10000 + i}",
                    "rtt_prior_ms": 10 + 5 * i,
                    **events,
                }
                for i in range(n_backends)
            ],
        }
    )
    clock_s = [0.0]
    router = build_router(cfg, lambda: clock_s[0], random.Random(0))
    for b in router.backends:
        router.inputs.set_event_stream(b, True)
    return router


def _text(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(f"{rng.randrange(1000):03d} " for _ in range(tokens))


def _warm(router: Router) -> None:
    """Fill every backend's index to capacity with unrelated prompts (128 blocks each)."""
    rng = np.random.default_rng(0)
    for b in router.backends.values():
        while b.prefix.size_blocks < b.prefix.capacity_blocks:
            b.prefix.insert(rng.integers(0, 2**63, 128, dtype=np.int64).view(np.uint64), 0.0)


def _body(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def _freeze_gc() -> None:
    """As the service runs: start-up objects frozen out of the collector (service/app.py)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD)


def measure(
    n_backends: int, tokens: int, iterations: int, recent_decisions: int = 1000
) -> tuple[list[float], list[float]]:
    router = _router(n_backends, recent_decisions=recent_decisions)
    _warm(router)
    body = _body(_text(tokens, 12345))
    # the measured prompt's history is cached on a third of the backends
    req0 = RouteRequest("seed", parse_body(CHAT, body), None)
    for i in range(0, n_backends, 3):
        router.backends[f"b{i}"].prefix.insert(router.features.prompt_blocks(req0)[0], 1.0)
    _freeze_gc()
    decide_ms, full_ms = [], []
    for i in range(iterations):
        t0 = time.perf_counter()
        llm = parse_body(CHAT, body)
        t1 = time.perf_counter()
        d = router.decide(RouteRequest(f"r{i}", llm, None))
        t2 = time.perf_counter()
        router.close(d.request_id, Status.OK)
        decide_ms.append((t2 - t1) * 1e3)
        full_ms.append((t2 - t0) * 1e3)
    return decide_ms, full_ms


# -- with a real tokenizer ------------------------------------------------------------------


def _words(rng: random.Random, lexicon: list[str], n: int) -> str:
    return " ".join(rng.choice(lexicon) for _ in range(n))


def chat_conversation(
    engine: EngineTokenizer, turns: int, tokens: int = CHAT_TOKENS, seed: int = 0
) -> tuple[list[dict[str, str]], list[str]]:
    """A conversation of `turns` rounds whose last one renders to about `tokens` tokens:
    the messages before its last user message (system, then user and assistant: a quarter
    and three quarters of each round's tokens), and last user messages to end it with (as
    many different ones as a run needs). Made-up words of the tiny model's training text."""
    from emulator.vllm.tiny_model import corpus

    rng = random.Random(seed)
    lexicon = sorted({w for line in corpus(seed, 2000) for w in line.split()})
    probe = _words(random.Random(1), lexicon, 2000)
    words = int(tokens / turns / (len(engine.tokenizer.ids(probe)) / 2000))  # per round
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    for _ in range(turns - 1):
        messages.append({"role": "user", "content": _words(rng, lexicon, words // 4)})
        messages.append({"role": "assistant", "content": _words(rng, lexicon, words * 3 // 4)})
    lasts = [_words(random.Random(seed + 100 + i), lexicon, words // 4) for i in range(1000)]
    return messages, lasts


def _chat_body(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "tiny", "messages": messages}).encode()


@dataclass
class TokenizedRun:
    # ms per decision: the approximation's decide, and tokenize + decide (+ parse) warm
    approx_ms: list[float] = field(default_factory=list)
    warm_ms: list[float] = field(default_factory=list)
    warm_parse_ms: list[float] = field(default_factory=list)
    cold_ms: list[float] = field(default_factory=list)
    tokens: int = 0  # the last turn's prompt
    new_tokens: int = 0  # of which tokenized (the rest came from the cache)
    cache: dict[str, int] = field(default_factory=dict)
    failures: int = 0


def _timed(router: Router, rid: str, llm: Any, step: PromptTokenizer | None) -> float:
    t0 = time.perf_counter()
    if step is not None:
        llm = step.apply(llm)
    d = router.decide(RouteRequest(rid, llm, None))
    t1 = time.perf_counter()
    router.close(d.request_id, Status.OK)
    return (t1 - t0) * 1e3


def measure_tokenized(
    engine: EngineTokenizer, turns: int, iterations: int, cold_iterations: int
) -> TokenizedRun:
    """The conversation's last turn (a different last message each time): tokenized and
    decided with its previous turn in the cache (warm) and with nothing cached (cold), and
    the approximation's decide on the same bodies, alternating."""
    history, lasts = chat_conversation(engine, turns)
    bodies = [_chat_body([*history, {"role": "user", "content": m}]) for m in lasts]
    entries = TokenizerConfig().cache_entries
    engine.cache = PromptCache(engine.tokenizer.ids, engine.tokenizer.boundaries()[0], entries)
    step = PromptTokenizer(engine)
    router = _router(3, precise=True)
    _warm(router)
    # the conversation's previous turn was routed (so tokenized and cached) already
    step.apply(parse_body(CHAT, _chat_body(history[:-1])))
    before = engine.cache.stats.tokenized_tokens
    _freeze_gc()
    run = TokenizedRun()
    for i in range(iterations):
        body = bodies[i % len(bodies)]
        run.approx_ms.append(_timed(router, f"a{i}", parse_body(CHAT, body), None))
        t0 = time.perf_counter()
        llm = parse_body(CHAT, body)
        run.warm_ms.append(_timed(router, f"w{i}", llm, step))
        run.warm_parse_ms.append((time.perf_counter() - t0) * 1e3)
    run.tokens = step.apply(parse_body(CHAT, bodies[0])).input_tokens
    run.new_tokens = (engine.cache.stats.tokenized_tokens - before) // (iterations + 1)
    run.cache, run.failures = engine.cache.stats.as_json(), step.failures
    boundaries, _ = engine.tokenizer.boundaries()
    for i in range(cold_iterations):
        engine.cache = PromptCache(engine.tokenizer.ids, boundaries, entries)  # nothing cached
        run.cold_ms.append(_timed(router, f"c{i}", parse_body(CHAT, bodies[i]), step))
    return run


def cold_turn_hold_ms(engine: EngineTokenizer, body: bytes, off_loop: bool) -> float:
    """The longest the event loop was held (ms) while a cold turn (nothing cached) was
    tokenized: on the loop itself, or in a worker thread as the shell does for a long
    body (ext_proc/envoy/sessions.py OFF_LOOP_BODY_BYTES). A ticker that wakes every 1 ms
    stands in for other requests' decisions."""
    boundaries, _ = engine.tokenizer.boundaries()
    engine.cache = PromptCache(engine.tokenizer.ids, boundaries, TokenizerConfig().cache_entries)
    step = PromptTokenizer(engine)

    async def run() -> float:
        done = asyncio.Event()
        worst_s = 0.0

        async def ticker() -> None:
            nonlocal worst_s
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                worst_s, last = max(worst_s, now - last - 0.001), now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        llm = parse_body(CHAT, body)
        if off_loop:
            await asyncio.to_thread(step.apply, llm)
        else:
            step.apply(llm)
        await asyncio.sleep(0.005)
        done.set()
        await tick
        return worst_s * 1e3

    return asyncio.run(run())


# -- the measurements' figures, and their tables --------------------------------------------


@dataclass(frozen=True)
class Quantiles:
    p50: float
    p99: float

    @classmethod
    def of(cls, samples: list[float]) -> Quantiles:
        return cls(percentile(samples, 50), percentile(samples, 99))


@dataclass(frozen=True)
class DecideRow:
    """One (backends, prompt) setting: ms per decision, decide alone and parse + decide;
    the target on decide's p99 (the 128k-token prompts only)."""

    n_backends: int
    tokens: int
    decide: Quantiles
    full: Quantiles
    target_p99_ms: float | None


def decide_row(
    n_backends: int, tokens: int, decide_ms: list[float], full_ms: list[float]
) -> DecideRow:
    target = TARGET_P99_MS[n_backends] if tokens == 131_072 else None
    return DecideRow(n_backends, tokens, Quantiles.of(decide_ms), Quantiles.of(full_ms), target)


@dataclass(frozen=True)
class IndexMemory:
    """The warm indexes of 3 backends: cached blocks and what they take."""

    blocks: int
    memory_bytes: int

    @property
    def bytes_per_block(self) -> float:
        return self.memory_bytes / self.blocks


def index_memory() -> IndexMemory:
    router = _router(3)
    _warm(router)
    blocks = sum(b.prefix.size_blocks for b in router.backends.values())
    return IndexMemory(blocks, sum(b.prefix.memory_bytes for b in router.backends.values()))


@dataclass(frozen=True)
class TokenizedRow:
    """One way of deciding the last turn: ms per decision, and against the approximation's
    decide on the same bodies (x its p50, x its p99)."""

    label: str
    latency: Quantiles
    x_approx: tuple[float, float]
    target_p99_ms: float | None

    @property
    def meets(self) -> bool:
        return self.target_p99_ms is None or self.latency.p99 <= self.target_p99_ms


@dataclass(frozen=True)
class TokenizedStudy:
    """One conversation's measurements: the last turn's prompt and what of it was
    tokenized per warm decision, a row per way measured, the prompt cache's counts."""

    turns: int
    tokens: int
    new_tokens: int
    rows: tuple[TokenizedRow, ...]
    cache: dict[str, int]
    failures: int

    @property
    def meets(self) -> bool:
        return all(r.meets for r in self.rows)


def tokenized_study(turns: int, run: TokenizedRun) -> TokenizedStudy:
    """A run's figures; the warm target holds on the CHAT_TURNS conversation only."""
    base = Quantiles.of(run.approx_ms)
    target = TARGET_WARM_P99_MS if turns == CHAT_TURNS else None
    measured = (
        ("approximation: decide", run.approx_ms, None),
        ("warm: tokenize + decide", run.warm_ms, target),
        ("warm: parse + tok + decide", run.warm_parse_ms, None),
        ("cold: tokenize + decide", run.cold_ms, None),
    )
    rows = []
    for label, samples, t in measured:
        if samples:
            q = Quantiles.of(samples)
            rows.append(TokenizedRow(label, q, (q.p50 / base.p50, q.p99 / base.p99), t))
    return TokenizedStudy(turns, run.tokens, run.new_tokens, tuple(rows), run.cache, run.failures)


def _target(t: float | None) -> str:
    return "" if t is None else f"<= {t:g}"


DECIDE_HEAD = (
    f"{'backends':>8} {'prompt':>7} {'decide p50':>11} {'decide p99':>11} "
    f"{'+parse p50':>11} {'+parse p99':>11} {'target p99':>10}"
)


def decide_line(r: DecideRow) -> str:
    return (
        f"{r.n_backends:>8} {r.tokens // 1024:>6}k {r.decide.p50:>11.3f} "
        f"{r.decide.p99:>11.3f} {r.full.p50:>11.3f} "
        f"{r.full.p99:>11.3f} {_target(r.target_p99_ms):>10}"
    )


def memory_line(m: IndexMemory) -> str:
    return (
        f"index memory: {m.bytes_per_block:.1f} bytes per cached block "
        f"({m.blocks} blocks over 3 backends; target <= {TARGET_BYTES_PER_BLOCK})"
    )


TOKENIZED_HEAD = (
    "\nreal tokenizer (the tiny model's byte-level BPE + ChatML template), 3 backends with "
    f"precise prefix state, the last turn of a ~{CHAT_TOKENS // 1024}k-token chat; "
    "approximation: 4 bytes/token on the same bodies. ms:\n"
    f"{'rounds':>6} {'tokens':>7} {'new':>6} {'':>24} {'p50':>7} {'p99':>7} "
    f"{'x approx p50':>12} {'x approx p99':>12} {'target p99':>10}"
)


def tokenized_lines(s: TokenizedStudy) -> str:
    lines = [
        f"{s.turns:>6} {s.tokens:>7,} {s.new_tokens:>6,} {r.label:>24} {r.latency.p50:>7.3f} "
        f"{r.latency.p99:>7.3f} {r.x_approx[0]:>12.1f} {r.x_approx[1]:>12.1f} "
        f"{_target(r.target_p99_ms):>10}"
        for r in s.rows
    ]
    c = s.cache
    lines.append(
        f"{'':>6} cache: {c['hits']} hits, {c['misses']} misses, {c['mismatches']} "
        f"mismatches, {s.failures} failures"
    )
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------


def run_tokenized_bench(iterations: int = 600, cold_iterations: int = 30) -> bool:
    """The real-tokenizer section; True when the warm p99 meets its target. `iterations`
    for the target's conversation (600: its p99 is the 6th slowest, steadier than 300's
    3rd), a third as many for the other."""
    t0 = time.monotonic()
    tiny = tiny_tokenizer_dir()
    path = tiny / TOKENIZER_JSON
    engine = _load_engine_tokenizer(TokenizerConfig(str(path)))
    assert engine is not None
    print(TOKENIZED_HEAD)
    met = True
    for turns, n, cold in (
        (CHAT_TURNS, iterations, cold_iterations),
        (CHAT_TURNS // 4, iterations // 3, 0),
    ):
        study = tokenized_study(turns, measure_tokenized(engine, turns, n, cold))
        print(tokenized_lines(study))
        met = met and study.meets
    history, lasts = chat_conversation(engine, CHAT_TURNS)
    body = _chat_body([*history, {"role": "user", "content": lasts[0]}])
    inline = [cold_turn_hold_ms(engine, body, False) for _ in range(5)]
    threaded = [cold_turn_hold_ms(engine, body, True) for _ in range(5)]
    print(
        f"a cold {CHAT_TURNS}-turn chat holds the event loop (worst of 5): "
        f"{max(inline):.1f} ms tokenized on it, {max(threaded):.1f} ms in a worker thread "
        f"(x{max(threaded) / max(inline):.2f})"
    )
    print(
        f"'new': tokens tokenized per warm decision (the previous answer and the new message); "
        f"{time.monotonic() - t0:.1f} s (the tokenizer is built once into {tiny})"
    )
    return met


def run_decide_bench(iterations: int = 300) -> int:
    print(DECIDE_HEAD)
    for n_backends in (3, 64):
        for tokens in (1024, 32_768, 131_072):
            print(
                decide_line(
                    decide_row(n_backends, tokens, *measure(n_backends, tokens, iterations))
                )
            )
    print(memory_line(index_memory()))
    run_tokenized_bench(2 * iterations)
    return 0
