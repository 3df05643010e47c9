"""Trace files: readers and a writer.

- Mooncake JSONL (FAST'25 release): `timestamp` (ms), `input_length`, `output_length`,
  `hash_ids` (512-token blocks; an id names a block together with its whole prefix).
- ART-Chat JSONL (the GORGO paper's dataset): `timestamp` (ms), an OpenAI chat body,
  `hash_ids` (hex strings, 256-token blocks), `token_hash` (a per-user id).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.traces.request import (
    ART_BLOCK_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    common_prefix_len,
)

# The conversation trace beside the checkout (shared/ sits next to the project): the
# default trace of the benchmarks and of the `two-models` preset.
CONVERSATION_TRACE = "../shared/traces/mooncake-fast25/conversation_trace.jsonl"


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
    raw: list[tuple[int, int, int, tuple[int, ...], str | None]] = []
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
        model = row.get("model")
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise TraceError(f"{where}: 'model' must be a non-empty string, got {model!r}")
        out_len = _int(row, "output_length", where)
        raw.append((_int(row, "timestamp", where), n_in, out_len, tuple(ids), model))
    if not raw:
        raise TraceError(f"{p}: no requests")
    shared = common_prefix_len([r[3] for r in raw])
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
            model=model,
        )
        for i, (ts, n_in, n_out, ids, model) in enumerate(raw)
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
        from ext_proc.prompt.tokens import count_tokens, render_chat

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
        row: dict[str, Any] = {
            "timestamp": round(r.arrival_s * 1000),
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(r.block_ids),
        }
        if r.model is not None:
            row["model"] = r.model
        lines.append(json.dumps(row) + "\n")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(lines), encoding="utf-8")
    return p
