"""Workload traces: readers, windows, a synthetic generator, and prompt synthesis.

A trace is a list of `TraceRequest`s sorted by arrival. Formats:
- Mooncake JSONL (FAST'25 release): `timestamp` (ms), `input_length`, `output_length`,
  `hash_ids` (512-token blocks; an id names a block together with its whole prefix).
- ART-Chat JSONL (the GORGO paper's dataset): `timestamp` (ms), an OpenAI chat body,
  `hash_ids` (hex strings, 256-token blocks), `token_hash` (a per-user id).
- Synthetic: seeded multi-turn sessions with adjustable prefix reuse and rate (tests).

Prompt synthesis turns block ids into text the project's tokenizer counts exactly (4 bytes
per token): every block id maps to its own deterministic text, so requests that share
leading ids share byte-identical prefixes.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
ART_BLOCK_TOKENS = 256


class TraceError(ValueError):
    """A trace file is unreadable; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    # Prefix block ids (each names its block and everything before it).
    block_ids: tuple[int, ...]
    block_tokens: int
    # The conversation this request belongs to (session affinity's key).
    session: str
    # ART-Chat rows carry the request body itself.
    body: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        return f"t{self.index}"


def _rows(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read trace: {e.strerror}") from e
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not JSON: {e.msg}") from e
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{n}: expected a JSON object per line")
            yield n, row


def _int(row: dict[str, Any], key: str, where: str) -> int:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {v!r}")
    return v


def read_mooncake(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    raw: list[tuple[int, int, int, tuple[int, ...]]] = []
    for n, row in _rows(p):
        where = f"{p}:{n}"
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
        n_in = _int(row, "input_length", where)
        if len(ids) != math.ceil(n_in / MOONCAKE_BLOCK_TOKENS):
            raise TraceError(
                f"{where}: {len(ids)} hash_ids for {n_in} input tokens "
                f"(expected ceil({n_in}/{MOONCAKE_BLOCK_TOKENS}))"
            )
        raw.append(
            (_int(row, "timestamp", where), n_in, _int(row, "output_length", where), tuple(ids))
        )
    if not raw:
        raise TraceError(f"{p}: no requests")
    shared = _common_prefix_len([r[3] for r in raw])
    raw.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    return [
        TraceRequest(
            i,
            ts / 1000.0,
            n_in,
            max(1, n_out),
            ids,
            MOONCAKE_BLOCK_TOKENS,
            # The conversation's root: its first block after the prefix every request
            # shares (a system prompt: block 0 in the conversation trace).
            f"s{ids[min(shared, len(ids) - 1)]}",
        )
        for i, (ts, n_in, n_out, ids) in enumerate(raw)
    ]


def read_art_chat(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    out: list[TraceRequest] = []
    hex_ids: dict[str, int] = {}
    for n, row in _rows(p):
        where = f"{p}:{n}"
        body = row.get("body", row.get("request"))
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise TraceError(f"{where}: expected an OpenAI chat body under 'body'")
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise TraceError(f"{where}: 'hash_ids' must be a list of hex strings")
        from ext_proc.tokens import count_tokens, render_chat

        n_in = count_tokens(render_chat(body["messages"]))
        n_out = body.get("max_tokens") or body.get("max_completion_tokens") or 256
        out.append(
            TraceRequest(
                len(out),
                _int(row, "timestamp", where) / 1000.0,
                n_in,
                int(n_out),
                tuple(hex_ids.setdefault(h, len(hex_ids)) for h in ids),
                ART_BLOCK_TOKENS,
                f"u{row.get('token_hash', '')}",
                body,
            )
        )
    out.sort(key=lambda r: r.arrival_s)
    return [replace(r, index=i) for i, r in enumerate(out)]


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Mooncake or ART-Chat, told apart by the first row."""
    p = Path(path)
    for _, row in _rows(p):
        return read_art_chat(p) if "body" in row or "request" in row else read_mooncake(p)
    raise TraceError(f"{p}: no requests")


def write_mooncake(path: str | Path, trace: Iterable[TraceRequest]) -> Path:
    """Write a trace as Mooncake JSONL (arrivals rounded to whole milliseconds), e.g. a
    synthetic one for `gorgo replay`. Needs 512-token blocks, as the format defines."""
    p = Path(path)
    lines = []
    for r in trace:
        if r.block_tokens != MOONCAKE_BLOCK_TOKENS:
            raise ValueError(
                f"request {r.id}: {r.block_tokens}-token blocks; Mooncake rows use "
                f"{MOONCAKE_BLOCK_TOKENS}"
            )
        row = {
            "timestamp": round(r.arrival_s * 1000),
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(r.block_ids),
        }
        lines.append(json.dumps(row) + "\n")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(lines), encoding="utf-8")
    return p


def _common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        n = min(n, len(s))
        while n and s[:n] != first[:n]:
            n -= 1
        if not n:
            break
    return n


def window(
    trace: Sequence[TraceRequest],
    start_s: float = 0.0,
    duration_s: float | None = None,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Requests arriving in [start_s, start_s + duration_s) (trace time), at most limit,
    with arrivals shifted so the window starts at 0."""
    out = [
        r
        for r in trace
        if r.arrival_s >= start_s and (duration_s is None or r.arrival_s < start_s + duration_s)
    ]
    if limit is not None:
        out = out[:limit]
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in out]


def spread_arrivals(trace: Sequence[TraceRequest], seconds: float) -> list[TraceRequest]:
    """Spread each request's arrival over [t, t + seconds), deterministically (a crc32 of
    its id), in arrival order. The Mooncake conversation trace stamps arrivals in 3 s
    steps, ~10 requests at the very same instant: replayed as is, several routers decide
    each burst blind to one another, however fast they share (0: unchanged)."""
    if seconds <= 0:
        return list(trace)
    spread = [
        replace(r, arrival_s=r.arrival_s + seconds * zlib.crc32(r.id.encode()) / 2**32)
        for r in trace
    ]
    return sorted(spread, key=lambda r: r.arrival_s)


def scaled(trace: Sequence[TraceRequest], time_scale: float) -> list[TraceRequest]:
    """Stretch arrivals by time_scale (2 = half the rate), as the paper's client did."""
    return [replace(r, arrival_s=r.arrival_s * time_scale) for r in trace]


def synthetic(
    sessions: int = 20,
    turns: int = 4,
    rate_rps: float = 2.0,
    reuse: float = 1.0,
    system_tokens: int = 1024,
    turn_tokens: int = 600,
    output_tokens: int = 64,
    seed: int = 0,
) -> list[TraceRequest]:
    """Multi-turn chat sessions: every request starts with a shared system prompt, and
    each turn carries its conversation so far (with probability `reuse`; otherwise the
    conversation restarts). Poisson arrivals at rate_rps, turns in order per session."""
    rng = random.Random(seed)
    bt = MOONCAKE_BLOCK_TOKENS
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system = new_ids(math.ceil(system_tokens / bt))
    arrivals: list[tuple[float, int, int]] = []
    t = 0.0
    for turn in range(turns):
        for s in range(sessions):
            t += rng.expovariate(rate_rps)
            arrivals.append((t, s, turn))
    history: dict[int, list[int]] = {}
    out: list[TraceRequest] = []
    for t, s, _ in sorted(arrivals):
        keep = history.get(s, system) if rng.random() < reuse else system
        ids = keep + new_ids(math.ceil(turn_tokens / bt))
        history[s] = ids
        out.append(TraceRequest(len(out), t, len(ids) * bt, output_tokens, tuple(ids), bt, f"s{s}"))
    return out


# ---------------------------------------------------------------------------------------
# Prompt synthesis.

_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# Every 3-letter word with its trailing space (4 bytes: one token each), as uint32s.
_WORDS = np.array(
    [f"{a}{b}{c} " for a in _ALPHABET for b in _ALPHABET for c in _ALPHABET], dtype="S4"
).view(np.uint32)
_N_WORDS = np.uint64(len(_WORDS))
_POSITIONS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)
# splitmix64 constants
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def block_text(block_id: int, tokens: int) -> str:
    """Deterministic text for one block: `tokens` words of 3 letters and a space (4 bytes
    = 1 token each under the project's tokenizer). Word j is a hash (splitmix64) of the
    block id and j alone, so fewer tokens give a prefix of the block's longer text (a
    partial last block matches the full block's start). ~18 us per 512-token block: the
    replay synthesizes prompts while it streams."""
    pos = _POSITIONS if tokens <= len(_POSITIONS) else np.arange(tokens, dtype=np.uint64)
    x = pos[:tokens] + np.uint64((block_id * _GOLDEN) & 0xFFFFFFFFFFFFFFFF)
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return _WORDS.take(x % _N_WORDS).tobytes().decode("ascii")


class PromptSynth:
    """Trace block ids -> prompt text, with a cache of recent blocks (prefixes repeat)."""

    def __init__(self, cache_blocks: int = 20_000) -> None:
        self._cache: dict[tuple[int, int], str] = {}
        self._cache_blocks = cache_blocks

    def _block(self, block_id: int, tokens: int) -> str:
        key = (block_id, tokens)
        text = self._cache.get(key)
        if text is None:
            if len(self._cache) >= self._cache_blocks:
                self._cache.pop(next(iter(self._cache)))
            text = self._cache[key] = block_text(block_id, tokens)
        return text

    def prompt(self, r: TraceRequest) -> str:
        """Exactly r.input_tokens tokens; the last block may be partial."""
        parts = []
        left = r.input_tokens
        for block_id in r.block_ids:
            n = min(r.block_tokens, left)
            if n <= 0:
                break
            parts.append(
                self._block(block_id, n) if n == r.block_tokens else block_text(block_id, n)
            )
            left -= n
        return "".join(parts)
