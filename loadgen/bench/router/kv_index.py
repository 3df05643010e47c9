"""`gorgo bench kv-index`: a micro-bench of the router's per-engine block index at SGLang's
default page size 1: what one 32k-token prompt costs the router, keyed for a decision and
applied as the engine's KV events (one page a token). In-process, no sockets (the
socket-level burst is loadgen/bench/router/kv_burst.py, `gorgo bench kv-burst`).

    gorgo bench kv-index [--tokens 32768] [--repeat 5]

Prints the best of `repeat` runs in ms:
- decide: `Router.candidates` for the prompt against one backend whose engine holds it
  (keying the prompt at the engine's granule and matching it);
- apply, one event a token: the batch as SGLang publishes it (one BlockStored a page);
- apply, coalesced: the same pages as one chained BlockStored (the decoder coalesces a
  chain of page events).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable

from ext_proc.config.load import config_from_dict
from ext_proc.core.build import build_router
from ext_proc.estimate.engine_index import EngineBlocks
from ext_proc.feeds.kv_events import BlockStored, EventBatch, KvEvent
from ext_proc.prompt.parse import COMPLETIONS, parse_body
from ext_proc.prompt.tokens import TokenIds
from ext_proc.vocab.types import RouteRequest

PAGE = 1  # SGLang's default page size


def _best_ms(run: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def page_events(ids: list[int]) -> tuple[KvEvent, ...]:
    """One BlockStored a page, each naming the previous page as its parent (SGLang's
    hashes are its own: any distinct ints do)."""
    return tuple(
        BlockStored((i + 1,), i if i else None, tuple(ids[i : i + PAGE]), PAGE, "GPU")
        for i in range(0, len(ids), PAGE)
    )


def coalesced(ids: list[int]) -> tuple[KvEvent, ...]:
    hashes = tuple(range(1, len(ids) // PAGE + 1))
    return (BlockStored(hashes, None, tuple(ids), PAGE, "GPU"),)


def bench(tokens: int, repeat: int) -> dict[str, float]:
    rng = random.Random(0)
    ids = [rng.randrange(150_000) for _ in range(tokens)]
    one_a_token = page_events(ids)
    chained = coalesced(ids)

    def apply(events: tuple[KvEvent, ...]) -> Callable[[], object]:
        return lambda: EngineBlocks().apply(EventBatch("", 0, 0.0, events, 0))

    cfg = config_from_dict(
        {
            "tuner": {"mode": "off"},
            "backends": [
                {"id": "a", "address": "127.0.0.1:1", "kv_events": {"endpoint": "tcp://*:5557"}}
            ],
        }
    )
    router = build_router(cfg, lambda: 0.0, random.Random(0))
    router.inputs.apply_kv_events("a", EventBatch("", 0, 0.0, chained, 0))
    router.inputs.set_event_stream("a", True)
    body = json.dumps({"prompt": ids, "max_tokens": 1}).encode()
    llm = parse_body(COMPLETIONS, body)
    llm = dataclasses.replace(llm, prompts=(TokenIds(ids),))
    request = RouteRequest("bench", llm, None)
    blocks = router.features.prompt_blocks(request)
    (c,) = router.features.candidates(request, blocks)
    assert c.cached_tokens > 0.9 * tokens, c.cached_tokens  # the engine's state matched
    return {
        "decide_ms": _best_ms(lambda: router.features.candidates(request, blocks), repeat),
        "apply_one_event_a_token_ms": _best_ms(apply(one_a_token), repeat),
        "apply_coalesced_ms": _best_ms(apply(chained), repeat),
        "cached_tokens": float(c.cached_tokens),
    }


def run_kv_index_bench(tokens: int = 32_768, repeat: int = 5) -> int:
    out = bench(tokens, repeat)
    for name, value in out.items():
        print(f"{name:28} {value:10.2f}")
    return 0
