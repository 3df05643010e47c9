"""A model per request for traces that name none: the multi-model preset.

`two-models[:PATH]` (wherever a trace is expected: `gorgo simulate two-models`,
`load_trace`) reads PATH (by default the Mooncake conversation trace, CONVERSATION_TRACE of
loadgen.traces.readers) and gives each conversation one model, `alpha` or `beta` half and
half: a crc32 of its session key over the shares, so every turn of a conversation asks for
the same model and the assignment is the same in every process. Rows that already carry a
`model` keep it. Nothing is copied: the preset is derived at load time.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import replace

from loadgen.traces.readers import CONVERSATION_TRACE, read_trace
from loadgen.traces.request import TraceError, TraceRequest

TWO_MODELS = "two-models"
# The preset's models and their shares of the conversations.
TWO_MODEL_SHARES: tuple[tuple[str, float], ...] = (("alpha", 0.5), ("beta", 0.5))


def model_of(session: str, shares: Sequence[tuple[str, float]]) -> str:
    """The model a conversation asks for: deterministic in its key, by the shares."""
    if not shares or min(w for _, w in shares) < 0 or sum(w for _, w in shares) <= 0:
        raise ValueError(f"model shares: expected non-negative shares, not all zero: {shares}")
    x = zlib.crc32(f"model:{session}".encode()) / 2**32 * sum(w for _, w in shares)
    for name, share in shares:
        x -= share
        if x < 0:
            return name
    return shares[-1][0]


def assign_models(
    trace: Sequence[TraceRequest], shares: Sequence[tuple[str, float]] = TWO_MODEL_SHARES
) -> list[TraceRequest]:
    """Each request without a model gets its conversation's (`model_of` its session)."""
    return [
        r if r.model is not None else replace(r, model=model_of(r.session or r.id, shares))
        for r in trace
    ]


def two_models(path: str | None = None) -> list[TraceRequest]:
    """The `two-models[:PATH]` preset: PATH's requests, alpha and beta per conversation."""
    trace = read_trace(path or CONVERSATION_TRACE)
    if any(r.body is not None for r in trace):
        raise TraceError(f"{TWO_MODELS}:{path}: expected a Mooncake trace (rows without a body)")
    return assign_models(trace)
