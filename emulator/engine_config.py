"""What one emulated engine is configured with: backend id, engine profile, token limits,
served model name, tokenizer and fault injection."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ext_proc.profile import DEFAULT_PROFILE, EngineProfile, load_profile
from ext_proc.tokens import APPROX, Tokenizer


def zero_delay_profile(base: EngineProfile) -> EngineProfile:
    """Every step takes no time: isolates proxy overhead in benchmarks."""
    return replace(
        base,
        name=f"{base.name}+zero-delay",
        prefill_base_ms=0.0,
        prefill_tokens_per_s=float("inf"),
        decode_base_ms=0.0,
        decode_batch_ms=0.0,
        decode_per_request_ms=0.0,
        decode_per_1k_context_ms=0.0,
        no_cuda_graph_ms=0.0,
        jitter_sigma=0.0,
    )


@dataclass
class Faults:
    """Fault injection, for reliability tests; all off by default."""

    # Share of generation requests answered with HTTP 500 at once.
    error_rate: float = 0.0
    # Share of generation requests held for stall_ms before they reach the scheduler.
    stall_rate: float = 0.0
    stall_ms: float = 0.0

    def validate(self) -> None:
        for key in ("error_rate", "stall_rate"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                raise ValueError(f"{key} must be a number in [0, 1], got {v!r}")
        v = self.stall_ms
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
            raise ValueError(f"stall_ms must be a finite number >= 0, got {v!r}")


@dataclass
class EngineConfig:
    """One emulated backend."""

    name: str  # backend id, e.g. "us-ashburn"; echoed in x-engine-id
    profile: EngineProfile = field(default_factory=lambda: load_profile(DEFAULT_PROFILE))
    default_max_tokens: int = 16  # when the request names no limit
    max_tokens_cap: int = 32768  # requested limits above this are clamped
    model: str = "emulated"  # served model name (/v1/models, responses)
    seed: int = 0  # step-time jitter and fault draws
    tokenizer: Tokenizer = APPROX
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EngineConfig.name must be a non-empty backend id")
        if self.max_tokens_cap < 1:
            raise ValueError(f"EngineConfig.max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.default_max_tokens < 1:
            raise ValueError(
                f"EngineConfig.default_max_tokens must be >= 1, got {self.default_max_tokens}"
            )
        self.faults.validate()

    @classmethod
    def zero_delay(cls, name: str, **overrides: Any) -> EngineConfig:
        """No prefill or decode time at all: isolates proxy overhead in benchmarks."""
        return cls(
            name=name, profile=zero_delay_profile(load_profile(DEFAULT_PROFILE)), **overrides
        )
