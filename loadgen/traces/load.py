"""Where a trace comes from, wherever a trace file is expected: a file (Mooncake or
ART-Chat, told apart by its first row), `paper-synthetic[:SEED]` (the paper-shaped window,
loadgen.traces.synthetic) or `two-models[:PATH]` (a model per conversation,
loadgen.traces.models)."""

from __future__ import annotations

from pathlib import Path

from loadgen.traces.models import two_models
from loadgen.traces.readers import read_trace
from loadgen.traces.request import TraceError, TraceRequest
from loadgen.traces.synthetic import paper_synthetic

TRACE_HELP = (
    "Mooncake or ART-Chat JSONL trace, or paper-synthetic[:SEED]: a generated window "
    "shaped like the GORGO paper's (docs/benchmarks.md)"
)

# The trace source naming the paper-shaped synthetic window (`paper-synthetic:SEED` for
# another seed) wherever a trace file is expected.
PAPER_SYNTHETIC = "paper-synthetic"


def load_trace(source: str | Path) -> list[TraceRequest]:
    """A trace file (`read_trace`), or `paper-synthetic[:SEED]`: the paper-shaped window
    generated for that seed (0 by default), or `two-models[:PATH]`: a trace (the Mooncake
    conversation trace by default) with a model per conversation (loadgen.traces.models).
    A file of either name: `./paper-synthetic`."""
    name, _, seed = str(source).partition(":")
    if name == "two-models":
        return two_models(seed or None)
    if name == PAPER_SYNTHETIC:
        try:
            return paper_synthetic(int(seed or 0))
        except ValueError:
            raise TraceError(
                f"{source}: expected {PAPER_SYNTHETIC} or {PAPER_SYNTHETIC}:SEED (an integer)"
            ) from None
    return read_trace(source)
