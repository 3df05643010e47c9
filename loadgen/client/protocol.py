"""The client protocol a run follows, applied alike by `gorgo simulate` and `gorgo replay`.

- `max_concurrency`: at most N requests in flight. An arrival that finds all N taken
  waits for the first one to free (first come, first served); the wait is its *slip*,
  recorded per request and summarized on its own, and its TTFT and E2E are measured from
  dispatch (when it got its slot), as the GORGO paper's 64 client workers measured them.
- `max_tokens`: every request's output length is set to N (the paper forced 128).
- `max_input_tokens`: prompts longer than N tokens are dropped before the run, and counted.
- `request_max_tokens` (the simulator's): what each request says as its `max_tokens`:
  `output` its output length (so the router knows it in advance), `none` nothing (the
  router must learn it), or N (a cap: outputs longer than N end at N, the rest as the
  trace has them).

`open` (no caps: the trace as it is, open loop) and `paper` (64, 128, 24,000: the GORGO
paper's client) are the presets; explicit values override a preset's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from loadgen.traces.request import TraceRequest


@dataclass(frozen=True)
class Protocol:
    # None: no cap.
    max_concurrency: int | None = None
    max_tokens: int | None = None
    max_input_tokens: int | None = None
    request_max_tokens: str = "output"

    def __post_init__(self) -> None:
        sent = self.request_max_tokens
        if sent not in ("output", "none") and not (sent.isdigit() and int(sent) >= 1):
            raise ValueError(
                f"--request-max-tokens must be output, none or a positive integer, got {sent!r}"
            )
        for flag, v in (
            ("--max-concurrency", self.max_concurrency),
            ("--max-tokens", self.max_tokens),
            ("--max-input-tokens", self.max_input_tokens),
        ):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag} must be a positive integer, got {v!r}")

    @property
    def name(self) -> str:
        """The preset these settings are, or `custom`."""
        for name, preset in PRESETS.items():
            if self == preset:
                return name
        return "custom"

    def describe(self) -> str:
        """One line for a table's caption: which protocol made it."""
        parts = [
            "open loop, no concurrency cap"
            if self.max_concurrency is None
            else f"at most {self.max_concurrency} requests in flight (TTFT from dispatch)",
        ]
        if self.max_tokens is not None:
            parts.append(f"max_tokens {self.max_tokens}")
        if self.max_input_tokens is not None:
            parts.append(f"prompts over {self.max_input_tokens:,} tokens dropped")
        if self.request_max_tokens == "none":
            parts.append("no max_tokens in the requests")
        elif self.request_max_tokens != "output":
            parts.append(f"max_tokens {self.request_max_tokens} in every request (a cap)")
        return f"protocol `{self.name}`: {', '.join(parts)}"

    def meta(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "max_concurrency": self.max_concurrency,
            "max_tokens": self.max_tokens,
            "max_input_tokens": self.max_input_tokens,
            "request_max_tokens": self.request_max_tokens,
        }

    def sent_max_tokens(self, output_tokens: int) -> int | None:
        """The `max_tokens` a request of this output length says (None: none)."""
        if self.request_max_tokens == "output":
            return output_tokens
        return None if self.request_max_tokens == "none" else int(self.request_max_tokens)

    def apply(self, trace: Sequence[TraceRequest]) -> tuple[list[TraceRequest], int]:
        """The trace this protocol runs: prompts over max_input_tokens dropped, output
        lengths set to max_tokens (or capped at request_max_tokens); and how many were
        dropped. Ids stay the trace's."""
        kept = [
            r
            for r in trace
            if self.max_input_tokens is None or r.input_tokens <= self.max_input_tokens
        ]
        if self.max_tokens is not None:
            kept = [replace(r, output_tokens=self.max_tokens) for r in kept]
        if self.request_max_tokens.isdigit():
            cap = int(self.request_max_tokens)
            kept = [replace(r, output_tokens=min(r.output_tokens, cap)) for r in kept]
        return kept, len(trace) - len(kept)


OPEN = Protocol()
# The paper's client: 64 workers, max_tokens 128 on every request, prompts over 24,000
# tokens dropped.
PAPER = Protocol(max_concurrency=64, max_tokens=128, max_input_tokens=24_000)
PRESETS = {"open": OPEN, "paper": PAPER}


def protocol_for(
    preset: str = "open",
    *,
    max_concurrency: int | None = None,
    max_tokens: int | None = None,
    max_input_tokens: int | None = None,
    request_max_tokens: str = "output",
) -> Protocol:
    """A preset with any explicitly given value overriding its own."""
    if preset not in PRESETS:
        raise ValueError(f"--protocol must be one of {', '.join(PRESETS)}, got {preset!r}")
    base = PRESETS[preset]
    return Protocol(
        base.max_concurrency if max_concurrency is None else max_concurrency,
        base.max_tokens if max_tokens is None else max_tokens,
        base.max_input_tokens if max_input_tokens is None else max_input_tokens,
        request_max_tokens,
    )


def add_protocol_flags(s: argparse.ArgumentParser, open_cap: str) -> None:
    """The protocol's flags, the same for `gorgo replay` and `gorgo simulate`."""
    s.add_argument(
        "--protocol",
        default="open",
        choices=["open", "paper"],
        help="client protocol preset: open (no caps) or paper (--max-concurrency 64 "
        "--max-tokens 128 --max-input-tokens 24000, the GORGO paper's client); the flags "
        "below override it",
    )
    s.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="at most N requests in flight; an arrival that finds all taken waits for one "
        f"(first come, first served), recorded as its slip; TTFT from dispatch ({open_cap})",
    )
    s.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="set every request's output length to N tokens",
    )
    s.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        metavar="N",
        help="drop requests whose prompt is over N tokens before the run (counted)",
    )
